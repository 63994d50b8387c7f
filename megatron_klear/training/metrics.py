"""Run metrics: a JSONL file always (rank 0), wandb (offline unless WANDB_API_KEY is set) and
TensorBoard when enabled, and a console line with step, loss, lr, tokens/s and ETA."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sys
import time

from megatron_klear.utils import atomic
from megatron_klear.utils.progress import format_seconds


class MetricsLogger:
    def __init__(
        self,
        *,
        jsonl_path: str,
        total_steps: int,
        config: dict | None = None,
        wandb: bool = False,
        wandb_project: str = "megatron-klear",
        run_name: str = "",
        tensorboard_dir: str | None = None,
        wandb_dir: str | None = None,
        enabled: bool = True,
        stream=None,
        resume_step: int | None = None,
    ):
        """``wandb_dir``: where wandb writes its files (``<wandb_dir>/wandb/``; the run's directory),
        unless ``WANDB_DIR`` is set (otherwise wandb writes into the working directory, the
        repository's root for a user who launches from it). ``resume_step``: the step a resumed run
        continues from; the JSONL file keeps the records up to it (the steps after it, logged before
        a crash, are run again) and is appended to. None (a fresh run): the JSONL file starts empty."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.start = time.time()
        self.first_step = None
        self._jsonl = None
        self._wandb = None
        self._tb = None
        if not enabled:
            return
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            if resume_step is None:
                self._jsonl = open(jsonl_path, "w", buffering=1)
            else:
                truncate_jsonl(jsonl_path, resume_step)
                self._jsonl = open(jsonl_path, "a", buffering=1)
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError:
                raise ImportError(
                    "logging.wandb=true needs wandb, from the [logging] extra: pip install -e '.[logging]' "
                    "in the repository's root"
                ) from None
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            _drop_unreachable_wandb_service(self.stream)
            where = {}
            if wandb_dir and not os.environ.get("WANDB_DIR"):  # WANDB_DIR, when set, is wandb's own choice
                os.makedirs(wandb_dir, exist_ok=True)
                where["dir"] = wandb_dir
            self._wandb = wandb_lib.init(
                project=wandb_project, name=run_name or None, config=config, mode=mode, **where
            )
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError(
                    "logging.tensorboard=true needs tensorboard, from the [logging] extra: "
                    "pip install -e '.[logging]' in the repository's root"
                ) from None
            self._tb = SummaryWriter(tensorboard_dir)

    def log(self, step: int, metrics: dict, console_keys=("loss", "lr", "grad_norm")) -> None:
        if not self.enabled:
            return
        now = time.time()
        if self.first_step is None:
            self.first_step, self.start = step - 1, now - metrics.get("step_time_s", 0.0)
        record = {"step": step, "time": now, **{k: v for k, v in metrics.items() if _finite(v)}}
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._wandb:
            self._guard_wandb(lambda: self._wandb.log(metrics, step=step))
        if self._tb:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        done = step - self.first_step
        elapsed = now - self.start
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        parts = [f"step {step}/{self.total_steps}"]
        for k in console_keys:
            if k in metrics:
                parts.append(f"{k} {metrics[k]:.4g}")
        if "tokens_per_s" in metrics:
            parts.append(f"{metrics['tokens_per_s']:.0f} tokens/s")
        parts.append(f"ETA {format_seconds(eta)}")
        self.stream.write(" | ".join(parts) + "\n")
        self.stream.flush()

    def _guard_wandb(self, call) -> None:
        """A wandb call that fails (its service process ended: a SIGTERM to every process of a
        Slurm step or a container reaches it too) stops wandb logging with one warning; training
        goes on, the JSONL file keeps every step, and a stop signal still ends in a saved step."""
        try:
            call()
        except Exception as e:  # noqa: BLE001 -- whatever wandb raises, the run must not die of it
            self._wandb = None
            self.stream.write(
                f"warning: wandb stopped working ({type(e).__name__}: {e}); metrics go on in the JSONL file\n"
            )
            self.stream.flush()

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._wandb:
            self._guard_wandb(self._wandb.finish)
        if self._tb:
            self._tb.close()


def _drop_unreachable_wandb_service(stream) -> None:
    """wandb hands its service's address to child processes in ``WANDB_SERVICE``; a run started
    from a process whose wandb service has ended (a notebook, a launcher, a test session that
    used wandb) inherits a dead address and ``wandb.init`` fails to connect. An address nothing
    answers on is removed, with a warning, so that wandb starts a service of its own."""
    token = os.environ.get("WANDB_SERVICE", "")
    unix = re.fullmatch(r"\d+-\d+-unix-(.+)", token)
    tcp = re.fullmatch(r"\d+-\d+-tcp-localhost-(\d+)", token)
    if unix:
        family, address = socket.AF_UNIX, unix.group(1)
    elif tcp:
        family, address = socket.AF_INET, ("127.0.0.1", int(tcp.group(1)))
    else:
        return
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.settimeout(2.0)
            probe.connect(address)
    except OSError as e:
        del os.environ["WANDB_SERVICE"]
        stream.write(f"warning: WANDB_SERVICE={token} names a wandb service that is gone ({e}); starting a new one\n")
        stream.flush()


def truncate_jsonl(path: str, last_step: int) -> int:
    """Keep the records of ``path`` with ``step <= last_step`` (dropping a torn last line too),
    atomically (a temporary file renamed over it). Returns how many records were dropped."""
    if not os.path.isfile(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                step = json.loads(line).get("step")
                keep = line.endswith("\n") and isinstance(step, int) and step <= last_step
            except (ValueError, AttributeError):
                keep = False
            if keep:
                kept.append(line)
            else:
                dropped += 1
    if dropped:
        with atomic.atomic_file(path) as f:
            f.writelines(kept)
    return dropped


def _finite(v) -> bool:
    return not isinstance(v, float) or math.isfinite(v)
