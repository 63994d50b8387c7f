"""Hostile programs: each must score 0, with its reason recorded, and leave the grader healthy.

The whole suite goes through a GradingPool (two workers, the way the RL loop grades), once per
isolation level this machine supports. Where an attack's success would be visible as a *pass*, the
test is built so that it would be: the expected output is the secret the program tries to steal
(an environment variable of the grader, a root-only file, a nonce that exists only in the
grader's memory, a message served on the host's loopback). A reward of 0 then proves the theft
failed, not merely that the program printed something else.

Afterwards: honest programs still score 1 (also while an attack runs next to them), no worker was
killed or crashed, no process of the sandbox uids survives, nothing is left in /tmp.
"""

import hashlib
import os
import stat
import time
import uuid

import pytest

from megatron_klear.rewards import GradingPool, RewardConfig
from megatron_klear.rewards import harness as harness_mod
from megatron_klear.rewards.processes import _base_dir, processes_of_uid

from .conftest import code_response, small_limits

SECRET = "SECRET-" + uuid.uuid4().hex
EXPECTED = "EXPECTED-" + uuid.uuid4().hex
NONCE = uuid.uuid4().hex
ENV_NAME = "KLEAR_TEST_SECRET"

STACK_AND_MEMORY = r"""
import gc, os, re, sys, ctypes
found = set()
PAT = re.compile("EXPECTED" + "-[0-9a-f]{32}")
def scan(obj):
    if isinstance(obj, (str, bytes)):
        s = obj if isinstance(obj, str) else obj.decode("latin-1")
        found.update(PAT.findall(s))
f = sys._getframe()
while f is not None:
    for v in list(f.f_locals.values()) + list(f.f_globals.values()):
        scan(v)
    f = f.f_back
for o in gc.get_objects():
    if isinstance(o, dict):
        for v in list(o.values()):
            scan(v)
    elif isinstance(o, (list, tuple)):
        for v in o:
            scan(v)
for m in list(sys.modules.values()):
    for v in list(getattr(m, "__dict__", {}).values()):
        scan(v)
ppid = os.getppid()
for pid in [ppid, 1] + [int(p) for p in os.listdir("/proc") if p.isdigit()]:
    for name in ("cmdline", "environ"):
        try:
            scan(open("/proc/%d/%s" % (pid, name), "rb").read())
        except OSError:
            pass
    try:
        with open("/proc/%d/mem" % pid, "rb") as mem:
            for line in open("/proc/%d/maps" % pid):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                try:
                    mem.seek(lo); scan(mem.read(min(hi - lo, 1 << 20)))
                except (OSError, ValueError, OverflowError):
                    pass
    except (OSError, ValueError):
        pass
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace(16, ppid, 0, 0)  # PTRACE_ATTACH: must be refused
print(sorted(found)[0] if found else "nothing found")
"""

MONKEYPATCH = r"""
import sys, os, json, builtins
h = sys.modules["__main__"]
h.RESULT_MARKER = b""
h._write_all = lambda fd, data: None
json.dumps = lambda *a, **k: '"EXPECTED-guess"'
builtins.print = lambda *a, **k: None
for fd in range(3, 20):
    try:
        os.write(fd, b"S\n@@klear-result@@true\n@@klear-result@@\"EXPECTED-guess\"\n")
    except OSError:
        pass
def f(x):
    return True
"""

READ_SECRETS = r"""
import os, glob
cands = [os.environ.get("%(env)s", "")]
for p in ["%(path)s"] + glob.glob("/proc/*/environ"):
    try:
        cands.append(open(p, "rb").read().decode("latin-1"))
    except OSError:
        pass
import re
hit = [m for c in cands for m in re.findall("SECRET" + "-[0-9a-f]{32}", c)]
print(hit[0] if hit else "no secret")
"""

NETWORK = r"""
import socket
got = "no network"
for fam, addr in ((socket.AF_INET, ("127.0.0.1", %(port)d)), (socket.AF_INET6, ("::1", %(port)d)),
                  (socket.AF_INET, ("151.101.0.223", 443))):
    try:
        s = socket.socket(fam, socket.SOCK_STREAM); s.settimeout(0.5); s.connect(addr)
        got = s.recv(100).decode() or "connected"; break
    except OSError as e:
        pass
for fam, typ in ((socket.AF_INET, socket.SOCK_DGRAM), (socket.AF_NETLINK, socket.SOCK_RAW),
                 (getattr(socket, "AF_PACKET", 17), socket.SOCK_RAW)):
    try:
        socket.socket(fam, typ); got = got if got != "no network" else "socket %%d allowed" %% fam
    except OSError:
        pass
print(got)
"""

KILL_PARENT = r"""
import os, signal
for target in (os.getppid(), 1):
    try: os.kill(target, signal.SIGKILL)
    except OSError: pass
try: os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
except OSError: pass
for p in os.listdir("/proc"):
    if p.isdigit() and int(p) != os.getpid():
        try: os.kill(int(p), signal.SIGKILL)
        except OSError: pass
os.kill(-1, signal.SIGKILL)
"""

ORPHAN = r"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        # the grandchild keeps stdout open and spins, forever if allowed
        while True:
            sys.stdout.write("")
            time.sleep(0.01)
    os._exit(0)
os._exit(0)
"""

FILL_DISK = r"""
import errno, os
block = b"x" * (1 << 20)
written = 0
for k, d in enumerate((".", os.environ.get("TMPDIR", "."), "/tmp", "/var/tmp", "/dev/shm")):
    for i in range(100000):
        if written >= 256:  # MiB; enough to show the cap, civil to the CI disk in fallback mode
            break
        try:
            f = open(os.path.join(d, "fill-%d-%d" % (k, i)), "xb")
        except OSError:
            break
        try:
            for _ in range(64):
                f.write(block); f.flush(); written += 1
        except OSError as e:
            if e.errno != errno.EFBIG:  # per-file cap: go on with the next file
                break
        finally:
            try:
                f.close()
            except OSError:
                pass
print(written)
"""

WRITE_OUTSIDE = r"""
import os
for p in %(paths)r:
    try:
        with open(p, "w") as f:
            f.write("pwned")
    except OSError:
        pass
for p in ("/harness.py", %(harness)r):
    try:
        with open(p, "a") as f:
            f.write("\nRESULT_MARKER = b''\n")
    except OSError:
        pass
"""

ATTACKS = {
    # name: (code, tests, acceptable verdict prefixes)
    "exit-0-early-stdio": (
        "import sys\nsys.exit(0)\nprint(int(input()) * 2)",
        {"inputs": ["1\n"], "outputs": ["2"]},
        ("wrong answer",),
    ),
    "exit-0-early-os": ("import os\nos._exit(0)", {"inputs": ["1\n"], "outputs": ["2"]}, ("wrong answer",)),
    "exit-0-early-call": (
        "import os\nos._exit(0)\ndef f(x):\n    return 2 * x",
        {"inputs": [[1]], "outputs": [2], "fn_name": "f"},
        ("no result",),
    ),
    "always-equal-object": (
        "class E:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
        "def f(x):\n    return E()",
        {"inputs": [[1]], "outputs": [[1, 2, 3]], "fn_name": "f"},
        ("runtime error",),
    ),
    "always-equal-list": (
        "class L(list):\n    def __eq__(self, o): return True\ndef f(x):\n    return L()",
        {"inputs": [[1]], "outputs": [[1, 2, 3]], "fn_name": "f"},
        ("wrong answer",),
    ),
    "always-equal-str": (
        "class S(str):\n    def __eq__(self, o): return True\n    __hash__ = str.__hash__\nprint(S('nope'))",
        {"inputs": [""], "outputs": [EXPECTED]},
        ("wrong answer",),
    ),
    "stack-inspection-stdio": (STACK_AND_MEMORY, {"inputs": [""], "outputs": [EXPECTED]}, ("wrong answer",)),
    "stack-inspection-call": (
        STACK_AND_MEMORY.replace("print(", "RESULT = (") + "\ndef f(x):\n    return RESULT",
        {"inputs": [[0]], "outputs": [EXPECTED], "fn_name": "f"},
        ("wrong answer",),
    ),
    "monkeypatch-harness": (
        MONKEYPATCH,
        {"inputs": [[0]], "outputs": [EXPECTED], "fn_name": "f"},
        ("wrong answer", "unreadable result", "no result"),
    ),
    # on a loaded machine 1 s of CPU can take more than the 2 s wall limit: either reason is right
    "infinite-loop": ("while True:\n    pass", {"inputs": [""], "outputs": ["1"]}, ("cpu time limit", "timeout")),
    "ignore-sigxcpu": (
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
        {"inputs": [""], "outputs": ["1"]},
        ("cpu time limit", "timeout"),
    ),
    "sleep": ("import time\ntime.sleep(1000)", {"inputs": [""], "outputs": ["1"]}, ("timeout",)),
    "infinite-stdout": ("while True:\n    print('x' * 10000)", {"inputs": [""], "outputs": ["1"]}, ("output limit",)),
    "infinite-stderr": (
        "import sys\nwhile True:\n    sys.stderr.write('y' * 10000)",
        {"inputs": [""], "outputs": ["1"]},
        ("output limit",),
    ),
    "memory-bomb-once": (
        "x = bytearray(16 * 1024 ** 3)\nprint(1)",
        {"inputs": [""], "outputs": ["1"]},
        ("memory limit",),
    ),
    "memory-bomb-growing": (
        "l = []\nwhile True:\n    l.append(bytearray(10 ** 7))",
        {"inputs": [""], "outputs": ["1"]},
        ("memory limit",),
    ),
    "fork-bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        {"inputs": [""], "outputs": ["1"]},
        ("cpu time limit", "timeout", "killed by signal"),
    ),
    "orphaned-grandchildren": (ORPHAN, {"inputs": [""], "outputs": ["1"]}, ("wrong answer",)),
    "fill-the-disk": (
        FILL_DISK,
        {"inputs": [""], "outputs": ["1"]},
        ("wrong answer", "timeout", "file size limit", "cpu time limit"),
    ),
    "read-secrets": (None, {"inputs": [""], "outputs": [SECRET]}, ("wrong answer",)),
    "network": (None, {"inputs": [""], "outputs": [SECRET]}, ("wrong answer",)),
    "kill-the-parent": (
        KILL_PARENT,
        {"inputs": [""], "outputs": ["1"]},
        ("killed by signal 9", "wrong answer", "runtime error"),
    ),
    "write-outside-tempdir": (None, {"inputs": [""], "outputs": ["1"]}, ("wrong answer",)),
}

# Functional (check-code) tests as the authors grade them -- solution + asserts, exit status 0 is a
# pass -- are beaten by exiting early, patching assert/__eq__ or printing a verdict. Here the checks
# are (call, expected) pairs (data/formats/functional.py); the expected value is a nonce the program
# would have to know. The check code goes through the same converter the readers use.
from megatron_klear.data.formats.functional import convert as _convert_check  # noqa: E402

FUNCTIONAL = _convert_check(
    f"def check(candidate):\n    want = {EXPECTED!r}\n    assert candidate(1) == want\n"
    f"    assert candidate(2) == {EXPECTED!r}\n\n\ncheck(Solution().f)"
)
PYTEST_STYLE = _convert_check(f"from solution import f\n\ndef test_f():\n    assert f(1) == {EXPECTED!r}\n")
FUNCTIONAL_ATTACKS = {
    "functional-exit-0-at-import": (
        "import sys\nsys.exit(0)\nclass Solution:\n    def f(self, x):\n        return x",
        FUNCTIONAL,
        ("no result",),
    ),
    "functional-os-exit-in-call": (
        "import os\nclass Solution:\n    def f(self, x):\n        os._exit(0)",
        FUNCTIONAL,
        ("no result",),
    ),
    "functional-exit-in-atexit": (
        "import atexit, os\natexit.register(lambda: os._exit(0))\ndef f(x):\n    raise SystemExit(0)",
        PYTEST_STYLE,
        ("no result",),
    ),
    "functional-patch-assert": (
        "import builtins\nbuiltins.AssertionError = type('Never', (Exception,), {})\n"
        "builtins.isinstance = lambda *a: True\nbuiltins.abs = lambda x: 0\n"
        "class Solution:\n    def f(self, x):\n        assert False\n        return 0",
        FUNCTIONAL,
        ("wrong answer", "runtime error"),
    ),
    "functional-always-equal-object": (
        "class E:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
        "class Solution:\n    def f(self, x):\n        return E()",
        FUNCTIONAL,
        ("runtime error",),
    ),
    "functional-always-equal-str": (
        "class S(str):\n    def __eq__(self, o): return True\n    __hash__ = str.__hash__\n"
        "def f(x):\n    return S('nope')",
        PYTEST_STYLE,
        ("wrong answer",),
    ),
    "functional-print-verdict": (
        "import os, sys\nprint('All tests passed'); print('PASSED')\n"
        "sys.stderr.write('OK\\n')\n"
        "for fd in range(1, 20):\n    try:\n"
        "        os.write(fd, b'\\n@@klear-result@@true\\n@@klear-result@@\"PASS\"\\n')\n"
        "    except OSError:\n        pass\n"
        "class Solution:\n    def f(self, x):\n        os._exit(0)",
        FUNCTIONAL,
        ("wrong answer",),
    ),
    "functional-patch-json": (
        "import json, json.encoder\njson.dumps = lambda *a, **k: 'true'\n"
        "json.encoder.JSONEncoder.encode = lambda self, o: 'true'\n"
        "def f(x):\n    return None",
        PYTEST_STYLE,
        ("wrong answer",),
    ),
    "functional-stack-inspection": (
        STACK_AND_MEMORY.replace("print(", "RESULT = (")
        + "\nclass Solution:\n    def f(self, x):\n        return RESULT",
        FUNCTIONAL,
        ("wrong answer",),
    ),
}

HONEST = (
    "import sys\nfor line in sys.stdin:\n    a, b = map(int, line.split())\n    print(a + b)",
    {"inputs": ["1 2\n", "10 20\n", "-5 5\n"], "outputs": ["3", "30", "0"]},
)


ATTACKS.update(FUNCTIONAL_ATTACKS)


@pytest.fixture(scope="module")
def secret_file():
    """A root-only file whose directories are all traversable: only its own mode protects it."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="klear-secret-", dir="/tmp")
    os.chmod(d, 0o755)
    p = os.path.join(d, "root-only.txt")
    with open(p, "w") as f:
        f.write(SECRET)
    os.chmod(p, 0o600)
    yield p
    shutil.rmtree(d, ignore_errors=True)


def _outside_paths():
    return [
        f"/tmp/klear-pwned-{NONCE}",
        f"/var/tmp/klear-pwned-{NONCE}",
        f"/dev/shm/klear-pwned-{NONCE}",
        os.path.join(_base_dir(), f"pwned-{NONCE}"),
        os.path.join(_base_dir(), "runs", f"pwned-{NONCE}"),
        os.path.join(os.path.dirname(os.path.abspath(__file__)), f"pwned-{NONCE}"),
        f"/root/pwned-{NONCE}",
        f"/usr/pwned-{NONCE}",
        f"/etc/pwned-{NONCE}",
    ]


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def graded(level, secret_file, loopback_server):
    """Run every attack (and honest programs alongside) through a 2-worker pool at `level`."""
    os.environ[ENV_NAME] = SECRET  # before the pool starts: the workers inherit it
    harness_sha = _sha(harness_mod.__file__)
    # A wall limit well above what the attacks that must meet another limit need to meet it (the
    # growing memory bomb writes 256 MB: 0.35 s alone, beyond 2 s beside busy neighbours).
    cfg = RewardConfig(code_max_tests=16, sandbox=small_limits(level, wall_s=6))
    attacks = dict(ATTACKS)
    attacks["read-secrets"] = (READ_SECRETS % {"env": ENV_NAME, "path": secret_file},) + ATTACKS["read-secrets"][1:]
    attacks["network"] = (NETWORK % {"port": loopback_server},) + ATTACKS["network"][1:]
    attacks["write-outside-tempdir"] = (
        WRITE_OUTSIDE % {"paths": _outside_paths(), "harness": harness_mod.__file__},
    ) + ATTACKS["write-outside-tempdir"][1:]
    pool = GradingPool(cfg, workers=2)
    try:
        futs = {}
        t0 = time.monotonic()
        for name, (code, tests, _) in attacks.items():
            futs[name] = pool.submit({"id": name, "task": "code", "response": code_response(code), "tests": tests})
            # an honest program next to each attack: attacks must not hurt their neighbours
            futs["honest-next-to-" + name] = pool.submit(
                {"id": "h", "task": "code", "response": code_response(HONEST[0]), "tests": HONEST[1]}
            )
        results = {name: f.result(timeout=120) for name, f in futs.items()}
        elapsed = time.monotonic() - t0
        after = pool.grade_many(
            [{"id": i, "task": "code", "response": code_response(HONEST[0]), "tests": HONEST[1]} for i in range(4)]
        )
        uids = [cfg.sandbox.base_uid + lease.slot for lease in pool._leases]
        leftovers = {uid: processes_of_uid(uid) for uid in uids}
        stats = dict(pool.stats)
        workers_alive = all(w.proc.is_alive() for w in pool._workers)
    finally:
        pool.close()
        os.environ.pop(ENV_NAME, None)
    tmp_left = [
        os.path.join(d, n)
        for d in ("/tmp", "/var/tmp", "/dev/shm")
        for n in os.listdir(d)
        if os.lstat(os.path.join(d, n)).st_uid in uids
    ]
    return {
        "results": results,
        "after": after,
        "leftovers": leftovers,
        "stats": stats,
        "workers_alive": workers_alive,
        "tmp_left": tmp_left,
        "elapsed": elapsed,
        "cfg": cfg,
        "harness_changed": _sha(harness_mod.__file__) != harness_sha,
    }


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_scores_zero_with_its_reason(graded, name):
    res = graded["results"][name]
    assert res.reward == 0.0 and res.passed == 0, f"{name}: {res}"
    assert res.error is None, f"{name}: the sandbox itself failed: {res.error}"
    acceptable = ATTACKS[name][2]
    assert all(v.startswith(acceptable) for v in res.tests), f"{name}: verdicts {res.tests}, expected {acceptable}"


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_honest_neighbour_of_attack_scores_one(graded, name):
    res = graded["results"]["honest-next-to-" + name]
    assert res.reward == 1.0 and res.passed == 3 and res.total == 3, res


def test_grader_healthy_after_all_attacks(graded):
    assert all(r.reward == 1.0 for r in graded["after"]), graded["after"]
    assert graded["workers_alive"], "a grading worker died"
    assert graded["stats"].get("killed", 0) == 0, graded["stats"]  # no hard-deadline kill, no crash
    assert graded["stats"].get("errors", 0) == 0, graded["stats"]


def test_no_process_of_the_sandbox_uids_survives(graded):
    assert graded["leftovers"] and all(not pids for pids in graded["leftovers"].values()), graded["leftovers"]


def test_nothing_left_in_shared_temp_dirs(graded):
    assert graded["tmp_left"] == []


def test_writes_outside_the_temp_dir_did_not_land(graded):
    assert [p for p in _outside_paths() if os.path.exists(p)] == []
    assert not graded["harness_changed"]


def test_attacks_are_cut_at_their_limits(graded):
    """Every attack ended by its sandbox's own limits, none by the pool's hard deadline (which kills a
    worker that outlives them): a structural check, not a wall-clock bound, which this CPU-heavy
    module could not keep reliably beside the other tests of its pass."""
    assert graded["stats"].get("killed", 0) == 0, graded["stats"]
    assert graded["workers_alive"], "a grading worker died"


def test_the_orphan_did_not_stall_the_grader(graded):
    # the grandchild held stdout open forever; the grader stopped reading soon after the main
    # process exited instead of waiting for EOF (or for the wall limit)
    res = graded["results"]["orphaned-grandchildren"]
    assert res.tests == ["wrong answer"]


def test_secret_file_is_root_only(secret_file):
    # root-only when the suite runs as root; as another user, readable by the grader's uid alone
    st = os.stat(secret_file)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    d = os.path.dirname(secret_file)
    while d != "/":  # every directory above it can be traversed by anyone
        assert os.stat(d).st_mode & 0o001, d
        d = os.path.dirname(d)


# --------------------------------------------------------------------------- controls
# The attacks are real: without the sandbox they do steal the secret. (Otherwise a reward of 0
# above could just mean a broken attack.)


def _run_plain(code: str, env=None) -> str:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env, stdin=subprocess.DEVNULL
    )
    return out.stdout.strip()


def test_control_read_secrets_works_unsandboxed(secret_file):
    code = READ_SECRETS % {"env": ENV_NAME, "path": secret_file}
    assert _run_plain(code, env={**os.environ, ENV_NAME: SECRET}) == SECRET  # from the environment
    assert _run_plain(code, env={"PATH": "/usr/bin"}) == SECRET  # from the root-only file


def test_control_network_works_unsandboxed(loopback_server):
    assert _run_plain(NETWORK % {"port": loopback_server}) == SECRET


def test_control_stack_inspection_finds_a_local_of_its_caller():
    # In a fresh interpreter: scanning every object of the (large) test process would touch
    # whatever other tests imported (lazy modules raise on attribute access).
    code = STACK_AND_MEMORY.replace("libc.ptrace(16, ppid, 0, 0)", "pass").replace(
        'for pid in [ppid, 1] + [int(p) for p in os.listdir("/proc") if p.isdigit()]:', "for pid in []:"
    )
    driver = (
        "def harness_like(code):\n"
        f"    expected = {EXPECTED!r}  # a local of the frame that runs the program\n"
        "    exec(compile(code, 'x', 'exec'), {'__name__': '__main__'})\n"
        f"harness_like({code!r})\n"
    )
    assert _run_plain(driver) == EXPECTED


def test_control_write_outside_works_unsandboxed():
    target = f"/tmp/klear-pwned-{NONCE}"
    try:
        _run_plain(WRITE_OUTSIDE % {"paths": [target], "harness": "/nonexistent/harness.py"})
        assert os.path.exists(target)
    finally:
        if os.path.exists(target):
            os.unlink(target)


def test_control_the_authors_exit_status_grading_passes_the_functional_attacks():
    """Graded the authors' way (solution + check code in one program, exit status 0 is a pass),
    exiting early and an atexit handler that exits 0 after a failed assert both pass; the same
    programs score 0 above."""
    import subprocess
    import sys

    check = f"\n\ndef check(candidate):\n    assert candidate(1) == {EXPECTED!r}\n\n\ncheck(Solution().f)\n"
    wrong = "class Solution:\n    def f(self, x):\n        return 0\n"
    for code in (
        FUNCTIONAL_ATTACKS["functional-exit-0-at-import"][0],
        "import atexit, os\natexit.register(lambda: os._exit(0))\n" + wrong,
    ):
        done = subprocess.run([sys.executable, "-c", code + check], capture_output=True, timeout=30)
        assert done.returncode == 0, done.stderr
    assert subprocess.run([sys.executable, "-c", wrong + check], capture_output=True, timeout=30).returncode == 1
