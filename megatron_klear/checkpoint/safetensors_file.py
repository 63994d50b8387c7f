"""The safetensors file format, read and written by rows: a tensor's rows ``[a, b)`` are one
contiguous byte range, so a piece of a tensor is read with one ``pread`` and written with one
``pwrite`` at its place, whatever the order of the pieces (and from several threads).

Layout (https://github.com/huggingface/safetensors, "Format"): 8 bytes little-endian header length
``N``, ``N`` bytes of JSON (``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}}``,
space-padded to 8 bytes), then the data, each tensor's ``data_offsets`` counted from the data's
start. The files written here load in ``safetensors`` and ``transformers`` (tested against them).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import struct
import threading

import torch

DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024**2  # safetensors' own limit


class UnreadableFileError(ValueError):
    """An input file that exists but cannot be read (truncated, corrupt); the message names it."""


def _unreadable(path: str, why: str) -> UnreadableFileError:
    return UnreadableFileError(
        f"{path}: cannot read this safetensors file ({why}); it is probably truncated or corrupt "
        "(an interrupted download or copy): fetch it again"
    )


class TensorRows:
    """One tensor of a safetensors file, read by rows on demand: ``rows[a:b]`` (a new tensor of
    those rows), ``rows[:]`` (all of it); ``shape`` and ``dtype`` without reading anything."""

    def __init__(self, path: str, name: str, dtype: torch.dtype, shape: tuple, offset: int):
        self.path, self.name, self.dtype, self.shape, self.offset = path, name, dtype, tuple(shape), offset
        self.row_bytes = math.prod(self.shape[1:]) * dtype.itemsize if self.shape else dtype.itemsize

    @property
    def nbytes(self) -> int:
        return (self.shape[0] if self.shape else 1) * self.row_bytes

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"{self.name}: rows are read as a plain slice [a:b], not {rows!r}")
        if not self.shape:
            return self.read(0, 1).reshape(())
        a, b, _ = rows.indices(self.shape[0])
        return self.read(a, max(a, b))

    def read(self, a: int, b: int) -> torch.Tensor:
        """Rows ``[a, b)`` as a fresh tensor."""
        out = torch.empty((b - a, *self.shape[1:]) if self.shape else (), dtype=self.dtype)
        return self.read_into(out, a, b)

    def read_into(self, out: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Rows ``[a, b)`` into ``out`` (contiguous, of this dtype): one ``pread``, the GIL released
        while reading."""
        if out.dtype != self.dtype or not out.is_contiguous() or out.nbytes != (b - a) * self.row_bytes:
            raise ValueError(f"{self.name}: rows [{a}, {b}) do not fit {out.dtype}{tuple(out.shape)}")
        # a ctypes view of the tensor's memory (a numpy one would pin its storage's size)
        view = memoryview((ctypes.c_ubyte * out.nbytes).from_address(out.data_ptr())) if out.nbytes else memoryview(b"")
        got = 0
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset + a * self.row_bytes)
            while got < view.nbytes:  # one read returns at most ~2 GiB on Linux: a large tensor takes several
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        if got != view.nbytes:
            raise _unreadable(self.path, f"tensor '{self.name}' ends past the end of the file")
        return out


def read_header(path: str) -> dict:
    """``{name: TensorRows}`` of a safetensors file, checked against the file's size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _unreadable(path, "shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise _unreadable(path, f"header length {n} does not fit the file's {size} bytes")
            header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _unreadable(path, f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise _unreadable(path, "header is not a JSON object")
    start, tensors = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise _unreadable(path, f"tensor '{name}' has a bad header entry ({e!r})") from None
        if end - begin != math.prod(shape) * dtype.itemsize or start + end > size:
            raise _unreadable(path, f"tensor '{name}' ends past the end of the file or has a bad size")
        tensors[name] = TensorRows(path, name, dtype, shape, start + begin)
    return tensors


class SafetensorsWriter:
    """A safetensors file whose tensors (names, shapes, dtypes: ``entries``) are known before their
    data: the header is written at once and each tensor's rows are written at their place by
    :meth:`write_rows`, in any order, from any thread. :meth:`close` fails naming a tensor that was
    not written whole."""

    def __init__(self, path: str, entries: list, metadata: dict | None = None):
        header, offset = {}, 0
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self.tensors = {}
        for name, shape, dtype in entries:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.tensors[name] = (offset, tuple(shape), dtype, nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path, self.data_start, self.nbytes = path, 8 + len(raw), offset
        self._written = dict.fromkeys(self.tensors, 0)
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._fd, struct.pack("<Q", len(raw)) + raw)
        os.ftruncate(self._fd, self.data_start + offset)

    def write_rows(self, name: str, start: int, tensor: torch.Tensor) -> None:
        """Rows ``start, start + len(tensor)`` of tensor ``name`` (cast to its dtype)."""
        offset, shape, dtype, nbytes = self.tensors[name]
        tensor = tensor.detach().to(dtype).contiguous()
        if (
            tuple(tensor.shape[1:]) != shape[1:]
            or start < 0
            or start + (tensor.shape[0] if shape else 1) > (shape[0] if shape else 1)
        ):
            raise ValueError(f"{self.path}: rows {start}+{tuple(tensor.shape)} do not fit '{name}' {shape}")
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
        row_bytes = nbytes // shape[0] if shape and shape[0] else nbytes
        where = self.data_start + offset + start * row_bytes
        done = 0
        while done < data.nbytes:  # pwrite may write less than asked (signals, large writes)
            done += os.pwrite(self._fd, data[done:], where + done)
        with self._lock:
            self._written[name] += data.nbytes

    def close(self, sync: bool = False) -> None:
        try:
            short = [n for n, (_, _, _, nbytes) in self.tensors.items() if self._written[n] != nbytes]
            if short:
                raise RuntimeError(
                    f"{self.path}: tensor '{short[0]}' was written {self._written[short[0]]} of "
                    f"{self.tensors[short[0]][3]} bytes ({len(short)} incomplete)"
                )
            if sync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)

    def abort(self) -> None:
        with contextlib.suppress(OSError):  # (already closed)
            os.close(self._fd)
