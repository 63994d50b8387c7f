"""Training checkpoints: model, optimizer, scheduler, RNG and data position, in Megatron's
torch_dist format; atomic (temporary name + rename), keep the last K, resume exactly.

Layout of ``save_dir``::

    iter_0000100/            a torch_dist checkpoint of {"model", "optimizer", "rng", common state}
        hf_config.json       so that tools/convert_megatron_to_hf.py exports it directly
        tokenizer/
        manifest.json
    latest_checkpointed_iteration.txt

The model part has the same keys as a converted model directory, so any training checkpoint is
also a model directory (it loads at any TP/PP). A run resumes on another layout (TP, PP, CP or DP
size) with its optimizer state, scheduler and data position, except where the distributed
optimizer's state was saved in Megatron-Core's dp_reshardable format, which moves only to another
data-parallel size: that resume is refused by name (:func:`optimizer_resume_refusal`), and
``optim.reshardable_checkpoints`` saves the fully reshardable format instead.
The rules of the directory itself (one run at a time, resume or refuse, which checkpoints are a
run's own, rotation) are :mod:`megatron_klear.training.run_dir`'s. A save that does not fit on the
disk (checked before writing, and any ENOSPC while writing) ends the run with
:class:`~megatron_klear.training.run_dir.DiskFullError` naming the path, the bytes needed and free;
the previous checkpoint stays the latest, the partial one is removed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_klear.checkpoint.dist_ckpt import disk_full_cause, format_bytes
from megatron_klear.platform.distributed import broadcast_from_rank0, is_rank0, rank
from megatron_klear.training.run_dir import DiskFullError, RunDirectory, RunDirError
from megatron_klear.utils import atomic


def rng_state() -> dict:
    """This rank's random states: Python's, NumPy's, torch's CPU and CUDA generators, and Megatron's
    model-parallel tracker (``get_cuda_rng_tracker``: the data-parallel, tensor-parallel and expert
    states that dropout and initialisation fork into), as Megatron-LM's checkpoints keep them. On
    the CPU the tracker is Megatron's inference tracker and holds no state."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker().get_states()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": {name: t.clone() if torch.is_tensor(t) else t for name, t in tracker.items()},
    }


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`'s states (a checkpoint written before the tracker was kept restores
    the rest)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("tracker"):
        get_cuda_rng_tracker().set_states(dict(state["tracker"]))


#: the parallel sizes that decide which random streams a global rank holds (its TP and EP ranks'
#: tracker seeds, its data-parallel place): random states are restored only onto the same ones
LAYOUT_KEYS = ("tp", "pp", "vpp", "cp", "ep", "etp")


def parallel_layout(parallel) -> dict:
    """``{tp, pp, vpp, cp, ep, etp}`` of a ``parallel`` config section (1 or None where absent)."""
    return {k: getattr(parallel, k, None if k == "vpp" else 1) for k in LAYOUT_KEYS}


def state_layout(state) -> dict | None:
    """The layout of a training state's job (None for a state built without a job config)."""
    parallel = getattr(getattr(state, "config", None), "parallel", None)
    return None if parallel is None else parallel_layout(parallel)


def rng_restore_refusal(info: dict, world: int, layout: dict | None) -> str | None:
    """Why a checkpoint's per-rank random states must not be restored here (None: they may be).
    They are saved per global rank; rank r's tracker states are the streams of its TP and EP ranks.
    On another world size or another layout, rank r would take another rank's streams (correlated
    dropout masks across TP ranks, for one), so the run keeps the states seeded from train.seed.
    A checkpoint written before the manifest kept the layout is judged by its world size alone."""
    saved_world = info.get("world_size", world)
    saved = info.get("layout") or layout
    layout = layout or saved or {}  # (a state without a job config: the world size alone)
    saved = saved or {}
    if saved_world == world and saved == layout:
        return None
    said = ", ".join(f"{k}={saved.get(k)}->{layout.get(k)}" for k in LAYOUT_KEYS if saved.get(k) != layout.get(k))
    return f"world size {saved_world}->{world}" + (f", {said}" if said else "")


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
    from megatron_klear.platform import any_rank

    return any_rank(local)  # the same answer on every rank


#: the distributed optimizer's checkpoint formats (Megatron-Core's ``distrib_optim_sharding_type``)
#: and what a resume may change: dp_reshardable "allows checkpoint resharding only in DP dimension"
#: (megatron/core/optimizer/distrib_optimizer.py, ``DistributedOptimizer.sharded_state_dict``'s
#: docstring), fully_reshardable is laid out per parameter like a plain optimizer's state
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"
#: a plain (not distributed) optimizer's state: per parameter, in the model's sharded keys
MODEL_SPACE = "model_space"


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_format(state) -> str:
    """The format this run saves its optimizer state in: :data:`MODEL_SPACE` for a plain optimizer;
    for the distributed optimizer ``optim.reshardable_checkpoints`` chooses between
    :data:`FULLY_RESHARDABLE` and Megatron-Core's cheaper :data:`DP_RESHARDABLE` (each rank writes
    its own buffers; Megatron-Core's default, fully_sharded_model_space, needs CUDA: "flattened_range
    is not supported" on the CPU)."""
    if not _is_distributed(state.optimizer):
        return MODEL_SPACE
    optim = getattr(getattr(state, "config", None), "optim", None)
    return FULLY_RESHARDABLE if getattr(optim, "reshardable_checkpoints", False) else DP_RESHARDABLE


def _optimizer_sharding_kwargs(fmt: str) -> dict:
    if fmt == MODEL_SPACE:
        return {}
    # fully_reshardable gathers each data-parallel group's state on its first rank over gloo, into
    # CPU memory (Megatron-Core's mem-efficient variant), instead of an all-gather into every GPU
    return {
        "metadata": {
            "distrib_optim_sharding_type": fmt,
            "distrib_optim_fully_reshardable_mem_efficient": fmt == FULLY_RESHARDABLE,
        }
    }


def optimizer_resume_refusal(info: dict, layout: dict | None, fmt: str) -> str | None:
    """Why a checkpoint's optimizer state cannot be resumed here (None: it can), in one sentence
    with the choices; ``fmt``: this run's :func:`optimizer_format`. The rules: the optimizer kind
    (``optim.distributed_optimizer``) stays; a dp_reshardable state moves only to another
    data-parallel size (Megatron-Core's own rule, quoted at :data:`DP_RESHARDABLE`); a change of
    ``parallel.vpp`` is refused for every format (the model's chunks, untested); checkpoints from
    before the manifest recorded the format are not judged."""
    saved = info.get("optimizer_format")
    if saved is None or not info.get("optimizer_state", True):
        return None
    if (saved == MODEL_SPACE) != (fmt == MODEL_SPACE):
        was = "true" if saved != MODEL_SPACE else "false"
        return (
            f"its optimizer state was written with optim.distributed_optimizer={was} and this run sets "
            f"{'false' if was == 'true' else 'true'}: resume with optim.distributed_optimizer={was}"
        )
    saved_layout, layout = info.get("layout") or {}, layout or {}
    if not saved_layout or not layout:
        return None
    keys = ("vpp",) if saved != DP_RESHARDABLE else tuple(k for k in LAYOUT_KEYS)
    changed = [k for k in keys if saved_layout.get(k) != layout.get(k)]
    if not changed:
        return None
    said = ", ".join(f"parallel.{k} {saved_layout.get(k)} -> {layout.get(k)}" for k in changed)
    if saved == DP_RESHARDABLE:
        why = (
            f"the distributed optimizer's state was saved dp_reshardable, which Megatron-Core reshards only "
            f"across data-parallel sizes, and this run changes {said}"
        )
        fix = (
            "resume at the checkpoint's layout (a change of node count alone is a data-parallel change), "
            "with optim.reshardable_checkpoints=true for the checkpoints that follow to be movable"
        )
    else:
        why = f"this run changes {said}, and a change of virtual pipeline stages is not supported on resume"
        fix = f"resume with parallel.vpp={saved_layout.get('vpp')}"
    new_run = (
        "start a new run from its weights with a fresh optimizer (model.path=<checkpoint>, another train.save_dir)"
    )
    return f"{why}. Choose: {fix}; or {new_run}"


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


def _tokenizer_dir(model_path: str) -> str:
    """Where the tokenizer files of ``model.path`` are, to copy into a checkpoint; "" when the
    directory is no longer a model directory of a known format (the checkpoint is saved without
    them rather than lost at the end of a run)."""
    from megatron_klear.checkpoint.model_source import ModelSource

    try:
        return ModelSource(model_path).tokenizer_dir
    except (OSError, ValueError):
        return ""


# -- whose run: what a checkpoint records of the job that wrote it ---------------------------------
class CheckpointManager:
    """Saving and loading a run's checkpoints in ``save_dir``; the directory's rules are its
    :class:`~megatron_klear.training.run_dir.RunDirectory` (``run_dir``)."""

    def __init__(self, save_dir: str, keep_last: int = 3, model_source: str | None = None):
        self.save_dir = save_dir
        self.model_source = model_source  # where hf_config.json / tokenizer come from
        self.run_dir = RunDirectory(save_dir, keep_last)

    def start_run(self, *, resume: bool = True, overwrite: bool = False, log=None, job=None) -> str | None:
        """:meth:`RunDirectory.start_run` (collective): the checkpoint to resume from, or None."""
        return self.run_dir.start_run(resume=resume, overwrite=overwrite, log=log, job=job)

    def latest(self) -> str | None:
        return self.run_dir.latest()

    def checkpoints(self) -> list:
        return self.run_dir.checkpoints()

    def finish(self) -> None:
        """End of the run: release the save directory."""
        self.run_dir.finish()

    # -- save --------------------------------------------------------------------------------------
    def _sharded_state(self, state, *, is_loading: bool, optimizer: bool = True, fmt: str | None = None) -> dict:
        from megatron.core.dist_checkpointing import ShardedObject

        from megatron_klear.checkpoint.dist_ckpt import model_sharded_state_dict

        model_sd = model_sharded_state_dict(state.model)
        world = dist.get_world_size() if dist.is_initialized() else 1
        sharded = dict(model_sd)
        if optimizer:  # (asking for it with is_loading=True creates empty Adam moments)
            if is_loading:
                _give_distributed_optimizer_a_state(state.optimizer)
            sharded["optimizer"] = state.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, **_optimizer_sharding_kwargs(fmt or optimizer_format(state))
            )
        sharded["rng"] = ShardedObject("rng_state", rng_state(), (world,), (rank(),), replica_id=0)
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
        # before the first optimizer step (e.g. RL steps whose groups were all filtered) Adam has no
        # moments yet and none are saved (megatron-core's distributed optimizer cannot even give a
        # state dict then: it asserts one step count); the load must then not ask for them
        has_optimizer_state = _optimizer_has_state(state.optimizer)
        sharded = self._sharded_state(state, is_loading=False, optimizer=has_optimizer_state)
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

        with open(os.path.join(tmp, dist_ckpt.HF_CONFIG), "w") as f:
            json.dump(state.arch.hf_config, f, indent=2)
        tok_dst = os.path.join(tmp, dist_ckpt.TOKENIZER_DIR)
        os.makedirs(tok_dst, exist_ok=True)
        src = self.model_source or ""
        if src and os.path.isdir(tok_src := _tokenizer_dir(src)):
            copy_tokenizer_files(tok_src, tok_dst)
        info = {
            "kind": "megatron_klear.training_checkpoint",
            "step": step,
            "model_source": src,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "layout": state_layout(state),
            "optimizer_state": has_optimizer_state,
            "optimizer_format": optimizer_format(state),
            "param_dtype": _param_dtype(state),
        }
        if self.run_dir.job is not None:
            info["job"] = self.run_dir.job
        write_manifest(tmp, info)
        atomic.finalize_dir(tmp, final)
        self.run_dir.point_latest(step)
        self.run_dir.rotate(step)

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

    # -- load --------------------------------------------------------------------------------------
    def load(self, state, ckpt_dir: str) -> dict:
        """Restore model, optimizer, scheduler and RNG; returns the common state."""
        from megatron.core import dist_checkpointing

        world = dist.get_world_size() if dist.is_initialized() else 1
        manifest = os.path.join(ckpt_dir, "manifest.json")
        try:
            with open(manifest, encoding="utf-8") as f:
                info = json.load(f)
        except FileNotFoundError:
            raise RunDirError(f"{ckpt_dir}: not a complete training checkpoint (no manifest.json)") from None
        except (ValueError, AttributeError) as e:
            raise RunDirError(f"{manifest}: unreadable ({e})") from None
        _check_precision(info.get("param_dtype"), _param_dtype(state), ckpt_dir)
        fmt = optimizer_format(state)
        refusal = optimizer_resume_refusal(info, state_layout(state), fmt)
        if refusal:
            raise RunDirError(f"{ckpt_dir}: cannot resume here: {refusal}")
        saved_fmt = info.get("optimizer_format") or (DP_RESHARDABLE if fmt != MODEL_SPACE else fmt)
        # saved before any optimizer step: no moments were saved, the fresh optimizer is that state
        sharded = self._sharded_state(
            state, is_loading=True, optimizer=info.get("optimizer_state", True), fmt=saved_fmt
        )
        refusal = rng_restore_refusal(info, world, state_layout(state))
        restore_rng = refusal is None
        if not restore_rng:
            sharded.pop("rng")
            if is_rank0():
                print(
                    f"resume: {ckpt_dir} was saved on another layout ({refusal}): its random states are not "
                    "restored; every rank keeps the states seeded from train.seed (dropout masks and other "
                    "random draws differ from an uninterrupted run)",
                    file=sys.stderr,
                    flush=True,
                )
        with torch.no_grad():
            loaded = dist_checkpointing.load(sharded, ckpt_dir)
        from megatron_klear.checkpoint.dist_ckpt import check_loaded, unwrap_model

        for i, chunk in enumerate(state.model):
            key = "model" if len(state.model) == 1 else f"model{i}"
            check_loaded(unwrap_model(chunk).load_state_dict(loaded[key], strict=False), ckpt_dir)
        if "optimizer" in sharded:
            with torch.no_grad(), _without_adam_step_state(state.optimizer, saved_fmt):
                state.optimizer.load_state_dict(loaded["optimizer"])  # (copies into its fp32 parameters in place)
            _restore_adam_steps(state.optimizer, loaded["optimizer"])
        common = loaded["common"]
        _check_schedule(common["scheduler"], state.scheduler, ckpt_dir)
        state.scheduler.num_steps = 0  # Megatron's load_state_dict adds the saved count to this
        state.scheduler.load_state_dict(common["scheduler"])
        if restore_rng:
            set_rng_state(loaded["rng"])
        state.step = int(common["step"])
        return common


#: the scheduler's settings a resume takes from its checkpoint (Megatron-Core's
#: ``OptimizerParamScheduler.load_state_dict``), and the settings of this run that make them
SCHEDULE_KEYS = {
    "max_lr": "optim.lr",
    "min_lr": "optim.min_lr",
    "lr_warmup_steps": "optim.warmup_steps",
    "lr_decay_steps": "optim.decay_steps, or train.steps / train.epochs with the global batch",
    "lr_decay_style": "optim.decay_style",
    "start_wd": "optim.weight_decay",
    "end_wd": "optim.weight_decay",
}


def _check_schedule(saved: dict, scheduler, ckpt_dir: str) -> None:
    """Say when this run's schedule settings differ from its checkpoint's: Megatron-Core's scheduler,
    built with ``use_checkpoint_opt_param_scheduler`` (its default), keeps the checkpoint's values
    on load, silently. The decay length is the one a change of layout moves in SFT: with
    ``train.steps: 0`` it is ``train.epochs`` of steps of ``data.micro_batches_per_step`` rows on each
    data-parallel rank, so a run requeued on fewer ranks decays over the checkpoint's step count and
    reaches ``optim.min_lr`` before its last step."""
    now = scheduler.state_dict()
    differ = [k for k in SCHEDULE_KEYS if k in saved and k in now and saved[k] != now[k]]
    if not differ or not is_rank0():
        return
    said = "; ".join(f"{k} {saved[k]} (this run's settings give {now[k]}: {SCHEDULE_KEYS[k]})" for k in differ)
    hint = ""
    if "lr_decay_steps" in differ:
        hint = (
            ". On another number of data-parallel ranks, the checkpoint's global batch "
            "(data.micro_batches_per_step x the data-parallel size) keeps its schedule's length in rows"
        )
    print(f"resume: {ckpt_dir}'s learning-rate schedule is kept: {said}{hint}", file=sys.stderr, flush=True)


def _param_dtype(state) -> str:
    """The model's parameter dtype as torch names it (``bfloat16``): the precision ``model.dtype``
    resolved to, which lays out the distributed optimizer's state."""
    from megatron_klear.checkpoint.dist_ckpt import unwrap_model
    from megatron_klear.platform.dtypes import canonical_name

    param = next(p for chunk in state.model for p in unwrap_model(chunk).parameters() if p.is_floating_point())
    return canonical_name(param.dtype)


def _check_precision(saved: str | None, current: str, ckpt_dir: str) -> None:
    """A run resumed in another precision than its checkpoints' is refused by name: Megatron's
    optimizers lay out their state by parameter dtype (a bf16 model's fp32 main parameters; the
    distributed optimizer's buffers keyed by dtype), and the load would end in a KeyError listing
    every key. Checkpoints written before the manifest recorded it are not checked."""
    from megatron_klear.platform.dtypes import SHORT_NAMES

    if saved is None or saved == current:
        return
    was, now = SHORT_NAMES.get(saved, saved), SHORT_NAMES.get(current, current)
    raise RunDirError(
        f"{ckpt_dir}: its model and optimizer state were trained in {was}, this run builds the model in {now} "
        f"(model.dtype): a run resumes only in its own precision. Set model.dtype={was} to resume it, or "
        f"start a new run from its weights: model.path={ckpt_dir} with another train.save_dir"
    )


def _give_distributed_optimizer_a_state(optimizer) -> None:
    """Before loading into a fresh megatron-core ``DistributedOptimizer``: without Apex or
    Transformer Engine (the CPU) its ``state_dict()`` reads Adam's step count from the inner
    optimizer's state and asserts there is exactly one, which a fresh optimizer has not got, so
    every resume of a run that had stepped failed there. One optimizer step with zero gradients
    and lr 0 creates that state (megatron-core's own ``_init_optimizer_states_with_dummy_values``,
    which it uses for the same reason with Megatron-FSDP); the load then overwrites all of it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or opt.optimizer.state:
            continue
        lrs = [g["lr"] for g in opt.optimizer.param_groups]
        for g in opt.optimizer.param_groups:
            g["lr"] = 0.0
        try:
            opt._init_optimizer_states_with_dummy_values()
        finally:
            for g, lr in zip(opt.optimizer.param_groups, lrs):
                g["lr"] = lr


@contextlib.contextmanager
def _without_adam_step_state(optimizer, fmt: str):
    """Around a fully_reshardable load into megatron-core 0.16.1's ``DistributedOptimizer`` without
    Apex or Transformer Engine (the CPU: torch's Adam keeps ``step`` per parameter):
    ``load_state_dict`` first gives every state a ``step`` (its "non-Apex/TE support"), then
    ``load_parameter_state_from_fully_reshardable`` hands ``_set_main_param_and_optimizer_states``
    each parameter's loaded tensors, which hold no ``step`` (it is read from the param groups), and
    that copies every entry of the state from them: ``KeyError: 'step'``. For the load, the
    instance's method is wrapped to pass each state's own ``step`` along (a copy onto itself);
    :func:`_restore_adam_steps` then sets the saved count. On a GPU, Apex's and TE's Adam keep no
    per-parameter step and the wrapper passes the tensors through."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    wrapped = []
    if fmt == FULLY_RESHARDABLE:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if isinstance(opt, DistributedOptimizer):
                wrapped.append(opt)
                opt._set_main_param_and_optimizer_states = _passing_step(opt)
    try:
        yield
    finally:
        for opt in wrapped:
            del opt._set_main_param_and_optimizer_states  # the class's method again


def _passing_step(opt):
    original = type(opt)._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group_index, group_order = opt.model_param_group_index_map[model_param]
        main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
        step = opt.optimizer.state.get(main_param, {}).get("step")
        if step is not None and "step" not in tensors:
            tensors = {**tensors, "step": step}
        original(opt, model_param, tensors)

    return set_states


def _restore_adam_steps(optimizer, loaded: dict) -> None:
    """Adam's step count after megatron-core 0.16.1's ``DistributedOptimizer.load_state_dict``
    without Apex or Transformer Engine (torch's Adam, which keeps ``step`` per parameter): it reads
    the saved count from the param groups, but the ``dp_reshardable`` parameter state written after
    it carries the ``step`` of the loading optimizer's own state (the dummy step of
    :func:`_give_distributed_optimizer_a_state`: 1), so every resume restarted Adam's bias
    correction and the first updates after it were several times too large. It also gave every
    parameter one shared ``step`` tensor, which torch's Adam would increment once per parameter. The
    saved count (one per optimizer, megatron-core asserts it) goes back into every state, a tensor
    of its own each."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    per_optimizer = isinstance(loaded, dict) and loaded and all(isinstance(k, int) for k in loaded)
    saved = [loaded[k] for k in sorted(loaded)] if per_optimizer else [loaded] * len(chained)
    for opt, sd in zip(chained, saved):
        if not isinstance(opt, DistributedOptimizer):
            continue
        inner = sd.get("optimizer") if isinstance(sd, dict) else None
        groups = inner.get("param_groups", []) if isinstance(inner, dict) else []
        steps = {float(g["step"]) for g in groups if "step" in g}
        count = steps.pop() if len(steps) == 1 else None
        for st in opt.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone() if count is None else torch.tensor(count, dtype=st["step"].dtype)
