"""Preemption: SIGTERM, SIGINT or SIGUSR1 -> finish the step, save a checkpoint, exit 0.

Who sends what (docs/checkpoints.md#preemption):

* ``kill -TERM <torchrun pid>`` (Kubernetes, a scheduler's preemption) and Ctrl-C (SIGINT):
  torchrun forwards them to every rank's process group, then waits ``--shutdown-timeout``
  seconds (default 30) before SIGKILL; the step and the save must fit in that time. torchrun
  itself then re-raises the signal it got (``SignalException``) and exits 1, whatever the ranks did.
* SIGUSR1 (Slurm's ``--signal=USR1@<seconds>``): torchrun does not handle it unless started with
  ``--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``; without that its default action
  ends torchrun at once and the ranks die with it (platform/process.py ``die_with_launcher``)
  without a checkpoint. Sent to the ranks themselves (Slurm signals every process of the step),
  it works with or without torchrun.

The signal only sets a flag; :meth:`TerminationFlag.should_stop`, called once per step, is
collective, so every rank stops and saves at the same step. A second SIGINT in a run without
torchrun interrupts at once (KeyboardInterrupt), as Ctrl-C twice is meant to.

A job whose step can be cut short (the RL loop: its generation, minutes at scale) gives
``install(on_signal=...)`` a callback: at the first signal it runs once in a thread of its own (the
handler only writes a byte to a pipe, which is safe in a signal handler; the thread does the
work), the step then raises :class:`StepInterrupted` having changed nothing, and the driver
(training/run.py) saves the last completed step at once instead of after the step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StepInterrupted(Exception):
    """Raised (collectively, on every rank) by a job's step that a stop signal cut short before it
    changed any state: the driver saves the last completed step and stops. The message says what
    was cut (e.g. "the generation of step 7, aborted 0.4 s after the signal")."""


class TerminationFlag:
    """Install with ``TerminationFlag().install()``; ``should_stop()`` is collective (every rank
    gets the same answer, so all of them save and stop at the same step); after it returned True,
    ``signal_name`` names the signal (received on some rank)."""

    def __init__(self):
        self.received = 0  # the signal's number, 0 while none came
        self.received_at = None  # time.monotonic() of the first one, on this rank
        self.signal_name = ""
        self._wake_fd = None  # the pipe's write end: the handler wakes the on_signal thread through it

    def install(self, signals=STOP_SIGNALS, on_signal=None):
        """Handle ``signals``; ``on_signal()``, if given, runs once in a thread of its own at the first
        one (to cut a step short: it must be safe to call from another thread)."""
        if on_signal is not None:
            self._watch(on_signal)
        for s in signals:
            signal.signal(s, self._handler)
        _warn_if_torchrun_ends_on(signals)
        return self

    def _watch(self, on_signal) -> None:
        read_fd, self._wake_fd = os.pipe()
        os.set_blocking(self._wake_fd, False)

        def wait_then_call():
            try:
                if os.read(read_fd, 1) == b"\0":  # (b"x": :meth:`close`)
                    on_signal()
            except Exception as e:  # noqa: BLE001 -- the step then ends as usual and the run saves after it
                print(f"warning: could not cut the step short on the stop signal: {e!r}", file=sys.stderr, flush=True)
            finally:
                os.close(read_fd)

        threading.Thread(target=wait_then_call, name="stop-signal", daemon=True).start()

    def close(self) -> None:
        """Ends the ``on_signal`` thread (the job is over); the handlers stay installed."""
        fd, self._wake_fd = self._wake_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, b"x")
            os.close(fd)

    def _handler(self, signum, frame):
        if self.received == signal.SIGINT and signum == signal.SIGINT and "TORCHELASTIC_RUN_ID" not in os.environ:
            raise KeyboardInterrupt  # Ctrl-C twice
        if self.received_at is None:
            self.received_at = time.monotonic()
            if self._wake_fd is not None:
                with contextlib.suppress(OSError):
                    os.write(self._wake_fd, b"\0")
        self.received = signum

    def should_stop(self) -> bool:
        from megatron_klear.platform import max_over_ranks

        # over the gloo control group: no NCCL communicator is needed between two steps
        got = max_over_ranks(self.received)
        if got:
            try:
                self.signal_name = signal.Signals(got).name
            except ValueError:
                self.signal_name = f"signal {got}"
        return bool(got)


def _caught_by(pid: int) -> int | None:
    """The mask of signals process ``pid`` catches (Linux /proc), None when unknown."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return int(line.split()[1], 16)
    return None


def _warn_if_torchrun_ends_on(signals) -> None:
    """Under torchrun in a Slurm job: say so when torchrun would die of SIGUSR1 (Slurm's
    ``--signal``) instead of forwarding it; the ranks would die with it, without a checkpoint."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "SLURM_JOB_ID" not in os.environ:
        return
    if os.environ.get("RANK", "0") != "0" or signal.SIGUSR1 not in signals:
        return
    caught = _caught_by(os.getppid())
    if caught is not None and not caught & (1 << (signal.SIGUSR1 - 1)):
        print(
            "warning: torchrun does not handle SIGUSR1: Slurm's --signal=USR1 would end it and every rank "
            "without a checkpoint; start it with --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 "
            "(docs/checkpoints.md#preemption)",
            file=sys.stderr,
            flush=True,
        )
