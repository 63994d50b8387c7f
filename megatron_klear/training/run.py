"""What every training job does around its own steps, shared by SFT (sft/trainer.py) and RL
(rl/loop.py): take the run directory (lock, resume or overwrite: training/checkpointing.py), load
the checkpoint a resumed run continues from, open the metrics logger (JSONL always, wandb and
TensorBoard when asked), write the job's config beside its checkpoints, then drive the steps: log
them, save on the configured cadence, at the last step and on a stop signal, stop cleanly, and close.

A job hands in its step, its save and its position (the step count a checkpoint records); the rest
is here, once::

    run = Run(cfg, job="sft")
    state = build_training_state(...)
    common = run.resume(state)             # {} for a new run
    run.open_log(total_steps, position=state.step)
    metrics = run.drive(step_fn, save_fn, lambda: state.step)
    run.close()
"""

from __future__ import annotations

import os
import time
from typing import Callable

from megatron_klear.platform import is_rank0
from megatron_klear.utils import atomic


class Run:
    """One job's run: ``cfg`` is its job config (``train``, ``logging``, ``model`` sections,
    ``to_dict``/``to_yaml``), ``job`` "sft" or "rl" (a resumed checkpoint must be of the same kind)."""

    def __init__(self, cfg, job: str):
        from megatron_klear.training.checkpointing import CheckpointManager

        self.cfg, self.job = cfg, job
        train = cfg.train
        self.ckpt = (
            CheckpointManager(train.save_dir, train.keep_last, model_source=cfg.model.path) if train.save_dir else None
        )
        self.resume_from = (
            self.ckpt.start_run(resume=train.resume, overwrite=train.overwrite, job=(job, cfg)) if self.ckpt else None
        )
        self.logger = None
        self.total_steps = 0
        self.saved_at = None  # the step of the checkpoint this run last saved or resumed from

    def resume(self, state) -> dict:
        """Loads the checkpoint this run continues from into ``state`` and returns what the job saved
        beside it (``common``); ``{}`` for a new run."""
        if not self.resume_from:
            return {}
        common = self.ckpt.load(state, self.resume_from)
        self.saved_at = int(common["step"])
        if is_rank0():
            print(f"resumed from {self.resume_from} at step {int(common['step'])}", flush=True)
        return common

    def open_log(self, total_steps: int, position: int) -> None:
        """The metrics logger (a resumed run keeps its JSONL records up to ``position``) and the
        job's config as ``config.yaml`` in the run directory."""
        from megatron_klear.training.metrics import MetricsLogger

        cfg, save_dir = self.cfg, self.cfg.train.save_dir
        self.total_steps = total_steps
        self.logger = MetricsLogger(
            jsonl_path=cfg.logging.jsonl or (os.path.join(save_dir, "metrics.jsonl") if save_dir else ""),
            total_steps=total_steps,
            config=cfg.to_dict(),
            wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project,
            run_name=cfg.logging.run_name,
            tensorboard_dir=os.path.join(save_dir or ".", "tensorboard") if cfg.logging.tensorboard else None,
            wandb_dir=save_dir or None,
            enabled=is_rank0(),
            resume_step=position if self.resume_from else None,
        )
        if is_rank0() and save_dir:
            atomic.write_text(os.path.join(save_dir, "config.yaml"), cfg.to_yaml())

    def log_now(self, at: int, metrics: dict) -> None:
        """Log ``metrics`` at position ``at`` outside a step (an evaluation before the first); nothing
        when empty."""
        if metrics and self.logger is not None:
            self.logger.log(at, metrics)

    def drive(
        self,
        step: Callable[[], dict],
        save: Callable[[], None],
        position: Callable[[], int],
        *,
        log_interval: int = 1,
        console_keys=None,
        stop_after: int | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> dict:
        """Runs ``step()`` until ``position()`` reaches the total; returns the last step's metrics.
        Logs every ``log_interval`` steps and the last; calls ``save()`` every ``train.save_interval``
        steps, at the last step and on SIGTERM/SIGINT/SIGUSR1 (then stops: training/signals.py).
        ``on_stop``: called (from another thread) at the first stop signal to cut the step in flight
        short; the step then raises :class:`~megatron_klear.training.signals.StepInterrupted` and the
        last completed step is saved at once. ``stop_after`` ends the run after that step without
        touching the schedule (tests of resume)."""
        from megatron_klear.training.signals import StepInterrupted, TerminationFlag
        from megatron_klear.training.stop_grace import StopGrace

        term = TerminationFlag().install(on_signal=on_stop)
        grace = StopGrace.from_env()
        interval, total = self.cfg.train.save_interval, self.total_steps
        shown = {"console_keys": console_keys} if console_keys else {}  # else the logger's own (SFT's)
        metrics = {}
        try:
            while position() < total:
                cut, t_step = None, time.monotonic()
                try:
                    metrics = step()
                    grace.step(metrics, time.monotonic() - t_step)
                except StepInterrupted as e:  # nothing of the step happened: the last one is saved
                    cut = e
                at = position()
                if cut is None and (at % log_interval == 0 or at == total):
                    self.logger.log(at, metrics, **shown)
                stopping = term.should_stop() or cut is not None  # collective: every rank saves this step
                t_save, saved = time.monotonic(), False
                if self.ckpt and at != self.saved_at and (stopping or at == total or (interval and at % interval == 0)):
                    save()
                    self.saved_at, saved = at, True
                    warning = grace.saved(time.monotonic() - t_save)
                    if warning and is_rank0() and not stopping:
                        print(warning, flush=True)
                if stopping:
                    self._say_stopped(term, at, total, cut, time.monotonic() - t_save if saved else None)
                    break
                if stop_after is not None and at >= stop_after:
                    break
        finally:
            term.close()
        return metrics

    def _say_stopped(self, term, at: int, total: int, cut, save_s: float | None) -> None:
        """Rank 0: the line that says where a stopped run stands and how long the stop took (what
        the launcher's grace must cover: torchrun --shutdown-timeout, Slurm's --signal lead;
        docs/slurm.md). ``save_s``: the save's time, None when the step had a checkpoint already."""
        if not is_rank0():
            return
        if not self.ckpt:
            where = "no train.save_dir"
        elif save_s is None:
            where = f"the checkpoint of step {at} was saved already"
        else:
            where = f"checkpoint of step {at} saved in {self.cfg.train.save_dir} (the save took {save_s:.1f} s)"
        during = f" ({cut}; nothing of it trained)" if cut is not None else ""
        since = f"; {time.monotonic() - term.received_at:.1f} s after the signal" if term.received_at else ""
        print(
            f"stopped on {term.signal_name or 'a stop signal'} after step {at}/{total}{during}: {where}{since}",
            flush=True,
        )

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
        if self.ckpt:
            self.ckpt.finish()
