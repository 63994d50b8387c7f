"""A torch_dist checkpoint's stored chunks, read directly, one at a time, from any thread.

torch_dist keeps each tensor as chunks: a TP rank's slice of one layer's tensor, one expert's, or a
conversion's piece. The checkpoint's ``.metadata`` (torch.distributed.checkpoint's ``Metadata``)
gives every chunk's place in the global tensor and its byte range in a ``__*.distcp`` file, where
it is one ``torch.save`` record. Reading a chunk is a seek and a ``torch.load`` of that record.

Why not ``dist_checkpointing.load``: its load plan compares every requested piece with every
stored chunk of the same key, which is quadratic in layers x experts (one key holds all of them:
hours of Python at 235B-A22B's 94 x 128), it needs the process group (so one read at a time), and
it copies each chunk once more into the requested tensor. Here each chunk is read once, in
O(chunks), by as many threads as asked.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSpec:
    """A stored tensor's global shape and dtype, as the checkpoint's metadata records them (what
    Megatron-Core's ``dist_checkpointing.load_tensors_metadata`` returns for a tensor key, read
    here without importing Megatron-Core or forming a process group)."""

    global_shape: tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class Chunk:
    key: str
    offsets: tuple  # its place in the global tensor
    sizes: tuple
    path: str  # the file holding its record
    start: int  # the record's byte range in the file
    length: int


class _Record(io.RawIOBase):
    """A read-only view of bytes ``[start, start + length)`` of an open file."""

    def __init__(self, f, start: int, length: int):
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: pos, io.SEEK_CUR: self.pos + pos, io.SEEK_END: self.length + pos}[whence]
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


class StoredChunks:
    """The stored chunks of a torch_dist checkpoint's tensors (not its pickled objects)."""

    def __init__(self, ckpt_dir: str):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

        metadata = FileSystemReader(ckpt_dir).read_metadata()
        self.dir = ckpt_dir
        self.by_key, self.tensors = {}, {}
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            chunks = []
            for c in md.chunks:
                info = metadata.storage_data[MetadataIndex(key, c.offsets)]
                if getattr(info, "transform_descriptors", None):
                    raise ValueError(
                        f"{ckpt_dir}: '{key}' is stored through transforms {list(info.transform_descriptors)} "
                        "(compression or other torch.distributed.checkpoint extensions), which the export does "
                        "not read"
                    )
                chunks.append(
                    Chunk(key, tuple(c.offsets), tuple(c.sizes), info.relative_path, info.offset, info.length)
                )
            self.by_key[key] = chunks
            self.tensors[key] = TensorSpec(tuple(md.size), md.properties.dtype)

    def covering(self, key: str, index: tuple) -> list:
        """The chunks of ``key`` that hold part of ``key[index]`` (``index`` into its leading
        dimensions: a layer, an expert)."""
        return [
            c for c in self.by_key.get(key, ()) if all(o <= i < o + s for i, o, s in zip(index, c.offsets, c.sizes))
        ]

    def read(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's tensor (of ``chunk.sizes``), read from its record."""
        with open(os.path.join(self.dir, chunk.path), "rb") as f:
            record = io.BufferedReader(_Record(f, chunk.start, chunk.length), buffer_size=1 << 20)
            tensor = torch.load(record, map_location="cpu", weights_only=True)
        if tuple(tensor.shape) != chunk.sizes:
            raise ValueError(
                f"{self.dir}/{chunk.path}: '{chunk.key}' chunk at {chunk.offsets} holds {tuple(tensor.shape)}, "
                f"its metadata says {chunk.sizes}"
            )
        return tensor
