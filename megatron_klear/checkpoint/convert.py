"""HF safetensors <-> Megatron torch_dist conversion, in pieces, each byte written once.

Neither direction materialises the model: the Megatron model is built on the ``meta`` device (no
memory) only to learn the checkpoint's keys and sharding from Megatron-Core itself.

* HF -> Megatron: every tensor is cut into row pieces of at most ``piece_bytes``; Megatron-Core's
  torch_dist save asks for each piece as a writer thread writes it, and the piece is made then
  from the HF rows it needs (:mod:`megatron_klear.checkpoint.streaming_save`).
* Megatron -> HF: the output's shards are laid out from the config, then each stored chunk of the
  checkpoint is read (:mod:`megatron_klear.checkpoint.stored_chunks`) and its rows written at their
  place in the shards, by ``workers`` threads.

Peak memory is a few pieces or chunks per worker whatever the model's size (docs/checkpoints.md).
Every source tensor is consumed exactly once; unknown or missing keys and wrong shapes are errors
naming the tensor; outputs go to a temporary directory renamed into place at the end.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import math
import os
import shutil
import tempfile
import threading

import torch

from megatron_klear.checkpoint import dist_ckpt
from megatron_klear.checkpoint.hf_io import TOKENIZER_FILES, HFReader, HFWriter, copy_tokenizer_files, write_manifest
from megatron_klear.checkpoint.mapping import (
    MappingError,
    check_hf_shapes,
    checkpoint_location,
    hf_shapes,
    layer_of,
    row_sources,
    rules_by_megatron,
    rules_for,
    to_megatron,
)
from megatron_klear.models.arch import ModelArch, load_arch
from megatron_klear.platform import dtypes
from megatron_klear.utils.progress import Progress


def _hf_dtype(cfg: dict) -> torch.dtype:
    """The checkpoint's half-precision dtype when config.json names one, else float32."""
    name = dtypes.canonical_name(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return dtypes.torch_dtype(name) if name in ("bfloat16", "float16") else torch.float32


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


class NotEnoughSpaceError(OSError):
    """The output's filesystem cannot hold what a conversion will write (checked before it starts)."""


def check_free_space(directory: str, needed: int, what: str) -> None:
    """Fail before writing anything when ``directory``'s filesystem has less than ``needed`` bytes
    free; the message names both and ``what`` needs them."""
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise NotEnoughSpaceError(
            f"{directory}: {what} needs {needed / 1e9:.2f} GB ({needed:,} bytes) free, the filesystem has "
            f"{free / 1e9:.2f} GB ({free:,} bytes): free some space or choose another output directory"
        )


def check_hf_keys(arch: ModelArch, reader: HFReader) -> list:
    """Expected vs present HF keys; returns HF keys that are allowed extras (tied lm_head)."""
    expected = {k for r in rules_for(arch) for k in r.hf}
    present = reader.keys()
    extras = []
    if arch.tie_word_embeddings and "lm_head.weight" in present:
        extras.append("lm_head.weight")  # a redundant copy of the tied embedding; verified below
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


PIECE_BYTES = 64 * 1024**2
PIECE_OVERHEAD = 2048  # bytes torch_dist adds per stored piece (its torch.save record, ~1.3 KB, and metadata), a bound


def _map_large_blocks() -> None:
    """Make glibc's malloc give each block of 1 MiB or more its own mapping, returned to the system
    when freed. By default it raises that threshold each time a large block is freed (up to 32 MB),
    after which pieces come from heap arenas that keep freed memory: 0.1-0.3 GiB more, varying from
    run to run with the pieces' sizes (benchmarks/RESULTS.md). Process-wide, and harmless to the
    rest of a process; nothing happens off glibc."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def default_workers() -> int:
    """Writer (and reader) threads when not told: one per core this process may use, up to 8."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def add_io_arguments(parser, pieces: bool = True) -> None:
    """The conversion tools' shared flags: threads, and (HF -> Megatron) the piece size."""
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="threads that read and write pieces (default: the cores this process may use, up to 8)",
    )
    if pieces:
        parser.add_argument(
            "--piece-mb",
            type=float,
            default=PIECE_BYTES / 1024**2,
            help="largest piece of a tensor held at once, MiB (peak memory is about workers x a few pieces)",
        )


def io_kwargs(args) -> dict:
    out = {"workers": args.workers}
    if getattr(args, "piece_mb", None) is not None:
        out["piece_bytes"] = max(1, int(args.piece_mb * 1024**2))
    return out


class _Pieces:
    """Rows of the canonical Megatron tensors, made from the HF source on demand: a checkpoint
    piece (key, offsets, sizes) -> its tensor, read straight from the safetensors rows it needs."""

    def __init__(self, arch: ModelArch, reader: HFReader, padded_vocab: int, dtype: torch.dtype, hf_dir: str):
        self.arch, self.reader, self.padded_vocab, self.dtype, self.hf_dir = arch, reader, padded_vocab, dtype, hf_dir
        self.rules = rules_by_megatron(arch)
        self.at = {}  # (checkpoint key, leading index) -> canonical name
        self.depth = {}
        for cname in self.rules:
            key, index = checkpoint_location(cname, arch)
            self.at[(key, index)] = cname
            self.depth[key] = len(index)

    def check(self) -> None:
        """Every rule's HF tensors have the shapes the config implies (before anything is written)."""
        for rule in self.rules.values():
            self.sources(rule)

    def sources(self, rule) -> list:
        sources = [self.reader.rows(k) for k in rule.hf]
        try:
            check_hf_shapes(rule, sources, self.arch)
        except MappingError as e:  # the shapes the config implies: name both files
            key = next((k for k in rule.hf if f"'{k}'" in str(e)), rule.hf[0])
            config = os.path.join(self.hf_dir, "config.json")
            raise MappingError(f"{self.reader.path_of(key)}: {e} ({config})") from None
        return sources

    def __call__(self, key: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        depth = self.depth[key]
        cname = self.at[(key, tuple(offsets[:depth]))]
        rule = self.rules[cname]
        if any(offsets[depth + 1 :]) or sizes[:depth] != (1,) * depth:
            raise MappingError(f"'{key}' piece at {offsets} of {sizes}: only whole rows of one tensor are made")
        start = offsets[depth] if len(offsets) > depth else 0
        stop = start + (sizes[depth] if len(sizes) > depth else 1)
        rows = to_megatron(rule, self.sources(rule), self.arch, self.padded_vocab, start, stop)
        return rows.to(self.dtype).reshape(sizes)


def hf_to_megatron(
    hf_dir: str,
    out_dir: str,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str | None = None,
    make_vocab_size_divisible_by: int = 128,
    workers: int | None = None,
    piece_bytes: int = PIECE_BYTES,
    progress: bool = True,
) -> str:
    """Convert an HF checkpoint into a megatron-klear torch_dist model directory.

    The checkpoint is written once, piece by piece (rows of one tensor, at most ``piece_bytes``),
    each piece read from the HF rows it needs just before ``workers`` writer threads write it: peak
    memory is about ``workers`` x a few pieces, whatever the model's size (docs/checkpoints.md)."""
    from megatron_klear.checkpoint import streaming_save

    _map_large_blocks()
    arch = load_arch(hf_dir)
    if arch.num_kv_heads % tp:
        raise ValueError(f"--tp {tp} must divide num_key_value_heads={arch.num_kv_heads}")
    if arch.num_layers % pp:
        raise ValueError(f"--pp {pp} must divide num_hidden_layers={arch.num_layers}")
    workers = workers or default_workers()
    reader = HFReader(hf_dir)
    extras = check_hf_keys(arch, reader)
    torch_dtype = dtypes.torch_dtype(dtype) if dtype else _hf_dtype(arch.hf_config)
    model = _meta_model(arch, torch_dtype, make_vocab_size_divisible_by)
    pieces = _Pieces(arch, reader, model.vocab_size, torch_dtype, hf_dir)
    pieces.check()
    for key in extras:  # the redundant tied head must equal the embedding it duplicates
        if not _rows_equal(reader.rows(key), reader.rows("model.embed_tokens.weight"), piece_bytes):
            raise MappingError(
                f"{hf_dir}: 'lm_head.weight' differs from 'model.embed_tokens.weight' but the "
                "config says tie_word_embeddings=true"
            )
    consumed = [k for rule in pieces.rules.values() for k in rule.hf]
    dupes = {k for k in consumed if consumed.count(k) > 1}
    if dupes:
        raise MappingError(f"source tensors consumed more than once: {sorted(dupes)}")

    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    sharded = streaming_save.split_rows(model.sharded_state_dict(), piece_bytes)
    # written once: the weights, torch.save's header per piece, the metadata and the tokenizer files
    tokenizer = sum(
        os.path.getsize(os.path.join(hf_dir, n)) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, n))
    )
    overhead = PIECE_OVERHEAD * streaming_save.count_pieces(sharded) + tokenizer + 64 * 1024
    check_free_space(parent, weights + overhead, f"converting {hf_dir} (the checkpoint, written once)")
    bar = Progress(weights / 1e6, "HF -> Megatron", unit="MB") if progress else None
    lock = threading.Lock()

    def produce(key, offsets, sizes):
        t = pieces(key, offsets, sizes)
        if bar:
            with lock:
                bar.step(t.numel() * t.element_size() / 1e6, note=key)
        return t

    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out_dir) + "-", dir=parent)
    try:
        dist_ckpt.save({"model": sharded}, tmp, strategy=streaming_save.strategy(produce, threads=workers))
        import json

        with open(os.path.join(tmp, dist_ckpt.HF_CONFIG), "w") as f:
            json.dump(arch.hf_config, f, indent=2)
        os.makedirs(os.path.join(tmp, dist_ckpt.TOKENIZER_DIR))
        tok = copy_tokenizer_files(hf_dir, os.path.join(tmp, dist_ckpt.TOKENIZER_DIR))
        write_manifest(
            tmp,
            {
                "kind": "megatron_klear.converted_model",
                "source": os.path.abspath(hf_dir),
                "format": "torch_dist",
                "dtype": str(torch_dtype),
                "suggested_parallel": {"tp": tp, "pp": pp},
                "padded_vocab_size": model.vocab_size,
                "arch": arch.to_dict(),
                "tokenizer_files": tok,
            },
        )
        dist_ckpt.finalize_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _rows_equal(a, b, piece_bytes: int) -> bool:
    if tuple(a.shape) != tuple(b.shape):
        return False
    step = max(1, piece_bytes // max(1, a.row_bytes))
    return all(torch.equal(a[i : i + step], b[i : i + step]) for i in range(0, a.shape[0], step))


def megatron_to_hf(
    ckpt_dir: str,
    out_dir: str,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    workers: int | None = None,
    progress: bool = True,
) -> str:
    """Convert a megatron-klear torch_dist model directory into an HF checkpoint directory.

    The checkpoint is read one stored chunk at a time (:mod:`megatron_klear.checkpoint.stored_chunks`)
    by ``workers`` threads, and each chunk's rows are written straight to their place in the
    output's safetensors shards, laid out before the first read: nothing is buffered, and peak
    memory is about ``workers`` x twice the checkpoint's largest chunk, whatever the model's size
    (docs/checkpoints.md).
    """
    from megatron.core import dist_checkpointing

    from megatron_klear.checkpoint.stored_chunks import StoredChunks
    from megatron_klear.platform import init_parallel

    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir}: checkpoint directory does not exist")
    arch = dist_ckpt.checkpoint_arch(ckpt_dir)
    if not dist_ckpt.is_torch_dist(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir}: no torch_dist checkpoint (metadata.json/.metadata) inside")
    init_parallel()  # reading a torch_dist checkpoint needs a process group, even of one
    _map_large_blocks()
    workers = workers or default_workers()
    # Only the model's weights: a training checkpoint also holds optimizer state and RNG, a
    # Transformer Engine one _extra_state (the rule is dist_ckpt.is_model_weight_key).
    meta = {
        k: v for k, v in dist_checkpointing.load_tensors_metadata(ckpt_dir).items() if dist_ckpt.is_model_weight_key(k)
    }
    if arch.tie_word_embeddings:
        meta.pop("output_layer.weight", None)

    rules = rules_by_megatron(arch)
    # canonical name -> (checkpoint key, index into its leading dims): a layer's slice of a stacked
    # tensor, an expert's slice of an expert tensor (mapping.checkpoint_location)
    where = {cname: checkpoint_location(cname, arch) for cname in rules}
    expected = {}
    for cname, (key, index) in where.items():
        expected.setdefault(key, []).append((index, rules[cname]))
    missing, unknown = sorted(set(expected) - set(meta)), sorted(set(meta) - set(expected))
    if missing or unknown:
        raise MappingError(
            f"{ckpt_dir}: checkpoint tensors do not match {dist_ckpt.HF_CONFIG}: missing {missing}, unknown {unknown}"
        )
    for key, entries in expected.items():
        shape = tuple(meta[key].global_shape)
        depth = len(entries[0][0])
        lead = tuple(max(index[d] for index, _ in entries) + 1 for d in range(depth))
        if shape[:depth] != lead:
            raise MappingError(
                f"{ckpt_dir}: '{key}' has leading dimensions {shape[:depth]} (layers/experts), "
                f"the config implies {lead}"
            )
    for cname, rule in rules.items():
        key, index = where[cname]
        rows = meta[key].global_shape[len(index)]
        if rule.kind == "vocab" and rows < arch.vocab_size:
            raise MappingError(f"'{key}' has {rows} rows, fewer than vocab_size={arch.vocab_size} ({ckpt_dir})")
    src_dtype = meta["embedding.word_embeddings.weight"].dtype
    torch_dtype = dtypes.torch_dtype(dtype) if dtype else src_dtype

    # The output's tensors, in the order of the model (embedding, layer by layer, head), laid out
    # in shards before anything is read.
    def place(cname):
        layer = layer_of(cname)
        return (0, 0) if cname.startswith("embedding.") else (1, layer) if layer is not None else (2, 0)

    order = sorted(rules, key=place)
    plan = [(h, shape, torch_dtype) for c in order for h, shape in zip(rules[c].hf, hf_shapes(rules[c], arch))]
    stored = StoredChunks(ckpt_dir)
    tasks = [t for c in order for t in _chunk_tasks(c, where[c], meta[where[c][0]], stored, ckpt_dir)]

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    weights = sum(math.prod(info.global_shape) for info in meta.values()) * torch_dtype.itemsize
    check_free_space(parent, weights, f"exporting {ckpt_dir} to HF")  # (the padded vocabulary included)
    writer = HFWriter(out_dir, max_shard_bytes=max_shard_bytes, dtype=torch_dtype, plan=plan)
    bar = Progress(weights / 1e6, "Megatron -> HF", unit="MB") if progress else None

    def export(cname, start, stop, chunks) -> int:
        """Rows ``[start, stop)`` of one canonical tensor, from the chunks that hold them."""
        rule, (key, index) = rules[cname], where[cname]
        shape = tuple(meta[key].global_shape[len(index) :])
        rows = None
        for chunk in chunks:
            part = stored.read(chunk)[tuple(i - o for i, o in zip(index, chunk.offsets))]
            at = tuple(chunk.offsets[len(index) :])  # the chunk's rows and columns here
            if len(chunks) == 1 and at[0] == start and tuple(part.shape) == (stop - start, *shape[1:]):
                rows = part  # the common case: the chunk is these rows, whole
                break
            if rows is None:
                rows = torch.empty((stop - start, *shape[1:]), dtype=part.dtype)
            rows[
                (slice(at[0] - start, at[0] - start + part.shape[0]),)
                + tuple(slice(o, o + n) for o, n in zip(at[1:], part.shape[1:]))
            ] = part
        offset = 0
        for j, a, b in row_sources(rule, arch, shape[0], start, stop):
            if j is not None:
                writer.write_rows(rule.hf[j], a, rows[offset : offset + b - a])
            offset += b - a
        return rows.numel() * torch_dtype.itemsize  # (the bytes written: the progress bar's unit)

    try:
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="hf-export") as pool:
            pending = []
            for task in tasks:
                pending.append(pool.submit(export, *task))
                while len(pending) >= workers:  # at most `workers` chunks being read and written
                    done = pending.pop(0).result()
                    if bar:
                        bar.step(done / 1e6)
            for future in pending:
                done = future.result()
                if bar:
                    bar.step(done / 1e6)
        config = dict(arch.hf_config)
        config["torch_dtype"] = dtypes.canonical_name(torch_dtype)
        config.pop("dtype", None)
        tok_dir = os.path.join(ckpt_dir, dist_ckpt.TOKENIZER_DIR)
        writer.finish(
            config,
            tokenizer_dir=tok_dir if os.path.isdir(tok_dir) and os.listdir(tok_dir) else None,
            manifest={"kind": "megatron_klear.hf_export", "source": os.path.abspath(ckpt_dir)},
        )
    except BaseException:
        writer.abort()
        raise
    return out_dir


def _chunk_tasks(cname: str, location: tuple, info, stored, ckpt_dir: str) -> list:
    """``(cname, start, stop, chunks)``: one canonical tensor's rows, by the row ranges of the
    stored chunks that hold it (the chunks of one range side by side in its columns, as a TP
    rank's slices of a row-parallel weight are). The chunks must cover the tensor exactly."""
    key, index = location
    shape = tuple(info.global_shape[len(index) :])
    by_rows = {}
    covered = 0
    for chunk in stored.covering(key, index):
        start, n = chunk.offsets[len(index)], chunk.sizes[len(index)]
        by_rows.setdefault((start, start + n), []).append(chunk)
        covered += math.prod(chunk.sizes[len(index) :])
    ranges = sorted(by_rows)
    if covered != math.prod(shape) or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        raise MappingError(
            f"{ckpt_dir}: the stored chunks of '{key}'{list(index)} do not cover its shape {shape} exactly"
        )
    return [(cname, a, b, by_rows[(a, b)]) for a, b in ranges]
