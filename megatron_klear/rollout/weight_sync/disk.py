"""``rollout.weight_sync=disk``: the trainer's weights written as an HF checkpoint directory by
rank 0, which the servers load with ``/update_weights_from_disk``
(:meth:`~megatron_klear.rollout.base.ServerEngine.load_from_disk`)."""

from __future__ import annotations

import os
import shutil

from megatron_klear.platform import barrier, is_rank0
from megatron_klear.rollout.weight_sync.gather import iter_model_hf_weights


def export_hf_for_engine(model_chunks, arch, out_dir: str, *, tokenizer_dir: str | None = None) -> str | None:
    """Collective: write the current weights as an HF checkpoint directory (rank 0 writes; returns
    its path there, None elsewhere)."""
    from megatron_klear.checkpoint.hf_io import HFWriter

    writer = HFWriter(out_dir) if is_rank0() else None
    for name, t in iter_model_hf_weights(model_chunks):
        writer.add(name, t)
    if writer is None:
        return None
    return writer.finish(
        dict(arch.hf_config), tokenizer_dir=tokenizer_dir, manifest={"kind": "megatron_klear.weight_sync"}
    )


def remove_old_versions(sync_dir: str, keep: str) -> list:
    """Delete the versioned weight directories (``step_*``) of ``sync_dir`` other than ``keep``;
    returns what was removed. Called once every server reports the new version."""
    removed = []
    for name in sorted(os.listdir(sync_dir)):
        if name.startswith("step_") and name != keep and os.path.isdir(os.path.join(sync_dir, name)):
            shutil.rmtree(os.path.join(sync_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


class DiskPush:
    """``rollout.weight_sync=disk``, the rollout manager's path (``push(version) -> metrics``): the
    weights go to ``<sync_dir>/step_NNNNNNN`` (``NNNNNNN``: the weight version, not the RL step) and
    every server reloads them; older versions are removed once the servers report the new one.
    ``placement`` (the rollout manager's: servers on their own GPUs, or sharing the trainer's) makes
    the trainer give way before the load (``before_load(state) -> metrics``) and performs it
    (``load(engine, path, version)``, collective: rank 0 holds the engine)."""

    to_servers = True

    def __init__(self, state, arch, engine, sync_dir: str, tokenizer_dir: str | None, placement):
        self.state, self.arch, self.engine = state, arch, engine
        self.sync_dir, self.tokenizer_dir, self.placement = sync_dir, tokenizer_dir, placement

    def push(self, version: int) -> dict:
        name = f"step_{version:07d}"
        path = export_hf_for_engine(
            self.state.model, self.arch, os.path.join(self.sync_dir, name), tokenizer_dir=self.tokenizer_dir
        )
        metrics = self.placement.before_load(self.state)
        metrics.update(self.placement.load(self.engine, path, version))  # (collective)
        if is_rank0():
            remove_old_versions(self.sync_dir, keep=name)
        barrier()
        return metrics

    def close(self) -> None:
        """Nothing is held between pushes (the versioned directories stay for a restart to reload)."""
