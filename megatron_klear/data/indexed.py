"""The on-disk SFT dataset: Megatron-Core indexed datasets plus a metadata JSON.

For an output prefix ``P`` the preprocessing command writes:

- ``P.bin`` / ``P.idx``: token ids, one sequence (and one document) per example, in
  Megatron-Core's ``IndexedDataset`` format (dtype uint16 when the vocabulary fits, else int32).
- ``P_loss_spans.bin`` / ``P_loss_spans.idx``: per example, the flattened ``[start, end)`` token
  spans that carry loss (``[s0, e0, s1, e1, ...]``, int32), same example order. Spans rather than a
  per-token mask: assistant turns are contiguous, so this costs a few bytes per example instead of
  one byte per token (~12 GB at 12B tokens).
- ``P.meta.json``: what made it (sources + sha256, tokenizer hash, settings), counts (kept,
  truncated, skipped / dropped per reason), token counts and the length histogram, and the sha256
  of both ``.idx`` files. It is written last: a prefix without it is incomplete.
- ``P.rejected.jsonl``: every rejected line as ``{"file", "line", "reason", "detail"}``.

Everything is written under a temporary prefix and renamed into place at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np

from megatron_klear.data.chat import spans_to_mask
from megatron_klear.utils import atomic

FORMAT = "megatron-klear-sft-indexed"
FORMAT_VERSION = 1


def _megatron_indexed_dataset():
    """megatron.core's indexed_dataset module (imported lazily; its import takes seconds).

    Importing megatron.core warns that Transformer Engine / Apex are missing; irrelevant to
    reading token files, so those warnings are silenced here.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
        warnings.filterwarnings("ignore", message=".*Apex.*")
        try:
            from megatron.core.datasets import indexed_dataset
        except ImportError as e:
            raise ImportError(
                "the SFT dataset format needs megatron-core, a dependency of this package: pip install -e . "
                "in the repository's root (megatron-core 0.16.x)"
            ) from e
    return indexed_dataset


def spans_prefix(prefix: str) -> str:
    return prefix + "_loss_spans"


def meta_path(prefix: str) -> str:
    return prefix + ".meta.json"


def rejected_path(prefix: str) -> str:
    return prefix + ".rejected.jsonl"


def _data_files(prefix: str) -> list:
    return [prefix + ".bin", prefix + ".idx", spans_prefix(prefix) + ".bin", spans_prefix(prefix) + ".idx"]


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: str, obj) -> None:
    atomic.write_json(path, obj, indent=2, ensure_ascii=False)


class SFTIndexedWriter:
    """Append examples, then :meth:`commit` (rename into place) or :meth:`abort` (clean up)."""

    def __init__(self, prefix: str, vocab_size: int):
        idx = _megatron_indexed_dataset()
        DType, IndexedDatasetBuilder = idx.DType, idx.IndexedDatasetBuilder
        parent = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(parent, exist_ok=True)
        self.prefix = prefix
        self.tmp_prefix = f"{prefix}.tmp-{os.getpid()}"
        self.token_dtype = DType.optimal_dtype(vocab_size)
        self._tokens = IndexedDatasetBuilder(self.tmp_prefix + ".bin", dtype=self.token_dtype)
        self._spans = IndexedDatasetBuilder(spans_prefix(self.tmp_prefix) + ".bin", dtype=np.int32)
        self.rejected_tmp = rejected_path(self.tmp_prefix)
        self.rejected = open(self.rejected_tmp, "w", encoding="utf-8")
        self.num_examples = 0

    def add(self, token_ids, loss_spans) -> None:
        tokens = np.asarray(token_ids, dtype=self.token_dtype)
        spans = np.asarray(loss_spans, dtype=np.int32).reshape(-1)
        self._tokens.add_document(tokens, [tokens.size])
        self._spans.add_document(spans, [spans.size])
        self.num_examples += 1

    def commit(self, metadata: dict) -> dict:
        """Finalize the indexes, move everything into place, write the metadata last."""
        self._tokens.finalize(self.tmp_prefix + ".idx")
        self._spans.finalize(spans_prefix(self.tmp_prefix) + ".idx")
        self.rejected.close()
        metadata = dict(metadata)
        metadata["format"] = FORMAT
        metadata["format_version"] = FORMAT_VERSION
        metadata["token_dtype"] = np.dtype(self.token_dtype).name
        metadata["num_examples"] = self.num_examples
        metadata["content_sha256"] = {
            "tokens_idx": _sha256_file(self.tmp_prefix + ".idx"),
            "loss_spans_idx": _sha256_file(spans_prefix(self.tmp_prefix) + ".idx"),
        }
        metadata["files"] = {
            "tokens": os.path.basename(self.prefix),
            "loss_spans": os.path.basename(spans_prefix(self.prefix)),
            "rejected": os.path.basename(rejected_path(self.prefix)),
        }
        # An old metadata file next to new data would describe the wrong content: drop it first.
        if os.path.exists(meta_path(self.prefix)):
            os.remove(meta_path(self.prefix))
        for tmp, final in zip(_data_files(self.tmp_prefix), _data_files(self.prefix)):
            os.replace(tmp, final)
        os.replace(self.rejected_tmp, rejected_path(self.prefix))
        write_json_atomic(meta_path(self.prefix), metadata)
        return metadata

    def abort(self) -> None:
        for f in (self._tokens.data_file, self._spans.data_file, self.rejected):
            try:
                f.close()
            except Exception:  # noqa: BLE001 -- cleaning up after a failure: the first error is the one raised
                pass
        for path in _data_files(self.tmp_prefix) + [self.rejected_tmp]:
            if os.path.exists(path):
                os.remove(path)


def load_metadata(prefix: str) -> dict:
    path = meta_path(prefix)
    if not os.path.exists(path):
        hint = " (the .bin/.idx exist: preprocessing did not finish)" if os.path.exists(prefix + ".idx") else ""
        raise FileNotFoundError(f"{path} not found: {prefix!r} is not a preprocessed SFT dataset{hint}")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: unreadable dataset metadata ({e}); re-run tools/preprocess_sft.py") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: unreadable dataset metadata (not a JSON object); re-run tools/preprocess_sft.py")
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format {meta.get('format')!r} v{meta.get('format_version')}, expected "
            f"{FORMAT!r} v{FORMAT_VERSION}"
        )
    return meta


def _open_indexed(IndexedDataset, prefix: str):
    """Megatron's reader, with its failures on a truncated or corrupt .idx/.bin naming the files."""
    try:
        return IndexedDataset(prefix)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - struct/numpy/assertion errors that name no file
        raise ValueError(
            f"{prefix}.idx / {prefix}.bin: cannot read this indexed dataset ({type(e).__name__}: {e}); "
            "it is probably truncated or corrupt: re-run tools/preprocess_sft.py"
        ) from None


class SFTIndexedReader:
    """Memory-mapped access to a preprocessed dataset: tokens, loss spans, lengths."""

    def __init__(self, prefix: str, expected_tokenizer_sha256: Optional[str] = None):
        IndexedDataset = _megatron_indexed_dataset().IndexedDataset
        self.prefix = prefix
        self.meta = load_metadata(prefix)
        if expected_tokenizer_sha256 is not None:
            got = self.meta["tokenizer"]["sha256"]
            if got != expected_tokenizer_sha256:
                raise ValueError(
                    f"{meta_path(prefix)}: dataset was tokenized with tokenizer {got[:12]}..., "
                    f"but the model's tokenizer is {expected_tokenizer_sha256[:12]}...: re-run "
                    "tools/preprocess_sft.py with the model's tokenizer"
                )
        self._tokens = _open_indexed(IndexedDataset, prefix)
        self._spans = _open_indexed(IndexedDataset, spans_prefix(prefix))
        n = self.meta["num_examples"]
        if len(self._tokens) != n or len(self._spans) != n:
            raise ValueError(
                f"{prefix}: metadata says {n} examples but the token index has "
                f"{len(self._tokens)} and the loss-span index {len(self._spans)}"
            )
        self.lengths = np.asarray(self._tokens.sequence_lengths, dtype=np.int64)
        self.pad_token_id = int(self.meta["tokenizer"]["pad_token_id"])

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def fingerprint(self) -> str:
        c = self.meta["content_sha256"]
        return hashlib.sha256((c["tokens_idx"] + c["loss_spans_idx"]).encode()).hexdigest()

    def tokens(self, i: int) -> np.ndarray:
        return self._tokens[int(i)]

    def loss_spans(self, i: int) -> np.ndarray:
        """``[k, 2]`` array of ``[start, end)`` token spans that carry loss."""
        return np.asarray(self._spans[int(i)], dtype=np.int64).reshape(-1, 2)

    def loss_mask(self, i: int) -> np.ndarray:
        """Per-token uint8 mask, 1 on assistant tokens (not shifted)."""
        return spans_to_mask(self.loss_spans(i), int(self.lengths[i]))

    def num_label_loss_tokens(self, i: int) -> int:
        """Loss tokens after the next-token shift: trainable tokens at positions >= 1."""
        return int(sum(max(0, e - max(s, 1)) for s, e in self.loss_spans(i)))
