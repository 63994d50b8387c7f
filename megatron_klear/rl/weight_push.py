"""The trainer's weights to the rollout engine: one class per path, each with ``push(version) ->
metrics`` (collective: every trainer rank calls it) and ``close()``.

``to_servers``: whether the weights went to rollout servers (which the probe check then verifies).

- :class:`InProcessPush`: the embedded engine in rank 0's process takes the tensors directly.
- :class:`DiskPush` (``rollout.weight_sync=disk``): a versioned HF directory
  ``<sync_dir>/step_NNNNNNN`` that every server reloads; older versions are removed once every
  server reports the new one.
- :class:`DistributedPush` (``rollout.weight_sync=distributed``): SGLang's
  ``update_weights_from_distributed``, a bucketed broadcast from each pipeline stage's leader over
  an update group with every server (:mod:`megatron_klear.rollout.weight_sync`).

A new path (CUDA IPC, say) is one more class here with the same two verbs, and one more case in
:func:`make_weight_push`.
"""
from __future__ import annotations

import os

from megatron_klear.platform import barrier, is_rank0


def export_weights(model, arch, out_dir: str, tokenizer_dir: str | None):
    """Collective: the current weights as an HF directory (rank 0 writes; returns its path there)."""
    from megatron_klear.rollout.weight_sync import export_hf_for_engine

    return export_hf_for_engine(model, arch, out_dir, tokenizer_dir=tokenizer_dir)


class InProcessPush:
    to_servers = False  # no servers to check

    def __init__(self, model, engine):
        self.model, self.engine = model, engine

    def push(self, version: int) -> dict:
        from megatron_klear.rollout.weight_sync import sync_weights

        sync_weights(self.model, self.engine, version=version)
        return {}

    def close(self) -> None:
        pass


class DiskPush:
    """``placement``: :mod:`megatron_klear.rl.colocation`'s object, which makes the trainer give way
    and the servers take their memory back around the load when they share the trainer's GPUs."""

    to_servers = True

    def __init__(self, state, arch, engine, sync_dir: str, tokenizer_dir: str, placement):
        self.state, self.arch, self.engine = state, arch, engine
        self.sync_dir, self.tokenizer_dir, self.placement = sync_dir, tokenizer_dir, placement

    def push(self, version: int) -> dict:
        from megatron_klear.rollout.weight_sync import remove_old_versions

        name = f"step_{version:07d}"
        path = export_weights(self.state.model, self.arch, os.path.join(self.sync_dir, name), self.tokenizer_dir)
        metrics = self.placement.before_load(self.state)
        if is_rank0():
            self.placement.load(self.engine, path, version)
            remove_old_versions(self.sync_dir, keep=name)
        barrier()
        return metrics

    def close(self) -> None:
        pass


class DistributedPush:
    to_servers = True

    def __init__(self, model, engine, r):
        from megatron_klear.rollout.weight_sync import DistributedWeightSync

        self.sync = DistributedWeightSync(
            model, engine, bucket_mb=r.sync_bucket_mb, backend=r.sync_backend, master_addr=r.sync_master_addr,
            master_port=r.sync_master_port, group_timeout=r.sync_group_timeout_s,
            bucket_timeout=r.sync_bucket_timeout_s, control_timeout=r.control_timeout_s)

    def push(self, version: int) -> dict:
        stats = self.sync.sync(version=version)
        return {"weights/sync_bytes": stats.get("bytes", 0), "weights/sync_buckets": stats.get("buckets", 0)}

    def close(self) -> None:
        self.sync.close()


def make_weight_push(cfg, state, arch, engine, sync_dir: str, tokenizer_dir: str, placement):
    """The path ``cfg.rollout`` asks for (collective: the distributed path sets up its groups)."""
    r = cfg.rollout
    if r.engine != "http":
        return InProcessPush(state.model, engine)
    if r.weight_sync == "distributed":
        return DistributedPush(state.model, engine, r)
    return DiskPush(state, arch, engine, sync_dir, tokenizer_dir, placement)
