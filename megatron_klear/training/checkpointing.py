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
* a run resumes only its own checkpoints: each records the job that wrote it (``manifest.json``:
  sft or rl, the model's shape, the data's fingerprint); a job whose description differs is refused
  before anything is loaded, naming what differs and the choices (:func:`job_identity`);
* rotation (``keep_last``) deletes only this run's checkpoints: those at or below the step just
  saved, never the one just written;
* a save that does not fit on the disk (checked before writing, and any ENOSPC while writing) ends
  the run with :class:`DiskFullError` naming the path, the bytes needed and free; the previous
  checkpoint stays the latest, the partial one is removed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist

from megatron_klear.checkpoint.dist_ckpt import disk_full_cause, format_bytes
from megatron_klear.platform.distributed import broadcast_from_rank0, is_rank0, rank
from megatron_klear.utils import atomic

LATEST = "latest_checkpointed_iteration.txt"
ITER_RE = re.compile(r"^iter_(\d{7})$")
LOCK = "run.lock"
REPLACED = "replaced"
# what a run writes into its save_dir besides iter_* (moved aside with it by train.overwrite)
RUN_FILES = (LATEST, "metrics.jsonl", "config.yaml", "tensorboard")


class RunDirError(ValueError):
    """The save directory cannot be used as asked (another run's checkpoints, a broken pointer)."""


class DiskFullError(RunDirError):
    """A checkpoint does not fit on the save directory's filesystem (a user error: a ValueError,
    so that the entry points end with one ``error:`` line; ``errno`` is ENOSPC)."""

    errno = errno.ENOSPC


def _print(message: str) -> None:
    print(message, flush=True)


def _step(name: str) -> int:
    return int(name[len("iter_") :])


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


@contextlib.contextmanager
def _quiet_writer_errors():
    """Megatron's writer logs a failed write ("Local process 0 encountered an error: ...") before
    raising it; the failure is reported once, from the raised error."""
    logger = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


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


def _control_group():
    from megatron_klear.platform import control_group

    try:
        return control_group()  # gloo: a CPU tensor works under NCCL too
    except RuntimeError:
        return None


def _sum_over_ranks(n: int) -> int:
    if dist.is_initialized() and dist.get_world_size() > 1:
        total = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(total, group=_control_group())
        return int(total.item())
    return n


def _gather(obj) -> list:
    """Every rank's ``obj``, on every rank (over the control group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=_control_group())
        return out
    return [obj]


# -- whose run: what a checkpoint records of the job that wrote it ---------------------------------
JOB_KINDS = ("sft", "rl")
# the model's fields that decide the shapes of its weights (and so of the optimizer state)
SHAPE_FIELDS = (
    "model_type",
    "hidden_size",
    "ffn_hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "qk_norm",
    "qkv_bias",
    "num_experts",
    "moe_topk",
    "moe_ffn_hidden_size",
    "moe_layer_pattern",
)


def _model_shape(arch) -> dict:
    shape = {k: getattr(arch, k) for k in SHAPE_FIELDS}
    shape["moe_layer_pattern"] = list(shape["moe_layer_pattern"])
    return shape


def _sft_data_fingerprint(prefix: str) -> str:
    """The preprocessed dataset's fingerprint, as PackedSFTDataset records it in its state (read
    from the metadata file alone: no index is opened)."""
    import types

    from megatron_klear.data.indexed import SFTIndexedReader, load_metadata

    return SFTIndexedReader.fingerprint.fget(types.SimpleNamespace(meta=load_metadata(prefix)))


def _files_sha256(paths) -> str:
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _known(read):
    """``read()``, or None when it cannot be read: that part of a job is then not compared (the job
    reports the problem itself where it really reads the part)."""
    try:
        return read()
    except Exception:  # noqa: BLE001 -- any failure means "unknown"
        return None


def job_identity(kind: str, cfg) -> dict:
    """What makes checkpoints a job's own: its kind (sft or rl), the model's shape (read from
    ``model.path``) and the data's fingerprint (SFT: the preprocessed dataset's content hash; RL: the
    sha256 of the prompt files). A part that cannot be read is None, and not compared: the job
    reports that problem itself where it reads the part."""
    from megatron_klear.training.setup import model_arch

    if kind not in JOB_KINDS:
        raise ValueError(f"job kind must be one of {JOB_KINDS}, got {kind!r}")
    if kind == "sft":
        data = _known(
            lambda: {"source": f"data.prefix={cfg.data.prefix}", "fingerprint": _sft_data_fingerprint(cfg.data.prefix)}
        )
    else:
        data = _known(
            lambda: {"source": f"rl.prompts={list(cfg.rl.prompts)}", "fingerprint": _files_sha256(cfg.rl.prompts)}
        )
    return {"kind": kind, "model": _known(lambda: _model_shape(model_arch(cfg.model.path))), "data": data}


def recorded_job(ckpt_dir: str) -> dict:
    """The job that wrote ``ckpt_dir``: its manifest's ``job`` record, or for a checkpoint written
    before there was one, what the checkpoint shows (the model's shape from hf_config.json; the
    kind, and SFT's data fingerprint, from the common state: an RL checkpoint holds its prompt
    position, an SFT one its data position). Unknown parts are None."""

    def manifest_job():
        with open(os.path.join(ckpt_dir, "manifest.json"), encoding="utf-8") as f:
            return json.load(f).get("job")

    job = _known(manifest_job)
    if isinstance(job, dict):
        return job
    from megatron_klear.checkpoint.dist_ckpt import checkpoint_arch

    job = {"kind": None, "model": _known(lambda: _model_shape(checkpoint_arch(ckpt_dir))), "data": None}
    common = _known(
        lambda: torch.load(os.path.join(ckpt_dir, "common.pt"), map_location="cpu", weights_only=True)["common"]
    )
    if isinstance(common, dict) and "prompts" in common:
        job["kind"] = "rl"
    elif isinstance(common, dict) and isinstance(common.get("data"), dict):
        prefix = _known(lambda: common["config"]["data"]["prefix"])
        job["kind"] = "sft"
        job["data"] = {"source": f"data.prefix={prefix}", "fingerprint": common["data"].get("dataset")}
    return job


def job_differences(saved: dict, job: dict) -> dict:
    """{"job" | "model" | "data": what differs} between a checkpoint's job and this one (parts
    unknown on either side are not compared; the data of jobs of different kinds neither)."""
    diffs = {}
    if saved.get("kind") and saved.get("kind") != job.get("kind"):
        diffs["job"] = f"its checkpoints are of an {saved['kind'].upper()} job, this is an {job['kind'].upper()} job"
    there, here = saved.get("model") or {}, job.get("model") or {}
    fields = [k for k in SHAPE_FIELDS if k in there and k in here and there[k] != here[k]]
    if fields:
        diffs["model"] = (
            ", ".join(f"{k} {there[k]}" for k in fields)
            + " in its checkpoints, "
            + ", ".join(f"{k} {here[k]}" for k in fields)
            + " in this job's model.path"
        )
    there, here = saved.get("data") or {}, job.get("data") or {}
    if (
        "job" not in diffs
        and there.get("fingerprint")
        and here.get("fingerprint")
        and there["fingerprint"] != here["fingerprint"]
    ):
        diffs["data"] = (
            f"its checkpoints were trained on {there.get('source')} (content {there['fingerprint'][:12]}), "
            f"this job reads {here.get('source')} (content {here['fingerprint'][:12]})"
        )
    return diffs


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


class CheckpointManager:
    def __init__(self, save_dir: str, keep_last: int = 3, model_source: str | None = None):
        self.save_dir = save_dir
        self.keep_last = keep_last
        self.model_source = model_source  # where hf_config.json / tokenizer come from
        self.lock = None
        self.job = None  # this run's job_identity (rank 0), recorded in every checkpoint's manifest
        self.model_path = None

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
                f"this run to {os.path.join(self.save_dir, REPLACED)}/) or another train.save_dir"
            )
        return ckpt

    def checkpoints(self) -> list:
        if not os.path.isdir(self.save_dir):
            return []
        return sorted(n for n in os.listdir(self.save_dir) if ITER_RE.match(n))

    # -- start of a run ----------------------------------------------------------------------------
    def start_run(self, *, resume: bool = True, overwrite: bool = False, log=None, job=None) -> str | None:
        """Claim ``save_dir`` for this run and decide where it starts (the module doc's rules).
        Every rank calls it; global rank 0 does the file work and prints what it did. Returns the
        checkpoint to resume from, or None for a fresh start. Raises :class:`RunDirError` or
        ``RunLockedError`` on every rank when the directory cannot be used as asked.

        ``job``: ``(kind, cfg)``, "sft" or "rl" and the job's config: the checkpoint to resume must
        have been written by the same kind of job, for a model of the same shape, on the same data
        (checked before anything is loaded), and ``train.overwrite`` must not move ``model.path``
        away. None: not checked."""
        outcome = None
        if is_rank0():
            try:
                if job is not None:
                    self.job, self.model_path = job_identity(*job), job[1].model.path
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
            ckpt = self.latest()
            self._check_same_run(ckpt)
            return ckpt
        found = self.checkpoints()
        if found and overwrite:
            self._check_model_stays(found)
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
            f"replace it (train.overwrite=true moves it to {os.path.join(self.save_dir, REPLACED)}/<time>/)"
        )

    def _check_same_run(self, ckpt: str) -> None:
        """Refuse to resume another run's checkpoint (see :meth:`start_run`), naming what differs
        and the choices."""
        if self.job is None:
            return
        diffs = job_differences(recorded_job(ckpt), self.job)
        if not diffs:
            return
        parts = list(diffs)
        what = parts[0] + " differs" if len(parts) == 1 else ", ".join(parts[:-1]) + f" and {parts[-1]} differ"
        config = os.path.join(self.save_dir, "config.yaml")
        resume = f"resume it (with its own settings{': ' + config if os.path.isfile(config) else ''})"
        replaced = os.path.join(self.save_dir, REPLACED)
        if self.model_path and _inside(self.model_path, self.save_dir):
            others = (
                f"choose another train.save_dir (model.path={self.model_path} is inside this one, so "
                f"train.overwrite=true would move it to {replaced}/<time>/ too)"
            )
        else:
            others = f"choose another train.save_dir, or train.overwrite=true (moves it to {replaced}/<time>/)"
        raise RunDirError(
            f"train.save_dir={self.save_dir} holds another run ({what}: {'; '.join(diffs.values())}): "
            f"{resume}, {others}"
        )

    def _check_model_stays(self, found: list) -> None:
        """train.overwrite moves the earlier run's checkpoints aside: not the one this job starts from."""
        if not self.model_path:
            return
        for name in found:
            if _inside(self.model_path, os.path.join(self.save_dir, name)):
                raise RunDirError(
                    f"train.overwrite=true would move model.path={self.model_path} (a checkpoint of the run in "
                    f"train.save_dir={self.save_dir}) to {os.path.join(self.save_dir, REPLACED)}/<time>/ before "
                    f"this job reads it: choose another train.save_dir for this job"
                )

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
            elif name.startswith((LATEST + ".tmp", atomic.temporary_prefix(LATEST))):  # (the first: older versions)
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
        log(
            f"train.overwrite=true: moved the earlier run in {self.save_dir} to {dest} "
            "(delete it when no longer needed)"
        )

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
        sharded["rng"] = ShardedObject("rng_state", _rng_state(), (world,), (rank(),), replica_id=0)
        return sharded

    def save(self, state, step: int, common: dict) -> str:
        """Save everything at ``step``; ``common`` (JSON-able, identical on every rank) holds the
        scheduler, the data position and the config. Raises :class:`DiskFullError` on every rank
        when the checkpoint does not fit (before writing when the free space is known to be short,
        or when a write runs out of space): the partial checkpoint is removed and the latest one
        stays the latest."""
        from megatron_klear.checkpoint import dist_ckpt

        final = os.path.join(self.save_dir, f"iter_{step:07d}")
        tmp = os.path.join(self.save_dir, f".tmp-iter_{step:07d}")
        sharded = self._sharded_state(state, is_loading=False)
        # before the first optimizer step (e.g. RL steps whose groups were all filtered) Adam has no
        # moments yet and none are saved; the load must then not ask for them
        has_optimizer_state = _optimizer_has_state(state.optimizer)
        sharded["common"] = {
            "step": step,
            "scheduler": state.scheduler.state_dict(),
            **common,
        }
        needed = _sum_over_ranks(dist_ckpt.sharded_state_bytes(sharded))

        def prepare():
            os.makedirs(self.save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(self.save_dir).free
            if needed > free:
                raise DiskFullError(self._disk_full_message(step, tmp, needed, free))
            os.makedirs(tmp)

        self._on_rank0(prepare, step, tmp, needed)
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            with _quiet_writer_errors():
                dist_ckpt.save(sharded, tmp)
            failure = None
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - sorted out with the other ranks' outcomes below
            failure = e
        self._raise_write_failure(failure, step, tmp, needed)
        self._on_rank0(lambda: self._complete(state, step, tmp, final, has_optimizer_state), step, tmp, needed)
        return final

    def _complete(self, state, step: int, tmp: str, final: str, has_optimizer_state: bool) -> None:
        """Rank 0, once every rank wrote its part: the model-directory files, the rename, the pointer,
        the rotation."""
        from megatron_klear.checkpoint import dist_ckpt
        from megatron_klear.checkpoint.hf_io import copy_tokenizer_files, write_manifest
        from megatron_klear.checkpoint.model_source import ModelSource

        with open(os.path.join(tmp, dist_ckpt.HF_CONFIG), "w") as f:
            json.dump(state.arch.hf_config, f, indent=2)
        tok_dst = os.path.join(tmp, dist_ckpt.TOKENIZER_DIR)
        os.makedirs(tok_dst, exist_ok=True)
        src = self.model_source or ""
        tok_src = ModelSource(src).tokenizer_dir
        if os.path.isdir(tok_src):
            copy_tokenizer_files(tok_src, tok_dst)
        info = {
            "kind": "megatron_klear.training_checkpoint",
            "step": step,
            "model_source": src,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "optimizer_state": has_optimizer_state,
        }
        if self.job is not None:
            info["job"] = self.job
        write_manifest(tmp, info)
        dist_ckpt.finalize_dir(tmp, final)
        atomic.write_text(os.path.join(self.save_dir, LATEST), str(step))
        self._rotate(step)

    def _on_rank0(self, work, step: int, tmp: str, needed: int) -> None:
        """Collective: ``work()`` on rank 0; if it fails every rank raises (the disk-full error as
        :class:`DiskFullError`, with the partial checkpoint removed), instead of the other ranks
        waiting for rank 0 forever."""
        outcome = None
        if is_rank0():
            try:
                work()
            except Exception as e:  # noqa: BLE001 - every rank must learn that rank 0 failed
                error = e
                if not isinstance(e, DiskFullError) and disk_full_cause(e):
                    error = DiskFullError(self._disk_full_message(step, tmp, needed, None, e))
                    error.__cause__ = e
                    shutil.rmtree(tmp, ignore_errors=True)
                outcome = (type(error).__name__, str(error))
        outcome = broadcast_from_rank0(outcome)
        if outcome is None:
            return
        if is_rank0():
            raise error
        if outcome[0] == "DiskFullError":
            raise DiskFullError(outcome[1])
        raise RuntimeError(f"saving the checkpoint of step {step} failed on rank 0: {outcome[1]}")

    def _raise_write_failure(self, failure, step: int, tmp: str, needed: int) -> None:
        """Collective, after Megatron's save: if any rank's write failed, every rank raises; a write
        that ran out of space (on any rank) as :class:`DiskFullError`, on every rank, with the
        partial checkpoint removed by rank 0."""
        outcomes = _gather(
            None if failure is None else (disk_full_cause(failure), f"{type(failure).__name__}: {failure}")
        )
        failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if not failed:
            return
        cause = next((o[0] for _, o in failed if o[0]), None)
        if cause:
            message = self._disk_full_message(step, tmp, needed, None, cause)
            if is_rank0():
                shutil.rmtree(tmp, ignore_errors=True)
            raise DiskFullError(message) from failure
        if failure is not None:
            raise failure
        raise RuntimeError(f"saving the checkpoint of step {step} failed on rank {failed[0][0]}: {failed[0][1][1]}")

    def _disk_full_message(self, step: int, tmp: str, needed: int, free: int | None, cause=None) -> str:
        """One line: the path, the bytes needed (the state's size: a lower bound) and free, and what
        is left of the run."""
        if free is None:
            try:
                free = shutil.disk_usage(self.save_dir).free
            except OSError:
                free = None
        if isinstance(cause, BaseException):
            cause = disk_full_cause(cause) or str(cause)
        try:
            previous = self.latest()
        except RunDirError:
            previous = None
        kept = (
            f"the previous checkpoint {previous} is intact and a restart resumes from it"
            if previous
            else "there is no earlier checkpoint of this run"
        )
        return (
            f"not enough disk space for the checkpoint of step {step}: {tmp} needs about {format_bytes(needed)}, "
            + (f"{format_bytes(free)} free" if free is not None else "free space unknown")
            + (f" (the write failed: {cause}; the partial checkpoint was removed)" if cause else "")
            + f"; {kept}. Free some space or choose another train.save_dir"
        )

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
