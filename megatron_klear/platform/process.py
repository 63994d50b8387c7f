"""Processes that do not outlive the run, one run per save directory, and free ports for new processes.

* :func:`die_with_parent`: ask Linux to kill this process when its parent exits
  (``PR_SET_PDEATHSIG``); :func:`preexec_die_with_parent` is the same as a ``subprocess.Popen``
  ``preexec_fn``, for children the project starts itself.
* :func:`die_with_launcher`: a rank started by ``torchrun`` runs in its own session, so killing
  torchrun (or its process group) used to leave the ranks training on; called first by the SFT
  and RL entry points, it makes them die with torchrun.
* :class:`RunLock`: a lock file (pid, host, start time) that a second run on the same directory
  sees; a lock whose owner is gone on this host is taken over, with a message.
* :func:`free_port`: a loopback TCP port the OS says is free, for a process about to be started
  (torchrun's master, a server, a router).

Standard library only (no torch): spawned helper processes import this module.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import sys
import time

from megatron_klear.utils import atomic

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux; elsewhere a
    no-op returning False). ``expected_parent``: the pid the parent should have; when the parent
    is already gone (we were re-parented before the call), the signal is sent at once."""
    if not sys.platform.startswith("linux"):
        return False
    before = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if (
            libc.prctl(
                PR_SET_PDEATHSIG, ctypes.c_ulong(int(sig)), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)
            )
            != 0
        ):
            return False
    except (OSError, AttributeError):
        return False
    now = os.getppid()
    if now != before or (expected_parent is not None and now != expected_parent):
        os.kill(os.getpid(), sig)  # the parent exited before the request took effect
    return True


def preexec_die_with_parent(sig: int = signal.SIGKILL):
    """A ``preexec_fn`` for ``subprocess.Popen``: the child dies when the process (the thread)
    that starts it exits. Call it in the parent: ``Popen(cmd, preexec_fn=preexec_die_with_parent())``."""
    parent = os.getpid()

    def preexec():
        die_with_parent(sig, expected_parent=parent)

    return preexec


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def die_with_launcher() -> bool:
    """Under torchrun: this rank is killed when torchrun's agent exits. Plain ``python`` runs are
    left alone (``nohup python -m ...`` must survive its shell)."""
    if not launched_by_torchrun():
        return False
    return die_with_parent(signal.SIGKILL)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it), rather than a fixed
    one another job may hold. Free when returned: the process it is meant for binds it soon after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- one run per directory -------------------------------------------------------------------------
class RunLockedError(RuntimeError):
    """The directory is held by another run (its lock file names the pid and host)."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2 :].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``path`` holds ``{"pid", "host", "start_time", "started", "argv"}`` of the run that owns it.

    :meth:`acquire` creates it, or refuses (:class:`RunLockedError`) while its owner lives (on this
    host: the pid exists with the same start time; on another host: always, since we cannot
    check), or takes it over when the owner on this host is gone, calling ``log`` to say so.
    Re-acquiring one's own lock is allowed. :meth:`release` (also at exit) removes it if ours."""

    def __init__(self, path: str, log=print):
        self.path = path
        self.log = log
        self.held = False

    def _mine(self) -> dict:
        pid = os.getpid()
        return {
            "pid": pid,
            "host": socket.gethostname(),
            "start_time": _start_time(pid),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv,
        }

    def _read(self) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                owner = json.load(f)
            return owner if isinstance(owner, dict) else None
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return None

    def _write_new(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self._mine(), f)
        return True

    def acquire(self) -> None:
        for _ in range(3):
            if self._write_new():
                break
            owner = self._read()
            if owner == {}:
                continue  # removed meanwhile: try again
            if owner and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
                break  # ours already
            stale = self._stale_reason(owner)
            if stale is None:
                raise RunLockedError(self._busy_message(owner))
            atomic.write_json(self.path, self._mine())
            after = self._read()
            if not after or after.get("pid") != os.getpid():  # someone else took it over first
                raise RunLockedError(self._busy_message(after or owner))
            self.log(f"{self.path}: taking over the lock of a run that is no longer running ({stale})")
            break
        else:
            raise RunLockedError(f"{self.path}: could not create the lock file")
        if not self.held:
            self.held = True
            atexit.register(self.release)

    def _stale_reason(self, owner: dict | None) -> str | None:
        if owner is None:
            try:
                if time.time() - os.path.getmtime(self.path) < 10:
                    return None  # probably being written by a run that is starting now
            except OSError:
                pass
            return "unreadable lock file"
        pid, host = owner.get("pid"), owner.get("host")
        if host != socket.gethostname() or not isinstance(pid, int):
            return None
        if not _alive(pid):
            return f"pid {pid} on {host} has exited"
        if owner.get("start_time") and _start_time(pid) not in (None, owner["start_time"]):
            return f"pid {pid} on {host} is now another process"
        return None

    def _busy_message(self, owner: dict | None) -> str:
        owner = owner or {}
        pid, host = owner.get("pid", "?"), owner.get("host", "?")
        since = f", started {owner['started']}" if owner.get("started") else ""
        what = os.path.dirname(os.path.abspath(self.path))
        msg = (
            f"{what} is in use by another run (pid {pid} on host {host}{since}; lock file {self.path}): "
            "stop that run first, or choose another train.save_dir"
        )
        if host != socket.gethostname():
            msg += f"; if that run is no longer running, delete {self.path}"
        return msg

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            atexit.unregister(self.release)
        except Exception:  # noqa: BLE001
            pass
        owner = self._read()
        if owner and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
