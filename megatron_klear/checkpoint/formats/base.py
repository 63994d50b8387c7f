"""What a weight format is: the interface every format implements, and what formats exchange.

A format is a way to keep a model's weights in a directory (HF safetensors, Megatron-Core's
torch_dist, ...). It answers five questions about a directory:

* :meth:`WeightFormat.detect`: is this directory mine? (only file names are looked at);
* :meth:`WeightFormat.arch` and :meth:`WeightFormat.tokenizer_dir`: the model's architecture and
  where its tokenizer files are (what ``model.path`` needs, :mod:`~megatron_klear.checkpoint.model_source`);
* :meth:`WeightFormat.read`: its weights, as a :class:`WeightReader` (conversion, export);
* :meth:`WeightFormat.write`: a new directory of this format holding the weights of any reader;
* :meth:`WeightFormat.load_model`: its weights into a live, TP/PP-sharded model (a job's start,
  the parity check).

Formats meet in the middle, in *canonical* tensors: the mapping's Megatron names and row layouts
(:mod:`megatron_klear.checkpoint.mapping`: a TP=1, PP=1 model, global layer and expert indices,
fused QKV and gate/up), read by rows so that no format ever holds a whole model. So converting is
``target.write(source.read(path), out)`` for any two formats, and a new format is one module here
(its reader and writer) plus one line in the registry (``formats/__init__.py``).
"""

from __future__ import annotations

import abc
import math
import os
import shutil
from dataclasses import dataclass

import torch

from megatron_klear.checkpoint.mapping import rules_by_megatron

PIECE_BYTES = 64 * 1024**2  # the most bytes of one tensor read or made at once, by default


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


def files_bytes(directory: str | None, names) -> int:
    """The bytes of the files ``names`` that exist in ``directory`` (the tokenizer files a writer copies)."""
    if not directory:
        return 0
    paths = (os.path.join(directory, n) for n in names)
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


@dataclass(frozen=True)
class WriteOptions:
    """How :meth:`WeightFormat.write` writes; each format reads the fields that apply to it."""

    dtype: torch.dtype | None = None  # of the written floating-point weights; None: the reader's
    workers: int = 1  # threads that read and write pieces
    piece_bytes: int = PIECE_BYTES  # the largest piece of a tensor held at once
    max_shard_bytes: int = 2 * 1024**3  # formats stored as shards of a size (HF safetensors)
    tp: int = 1  # the layout the model will be trained with: checked against its shapes, recorded
    pp: int = 1
    make_vocab_size_divisible_by: int = 128  # formats that keep the vocabulary padded (torch_dist)
    progress: str | None = None  # the progress line's label ("HF -> Megatron"); None: no progress line


class WeightReader(abc.ABC):
    """A directory's weights as canonical tensors, read by rows on demand, from any thread.

    ``path`` is the directory, ``arch`` the model's architecture, ``dtype`` the dtype its weights
    are stored in (what a conversion writes when not told another), ``tokenizer_dir`` the
    directory holding its tokenizer files (None: none). Every check that can fail on the input
    (missing or unknown tensors, shapes) is made when the reader is made, before anything is
    written, and its error names the file."""

    path: str
    arch: object  # a models.arch.ModelArch
    dtype: torch.dtype
    tokenizer_dir: str | None = None

    def names(self) -> list:
        """Every canonical tensor of the model, in the model's order (embedding, layers, head)."""
        return list(rules_by_megatron(self.arch))

    @abc.abstractmethod
    def shape(self, name: str) -> tuple:
        """The canonical tensor's shape; a vocabulary tensor (embedding, output layer) has
        ``arch.vocab_size`` rows, whatever padding the format stores."""

    @abc.abstractmethod
    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of the canonical tensor ``name``, in the stored dtype. A
        vocabulary tensor reads as zeros at and past ``arch.vocab_size`` rows, so that a writer
        pads it to the size it needs."""

    def row_ranges(self, name: str, piece_bytes: int) -> list:
        """The row ranges ``[(start, stop), ...]`` to read ``name`` in: in order, covering its rows
        exactly. By default pieces of at most ``piece_bytes``; a format that stores tensors in
        chunks of its own gives those, so that each stored chunk is read once."""
        shape = self.shape(name)
        rows = shape[0]
        row_bytes = math.prod(shape[1:]) * self.dtype.itemsize
        step = max(1, piece_bytes // max(1, row_bytes))
        return [(a, min(a + step, rows)) for a in range(0, rows, step)]

    def close(self) -> None:  # noqa: B027 -- an optional hook, a no-op by default
        """Let go of open files and caches (a reader is used once)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class WeightFormat(abc.ABC):
    """One way to keep a model's weights in a directory. ``name`` is its key in the registry (what
    tools and errors call it), ``title`` what progress lines call it, ``looks_for`` what
    :meth:`detect` looks for (listed when no format recognises a directory)."""

    name: str = ""
    title: str = ""
    looks_for: str = ""

    @abc.abstractmethod
    def detect(self, path: str) -> bool:
        """True when the directory ``path`` is of this format, judged by the files present (nothing
        is read or checked: :meth:`read` does that)."""

    @abc.abstractmethod
    def arch(self, path: str):
        """The architecture (a :class:`~megatron_klear.models.arch.ModelArch`) of the model at ``path``."""

    @abc.abstractmethod
    def tokenizer_dir(self, path: str) -> str:
        """The directory holding the tokenizer files of the model at ``path``."""

    @abc.abstractmethod
    def read(self, path: str, *, piece_bytes: int = PIECE_BYTES) -> WeightReader:
        """The weights at ``path``, checked (missing, unknown or misshapen tensors are errors naming
        the file) but not read yet. ``piece_bytes``: the most bytes a check reads at once."""

    @abc.abstractmethod
    def write(self, weights: WeightReader, out_dir: str, options: WriteOptions) -> str:
        """Write ``weights`` as a new directory ``out_dir`` of this format, with the tokenizer files
        and a ``manifest.json``; built under a temporary name and put in place when complete
        (:func:`megatron_klear.utils.atomic.finalize_dir`). Returns the output's absolute path."""

    @abc.abstractmethod
    def load_model(self, model_chunks, path: str) -> None:
        """Copy the weights at ``path`` into this rank's (unwrapped) model chunks, at their TP/PP
        layout; a missing or unexpected weight is an error naming it."""
