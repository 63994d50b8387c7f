"""What isolation this machine offers untrusted programs, found by running one.

`probe_isolation` runs a small probe program in the sandbox (`sandbox.py`) at each level that can
work here: "bwrap" (bubblewrap) when it is installed, "fallback" when the grader is root. The
program reports who it runs as and what it reaches (a root-only file, a host file outside /usr, the
host's /tmp, the loopback network, a writable /usr, other processes, its standard library); each
reach a level must not allow is a problem, and for the fallback, each one it allows by design is a
stated limitation. `resolve_isolation` picks the level per `reward.sandbox` from that report, once
per process and configuration, and refuses loudly (`SandboxUnavailable`) when the requested
isolation cannot be had; falling back from bubblewrap is logged as an error.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass, field

from .config import SandboxConfig
from .processes import SandboxUnavailable
from .sandbox import ENV_KEYS, Sandbox, bwrap_path, program_python

__all__ = ["IsolationReport", "probe_isolation", "resolve_isolation"]

log = logging.getLogger(__name__)


@dataclass
class IsolationReport:
    """What the start-up probe found."""

    level: str | None  # what runs will use; None: refused
    bwrap_ok: bool = False
    bwrap_problems: list[str] = field(default_factory=list)
    fallback_ok: bool = False
    fallback_problems: list[str] = field(default_factory=list)
    limitations: list[str] = field(default_factory=list)  # what the chosen level does not give

    def summary(self) -> str:
        parts = [f"isolation={self.level}"]
        if self.bwrap_problems:
            parts.append("bubblewrap: " + "; ".join(self.bwrap_problems))
        if self.level == "fallback" and self.limitations:
            parts.append("fallback limitations: " + "; ".join(self.limitations))
        return " | ".join(parts)


_PROBE = r"""
import json, os, socket, sys
r = {"uid": os.getuid(), "euid": os.geteuid(), "groups": os.getgroups(), "pid": os.getpid(),
     "env": sorted(os.environ)}
def can_read(p):
    try:
        open(p, "rb").read(1); return True
    except OSError:
        return False
r["secret_readable"] = can_read(sys.stdin.readline().strip())
r["host_file_visible"] = can_read(sys.stdin.readline().strip())
r["host_tmp_visible"] = can_read(sys.stdin.readline().strip())
port = int(sys.stdin.readline())
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM); s.settimeout(1.0)
    s.connect(("127.0.0.1", port)); r["network"] = True
except OSError:
    r["network"] = False
try:
    open("/usr/.klear-probe", "w"); r["system_writable"] = True
except OSError:
    r["system_writable"] = False
r["visible_pids"] = len([p for p in os.listdir("/proc") if p.isdigit()])
try:
    import heapq, bisect, collections  # stdlib readable after the privilege drop
    r["stdlib"] = True
except Exception:
    r["stdlib"] = False
print(json.dumps(r))
"""


def _probe_level(cfg: SandboxConfig, level: str) -> tuple[list[str], list[str]]:
    """Run the probe program at `level`; returns (problems, limitations)."""
    problems: list[str] = []
    limitations: list[str] = []
    d = tempfile.mkdtemp(prefix="klear-probe-")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        secret = os.path.join(d, "secret")
        with open(secret, "w") as f:
            f.write("root only")
        os.chmod(secret, 0o600)
        visible = os.path.join(d, "visible")
        with open(visible, "w") as f:
            f.write("world readable")
        os.chmod(visible, 0o644)
        os.chmod(d, 0o755)
        host_tmp = os.path.join(tempfile.gettempdir(), f"klear-probe-{uuid.uuid4().hex}")
        with open(host_tmp, "w") as f:
            f.write("x")
        os.chmod(host_tmp, 0o644)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        probe_cfg = SandboxConfig(
            **{
                **cfg.__dict__,
                "wall_s": max(10.0, cfg.wall_s),
                "cpu_s": max(5.0, cfg.cpu_s),
                "memory_mb": max(256, cfg.memory_mb),
            }
        )
        try:
            with Sandbox(probe_cfg, level=level) as sb:
                res = sb.run_code(_PROBE, f"{secret}\n{visible}\n{host_tmp}\n{port}\n".encode())
                uid = sb.uid
        finally:
            os.unlink(host_tmp)
        if not res.started or res.exit_code != 0:
            problems.append(
                "probe program did not run: "
                + (res.failure_reason(probe_cfg) or res.stderr_tail.decode("utf-8", "replace")[-300:])
            )
            return problems, limitations
        r = json.loads(res.stdout.decode().strip().splitlines()[-1])
        if os.getuid() == 0 and (r["uid"] != uid or r["euid"] != uid or r["groups"]):
            problems.append(f"program runs as uid {r['uid']} groups {r['groups']}, not uid {uid}")
        if r["uid"] == 0:
            problems.append("program runs as root")
        if r["secret_readable"]:
            problems.append("program can read a root-only file")
        if r["network"]:
            problems.append("program can connect to the host's loopback network")
        if set(r["env"]) - set(ENV_KEYS):
            problems.append(f"environment not clean: {sorted(set(r['env']) - set(ENV_KEYS))}")
        if not r["stdlib"]:
            problems.append(
                f"the interpreter {program_python(cfg)} cannot import its standard "
                "library as an unprivileged uid (set sandbox.python)"
            )
        if level == "bwrap":
            if r["host_file_visible"]:
                problems.append("host files outside /usr are visible")
            if r["host_tmp_visible"]:
                problems.append("/tmp is not private")
            if r["system_writable"]:
                problems.append("/usr is writable")
            if r["visible_pids"] > 4:
                problems.append(f"no private PID namespace ({r['visible_pids']} processes visible)")
        else:
            if r["host_file_visible"]:
                limitations.append("world-readable host files are readable")
            if r["host_tmp_visible"]:
                limitations.append("/tmp is shared (cleaned after each run)")
            if r["visible_pids"] > 4:
                limitations.append("host processes are visible (not signalable)")
            limitations.append("no mount/PID/IPC namespaces; disk writes limited per file only")
        return problems, limitations
    except SandboxUnavailable as e:
        return [str(e)], limitations
    finally:
        listener.close()
        shutil.rmtree(d, ignore_errors=True)


def probe_isolation(cfg: SandboxConfig | None = None) -> IsolationReport:
    """Test, with a real probe program, what isolation works here. Does not decide anything."""
    cfg = cfg or SandboxConfig()
    rep = IsolationReport(level=None)
    if bwrap_path() is None:
        rep.bwrap_problems.append("bubblewrap (bwrap) is not installed (Debian: apt-get install bubblewrap)")
    else:
        rep.bwrap_problems, _ = _probe_level(cfg, "bwrap")
        rep.bwrap_ok = not rep.bwrap_problems
    if os.getuid() != 0:
        rep.fallback_problems.append("the fallback needs root (to run programs as a separate uid)")
    else:
        rep.fallback_problems, rep.limitations = _probe_level(cfg, "fallback")
        rep.fallback_ok = not rep.fallback_problems
    return rep


_resolved: dict[tuple, IsolationReport] = {}
_resolved_lock = threading.Lock()


def resolve_isolation(cfg: SandboxConfig | None = None) -> IsolationReport:
    """Pick the isolation level per `cfg`, probing once per process; refuses loudly.

    Raises SandboxUnavailable when the requested isolation cannot be had. Falling back from
    bubblewrap is logged at ERROR level and printed to stderr: a sandbox that is silently weaker
    than believed is the worst outcome.
    """
    cfg = cfg or SandboxConfig()
    key = (cfg.isolation, cfg.allow_fallback, program_python(cfg), cfg.base_uid, bwrap_path())
    with _resolved_lock:
        if key in _resolved:
            return _resolved[key]
        rep = probe_isolation(cfg)
        if cfg.isolation in ("auto", "bwrap") and rep.bwrap_ok:
            rep.level = "bwrap"
            rep.limitations = []
        elif cfg.isolation == "fallback" or (cfg.isolation == "auto" and cfg.allow_fallback):
            if not rep.fallback_ok:
                raise SandboxUnavailable(
                    "no usable sandbox: bubblewrap: "
                    + ("; ".join(rep.bwrap_problems) or "not requested")
                    + " | fallback: "
                    + "; ".join(rep.fallback_problems)
                )
            rep.level = "fallback"
            msg = (
                "SANDBOX DEGRADED: bubblewrap isolation unavailable ("
                + ("; ".join(rep.bwrap_problems) or "fallback requested")
                + "); running untrusted programs with rlimits + separate uid + seccomp only. "
                "Limitations: " + "; ".join(rep.limitations)
            )
            log.error(msg)  # without logging configured, Python's last-resort handler prints it
            if log.hasHandlers():  # configured handlers may write elsewhere: stderr as well
                print(f"megatron_klear.rewards: {msg}", file=sys.stderr, flush=True)
        else:
            raise SandboxUnavailable(
                "bubblewrap isolation does not work here: "
                + "; ".join(rep.bwrap_problems)
                + ". Refusing to run untrusted code; set sandbox.allow_fallback=true to accept "
                "the weaker rlimits + separate-uid fallback"
                + ("" if rep.fallback_ok else " (which does not work either: " + "; ".join(rep.fallback_problems) + ")")
            )
        _resolved[key] = rep
        return rep
