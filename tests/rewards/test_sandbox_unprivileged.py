"""Code grading as a user who is not root, through the real Sandbox, with the verdicts root gets.

When the suite runs as root, the grader runs as uid 65534 with no supplementary groups (see
unprivileged.py); as any other user, as that user. Without root there is no fallback and no uid
switching: programs run as the grader's own uid, and only bubblewrap's namespaces keep them from
the grader's files, its network and its processes. So next to a correct and a wrong program, the
programs here attack exactly that: they read a file only the grader's uid may read, connect to a
server on the host's loopback, and write into the grader's own directories and the host's /tmp.
Controls show each attack succeeds for that uid without the sandbox. Skipped only where this
machine cannot drop privileges or gives that uid no sandbox, with the reason.
"""

import json
import os
import uuid

import pytest

from megatron_klear.rewards.processes import _base_dir

from .unprivileged import Unprivileged, grade_programs

SECRET = "SECRET-" + uuid.uuid4().hex
NONCE = uuid.uuid4().hex
# roomy limits: these are verdict tests, not limit tests, and must not race a loaded machine
SANDBOX = dict(isolation="auto", allow_fallback=True, cpu_s=4, wall_s=10, memory_mb=512, tmpfs_mb=16)

ADD = "a, b = map(int, input().split())\nprint(a {} b)"
ADD_TESTS = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3", "12"]}
READ_FILE = """
path = input().strip()
try:
    print(open(path).read())
except OSError as e:
    print("denied", e.errno)
"""
NETWORK = """
import socket
port = int(input())
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(1.0)
    s.connect(("127.0.0.1", port))
    print(s.recv(100).decode())
except OSError as e:
    print("no network", e.errno)
"""
WRITE = """
import sys
for p in sys.stdin.read().split():
    try:
        with open(p, "w") as f:
            f.write("pwned")
    except OSError:
        pass
print("done")
"""
EXPECTED = {
    "correct": (1.0, ["pass", "pass"]),
    "wrong": (0.0, ["wrong answer", "wrong answer"]),
    "read-the-graders-file": (0.0, ["wrong answer"]),
    "network": (0.0, ["wrong answer"]),
    # a pass: the program ran to its end, every write attempted; the writes are checked on the host
    "write-outside": (1.0, ["pass"]),
}


@pytest.fixture(scope="module")
def user():
    u = Unprivileged()
    if u.skip_reason:
        u.close()
        pytest.skip(u.skip_reason)
    yield u
    u.close()


def _secret_file(directory: str, uid: int, gid: int) -> str:
    p = os.path.join(directory, "secret")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "w") as f:
        f.write(SECRET)
    if os.getuid() == 0:
        os.chown(p, uid, gid)
    return p


def _programs(secret: str, port: int, targets: list[str]) -> dict:
    return {
        "correct": [ADD.format("+"), ADD_TESTS],
        "wrong": [ADD.format("-"), ADD_TESTS],
        "read-the-graders-file": [READ_FILE, {"inputs": [secret + "\n"], "outputs": [SECRET]}],
        "network": [NETWORK, {"inputs": [f"{port}\n"], "outputs": [SECRET]}],
        "write-outside": [WRITE, {"inputs": [" ".join(targets)], "outputs": ["done"]}],
    }


@pytest.fixture(scope="module")
def graded(user, loopback_server, tmp_path_factory):
    """The same programs graded by this process (root, when the suite is) and by the unprivileged uid."""
    # the unprivileged grader: its own private file, its home, its sandbox directory, the host's /tmp
    user_secret = _secret_file(user.home, user.uid, user.gid)
    user_targets = [
        os.path.join(user.home, f"pwned-{NONCE}"),
        os.path.join(user.home, f"megatron-klear-sandbox-{user.uid}", f"pwned-{NONCE}"),
        f"/tmp/klear-unpriv-pwned-{NONCE}",
    ]
    req = {"programs": _programs(user_secret, loopback_server, user_targets), "sandbox": SANDBOX}
    done = user.run([os.path.join(user.code, "unprivileged.py"), "grade"], stdin=json.dumps(req))
    assert done.returncode == 0, done.stderr
    as_user = json.loads(done.stdout.strip().splitlines()[-1])

    here = str(tmp_path_factory.mktemp("grader"))
    own_targets = [os.path.join(here, f"pwned-{NONCE}"), os.path.join(_base_dir(), f"pwned-{NONCE}")]
    own_targets.append(f"/tmp/klear-own-pwned-{NONCE}")
    own_secret = _secret_file(here, os.getuid(), os.getgid())
    as_self = grade_programs(_programs(own_secret, loopback_server, own_targets), SANDBOX)
    landed = [p for p in user_targets + own_targets if os.path.exists(p)]
    for p in landed:
        os.unlink(p)
    return {"user": as_user, "self": as_self, "landed": landed, "user_secret": user_secret}


def _usable(graded):
    u = graded["user"]
    if "refused" in u:
        # skipped only when the machine denies that uid bubblewrap's namespaces; a refusal where a
        # bare bubblewrap works is the sandbox's own failure
        assert u["machine_says_no"], f"grading refused for uid {u['uid']} though bubblewrap works: {u['refused']}"
        pytest.skip(f"no sandbox for uid {u['uid']} on this machine: {u['refused']}")


def test_an_unprivileged_grader_gets_the_same_verdicts_as_root(user, graded):
    _usable(graded)
    u, me = graded["user"], graded["self"]
    assert u["uid"] == user.uid != 0 and u["level"] == "bwrap", u
    assert me["uid"] == os.getuid()
    for name, (reward, tests) in EXPECTED.items():
        assert (u["results"][name]["reward"], u["results"][name]["tests"]) == (reward, tests), (
            name,
            u["results"][name],
        )
        assert u["results"][name]["error"] is None, (name, u["results"][name])
    assert u["results"] == me["results"]


def test_writes_outside_the_sandbox_did_not_land(graded):
    _usable(graded)
    assert graded["landed"] == []


def test_programs_of_an_unprivileged_grader_run_as_its_own_uid_and_there_is_no_fallback(user, graded):
    _usable(graded)
    u = graded["user"]
    # bubblewrap's user namespace maps the program to the grader's uid and gid: no uid switch without root
    assert u["program_ids"] == [str(user.uid), str(user.gid)], u
    assert u["fallback"] == "the fallback sandbox needs root to run programs as a separate uid", u
    if os.getuid() == 0:  # and root's programs run as a private uid instead
        assert int(graded["self"]["program_ids"][0]) >= 1_900_000_000


def test_control_each_attack_succeeds_for_that_uid_without_the_sandbox(user, graded, loopback_server):
    """Run unsandboxed as the same uid, the attacks do what the sandbox stopped."""
    assert user.run(["-c", READ_FILE], stdin=graded["user_secret"] + "\n").stdout.strip() == SECRET
    assert user.run(["-c", NETWORK], stdin=f"{loopback_server}\n").stdout.strip() == SECRET
    targets = [os.path.join(user.home, f"control-{NONCE}"), f"/tmp/klear-unpriv-control-{NONCE}"]
    try:
        assert user.run(["-c", WRITE], stdin=" ".join(targets)).stdout.strip() == "done"
        assert [os.path.exists(p) for p in targets] == [True, True]
    finally:
        for p in targets:
            if os.path.exists(p):
                os.unlink(p)
