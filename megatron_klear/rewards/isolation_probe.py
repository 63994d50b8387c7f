"""What isolation this machine offers untrusted programs, found by running one.

`probe_isolation` runs a small probe program in the sandbox (`sandbox.py`) at each level that can
work here: "bwrap" (bubblewrap) when it is installed, "fallback" when the grader is root. The
program reports who it runs as and what it reaches (a root-only file, a host file outside /usr, the
host's /tmp, the loopback network, a writable /usr, other processes, its standard library); each
reach a level must not allow is a problem, and for the fallback, each one it allows by design is a
stated limitation. `resolve_isolation` picks the level per `reward.sandbox` from that report, once
per process and configuration, and refuses loudly (`SandboxUnavailable`) when the requested
isolation cannot be had; falling back from bubblewrap is logged as an error.

When bubblewrap fails, `host_facts` and `namespace_causes` say why (no binary, the kernel settings
that switch unprivileged user namespaces off, a container without the privilege to create
namespaces), and the refusal names the cause. Run on a compute node before a job, as the user
the job runs as (`docs/rewards.md`, "On a cluster, as a normal user"):

    python -m megatron_klear.rewards.isolation_probe [--allow-fallback] [--isolation L] [--python P]

prints what this machine gives (bubblewrap, the root-only fallback, or nothing, and why) and exits
0 when code can be graded with those settings, 1 when it cannot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass, field

from .config import ISOLATION_LEVELS, SandboxConfig
from .processes import SandboxUnavailable
from .sandbox import ENV_KEYS, Sandbox, bwrap_path, program_python, usr_view_args

__all__ = [
    "HostFacts",
    "IsolationReport",
    "check_main",
    "choose_level",
    "host_facts",
    "namespace_causes",
    "probe_isolation",
    "resolve_isolation",
]

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
    bwrap_causes: list[str] = field(default_factory=list)  # why bubblewrap fails, when known

    def summary(self) -> str:
        parts = [f"isolation={self.level}"]
        if self.bwrap_problems:
            parts.append("bubblewrap: " + "; ".join(self.bwrap_problems))
        if self.bwrap_causes:
            parts.append("why: " + "; ".join(self.bwrap_causes))
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


# ----------------------------------------------------------------------------- why bubblewrap fails

#: The kernel settings that decide whether a user who is not root may create a user namespace,
#: which bubblewrap needs when the grader is not root: (name, the value that forbids it, what it
#: is, what to ask for).
USERNS_SYSCTLS = (
    (
        "kernel.unprivileged_userns_clone",
        0,
        "the switch for them in Debian's and Ubuntu's kernels",
        "kernel.unprivileged_userns_clone=1",
    ),
    (
        "user.max_user_namespaces",
        0,
        "how many user namespaces may exist; 0: none",
        "user.max_user_namespaces set to a positive number (e.g. 15000)",
    ),
    (
        "kernel.apparmor_restrict_unprivileged_userns",
        1,
        "Ubuntu 23.10 and later: only programs whose AppArmor profile allows `userns` may create them",
        "an AppArmor profile for bwrap that allows `userns`, or kernel.apparmor_restrict_unprivileged_userns=0",
    ),
)
_CAP_SYS_ADMIN = 21


@dataclass
class HostFacts:
    """What decides whether bubblewrap can create namespaces here (`host_facts`)."""

    uid: int
    bwrap: str | None  # its path; None: not installed
    bwrap_setuid: bool = False  # installed setuid root (some distributions): unusable by a non-root grader
    sysctls: dict[str, int | None] = field(default_factory=dict)  # name -> value; None: no such file
    container: str | None = None  # what says this is a container; None: nothing does
    cap_sys_admin: bool = False  # in this process's effective capabilities
    seccomp_filtered: bool = False  # a seccomp filter is applied to this process
    bare_bwrap_error: str | None = None  # a bare bubblewrap's failure; None: it ran (or was not tried)

    @property
    def unprivileged(self) -> bool:
        """bubblewrap creates a user namespace: the grader is not root, and bwrap not setuid."""
        return self.uid != 0 and not self.bwrap_setuid


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bare_bwrap(bwrap: str, unprivileged: bool) -> str | None:
    """Run `true` in the namespaces the sandbox creates, nothing else; its error or None."""
    true = shutil.which("true", path="/usr/bin:/bin") or "/usr/bin/true"
    cmd = [bwrap] + (["--unshare-user"] if unprivileged else [])
    cmd += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", *usr_view_args(), true]
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if done.returncode == 0:
        return None
    err = done.stderr.decode("utf-8", "replace").strip().splitlines()
    return err[-1] if err else f"exit status {done.returncode}"


def host_facts(proc: str = "/proc", root: str = "/", try_bwrap: bool = True) -> HostFacts:
    """Read what decides bubblewrap's fate here: its binary, the user-namespace sysctls (under
    `proc`/sys), container markers (under `root`), this process's capabilities and seccomp state,
    and (`try_bwrap`) whether a bare bubblewrap can create the sandbox's namespaces."""
    bwrap = bwrap_path()
    facts = HostFacts(uid=os.getuid(), bwrap=bwrap)
    # a fact that cannot be read keeps its default (unknown), and the report says so
    if bwrap is not None:
        with contextlib.suppress(OSError):
            facts.bwrap_setuid = bool(os.stat(bwrap).st_mode & stat.S_ISUID)
    for name, *_ in USERNS_SYSCTLS:
        facts.sysctls[name] = _read_int(os.path.join(proc, "sys", *name.split(".")))
    status = {}
    with contextlib.suppress(OSError):
        with open(os.path.join(proc, "self", "status")) as f:
            status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    with contextlib.suppress(ValueError):
        facts.cap_sys_admin = bool(int(status.get("CapEff", "0"), 16) >> _CAP_SYS_ADMIN & 1)
    facts.seccomp_filtered = status.get("Seccomp", "0").strip() == "2"
    for marker, what in ((".dockerenv", "Docker"), ("run/.containerenv", "Podman"), (".singularity.d", "Apptainer")):
        if os.path.exists(os.path.join(root, marker)):
            facts.container = f"{what} (/{marker} exists)"
            break
    else:
        if os.environ.get("container"):
            facts.container = f"container={os.environ['container']} in the environment"
    if try_bwrap and bwrap is not None:
        facts.bare_bwrap_error = _bare_bwrap(bwrap, facts.unprivileged)
    return facts


def namespace_causes(facts: HostFacts) -> list[str]:
    """Why bubblewrap cannot run the sandbox here, each cause with what would change it; [] when
    nothing found here stops it (a failing probe then names its own problem)."""
    if facts.bwrap is None:
        return [
            "no bwrap binary on PATH: bubblewrap must be installed (Debian/Ubuntu: apt-get install "
            "bubblewrap; RHEL/Fedora: dnf install bubblewrap)"
        ]
    causes = []
    if facts.uid != 0:
        if facts.bwrap_setuid:
            causes.append(
                f"{facts.bwrap} is installed setuid root: in setuid mode bubblewrap refuses the size limit "
                "(--size) of the sandbox's private /tmp; needs a bubblewrap without the setuid bit, and "
                "unprivileged user namespaces"
            )
        for name, forbidding, what, ask in USERNS_SYSCTLS:
            if facts.sysctls.get(name) == forbidding:
                causes.append(f"{name} = {forbidding} ({what}): no user namespace for uid {facts.uid}; needs {ask}")
    elif facts.container and not facts.cap_sys_admin:
        causes.append(
            f"root inside a container ({facts.container}) without CAP_SYS_ADMIN: bubblewrap cannot create "
            "namespaces; needs that capability for the container, or the job run as a normal user with "
            "user namespaces, or grading outside the container"
        )
    if not causes and facts.bare_bwrap_error is not None:
        where = f"in a container ({facts.container})" if facts.container else "here"
        filt = " under a seccomp filter (a container runtime's default profile denies unshare and mount)"
        causes.append(
            f"a bare bubblewrap cannot create namespaces {where}"
            + (filt if facts.seccomp_filtered else "")
            + f": {facts.bare_bwrap_error}; "
            + (
                "the user-namespace settings do not explain it"
                if facts.uid != 0
                else "this is not a user-namespace setting (bubblewrap runs privileged for root)"
            )
        )
    return causes


def probe_isolation(cfg: SandboxConfig | None = None) -> IsolationReport:
    """Test, with a real probe program, what isolation works here. Does not decide anything."""
    cfg = cfg or SandboxConfig()
    rep = IsolationReport(level=None)
    if bwrap_path() is None:
        rep.bwrap_problems.append("bubblewrap (bwrap) is not installed (Debian: apt-get install bubblewrap)")
    else:
        rep.bwrap_problems, _ = _probe_level(cfg, "bwrap")
        rep.bwrap_ok = not rep.bwrap_problems
    if not rep.bwrap_ok and bwrap_path() is not None:
        rep.bwrap_causes = namespace_causes(host_facts())
    if os.getuid() != 0:
        rep.fallback_problems.append("the fallback needs root (to run programs as a separate uid)")
    else:
        rep.fallback_problems, rep.limitations = _probe_level(cfg, "fallback")
        rep.fallback_ok = not rep.fallback_problems
    return rep


_resolved: dict[tuple, IsolationReport] = {}
_resolved_lock = threading.Lock()


def choose_level(cfg: SandboxConfig, rep: IsolationReport) -> str:
    """The level `cfg` gets from what the probe found: "bwrap" or "fallback". Raises
    SandboxUnavailable naming what failed when the requested isolation cannot be had."""
    why = (" (why: " + "; ".join(rep.bwrap_causes) + ")") if rep.bwrap_causes else ""
    if cfg.isolation in ("auto", "bwrap") and rep.bwrap_ok:
        return "bwrap"
    if cfg.isolation == "fallback" or (cfg.isolation == "auto" and cfg.allow_fallback):
        if not rep.fallback_ok:
            raise SandboxUnavailable(
                "no usable sandbox: bubblewrap: "
                + ("; ".join(rep.bwrap_problems) or "not requested")
                + why
                + " | fallback: "
                + "; ".join(rep.fallback_problems)
            )
        return "fallback"
    raise SandboxUnavailable(
        "bubblewrap isolation does not work here: "
        + "; ".join(rep.bwrap_problems)
        + why
        + ". Refusing to run untrusted code; set sandbox.allow_fallback=true to accept "
        "the weaker rlimits + separate-uid fallback"
        + ("" if rep.fallback_ok else " (which does not work either: " + "; ".join(rep.fallback_problems) + ")")
    )


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
        rep.level = choose_level(cfg, rep)
        if rep.level == "bwrap":
            rep.limitations = []
        else:
            msg = (
                "SANDBOX DEGRADED: bubblewrap isolation unavailable ("
                + ("; ".join(rep.bwrap_problems) or "fallback requested")
                + "); running untrusted programs with rlimits + separate uid + seccomp only. "
                "Limitations: " + "; ".join(rep.limitations)
            )
            log.error(msg)  # without logging configured, Python's last-resort handler prints it
            if log.hasHandlers():  # configured handlers may write elsewhere: stderr as well
                print(f"megatron_klear.rewards: {msg}", file=sys.stderr, flush=True)
        _resolved[key] = rep
        return rep


# ----------------------------------------------------------------------------- the command


def _yes(b: bool) -> str:
    return "yes" if b else "no"


def check_main(argv: list[str] | None = None) -> int:
    """`python -m megatron_klear.rewards.isolation_probe`: what isolation this machine gives code
    grading, for this user and these settings; exit status 0 when code can be graded, 1 when not."""
    ap = argparse.ArgumentParser(
        prog="python -m megatron_klear.rewards.isolation_probe",
        description="Check, as the user a job runs as, which sandbox code grading gets on this machine "
        "(bubblewrap, the root-only fallback, or none) and why. Exit status 0: code can be graded "
        "with these settings; 1: it cannot.",
    )
    ap.add_argument("--isolation", choices=ISOLATION_LEVELS, default="auto", help="reward.sandbox.isolation")
    ap.add_argument(
        "--allow-fallback", action="store_true", help="reward.sandbox.allow_fallback: accept the root-only fallback"
    )
    ap.add_argument("--python", default=None, help="reward.sandbox.python: the programs' interpreter")
    args = ap.parse_args(argv)
    cfg = SandboxConfig(isolation=args.isolation, allow_fallback=args.allow_fallback, python=args.python)
    rep = probe_isolation(cfg)
    facts = host_facts(try_bwrap=False)
    try:
        level, refusal = choose_level(cfg, rep), None
    except SandboxUnavailable as e:
        level, refusal = None, str(e)
    out = [
        f"uid {facts.uid}{' (root)' if facts.uid == 0 else ''}, kernel {os.uname().release}, "
        f"programs run with {program_python(cfg)}",
        "sysctls: "
        + ", ".join(f"{k}={'absent' if v is None else v}" for k, v in facts.sysctls.items())
        + f"; container: {facts.container or 'none detected'}; CAP_SYS_ADMIN: {_yes(facts.cap_sys_admin)}"
        + f"; seccomp filter: {_yes(facts.seccomp_filtered)}",
    ]
    if facts.bwrap is None:
        out.append("bubblewrap: not installed")
        out += ["why: " + c for c in namespace_causes(facts)]
    elif rep.bwrap_ok:
        how = (
            "privileged (the grader is root; programs run as private uids)"
            if facts.uid == 0
            else f"in a user namespace (programs run as uid {facts.uid}, the grader's own)"
        )
        out.append(f"bubblewrap: works, {how} ({facts.bwrap})")
    else:
        out.append(f"bubblewrap: FAILS ({facts.bwrap}): " + "; ".join(rep.bwrap_problems))
        out += ["why: " + c for c in rep.bwrap_causes]
    if rep.fallback_ok:
        out.append(
            "fallback: works (root)"
            + ("" if cfg.allow_fallback or cfg.isolation == "fallback" else ", not allowed (--allow-fallback)")
            + "; it does not give: "
            + "; ".join(rep.limitations)
        )
    else:
        out.append("fallback: unavailable: " + "; ".join(rep.fallback_problems))
    if level is not None:
        out.append(f"isolation: {level}" + (" (DEGRADED: no namespaces)" if level == "fallback" else ""))
    else:
        out.append("isolation: none -- code grading is refused here with these settings")
        if not any(line.startswith("why: ") for line in out):  # say what failed, at least
            out.append(f"refused: {refusal}")
        out.append("what to ask for, and the alternatives: docs/rewards.md, 'On a cluster, as a normal user'")
    print("\n".join(out), flush=True)
    return 0 if level is not None else 1


if __name__ == "__main__":
    sys.exit(check_main())
