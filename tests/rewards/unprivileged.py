"""Running the grader as a user who is not root, from a suite that may run as root.

`as_user` runs a command of this file (or `python -m ...`) as an unprivileged uid: the suite's own
uid when it is not root, else uid/gid 65534 (nobody) with no supplementary groups, dropped by
Python's subprocess (setgroups, setresgid, setresuid) before the interpreter starts. The
reward package is copied first to a directory that uid can read (a checkout under /root is not),
and run with an interpreter that uid can execute: the suite's own, else /usr/bin/python3 (the
package needs only the standard library). `Unprivileged.skip_reason` says why, when neither
works or privileges cannot be dropped; the tests skip with it and never pretend.

`--no-userns` runs the command in a user namespace in which `user.max_user_namespaces` is 0, so
that bubblewrap fails for the unprivileged uid as it does on a cluster with user namespaces off;
the host's own setting is not touched (the limit is per user namespace). Root only.

Run as a script (as the unprivileged uid) it grades the programs given on stdin through the real
Sandbox and prints the verdicts as JSON (`grade_programs`, which the root side calls in-process).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile

UID = GID = 65534
_CLONE_NEWUSER = 0x10000000
_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))


def code_response(code: str) -> str:
    return "<think>thinking</think>\nHere is my solution.\n```python\n" + code + "\n```\n"


def grade_programs(programs: dict, sandbox_kwargs: dict) -> dict:
    """Grade {name: [code, tests]} at the level `resolve_isolation` picks for this process."""
    from megatron_klear.rewards import RewardConfig, SandboxConfig
    from megatron_klear.rewards.code import grade_code
    from megatron_klear.rewards.isolation_probe import host_facts, resolve_isolation
    from megatron_klear.rewards.processes import SandboxUnavailable
    from megatron_klear.rewards.sandbox import Sandbox

    cfg = RewardConfig(code_max_tests=None, sandbox=SandboxConfig(**sandbox_kwargs))
    out = {"uid": os.getuid(), "gid": os.getgid()}
    try:
        Sandbox(cfg.sandbox, level="fallback").close()
        out["fallback"] = "available"
    except SandboxUnavailable as e:
        out["fallback"] = str(e)
    try:
        rep = resolve_isolation(cfg.sandbox)
    except SandboxUnavailable as e:
        facts = host_facts()  # the machine's doing (no bubblewrap, no namespaces), or the sandbox's?
        return {**out, "refused": str(e), "machine_says_no": facts.bwrap is None or facts.bare_bwrap_error is not None}
    out["level"] = rep.level
    with Sandbox(cfg.sandbox, level=rep.level) as sb:
        out["program_ids"] = sb.run_code("import os\nprint(os.getuid(), os.getgid())").stdout.decode().split()
        out["results"] = {}
        for name, (code, tests) in programs.items():
            r = grade_code(code_response(code), tests, cfg, sb)
            out["results"][name] = {"reward": r.reward, "passed": r.passed, "tests": r.tests, "error": r.error}
    return out


class Unprivileged:
    """An unprivileged uid to run commands as, and a copy of the package that uid can read."""

    def __init__(self):
        self.root = os.getuid() == 0
        self.uid, self.gid = (UID, GID) if self.root else (os.getuid(), os.getgid())
        self.dir = tempfile.mkdtemp(prefix="klear-unpriv-", dir="/tmp")
        os.chmod(self.dir, 0o755)
        self.code = os.path.join(self.dir, "code")
        for rel in ("megatron_klear/__init__.py", "megatron_klear/platform/__init__.py"):
            os.makedirs(os.path.dirname(os.path.join(self.code, rel)), exist_ok=True)
            shutil.copy(os.path.join(_REPO, rel), os.path.join(self.code, rel))
        for rel in ("quiet.py", "deferred_compile.py"):  # (what megatron_klear/__init__.py imports)
            shutil.copy(
                os.path.join(_REPO, "megatron_klear/platform", rel), os.path.join(self.code, "megatron_klear/platform")
            )
        shutil.copytree(
            os.path.join(_REPO, "megatron_klear/rewards"),
            os.path.join(self.code, "megatron_klear/rewards"),
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        shutil.copy(os.path.abspath(__file__), os.path.join(self.code, "unprivileged.py"))
        for d, _dirs, files in os.walk(self.code):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644)
        # the user's home and TMPDIR: its grader keeps its private sandbox directory there
        self.home = os.path.join(self.dir, "home")
        os.mkdir(self.home, 0o700)
        if self.root:
            os.chown(self.home, self.uid, self.gid)
        self.python, self.skip_reason = None, None
        tried = []
        for cand in (sys.executable, "/usr/bin/python3"):
            if not os.path.exists(cand):
                continue
            try:
                done = self.run(
                    ["-c", "import sys; assert sys.version_info >= (3, 10), sys.version; import unprivileged"],
                    python=cand,
                )
            except OSError as e:
                if e.filename == cand:  # the interpreter: not executable by that uid
                    tried.append(f"{cand}: {e.strerror}")
                    continue
                # setgroups/setresgid/setresuid refused before the exec: this root cannot change uid
                self.skip_reason = f"cannot drop privileges to uid {self.uid}: {e}"
                return
            if done.returncode == 0:
                self.python = cand
                return
            tried.append(f"{cand}: {(done.stderr.strip().splitlines() or ['exit %d' % done.returncode])[-1]}")
        self.skip_reason = f"no Python interpreter that uid {self.uid} can run: " + "; ".join(tried)

    def env(self, **extra) -> dict:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.home,
            "TMPDIR": self.home,
            "PYTHONPATH": self.code,
            "PYTHONDONTWRITEBYTECODE": "1",
            "LANG": "C.UTF-8",
            **extra,
        }

    def run(self, args, *, python=None, stdin=None, no_userns=False, timeout=120, **env) -> subprocess.CompletedProcess:
        """Run `python args` as the unprivileged uid (in /tmp's copy of the package)."""
        cmd = [python or self.python, *args]
        drop = {}
        if no_userns:
            if not self.root:
                raise RuntimeError("no_userns needs root")
            cmd = [python or self.python, os.path.join(self.code, "unprivileged.py"), "--no-userns", *cmd]
        elif self.root:
            drop = {"user": self.uid, "group": self.gid, "extra_groups": []}
        return subprocess.run(
            cmd,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(**env),
            cwd=self.home,
            **drop,
        )

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _run_without_userns(cmd: list[str]) -> int:
    """As root: run `cmd` as UID in a new user namespace (identity-mapped) whose
    user.max_user_namespaces is 0: no user namespace can be created inside it."""
    libc = ctypes.CDLL(None, use_errno=True)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            os.close(go_w)
            if libc.unshare(_CLONE_NEWUSER) != 0:
                os.write(2, f"unshare(CLONE_NEWUSER): {os.strerror(ctypes.get_errno())}\n".encode())
                os._exit(97)
            os.write(ready_w, b"u")
            if os.read(go_r, 1) != b"g":
                os._exit(97)
            os.setresgid(0, 0, 0)
            os.setresuid(0, 0, 0)
            with open("/proc/sys/user/max_user_namespaces", "w") as f:
                f.write("0")
            os.setgroups([])
            os.setresgid(GID, GID, GID)
            os.setresuid(UID, UID, UID)
            os.execv(cmd[0], cmd)
        except BaseException as e:  # noqa: BLE001 -- report anything, never return into the caller
            os.write(2, f"staging the user namespace failed: {e!r}\n".encode())
        os._exit(97)
    os.close(ready_w)
    os.close(go_r)
    ok = os.read(ready_r, 1) == b"u"
    if ok:
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write("0 0 4294967295\n")
        os.write(go_w, b"g")
    os.close(go_w)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--no-userns"]:
        return _run_without_userns(argv[1:])
    if argv[:1] == ["grade"]:
        req = json.load(sys.stdin)
        print(json.dumps(grade_programs(req["programs"], req["sandbox"])))
        return 0
    raise SystemExit(f"usage: {sys.argv[0]} grade | --no-userns CMD...")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
