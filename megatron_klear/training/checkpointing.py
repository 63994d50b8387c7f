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

The rules of a save directory (:meth:`CheckpointManager.start_run`, called before training):

* one run at a time: the run holds ``run.lock`` (pid, host); another run that finds it refuses,
  unless its owner on this host has exited (then the lock is taken over, saying so);
* partial checkpoints left by an interrupted save (``.tmp-iter_*``) are removed at start-up;
* a run resumes from ``latest_checkpointed_iteration.txt`` (``train.resume``, the default);
  a fresh run never mixes with an earlier run's checkpoints: it refuses, naming the choices, or,
  with ``train.overwrite=true``, moves the earlier run to ``replaced/<time>/`` first;
* rotation (``keep_last``) deletes only this run's checkpoints: those at or below the step just
  saved, never the one just written.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist

from megatron_klear.platform.distributed import barrier, broadcast_from_rank0, is_rank0, rank

LATEST = "latest_checkpointed_iteration.txt"
ITER_RE = re.compile(r"^iter_(\d{7})$")
LOCK = "run.lock"
REPLACED = "replaced"
# what a run writes into its save_dir besides iter_* (moved aside with it by train.overwrite)
RUN_FILES = (LATEST, "metrics.jsonl", "config.yaml", "tensorboard")


class RunDirError(ValueError):
    """The save directory cannot be used as asked (another run's checkpoints, a broken pointer)."""


def _print(message: str) -> None:
    print(message, flush=True)


def _step(name: str) -> int:
    return int(name[len("iter_"):])


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


def _optimizer_has_state(optimizer) -> bool:
    """Whether any (chained) Megatron optimizer holds per-parameter state (Adam moments)."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    local = any(len(st) > 0 for o in chained for st in getattr(getattr(o, "optimizer", None), "state", {}).values())
    if dist.is_initialized() and dist.get_world_size() > 1:  # the same answer on every rank
        flag = torch.tensor([int(local)], dtype=torch.int64)
        from megatron_klear.platform import control_group

        try:
            group = control_group()  # gloo: a CPU tensor works under NCCL too
        except RuntimeError:
            group = None
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
    return local


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
        self.lock = None

    # -- discovery ---------------------------------------------------------------------------------
    def latest(self) -> str | None:
        path = os.path.join(self.save_dir, LATEST)
        if not os.path.isfile(path):
            return None
        text = open(path).read().strip()
        try:
            step = int(text)
        except ValueError:
            raise RunDirError(f"{path}: expected a step number, found {text[:40]!r}") from None
        ckpt = os.path.join(self.save_dir, f"iter_{step:07d}")
        if not os.path.isdir(ckpt):
            raise RunDirError(
                f"{path} points at step {step} but {ckpt} is missing: write the step of a checkpoint that "
                f"exists into {path} to resume from it, or start afresh with train.overwrite=true (moves "
                f"this run to {os.path.join(self.save_dir, REPLACED)}/) or another train.save_dir")
        return ckpt

    def checkpoints(self) -> list:
        if not os.path.isdir(self.save_dir):
            return []
        return sorted(n for n in os.listdir(self.save_dir) if ITER_RE.match(n))

    # -- start of a run ----------------------------------------------------------------------------
    def start_run(self, *, resume: bool = True, overwrite: bool = False, log=None) -> str | None:
        """Claim ``save_dir`` for this run and decide where it starts (the module doc's rules).
        Every rank calls it; global rank 0 does the file work and prints what it did. Returns the
        checkpoint to resume from, or None for a fresh start. Raises :class:`RunDirError` or
        ``RunLockedError`` on every rank when the directory cannot be used as asked."""
        outcome = None
        if is_rank0():
            try:
                outcome = ("ok", self._start_run_rank0(resume, overwrite, log or _print))
            except Exception as e:  # noqa: BLE001 - every rank must learn that rank 0 failed
                error = e
                outcome = ("error", type(e).__name__, str(e))
        outcome = broadcast_from_rank0(outcome)
        if outcome[0] == "ok":
            return outcome[1]
        if is_rank0():
            raise error
        from megatron_klear.platform.process import RunLockedError

        raise (RunLockedError if outcome[1] == "RunLockedError" else RunDirError)(outcome[2])

    def _start_run_rank0(self, resume: bool, overwrite: bool, log) -> str | None:
        from megatron_klear.platform.process import RunLock

        os.makedirs(self.save_dir, exist_ok=True)
        if self.lock is None:
            self.lock = RunLock(os.path.join(self.save_dir, LOCK), log=log)
        self.lock.acquire()
        try:
            return self._choose_start(resume, overwrite, log)
        except BaseException:
            self.lock.release()
            raise

    def _choose_start(self, resume: bool, overwrite: bool, log) -> str | None:
        self._clean_partial(log)
        latest_file = os.path.join(self.save_dir, LATEST)
        if resume and not overwrite and os.path.isfile(latest_file):
            return self.latest()
        found = self.checkpoints()
        if found and overwrite:
            self._move_aside(log)
        elif found:
            self._refuse(found, resume)
        if os.path.isfile(latest_file):  # pointing at nothing of this run
            os.remove(latest_file)
        return None

    def _refuse(self, found: list, resume: bool) -> None:
        listed = ", ".join(found[:3]) + (f", ... ({len(found)} in all)" if len(found) > 3 else "")
        latest_file = os.path.join(self.save_dir, LATEST)
        pointer = f"after writing the step to resume from (e.g. {_step(found[-1])}) into {latest_file}"
        if not resume:
            why = "train.resume=false"
            choice = "resume it (train.resume=true" + ("" if os.path.isfile(latest_file) else f", {pointer}") + ")"
        else:
            why = f"there is no {LATEST} to resume from"
            choice = f"resume it ({pointer})"
        raise RunDirError(
            f"train.save_dir={self.save_dir} holds checkpoints of an earlier run ({listed}) and this run would "
            f"start afresh ({why}). Choose one: {choice}, write to a new directory (train.save_dir=...), or "
            f"replace it (train.overwrite=true moves it to {os.path.join(self.save_dir, REPLACED)}/<time>/)")

    def _clean_partial(self, log) -> None:
        """Remove what interrupted saves leave: ``.tmp-iter_*`` (a checkpoint being written),
        ``iter_*.old`` (a checkpoint being replaced: put back if the new one never arrived) and
        the pointer file's temporaries."""
        for name in sorted(os.listdir(self.save_dir)):
            path = os.path.join(self.save_dir, name)
            if name.startswith(".tmp-iter_"):
                shutil.rmtree(path, ignore_errors=True)
                log(f"removed partial checkpoint {path} (left by an interrupted save)")
            elif name.endswith(".old") and ITER_RE.match(name[:-4]):
                final = path[:-4]
                if os.path.isdir(final):
                    shutil.rmtree(path, ignore_errors=True)
                    log(f"removed {path} (left by an interrupted save)")
                else:
                    os.replace(path, final)
                    log(f"restored {final} from {path} (its replacement was interrupted)")
            elif name.startswith(LATEST + ".tmp"):
                os.remove(path)

    def _move_aside(self, log) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest = os.path.join(self.save_dir, REPLACED, stamp)
        n = 1
        while os.path.exists(dest):
            n += 1
            dest = os.path.join(self.save_dir, REPLACED, f"{stamp}-{n}")
        os.makedirs(dest)
        for name in sorted(os.listdir(self.save_dir)):
            if ITER_RE.match(name) or name in RUN_FILES:
                os.replace(os.path.join(self.save_dir, name), os.path.join(dest, name))
        log(f"train.overwrite=true: moved the earlier run in {self.save_dir} to {dest} (delete it when no longer needed)")

    def finish(self) -> None:
        """End of the run: release the save directory."""
        if self.lock is not None:
            self.lock.release()

    # -- save --------------------------------------------------------------------------------------
    def _sharded_state(self, state, *, is_loading: bool, optimizer: bool = True) -> dict:
        from megatron.core.dist_checkpointing import ShardedObject

        from megatron_klear.checkpoint.dist_ckpt import model_sharded_state_dict

        model_sd = model_sharded_state_dict(state.model)
        world = dist.get_world_size() if dist.is_initialized() else 1
        sharded = dict(model_sd)
        if optimizer:  # (asking for it with is_loading=True creates empty Adam moments)
            sharded["optimizer"] = state.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, **_optimizer_sharding_kwargs(state.optimizer)
            )
        sharded["rng"] = ShardedObject(
            "rng_state", _rng_state(), (world,), (rank(),), replica_id=0
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
        if is_rank0():
            os.makedirs(self.save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        barrier()
        sharded = self._sharded_state(state, is_loading=False)
        # before the first optimizer step (e.g. RL steps whose groups were all filtered) Adam has no
        # moments yet and none are saved; the load must then not ask for them
        has_optimizer_state = _optimizer_has_state(state.optimizer)
        sharded["common"] = {
            "step": step,
            "scheduler": state.scheduler.state_dict(),
            **common,
        }
        from megatron_klear.platform.process import start_checkpoint_writer_manager

        start_checkpoint_writer_manager()  # Megatron's writer queue, in a process that dies with this one
        dist_checkpointing.save(sharded, tmp, sharded_strategy=dist_ckpt.save_strategy())
        barrier()
        if is_rank0():
            with open(os.path.join(tmp, dist_ckpt.HF_CONFIG), "w") as f:
                json.dump(state.arch.hf_config, f, indent=2)
            tok_dst = os.path.join(tmp, dist_ckpt.TOKENIZER_DIR)
            os.makedirs(tok_dst, exist_ok=True)
            src = self.model_source or ""
            tok_src = src if os.path.isfile(os.path.join(src, "config.json")) else os.path.join(src, dist_ckpt.TOKENIZER_DIR)
            if os.path.isdir(tok_src):
                copy_tokenizer_files(tok_src, tok_dst)
            write_manifest(tmp, {"kind": "megatron_klear.training_checkpoint", "step": step,
                                 "model_source": src, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                                 "optimizer_state": has_optimizer_state})
            dist_ckpt.finalize_dir(tmp, final)
            _write_atomic(os.path.join(self.save_dir, LATEST), str(step))
            self._rotate(step)
        barrier()
        return final

    def _rotate(self, step: int) -> None:
        """Keep the last ``keep_last`` of this run's checkpoints: those at or below ``step`` (a
        fresh run starts without earlier checkpoints, a resumed one continues its own series);
        anything above ``step`` is not this run's and is left alone."""
        ours = [n for n in self.checkpoints() if _step(n) <= step]
        for old in ours[: -self.keep_last]:
            shutil.rmtree(os.path.join(self.save_dir, old), ignore_errors=True)

    # -- load --------------------------------------------------------------------------------------
    def load(self, state, ckpt_dir: str) -> dict:
        """Restore model, optimizer, scheduler and RNG; returns the common state."""
        from megatron.core import dist_checkpointing

        world = dist.get_world_size() if dist.is_initialized() else 1
        manifest = os.path.join(ckpt_dir, "manifest.json")
        try:
            with open(manifest, encoding="utf-8") as f:
                info = json.load(f)
            saved_world = info.get("world_size", world)
        except FileNotFoundError:
            raise RunDirError(f"{ckpt_dir}: not a complete training checkpoint (no manifest.json)") from None
        except (ValueError, AttributeError) as e:
            raise RunDirError(f"{manifest}: unreadable ({e})") from None
        # saved before any optimizer step: no moments were saved, the fresh optimizer is that state
        sharded = self._sharded_state(state, is_loading=True, optimizer=info.get("optimizer_state", True))
        restore_rng = saved_world == world
        if not restore_rng:
            sharded.pop("rng")
        with torch.no_grad():
            loaded = dist_checkpointing.load(sharded, ckpt_dir)
        from megatron_klear.checkpoint.dist_ckpt import _unwrap, check_loaded

        for i, chunk in enumerate(state.model):
            key = "model" if len(state.model) == 1 else f"model{i}"
            check_loaded(_unwrap(chunk).load_state_dict(loaded[key], strict=False), ckpt_dir)
        if "optimizer" in sharded:
            state.optimizer.load_state_dict(loaded["optimizer"])
        common = loaded["common"]
        state.scheduler.num_steps = 0  # Megatron's load_state_dict adds the saved count to this
        state.scheduler.load_state_dict(common["scheduler"])
        if restore_rng:
            _set_rng_state(loaded["rng"])
        state.step = int(common["step"])
        return common
