"""Which path carries the weights, from a ``rollout`` config section: each is a :class:`WeightPush`
(declared here, the rollout manager's only view of it; the tests check every path conforms)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from megatron_klear.rollout.weight_sync.disk import DiskPush
from megatron_klear.rollout.weight_sync.distributed import DistributedWeightSync
from megatron_klear.rollout.weight_sync.in_memory import InMemoryPush
from megatron_klear.rollout.weight_sync.in_process import InProcessPush


@runtime_checkable
class WeightPush(Protocol):
    """One path of the trainer's weights to the engine."""

    #: whether rollout servers receive the weights (the probe check then verifies them)
    to_servers: bool

    def push(self, version: int) -> dict:
        """Collective (every trainer rank calls it): the current weights to the engine as weight
        version ``version``; the path's metrics (``weights/...``)."""

    def close(self) -> None:
        """Release what the path holds between pushes (process groups, files)."""


def make_weight_push(r, state, arch, engine, sync_dir: str, tokenizer_dir: str | None, placement) -> WeightPush:
    """Collective (the distributed path sets up its update groups at its first push). ``engine``:
    rank 0's (None elsewhere); ``placement``: see :class:`~.disk.DiskPush`."""
    if not r.servers:
        return InProcessPush(state.model, engine)
    if r.weight_sync == "distributed":
        return DistributedWeightSync.from_config(state.model, engine, r)
    disk = DiskPush(state, arch, engine, sync_dir, tokenizer_dir, placement)
    if r.weight_sync == "memory":
        return InMemoryPush(state, engine, placement, r.sync_bucket_mb, fallback=disk)
    return disk
