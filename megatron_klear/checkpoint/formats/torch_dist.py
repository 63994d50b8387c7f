"""Megatron-Core torch_dist directories as a weight format: a converted model directory or a
training checkpoint's ``iter_NNNNNNN`` (:mod:`megatron_klear.checkpoint.dist_ckpt` describes the
layout: the torch_dist files, ``hf_config.json``, ``tokenizer/``, ``manifest.json``).

Reading takes each stored chunk of the checkpoint straight from its file
(:mod:`megatron_klear.checkpoint.stored_chunks`), not through ``dist_checkpointing.load``; only the
model's weights are read (a training checkpoint's optimizer state, RNG and Transformer Engine
``_extra_state`` are skipped: :func:`~megatron_klear.checkpoint.dist_ckpt.is_model_weight_key`).
Writing builds the Megatron model on the ``meta`` device (no memory) only to learn its checkpoint
keys and sharding from Megatron-Core, then saves through Megatron-Core's own torch_dist save with
every piece made from the reader just before a writer thread writes it
(:mod:`megatron_klear.checkpoint.streaming_save`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import threading

import torch

from megatron_klear.checkpoint import dist_ckpt
from megatron_klear.checkpoint.formats.base import (
    PIECE_BYTES,
    WeightFormat,
    WeightReader,
    WriteOptions,
    check_free_space,
    files_bytes,
)
from megatron_klear.checkpoint.hf_io import TOKENIZER_FILES, copy_tokenizer_files, write_manifest
from megatron_klear.checkpoint.mapping import MappingError, checkpoint_location, rules_by_megatron
from megatron_klear.models.arch import ModelArch
from megatron_klear.utils import atomic
from megatron_klear.utils.progress import Progress

NAME = "torch_dist"
PIECE_OVERHEAD = 2048  # bytes torch_dist adds per stored piece (its torch.save record, ~1.3 KB, and metadata), a bound


class TorchDistWeights(WeightReader):
    """A torch_dist checkpoint's model weights as canonical rows, assembled from the stored chunks
    that hold them (the chunks of one row range side by side in its columns, as a TP rank's slices
    of a row-parallel weight are)."""

    def __init__(self, path: str):
        from megatron_klear.checkpoint.stored_chunks import StoredChunks

        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: checkpoint directory does not exist")
        self.path = path
        self.arch = arch = dist_ckpt.checkpoint_arch(path)
        if not dist_ckpt.is_torch_dist(path):
            raise FileNotFoundError(f"{path}: no torch_dist checkpoint (metadata.json/.metadata) inside")
        # the stored tensors' shapes and dtypes, from the checkpoint's own metadata: no Megatron-Core
        # import and no process group (an export is a plain process, ~5 s quicker to start)
        self.stored = StoredChunks(path)
        meta = {k: v for k, v in self.stored.tensors.items() if dist_ckpt.is_model_weight_key(k)}
        if arch.tie_word_embeddings:
            meta.pop("output_layer.weight", None)
        rules = rules_by_megatron(arch)
        # canonical name -> (checkpoint key, index into its leading dims): a layer's slice of a
        # stacked tensor, an expert's slice of an expert tensor (mapping.checkpoint_location)
        self.where = {name: checkpoint_location(name, arch) for name in rules}
        _check_keys(path, arch, rules, self.where, meta)
        self.dtype = meta["embedding.word_embeddings.weight"].dtype
        self._stored_shape = {n: tuple(meta[k].global_shape[len(i) :]) for n, (k, i) in self.where.items()}
        self._stored_dtype = {n: meta[k].dtype for n, (k, _) in self.where.items()}
        self._vocab = {n for n, r in rules.items() if r.kind == "vocab"}
        self._by_rows = {n: self._chunks_by_rows(n) for n in rules}  # (checks that they cover each tensor)
        tok = os.path.join(path, dist_ckpt.TOKENIZER_DIR)
        self.tokenizer_dir = tok if os.path.isdir(tok) and os.listdir(tok) else None

    def _chunks_by_rows(self, name: str) -> list:
        """``[((start, stop), chunks), ...]``: the stored chunks holding ``name``, by row range. They
        must cover the tensor exactly."""
        key, index = self.where[name]
        shape = self._stored_shape[name]
        by_rows, covered = {}, 0
        for chunk in self.stored.covering(key, index):
            start, n = chunk.offsets[len(index)], chunk.sizes[len(index)]
            by_rows.setdefault((start, start + n), []).append(chunk)
            covered += math.prod(chunk.sizes[len(index) :])
        ranges = sorted(by_rows)
        if covered != math.prod(shape) or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
            raise MappingError(
                f"{self.path}: the stored chunks of '{key}'{list(index)} do not cover its shape {shape} exactly"
            )
        return [(r, by_rows[r]) for r in ranges]

    def shape(self, name: str) -> tuple:
        shape = self._stored_shape[name]
        return (self.arch.vocab_size, *shape[1:]) if name in self._vocab else shape

    def row_ranges(self, name: str, piece_bytes: int) -> list:
        rows = self.shape(name)[0]
        return [(a, min(b, rows)) for (a, b), _ in self._by_rows[name] if a < rows]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name not in self.where:
            raise MappingError(f"{self.path}: '{name}' is not a tensor of this {self.arch.model_type} model")
        shape, key, index = self._stored_shape[name], *self.where[name]
        real = min(stop, self.arch.vocab_size) if name in self._vocab else stop  # zeros past the vocabulary
        if not 0 <= start <= stop or real > shape[0]:
            raise MappingError(f"{self.path}: rows [{start}, {stop}) of '{key}'{list(index)}, which has {shape[0]}")
        groups = [(a, b, chunks) for (a, b), chunks in self._by_rows[name] if a < real and b > start]
        if real == stop and len(groups) == 1 and len(groups[0][2]) == 1:  # the common case: one chunk holds them
            a, _, (chunk,) = groups[0]
            part = self._part(chunk, index)
            if tuple(part.shape[1:]) == shape[1:]:
                return part[start - a : stop - a]
        out = torch.empty((stop - start, *shape[1:]), dtype=self._stored_dtype[name])
        out[max(0, real - start) :].zero_()
        for a, b, chunks in groups:
            lo, hi = max(a, start), min(b, real)
            for chunk in chunks:
                part = self._part(chunk, index)
                cols = tuple(slice(o, o + n) for o, n in zip(chunk.offsets[len(index) + 1 :], part.shape[1:]))
                out[(slice(lo - start, hi - start), *cols)] = part[lo - a : hi - a]
        return out

    def _part(self, chunk, index: tuple) -> torch.Tensor:
        """The chunk's rows of the canonical tensor (its slice at ``index`` of the leading dims)."""
        return self.stored.read(chunk)[tuple(i - o for i, o in zip(index, chunk.offsets))]


def _check_keys(path: str, arch: ModelArch, rules: dict, where: dict, meta: dict) -> None:
    """The checkpoint's model weights are the ones the config implies, at the shapes it implies."""
    expected = {}
    for key, index in where.values():
        expected.setdefault(key, []).append(index)
    missing, unknown = sorted(set(expected) - set(meta)), sorted(set(meta) - set(expected))
    if missing or unknown:
        raise MappingError(
            f"{path}: checkpoint tensors do not match {dist_ckpt.HF_CONFIG}: missing {missing}, unknown {unknown}"
        )
    for key, indices in expected.items():
        shape = tuple(meta[key].global_shape)
        depth = len(indices[0])
        lead = tuple(max(index[d] for index in indices) + 1 for d in range(depth))
        if shape[:depth] != lead:
            raise MappingError(
                f"{path}: '{key}' has leading dimensions {shape[:depth]} (layers/experts), the config implies {lead}"
            )
    for name, rule in rules.items():
        key, index = where[name]
        rows = meta[key].global_shape[len(index)]
        if rule.kind == "vocab" and rows < arch.vocab_size:
            raise MappingError(f"'{key}' has {rows} rows, fewer than vocab_size={arch.vocab_size} ({path})")


def _meta_model(arch: ModelArch, dtype: torch.dtype, make_vocab_size_divisible_by: int):
    from megatron_klear.models.builder import ModelOptions, build_model
    from megatron_klear.platform import ParallelConfig, init_parallel

    init_parallel(ParallelConfig())
    opts = ModelOptions(
        backend="local",
        dtype={torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype],
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )
    with torch.device("meta"):
        return build_model(arch, opts, ParallelConfig(), cpu_init=True)


class _Pieces:
    """A checkpoint piece (key, offsets, sizes) -> its tensor: the rows of one canonical tensor,
    taken from the reader when the writer thread is about to write them, cast to the output dtype."""

    def __init__(self, weights: WeightReader, dtype: torch.dtype):
        self.weights, self.dtype = weights, dtype
        self.at = {}  # (checkpoint key, leading index) -> canonical name
        self.depth = {}
        for name in weights.names():
            key, index = checkpoint_location(name, weights.arch)
            self.at[(key, index)] = name
            self.depth[key] = len(index)

    def __call__(self, key: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        depth = self.depth[key]
        name = self.at[(key, tuple(offsets[:depth]))]
        if any(offsets[depth + 1 :]) or sizes[:depth] != (1,) * depth:
            raise MappingError(f"'{key}' piece at {offsets} of {sizes}: only whole rows of one tensor are made")
        start = offsets[depth] if len(offsets) > depth else 0
        stop = start + (sizes[depth] if len(sizes) > depth else 1)
        return self.weights.rows(name, start, stop).to(self.dtype).reshape(sizes)


class TorchDistFormat(WeightFormat):
    name = NAME
    title = "Megatron"
    looks_for = "metadata.json and .metadata (torch_dist), with hf_config.json"

    def detect(self, path: str) -> bool:
        return dist_ckpt.is_torch_dist(path)

    def arch(self, path: str):
        return dist_ckpt.checkpoint_arch(path)

    def tokenizer_dir(self, path: str) -> str:
        return os.path.join(path, dist_ckpt.TOKENIZER_DIR)

    def read(self, path: str, *, piece_bytes: int = PIECE_BYTES) -> TorchDistWeights:
        return TorchDistWeights(path)

    def load_model(self, model_chunks, path: str) -> None:
        dist_ckpt.load_model(model_chunks, path)

    def write(self, weights: WeightReader, out_dir: str, options: WriteOptions) -> str:
        """The checkpoint is written once, piece by piece (rows of one tensor, at most
        ``options.piece_bytes``), each piece taken from ``weights`` just before one of ``workers``
        writer threads writes it: peak memory is about ``workers`` x a few pieces, whatever the
        model's size (docs/checkpoints.md). The output loads at any TP/PP; ``options.tp`` and
        ``options.pp`` are checked against the model's shapes and recorded in the manifest."""
        from megatron_klear.checkpoint import streaming_save

        arch = weights.arch
        if arch.num_kv_heads % options.tp:
            raise ValueError(f"--tp {options.tp} must divide num_key_value_heads={arch.num_kv_heads}")
        if arch.num_layers % options.pp:
            raise ValueError(f"--pp {options.pp} must divide num_hidden_layers={arch.num_layers}")
        dtype = options.dtype or weights.dtype
        model = _meta_model(arch, dtype, options.make_vocab_size_divisible_by)
        pieces = _Pieces(weights, dtype)
        out_dir = os.path.abspath(out_dir)
        parent = os.path.dirname(out_dir)
        os.makedirs(parent, exist_ok=True)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        sharded = streaming_save.split_rows(model.sharded_state_dict(), options.piece_bytes)
        # written once: the weights, torch.save's header per piece, the metadata and the tokenizer files
        tokenizer = files_bytes(weights.tokenizer_dir, TOKENIZER_FILES)
        overhead = PIECE_OVERHEAD * streaming_save.count_pieces(sharded) + tokenizer + 64 * 1024
        check_free_space(parent, total + overhead, f"converting {weights.path} (the checkpoint, written once)")
        bar = Progress(total / 1e6, options.progress, unit="MB") if options.progress else None
        lock = threading.Lock()

        def produce(key, offsets, sizes):
            t = pieces(key, offsets, sizes)
            if bar:
                with lock:
                    bar.step(t.numel() * t.element_size() / 1e6, note=key)
            return t

        tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out_dir) + "-", dir=parent)
        try:
            strategy = streaming_save.strategy(produce, threads=options.workers)
            dist_ckpt.save({"model": sharded}, tmp, strategy=strategy)
            with open(os.path.join(tmp, dist_ckpt.HF_CONFIG), "w") as f:
                json.dump(arch.hf_config, f, indent=2)
            os.makedirs(os.path.join(tmp, dist_ckpt.TOKENIZER_DIR))
            tok = []
            if weights.tokenizer_dir:
                tok = copy_tokenizer_files(weights.tokenizer_dir, os.path.join(tmp, dist_ckpt.TOKENIZER_DIR))
            write_manifest(
                tmp,
                {
                    "kind": "megatron_klear.converted_model",
                    "source": os.path.abspath(weights.path),
                    "format": NAME,
                    "dtype": str(dtype),
                    "suggested_parallel": {"tp": options.tp, "pp": options.pp},
                    "padded_vocab_size": model.vocab_size,
                    "arch": arch.to_dict(),
                    "tokenizer_files": tok,
                },
            )
            atomic.finalize_dir(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out_dir
