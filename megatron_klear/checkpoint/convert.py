"""Conversion between weight formats, in pieces, each byte written once.

Any registered format converts to any other (:mod:`megatron_klear.checkpoint.formats`): the source
format reads the directory as canonical tensors by rows, the target format writes them.
:func:`hf_to_megatron` and :func:`megatron_to_hf` are the two directions the tools run
(``tools/convert_hf_to_megatron.py``, ``tools/convert_megatron_to_hf.py``).

Neither direction materialises the model:

* HF -> Megatron (:mod:`~megatron_klear.checkpoint.formats.torch_dist`): every tensor is cut into
  row pieces of at most ``piece_bytes``; Megatron-Core's torch_dist save asks for each piece as a
  writer thread writes it, and the piece is made then from the HF rows it needs
  (:mod:`megatron_klear.checkpoint.streaming_save`).
* Megatron -> HF (:mod:`~megatron_klear.checkpoint.formats.hf`): the output's shards are laid out
  from the config, then each stored chunk of the checkpoint is read
  (:mod:`megatron_klear.checkpoint.stored_chunks`) and its rows written at their place in the
  shards, by ``workers`` threads.

Peak memory is a few pieces or chunks per worker whatever the model's size (docs/checkpoints.md).
Every source tensor is consumed exactly once; unknown or missing keys and wrong shapes are errors
naming the tensor; outputs go to a temporary directory put in place at the end
(:func:`megatron_klear.utils.atomic.finalize_dir`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os

from megatron_klear.checkpoint.formats import HF, TORCH_DIST, detect_format, get_format
from megatron_klear.checkpoint.formats.base import PIECE_BYTES, WriteOptions
from megatron_klear.checkpoint.formats.base import NotEnoughSpaceError as NotEnoughSpaceError
from megatron_klear.checkpoint.formats.base import check_free_space as check_free_space
from megatron_klear.platform import dtypes


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


def convert(
    src: str,
    out_dir: str,
    *,
    to: str,
    source_format: str | None = None,
    dtype: str | None = None,
    workers: int | None = None,
    piece_bytes: int = PIECE_BYTES,
    max_shard_bytes: int = 2 * 1024**3,
    tp: int = 1,
    pp: int = 1,
    make_vocab_size_divisible_by: int = 128,
    progress: bool = True,
) -> str:
    """Write the model at ``src`` as a new directory ``out_dir`` of format ``to`` (a name in the
    registry). ``source_format``: the source's format by name (default: found from its files).
    ``dtype`` (fp32, bf16, ...): the output's (default: the source's); ``workers`` threads read and
    write pieces of at most ``piece_bytes``; the other arguments go to the formats they concern
    (:class:`~megatron_klear.checkpoint.formats.base.WriteOptions`). Returns the output's path."""
    source = get_format(source_format) if source_format else detect_format(src)
    target = get_format(to)
    _map_large_blocks()
    options = WriteOptions(
        dtype=dtypes.torch_dtype(dtype) if dtype else None,
        workers=workers or default_workers(),
        piece_bytes=piece_bytes,
        max_shard_bytes=max_shard_bytes,
        tp=tp,
        pp=pp,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        progress=f"{source.title} -> {target.title}" if progress else None,
    )
    with source.read(src, piece_bytes=piece_bytes) as weights:
        return target.write(weights, out_dir, options)


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
    return convert(
        hf_dir,
        out_dir,
        to=TORCH_DIST,
        source_format=HF,
        dtype=dtype,
        workers=workers,
        piece_bytes=piece_bytes,
        tp=tp,
        pp=pp,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        progress=progress,
    )


def megatron_to_hf(
    ckpt_dir: str,
    out_dir: str,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    workers: int | None = None,
    progress: bool = True,
) -> str:
    """Convert a megatron-klear torch_dist model directory (or a training checkpoint) into an HF
    checkpoint directory.

    The checkpoint is read one stored chunk at a time (:mod:`megatron_klear.checkpoint.stored_chunks`)
    by ``workers`` threads, and each chunk's rows are written straight to their place in the
    output's safetensors shards, laid out before the first read: nothing is buffered, and peak
    memory is about ``workers`` x twice the checkpoint's largest chunk, whatever the model's size
    (docs/checkpoints.md).
    """
    return convert(
        ckpt_dir,
        out_dir,
        to=HF,
        source_format=TORCH_DIST,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        workers=workers,
        progress=progress,
    )
