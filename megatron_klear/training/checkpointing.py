"""Training checkpoints: model, optimizer, scheduler, RNG and data position, in Megatron's
torch_dist format; atomic (temporary name + rename), keep the last K, resume exactly.

Layout of ``save_dir``::

    iter_0000100/            a torch_dist checkpoint of {"model", "optimizer", "rng", common state}
        hf_config.json       so that tools/convert_megatron_to_hf.py exports it directly
        tokenizer/
        manifest.json
    latest_checkpointed_iteration.txt

The model part has the same keys as a converted model directory, so any training checkpoint is
also a model directory (it loads at any TP/PP; the optimizer state reloads at the same TP/PP).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest_checkpointed_iteration.txt"
ITER_RE = re.compile(r"^iter_(\d{7})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _optimizer_sharding_kwargs(optimizer) -> dict:
    # The default distributed-optimizer layout needs CUDA ("flattened_range is not supported" on
    # CPU); dp_reshardable works everywhere.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if any(isinstance(o, DistributedOptimizer) for o in chained):
        return {"sharding_type": "dp_reshardable"}
    return {}


class CheckpointManager:
    def __init__(self, save_dir: str, keep_last: int = 3, model_source: str | None = None):
        self.save_dir = save_dir
        self.keep_last = keep_last
        self.model_source = model_source  # where hf_config.json / tokenizer come from

    # -- discovery ---------------------------------------------------------------------------------
    def latest(self) -> str | None:
        path = os.path.join(self.save_dir, LATEST)
        if not os.path.isfile(path):
            return None
        step = int(open(path).read().strip())
        ckpt = os.path.join(self.save_dir, f"iter_{step:07d}")
        if not os.path.isdir(ckpt):
            raise FileNotFoundError(f"{path} points at step {step} but {ckpt} is missing")
        return ckpt

    def checkpoints(self) -> list:
        if not os.path.isdir(self.save_dir):
            return []
        return sorted(n for n in os.listdir(self.save_dir) if ITER_RE.match(n))

    # -- save --------------------------------------------------------------------------------------
    def _sharded_state(self, state, *, is_loading: bool) -> dict:
        from megatron.core.dist_checkpointing import ShardedObject

        from megatron_klear.checkpoint.dist_ckpt import model_sharded_state_dict

        model_sd = model_sharded_state_dict(state.model)
        world = dist.get_world_size() if dist.is_initialized() else 1
        sharded = dict(model_sd)
        sharded["optimizer"] = state.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, **_optimizer_sharding_kwargs(state.optimizer)
        )
        sharded["rng"] = ShardedObject(
            "rng_state", _rng_state(), (world,), (_rank(),), replica_id=0
        )
        return sharded

    def save(self, state, step: int, common: dict) -> str:
        """Save everything at ``step``; ``common`` (JSON-able, identical on every rank) holds the
        scheduler, the data position and the config."""
        from megatron.core import dist_checkpointing

        from megatron_klear.checkpoint import dist_ckpt
        from megatron_klear.checkpoint.hf_io import copy_tokenizer_files, write_manifest

        final = os.path.join(self.save_dir, f"iter_{step:07d}")
        tmp = os.path.join(self.save_dir, f".tmp-iter_{step:07d}")
        if _rank() == 0:
            os.makedirs(self.save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        _barrier()
        sharded = self._sharded_state(state, is_loading=False)
        sharded["common"] = {
            "step": step,
            "scheduler": state.scheduler.state_dict(),
            **common,
        }
        dist_checkpointing.save(sharded, tmp, sharded_strategy=dist_ckpt.save_strategy())
        _barrier()
        if _rank() == 0:
            with open(os.path.join(tmp, dist_ckpt.HF_CONFIG), "w") as f:
                json.dump(state.arch.hf_config, f, indent=2)
            tok_dst = os.path.join(tmp, dist_ckpt.TOKENIZER_DIR)
            os.makedirs(tok_dst, exist_ok=True)
            src = self.model_source or ""
            tok_src = src if os.path.isfile(os.path.join(src, "config.json")) else os.path.join(src, dist_ckpt.TOKENIZER_DIR)
            if os.path.isdir(tok_src):
                copy_tokenizer_files(tok_src, tok_dst)
            write_manifest(tmp, {"kind": "megatron_klear.training_checkpoint", "step": step,
                                 "model_source": src, "world_size": dist.get_world_size() if dist.is_initialized() else 1})
            dist_ckpt.finalize_dir(tmp, final)
            _write_atomic(os.path.join(self.save_dir, LATEST), str(step))
            for old in self.checkpoints()[: -self.keep_last]:
                shutil.rmtree(os.path.join(self.save_dir, old), ignore_errors=True)
        _barrier()
        return final

    # -- load --------------------------------------------------------------------------------------
    def load(self, state, ckpt_dir: str) -> dict:
        """Restore model, optimizer, scheduler and RNG; returns the common state."""
        from megatron.core import dist_checkpointing

        sharded = self._sharded_state(state, is_loading=True)
        world = dist.get_world_size() if dist.is_initialized() else 1
        saved_world = json.load(open(os.path.join(ckpt_dir, "manifest.json"))).get("world_size", world)
        restore_rng = saved_world == world
        if not restore_rng:
            sharded.pop("rng")
        with torch.no_grad():
            loaded = dist_checkpointing.load(sharded, ckpt_dir)
        from megatron_klear.checkpoint.dist_ckpt import _unwrap, check_loaded

        for i, chunk in enumerate(state.model):
            key = "model" if len(state.model) == 1 else f"model{i}"
            check_loaded(_unwrap(chunk).load_state_dict(loaded[key], strict=False), ckpt_dir)
        state.optimizer.load_state_dict(loaded["optimizer"])
        common = loaded["common"]
        state.scheduler.num_steps = 0  # Megatron's load_state_dict adds the saved count to this
        state.scheduler.load_state_dict(common["scheduler"])
        if restore_rng:
            _set_rng_state(loaded["rng"])
        state.step = int(common["step"])
        return common
