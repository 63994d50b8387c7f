"""HF safetensors directories as a weight format: ``config.json`` beside ``model.safetensors`` or
shards ``model-NNNNN-of-NNNNN.safetensors`` with ``model.safetensors.index.json`` (the layout
transformers writes and SGLang and vLLM load), plus the tokenizer files.

Reading maps HF tensors to canonical rows through the mapping, each piece read from the rows of the
shards it needs (:mod:`megatron_klear.checkpoint.hf_io`); writing lays the output's shards out
from the config first, then puts each piece's rows at their place, from ``workers`` threads.
"""

from __future__ import annotations

import concurrent.futures
import math
import os

import torch

from megatron_klear.checkpoint.formats.base import (
    PIECE_BYTES,
    WeightFormat,
    WeightReader,
    WriteOptions,
    check_free_space,
    files_bytes,
)
from megatron_klear.checkpoint.hf_io import TOKENIZER_FILES, HFReader, HFWriter
from megatron_klear.checkpoint.mapping import (
    MappingError,
    check_hf_shapes,
    hf_shapes,
    layer_of,
    megatron_rows,
    row_sources,
    rules_by_megatron,
    rules_for,
    to_megatron,
)
from megatron_klear.models.arch import ModelArch, load_arch
from megatron_klear.platform import dtypes
from megatron_klear.utils.progress import Progress

NAME = "hf"
CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def stored_dtype(cfg: dict) -> torch.dtype:
    """The checkpoint's half-precision dtype when config.json names one, else float32."""
    name = dtypes.canonical_name(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return dtypes.torch_dtype(name) if name in ("bfloat16", "float16") else torch.float32


def check_hf_keys(arch: ModelArch, reader: HFReader) -> list:
    """Expected vs present HF keys; returns HF keys that are allowed extras (tied lm_head)."""
    expected = {k for r in rules_for(arch) for k in r.hf}
    present = reader.keys()
    extras = []
    if arch.tie_word_embeddings and "lm_head.weight" in present:
        extras.append("lm_head.weight")  # a redundant copy of the tied embedding; verified on reading
    missing = sorted(expected - present)
    unknown = sorted(present - expected - set(extras))
    if missing:
        raise MappingError(f"{reader.dir}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unknown:
        raise MappingError(
            f"{reader.dir}: unknown tensors (not in the {arch.model_type} mapping) "
            f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
        )
    return extras


def _rows_equal(a, b, piece_bytes: int) -> bool:
    if tuple(a.shape) != tuple(b.shape):
        return False
    step = max(1, piece_bytes // max(1, a.row_bytes))
    return all(torch.equal(a[i : i + step], b[i : i + step]) for i in range(0, a.shape[0], step))


class HFWeights(WeightReader):
    """An HF directory's tensors as canonical rows: each read takes the HF rows it needs from the
    shards (fusing QKV per query group and gate/up, zero rows past the vocabulary)."""

    def __init__(self, path: str, piece_bytes: int = PIECE_BYTES):
        self.path = path
        self.arch = load_arch(path)  # (first: a missing directory is "no config.json")
        self.reader = HFReader(path)
        self.dtype = stored_dtype(self.arch.hf_config)
        self.tokenizer_dir = path
        self.rules = rules_by_megatron(self.arch)
        extras = check_hf_keys(self.arch, self.reader)
        for rule in self.rules.values():  # every tensor has the shape the config implies
            self._sources(rule)
        for key in extras:  # the redundant tied head must equal the embedding it duplicates
            if not _rows_equal(self.reader.rows(key), self.reader.rows("model.embed_tokens.weight"), piece_bytes):
                raise MappingError(
                    f"{path}: 'lm_head.weight' differs from 'model.embed_tokens.weight' but the "
                    "config says tie_word_embeddings=true"
                )
        consumed = [k for rule in self.rules.values() for k in rule.hf]
        dupes = {k for k in consumed if consumed.count(k) > 1}
        if dupes:
            raise MappingError(f"source tensors consumed more than once: {sorted(dupes)}")

    def _sources(self, rule) -> list:
        sources = [self.reader.rows(k) for k in rule.hf]
        try:
            check_hf_shapes(rule, sources, self.arch)
        except MappingError as e:  # the shapes the config implies: name both files
            key = next((k for k in rule.hf if f"'{k}'" in str(e)), rule.hf[0])
            config = os.path.join(self.path, CONFIG)
            raise MappingError(f"{self.reader.path_of(key)}: {e} ({config})") from None
        return sources

    def _rule(self, name: str):
        if name not in self.rules:
            raise MappingError(f"{self.path}: '{name}' is not a tensor of this {self.arch.model_type} model")
        return self.rules[name]

    def shape(self, name: str) -> tuple:
        rule = self._rule(name)
        return (megatron_rows(rule, self.arch, self.arch.vocab_size), *hf_shapes(rule, self.arch)[0][1:])

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        rule = self._rule(name)
        padded = max(stop, self.arch.vocab_size)  # (a vocabulary tensor: zero rows past the vocabulary)
        return to_megatron(rule, self._sources(rule), self.arch, padded, start, stop)

    def close(self) -> None:
        self.reader.close()


def _model_order(name: str) -> tuple:
    layer = layer_of(name)
    return (0, 0) if name.startswith("embedding.") else (1, layer) if layer is not None else (2, 0)


class HFFormat(WeightFormat):
    name = NAME
    title = "HF"
    looks_for = f"{CONFIG} beside {SINGLE_FILE} or {INDEX}"

    def detect(self, path: str) -> bool:
        # config.json alone is enough to say what the model is (its architecture, model.path's
        # identity); reading the weights then names the missing safetensors
        return os.path.isfile(os.path.join(path, CONFIG))

    def arch(self, path: str):
        return load_arch(path)

    def tokenizer_dir(self, path: str) -> str:
        return path

    def read(self, path: str, *, piece_bytes: int = PIECE_BYTES) -> HFWeights:
        return HFWeights(path, piece_bytes)

    def load_model(self, model_chunks, path: str) -> None:
        from megatron_klear.checkpoint.model_weights import load_hf_weights

        load_hf_weights(model_chunks, HFReader(path))

    def write(self, weights: WeightReader, out_dir: str, options: WriteOptions) -> str:
        """The output's shards are laid out from the config first (every tensor's name, shape and
        offset), then ``workers`` threads each take one of the reader's row ranges at a time and
        write its rows at their place: nothing is buffered, each byte is written once, and peak
        memory is about ``workers`` x twice the largest range (docs/checkpoints.md)."""
        arch = weights.arch
        dtype = options.dtype or weights.dtype
        rules = rules_by_megatron(arch)
        order = sorted(weights.names(), key=_model_order)
        plan = [(h, shape, dtype) for c in order for h, shape in zip(rules[c].hf, hf_shapes(rules[c], arch))]
        tasks = [(c, a, b) for c in order for a, b in weights.row_ranges(c, options.piece_bytes)]
        out_dir = os.path.abspath(out_dir)
        parent = os.path.dirname(out_dir)
        os.makedirs(parent, exist_ok=True)
        total = sum(math.prod(shape) for _, shape, _ in plan) * dtype.itemsize
        tokenizer = files_bytes(weights.tokenizer_dir, TOKENIZER_FILES)
        check_free_space(parent, total + tokenizer, f"writing {weights.path} as HF safetensors")
        writer = HFWriter(out_dir, max_shard_bytes=options.max_shard_bytes, dtype=dtype, plan=plan)
        bar = Progress(total / 1e6, options.progress, unit="MB") if options.progress else None

        def write_range(name: str, start: int, stop: int) -> int:
            rule, rows, offset = rules[name], weights.rows(name, start, stop), 0
            for j, a, b in row_sources(rule, arch, arch.vocab_size, start, stop):
                if j is not None:
                    writer.write_rows(rule.hf[j], a, rows[offset : offset + b - a])
                offset += b - a
            return rows.numel() * dtype.itemsize  # (the bytes written: the progress bar's unit)

        try:
            with concurrent.futures.ThreadPoolExecutor(options.workers, thread_name_prefix="hf-write") as pool:
                pending = []
                for task in tasks:
                    pending.append(pool.submit(write_range, *task))
                    while len(pending) >= options.workers:  # at most `workers` ranges read and written at once
                        done = pending.pop(0).result()
                        if bar:
                            bar.step(done / 1e6)
                for future in pending:
                    done = future.result()
                    if bar:
                        bar.step(done / 1e6)
            config = dict(arch.hf_config)
            config["torch_dtype"] = dtypes.canonical_name(dtype)
            config.pop("dtype", None)
            writer.finish(
                config,
                tokenizer_dir=weights.tokenizer_dir,
                manifest={"kind": "megatron_klear.hf_export", "source": os.path.abspath(weights.path)},
            )
        except BaseException:
            writer.abort()
            raise
        return out_dir
