"""The sandbox directly: start-up probe and refusal, limits and their reasons, kill and reap."""

import ast
import os
import stat
import textwrap
import time

import pytest

from megatron_klear.rewards import SandboxConfig, isolation_probe
from megatron_klear.rewards.code import grade_code
from megatron_klear.rewards.config import RewardConfig
from megatron_klear.rewards.harness import seccomp_filter
from megatron_klear.rewards.isolation_probe import probe_isolation, resolve_isolation
from megatron_klear.rewards.processes import SandboxUnavailable, SlotLease, processes_of_uid
from megatron_klear.rewards.sandbox import Sandbox

from .conftest import code_response, small_limits


@pytest.fixture(scope="module")
def sb(level):
    s = Sandbox(small_limits(level), level=level)
    yield s
    s.close()


@pytest.fixture
def fresh_resolution(monkeypatch):
    monkeypatch.setattr(isolation_probe, "_resolved", {})


def _fake_bwrap(tmp_path, body: str) -> str:
    d = tmp_path / "fakebin"
    d.mkdir()
    p = d / "bwrap"
    p.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    p.chmod(0o755)
    return str(d)


# --------------------------------------------------------------------------- probe and refusal


def test_probe_on_this_machine_is_truthful(isolation_report):
    rep = isolation_report
    if os.path.exists("/usr/bin/bwrap") or os.path.exists("/bin/bwrap"):
        # bubblewrap installed: either it works, or the probe names what fails
        assert rep.bwrap_ok or rep.bwrap_problems
    else:
        assert not rep.bwrap_ok and "not installed" in rep.bwrap_problems[0]
    if os.getuid() == 0:
        assert rep.fallback_ok, rep.fallback_problems
        assert "world-readable host files are readable" in rep.limitations


def test_a_bwrap_that_does_not_isolate_is_refused(tmp_path, monkeypatch, fresh_resolution, isolation_report):
    if not isolation_report.bwrap_ok:
        pytest.skip("needs a working bubblewrap to wrap: " + "; ".join(isolation_report.bwrap_problems))
    # looks like bubblewrap, runs the program, silently skips the PID and network namespaces
    fake = _fake_bwrap(
        tmp_path,
        """
        args=()
        for a in "$@"; do
          case "$a" in --unshare-pid|--unshare-net) ;; *) args+=("$a");; esac
        done
        exec /usr/bin/bwrap "${args[@]}"
    """,
    )
    monkeypatch.setenv("PATH", fake + ":" + os.environ["PATH"])
    rep = probe_isolation(small_limits("auto"))
    assert not rep.bwrap_ok
    assert any("PID namespace" in p for p in rep.bwrap_problems), rep.bwrap_problems
    with pytest.raises(SandboxUnavailable, match="Refusing to run untrusted code"):
        resolve_isolation(small_limits("auto", allow_fallback=False))


def test_no_namespaces_refuses_or_falls_back_loudly(tmp_path, monkeypatch, fresh_resolution, capfd):
    # what bubblewrap says in a container that forbids namespaces
    fake = _fake_bwrap(
        tmp_path,
        """
        echo "bwrap: No permissions to creating new namespace, likely because the kernel does not allow \
non-privileged user namespaces." >&2
        exit 1
    """,
    )
    monkeypatch.setenv("PATH", fake + ":" + os.environ["PATH"])
    with pytest.raises(SandboxUnavailable, match="No permissions to creat"):
        resolve_isolation(small_limits("auto", allow_fallback=False))
    with pytest.raises(SandboxUnavailable):
        resolve_isolation(small_limits("bwrap"))
    if os.getuid() != 0:
        pytest.skip("the fallback needs root")
    rep = resolve_isolation(small_limits("auto", allow_fallback=True))
    assert rep.level == "fallback"
    err = capfd.readouterr().err
    assert "SANDBOX DEGRADED" in err and "No permissions to creat" in err


def test_missing_bwrap_is_named(monkeypatch, fresh_resolution):
    monkeypatch.setattr(isolation_probe, "bwrap_path", lambda: None)
    rep = probe_isolation(small_limits("auto"))
    assert not rep.bwrap_ok and "bubblewrap (bwrap) is not installed" in rep.bwrap_problems[0]


# --------------------------------------------------------------------------- identity and limits


def test_program_runs_as_the_slot_uid_without_groups(sb):
    res = sb.run_code("import os\nprint(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())")
    if os.getuid() != 0:
        # A grader that is not root cannot switch uids: the program runs as the grader's own uid and
        # gid (bubblewrap's user namespace maps them to themselves), and keeps the grader's
        # supplementary groups, which nothing unprivileged can drop; in the user namespace they show
        # as the overflow gid. tests/rewards/test_sandbox_unprivileged.py runs this case from a root
        # suite too.
        uid, euid, gid, groups = res.stdout.decode().split(" ", 3)
        assert (int(uid), int(euid), int(gid)) == (os.getuid(), os.getuid(), os.getgid()), res
        assert sb.uid == -1
        with open("/proc/sys/kernel/overflowgid") as f:
            assert set(ast.literal_eval(groups.strip())) <= {os.getgid(), int(f.read())}, res
        return
    uid = sb.uid
    assert res.stdout.decode().split("\n")[0] == f"{uid} {uid} {uid} []"
    assert uid == sb.cfg.base_uid + sb.slot and uid != 0


def test_the_graders_environment_does_not_reach_the_program(sb, monkeypatch):
    import subprocess
    import sys

    secret = "SECRET-" + os.urandom(8).hex()
    monkeypatch.setenv("KLEAR_GRADER_TOKEN", secret)
    code = "import os\nprint(os.environ.get('KLEAR_GRADER_TOKEN', 'absent'), sorted(os.environ))"
    # control: an ordinary child process inherits it
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert secret in plain
    out = sb.run_code(code).stdout.decode()
    assert secret not in out and out.startswith("absent")
    assert set(eval(out.split(" ", 1)[1])) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "PWD"}


def test_reasons_for_each_limit(sb, level):
    cfg = sb.cfg
    with Sandbox(small_limits(level, wall_s=8), level=level) as roomy:  # CPU limit before the wall
        assert roomy.run_code("while True: pass").failure_reason(roomy.cfg) == "cpu time limit (1 s)"
    cases = {
        "import time\ntime.sleep(60)": f"timeout (wall {cfg.wall_s:g} s)",
        "x = bytearray(2 ** 34)": f"memory limit ({cfg.memory_mb} MB)",
        "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)": "killed by signal 11",
        "while True: print('y' * 4096)": f"output limit ({cfg.output_limit_bytes} bytes)",
        "open('big', 'wb').write(b'x' * (8 << 20))": f"file size limit ({cfg.file_size_mb} MB)",
        "raise SystemExit(7)": "runtime error (exit 7)",
        "print('ok')": None,
    }
    for code, reason in cases.items():
        res = sb.run_code(code)
        assert res.started, code
        assert res.failure_reason(cfg) == reason, (code, res)


def test_sleep_is_cut_at_the_wall_limit(sb):
    t = time.monotonic()
    res = sb.run_code("import time\ntime.sleep(60)")
    assert res.status == "timeout" and sb.cfg.wall_s <= time.monotonic() - t < sb.cfg.wall_s + 1.5


def test_orphaned_grandchild_is_killed_and_does_not_stall(sb):
    code = textwrap.dedent("""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                while True:
                    time.sleep(0.01)
            os._exit(0)
        print("parent done", flush=True)
    """)
    t = time.monotonic()
    res = sb.run_code(code)
    assert time.monotonic() - t < 1.0, "the grader waited for the grandchild"
    assert res.stdout == b"parent done\n" and res.failure_reason(sb.cfg) is None
    if sb.uid >= 0:
        # bwrap: its monitor exits once the program's main process has, and the kernel kills
        # what is left in the PID namespace after that, asynchronously (the namespace's init dies
        # with the monitor). Wait for that teardown; a grandchild that escaped spins forever.
        deadline = time.monotonic() + 10
        while processes_of_uid(sb.uid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert processes_of_uid(sb.uid) == []


def test_disk_writes_are_capped_and_cleaned(sb, level):
    from .test_sandbox_hostile import FILL_DISK

    res = sb.run_code(FILL_DISK)
    written_mb = int(res.stdout.decode().split()[0]) if res.stdout.strip() else 0
    if level == "bwrap":
        # everything writable is the private /tmp, a tmpfs of tmpfs_mb: the program ran out of space
        assert written_mb <= sb.cfg.tmpfs_mb, written_mb
    else:
        assert written_mb > 0  # no namespaces: only the per-file cap and the wall clock bound it
    left = [
        os.path.join(d, n) for d in ("/tmp", "/var/tmp", "/dev/shm") for n in os.listdir(d) if n.startswith("fill-")
    ]
    assert left == []


@pytest.mark.parametrize(
    "idiom",
    [
        "sys.stdin.read()",
        "open(0).read()",
        "open('/dev/stdin').read()",
        "sys.stdin.buffer.read().decode()",
        "' '.join(iter(input, 'END'))",
    ],
)
def test_common_stdin_idioms_work(sb, idiom):
    res = sb.run_code(f"import sys\nprint({idiom}.split()[-1].upper())", b"a b\nhello\nEND\n")
    assert res.stdout.decode().strip() in ("HELLO", "END"), res


def test_threads_and_subprocesses_still_work(sb):
    code = textwrap.dedent("""
        import subprocess, threading
        out = []
        t = threading.Thread(target=lambda: out.append(sum(range(10))))
        t.start(); t.join()
        print(out[0], subprocess.run(["echo", "hi"], capture_output=True, text=True).stdout.strip())
    """)
    res = sb.run_code(code)
    assert res.stdout == b"45 hi\n", res


def test_namespace_creation_and_ptrace_are_denied(sb):
    code = textwrap.dedent("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        r = []
        for name, call in (("unshare", lambda: libc.unshare(0x10000000)),      # CLONE_NEWUSER
                           ("ptrace", lambda: libc.ptrace(16, os.getppid(), 0, 0))):
            rc = call()
            r.append("%s=%d/%d" % (name, rc, ctypes.get_errno()))
        print(" ".join(r))
    """)
    res = sb.run_code(code)
    assert res.stdout.decode().strip() == "unshare=-1/1 ptrace=-1/1", res


def test_the_interpreter_missing_is_a_sandbox_failure_not_a_program_failure(level):
    cfg = RewardConfig(sandbox=small_limits(level, python="/nonexistent/python3"))
    with Sandbox(cfg.sandbox, level=level) as s:
        res = s.run_code("print(1)")
        assert not res.started and res.failure_reason(s.cfg).startswith("sandbox failure")
        graded = grade_code(code_response("print(1)"), {"inputs": [""], "outputs": ["1"]}, cfg, s)
    assert graded.reward == 0.0 and graded.error is not None and "could not start" in graded.error


def test_program_files_are_removed(sb):
    with sb.program("print(1)") as prog:
        assert os.path.isdir(prog.dir)
        assert stat.S_IMODE(os.stat(prog.code_path).st_mode) == 0o600  # root-only: read before the drop
        prog.run()
    assert not os.path.exists(prog.dir)


# --------------------------------------------------------------------------- plumbing


def test_slot_leases_are_exclusive():
    a, b = SlotLease(64), SlotLease(64)
    assert a.slot != b.slot
    s = a.slot
    a.release()
    c = SlotLease(64, prefer=s)
    assert c.slot == s
    b.release()
    c.release()


def test_seccomp_filter_shape():
    prog = seccomp_filter("x86_64")
    assert prog is not None and len(prog) % 8 == 0 and 20 < len(prog) // 8 < 100
    assert seccomp_filter("aarch64") is not None
    assert seccomp_filter("riscv64") is None


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="SandboxConfig.wall_s"):
        SandboxConfig(wall_s=0)
    with pytest.raises(ValueError, match="SandboxConfig.open_files"):
        SandboxConfig(open_files=3)
    with pytest.raises(ValueError, match="SandboxConfig.base_uid"):
        SandboxConfig(base_uid=0)
