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

    def resume(self, state) -> dict:
        """Loads the checkpoint this run continues from into ``state`` and returns what the job saved
        beside it (``common``); ``{}`` for a new run."""
        if not self.resume_from:
            return {}
        common = self.ckpt.load(state, self.resume_from)
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

    def drive(
        self,
        step: Callable[[], dict],
        save: Callable[[], None],
        position: Callable[[], int],
        *,
        log_interval: int = 1,
        console_keys=None,
        stop_after: int | None = None,
    ) -> dict:
        """Runs ``step()`` until ``position()`` reaches the total; returns the last step's metrics.
        Logs every ``log_interval`` steps and the last; calls ``save()`` every ``train.save_interval``
        steps, at the last step and on SIGTERM/SIGINT/SIGUSR1 (then stops: training/signals.py).
        ``stop_after`` ends the run after that step without touching the schedule (tests of resume)."""
        from megatron_klear.training.signals import TerminationFlag

        term = TerminationFlag().install()
        interval, total = self.cfg.train.save_interval, self.total_steps
        shown = {"console_keys": console_keys} if console_keys else {}  # else the logger's own (SFT's)
        metrics = {}
        while position() < total:
            metrics = step()
            at = position()
            if at % log_interval == 0 or at == total:
                self.logger.log(at, metrics, **shown)
            stopping = term.should_stop()  # collective: every rank saves this step and stops
            t_save = time.monotonic()
            if self.ckpt and (stopping or at == total or (interval and at % interval == 0)):
                save()
            if stopping:
                if is_rank0():
                    now = time.monotonic()
                    where = (
                        f"checkpoint of step {at} saved in {self.cfg.train.save_dir} (the save took "
                        f"{now - t_save:.1f} s)"
                        if self.ckpt
                        else "no train.save_dir"
                    )
                    # the time from the signal to here is what the launcher's grace must cover
                    # (torchrun --shutdown-timeout, Slurm's --signal lead: docs/slurm.md)
                    since = f"; {now - term.received_at:.1f} s after the signal" if term.received_at else ""
                    print(f"stopped on {term.signal_name} after step {at}/{total}: {where}{since}", flush=True)
                break
            if stop_after is not None and at >= stop_after:
                break
        return metrics

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
        if self.ckpt:
            self.ckpt.finish()
