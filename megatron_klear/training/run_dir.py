"""The run directory (``train.save_dir``) of a training job, apart from what is saved in it
(training/checkpointing.py): one run at a time, where a run starts, which checkpoints are its own,
the latest-step pointer and the rotation.

The rules (:meth:`RunDirectory.start_run`, called before training):

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

import errno
import hashlib
import json
import os
import re
import shutil
import time

import torch

from megatron_klear.platform.distributed import broadcast_from_rank0, is_rank0
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


class RunDirectory:
    """``save_dir`` as one run's: its lock, where the run starts (resume, refuse, or move an earlier
    run aside), the latest-step pointer and the rotation of its checkpoints (the module's rules).
    ``keep_last``: checkpoints kept by :meth:`rotate`."""

    def __init__(self, save_dir: str, keep_last: int = 3):
        self.save_dir = save_dir
        self.keep_last = keep_last
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
        """Remove what interrupted saves leave: ``.tmp-iter_*`` (a checkpoint being written), the
        old copy of a checkpoint being replaced (``iter_*.old-<pid>``, or ``iter_*.old`` of older
        versions: put back if the new one never arrived, :func:`~megatron_klear.utils.atomic.recover_dir`)
        and the pointer file's temporaries."""
        for name in sorted(os.listdir(self.save_dir)):
            path = os.path.join(self.save_dir, name)
            replaced = atomic.replaced_dir_of(name)
            if name.startswith(".tmp-iter_"):
                shutil.rmtree(path, ignore_errors=True)
                log(f"removed partial checkpoint {path} (left by an interrupted save)")
            elif replaced and ITER_RE.match(replaced):
                final = os.path.join(self.save_dir, replaced)
                for action, old in atomic.recover_dir(final):
                    if action == "restored":
                        log(f"restored {final} from {old} (its replacement was interrupted)")
                    else:
                        log(f"removed {old} (left by an interrupted save)")
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

    # -- after a save ------------------------------------------------------------------------------
    def point_latest(self, step: int) -> None:
        """The pointer a resumed run reads (written whole or not at all)."""
        atomic.write_text(os.path.join(self.save_dir, LATEST), str(step))

    def rotate(self, step: int) -> None:
        """Keep the last ``keep_last`` of this run's checkpoints: those at or below ``step`` (a
        fresh run starts without earlier checkpoints, a resumed one continues its own series);
        anything above ``step`` is not this run's and is left alone."""
        ours = [n for n in self.checkpoints() if _step(n) <= step]
        for old in ours[: -self.keep_last]:
            shutil.rmtree(os.path.join(self.save_dir, old), ignore_errors=True)
