"""A torch_dist checkpoint whose tensors are made while it is written, piece by piece.

Megatron-Core's own save takes a sharded state dict of real tensors (its writer gathers and
clones them before writing), so saving a converted model that way needs the whole model in
memory or staged on disk first. Here the state dict holds ``meta`` tensors (shapes, dtypes,
sharding; no memory) cut into row pieces of at most ``piece_bytes``, and the save strategy's
planner asks ``produce(key, offsets, sizes)`` for each piece at the moment a writer thread writes
it. So at any time the memory holds about one piece per writer thread, and each byte of the
checkpoint is written once, into Megatron-Core's own format through its own save
(``dist_checkpointing.save``: its key flattening, sharded objects, ``common.pt`` and
``metadata.json``) and torch's ``FileSystemWriter`` (one file per writer thread).

A checkpoint made of smaller pieces than a training run writes is still the same checkpoint:
torch_dist records every piece's place in the global tensor and reshards on load, as it does
between any two TP/PP layouts.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Callable

import torch


def _smallest_split(rows: int, row_bytes: int, piece_bytes: int) -> int:
    """The fewest equal row pieces (a divisor of ``rows``) of at most ``piece_bytes`` each."""
    for n in range(1, rows + 1):
        if rows % n == 0 and (rows // n) * row_bytes <= piece_bytes:
            return n
    return max(rows, 1)


def split_rows(sharded: dict, piece_bytes: int) -> dict:
    """The same sharded state dict (factories applied) with every ShardedTensor cut along its
    first local dimension into equal pieces of at most ``piece_bytes`` (a regular grid, as
    Megatron-Core's validation wants), their data ``meta`` tensors."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    def split(x):
        if isinstance(x, dict):
            return {k: split(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [y for v in x for y in _as_list(split(v))]
        return _split_one(x, piece_bytes) if isinstance(x, ShardedTensor) else x

    apply_factories(sharded)  # (a fused gate/up weight becomes its two halves)
    return split(sharded)


def _as_list(x) -> list:
    return x if isinstance(x, list) else [x]


def _split_one(sh, piece_bytes: int):
    """``sh`` cut into equal row pieces, each with its leading (layer, expert) axes as axes of
    its own of size 1 rather than prepended ones: the same chunks on disk, but torch's sharded
    tensor, which Megatron-Core builds for prepended axes, checks every pair of a key's chunks for
    overlap, quadratic in layers x experts (minutes at 235B-A22B's 24,000 expert chunks a key)."""
    local = tuple(sh.local_shape)
    if not local:
        return sh
    lead = (1,) * sh.prepend_axis_num
    row_bytes = math.prod(local[1:]) * sh.dtype.itemsize
    n = _smallest_split(local[0], row_bytes, piece_bytes)
    axis, size = sh.prepend_axis_num, local[0] // n
    fragments = list(sh.axis_fragmentations)
    fragments[axis] *= n
    pieces = []
    for i in range(n):
        offset = list(sh.global_offset)
        offset[axis] += i * size
        shape = (*lead, size, *local[1:])
        pieces.append(
            dataclasses.replace(
                sh,
                data=torch.empty(shape, dtype=sh.dtype, device="meta"),
                local_shape=shape,
                global_offset=tuple(offset),
                axis_fragmentations=tuple(fragments),
                prepend_axis_num=0,
            )
        )
    return pieces if n > 1 else pieces[0]


def count_pieces(sharded: dict) -> int:
    """How many tensor pieces :func:`split_rows`'s state dict holds."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return sum(isinstance(x, ShardedTensor) for v in sharded.values() for x in (v if isinstance(v, list) else [v]))


def _planner_class():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class ProducingSavePlanner(MCoreSavePlanner):
        """Megatron-Core's save planner, with each tensor piece made by ``produce`` when it is
        written instead of looked up in the state dict."""

        def __init__(self, produce: Callable, **kwargs):
            super().__init__(**kwargs)
            self.produce = produce
            self._local = threading.local()

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            # torch's writer keeps a reference to every tensor it wrote, the last one per key and
            # file, until the file is done (filesystem.py: ``tensor_dict``, used only by its
            # safetensors format): a piece per weight kind per thread, which grows to GBs. Its
            # serial loader (which ``strategy`` makes it use: no copy-ahead) asks a thread for
            # its next piece only once that thread wrote the previous one, so the previous
            # piece's memory is released here. The round-trip tests would see a piece released
            # before it was written.
            previous = getattr(self._local, "previous", None)
            if previous is not None:
                previous.untyped_storage().resize_(0)
            chunk = write_item.tensor_data.chunk
            piece = self.produce(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))
            storage = piece.untyped_storage()
            if storage.nbytes() != piece.nbytes or not storage.resizable():
                piece = piece.clone()  # a piece owns exactly its memory (a torch.load-ed one cannot be freed so)
            self._local.previous = piece
            return piece

    return ProducingSavePlanner


def strategy(produce: Callable, threads: int = 1, sync_files: bool = True):
    """A ``dist_checkpointing.save`` strategy (torch_dist) that makes each piece with
    ``produce(key, offsets, sizes)`` (a new tensor of ``sizes`` that nothing else holds: its
    memory is released once written) and writes with ``threads`` threads."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class ProducingSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            from torch.distributed import checkpoint as dcp

            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            writer = dcp.FileSystemWriter(
                str(checkpoint_dir), thread_count=threads, sync_files=sync_files, per_thread_copy_ahead=0
            )
            planner = _planner_class()(produce, dedup_replicated_tensors=False, flatten_state_dict=False)
            dcp.save(mcore_to_pyt_state_dict(flat, False), storage_writer=writer, planner=planner)

    return ProducingSaveStrategy("torch_dist", 1, thread_count=threads)
