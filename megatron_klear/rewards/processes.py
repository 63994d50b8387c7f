"""The processes of sandboxed runs: this process as their subreaper, the private uid slots runs
lease (one uid per concurrent sandbox, held with a lock file), and killing everything a uid runs.
Used by :mod:`megatron_klear.rewards.sandbox` and the grading pool."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

log = logging.getLogger(__name__)


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be provided on this machine."""


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux), so that grandchildren a
    program leaves behind come back to us to be reaped. Only for dedicated worker processes."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return (
            libc.prctl(36, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0
        )  # PR_SET_CHILD_SUBREAPER
    except OSError:
        return False


def _is_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        out = ctypes.c_int(0)
        return libc.prctl(37, ctypes.byref(out), 0, 0, 0) == 0 and out.value == 1
    except OSError:
        return False


def _reap_orphans(timeout_s: float = 0.5) -> None:
    """Reap dead children that are not ours by Popen (orphans handed to us as subreaper)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() > end:
                log.warning("sandbox: children still alive %.1f s after being killed", timeout_s)
                return
            time.sleep(0.001)


def processes_of_uid(uid: int) -> list[int]:
    """PIDs whose real uid is `uid` (tests and diagnostics)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            out.append(int(name))
                        break
        except OSError:
            continue
    return out


def kill_uid(uid: int) -> None:
    """SIGKILL every process whose real or saved uid is `uid` (root only; `uid` must be private
    to the caller, e.g. a sandbox slot uid)."""
    kill = shutil.which("kill", path="/usr/bin:/bin")
    cmd = (
        [kill, "-KILL", "-1"]
        if kill
        else [sys.executable, "-I", "-S", "-c", "import os, signal; os.kill(-1, signal.SIGKILL)"]
    )
    subprocess.run(
        cmd,
        user=uid,
        group=uid,
        extra_groups=[],
        env={},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )


def _base_dir() -> str:
    """The grader's private directory; refuses one that another user could have planted."""
    path = os.path.join(tempfile.gettempdir(), f"megatron-klear-sandbox-{os.getuid()}")
    with contextlib.suppress(FileExistsError):  # ours from an earlier run: checked below
        os.mkdir(path, 0o711)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise SandboxUnavailable(f"{path} exists but is not a private directory of uid {os.getuid()}")
    os.chmod(path, 0o711)
    for sub, mode in (("slots", 0o700), ("runs", 0o711)):
        p = os.path.join(path, sub)
        os.makedirs(p, mode=mode, exist_ok=True)
        os.chmod(p, mode)
    return path


class SlotLease:
    """Exclusive use of one sandbox uid slot, across processes (flock on a lock file).

    The lock dies with its holder, so a crashed grader never leaks a slot.
    """

    def __init__(self, max_slots: int, prefer: int | None = None):
        d = os.path.join(_base_dir(), "slots")
        order = list(range(max_slots))
        if prefer is not None and 0 <= prefer < max_slots:
            order.remove(prefer)
            order.insert(0, prefer)
        for slot in order:
            fd = os.open(os.path.join(d, f"{slot}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.slot, self._fd = slot, fd
            return
        raise SandboxUnavailable(f"all {max_slots} sandbox slots are in use")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ----------------------------------------------------------------------------- the sandbox
