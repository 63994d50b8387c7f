"""Which path carries the weights, from a ``rollout`` config section. Each path is an object with
``push(version) -> metrics`` (collective: every trainer rank calls it), ``close()`` and
``to_servers`` (whether rollout servers received them, which the probe check then verifies)."""

from __future__ import annotations

from megatron_klear.rollout.weight_sync.disk import DiskPush
from megatron_klear.rollout.weight_sync.distributed import DistributedWeightSync
from megatron_klear.rollout.weight_sync.in_process import InProcessPush


def make_weight_push(r, state, arch, engine, sync_dir: str, tokenizer_dir: str | None, placement):
    """Collective (the distributed path sets up its update groups at its first push). ``engine``:
    rank 0's (None elsewhere); ``placement``: see :class:`~.disk.DiskPush`."""
    if not r.servers:
        return InProcessPush(state.model, engine)
    if r.weight_sync == "distributed":
        return DistributedWeightSync.from_config(state.model, engine, r)
    return DiskPush(state, arch, engine, sync_dir, tokenizer_dir, placement)
