"""The sandbox check a user runs first on a compute node (`python -m megatron_klear.rewards.isolation_probe`).

Facts this machine cannot show (user namespaces switched off by each setting, AppArmor's
restriction, a container without CAP_SYS_ADMIN) are injected: fake /proc files, or HostFacts built
by hand. What it can show is checked for real: the command as this user, as an unprivileged uid,
as that uid without bubblewrap on its PATH, and as that uid where user namespaces are off.
"""

import os
import shutil
import subprocess
import sys

import pytest

from megatron_klear.rewards import isolation_probe
from megatron_klear.rewards.isolation_probe import (
    USERNS_SYSCTLS,
    HostFacts,
    IsolationReport,
    check_main,
    choose_level,
    host_facts,
    namespace_causes,
    probe_isolation,
)
from megatron_klear.rewards.processes import SandboxUnavailable
from tests.components import missing

from .conftest import small_limits
from .unprivileged import Unprivileged

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULE = "megatron_klear.rewards.isolation_probe"
BWRAP = "/usr/bin/bwrap"
SYSCTL_NAMES = [name for name, *_ in USERNS_SYSCTLS]


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _status(cap_eff: int, seccomp: int) -> str:
    return f"Name:\tpython\nCapEff:\t{cap_eff:016x}\nNoNewPrivs:\t0\nSeccomp:\t{seccomp}\n"


# --------------------------------------------------------------------------- injected facts


def test_host_facts_reads_the_files_it_is_pointed_at(tmp_path):
    proc, root = str(tmp_path / "proc"), str(tmp_path / "root")
    _write(f"{proc}/sys/kernel/unprivileged_userns_clone", "0\n")
    _write(f"{proc}/sys/user/max_user_namespaces", "0\n")
    _write(f"{proc}/sys/kernel/apparmor_restrict_unprivileged_userns", "1\n")
    _write(f"{proc}/self/status", _status(cap_eff=0, seccomp=2))
    _write(f"{root}/.dockerenv", "")
    f = host_facts(proc=proc, root=root, try_bwrap=False)
    assert f.sysctls == {
        "kernel.unprivileged_userns_clone": 0,
        "user.max_user_namespaces": 0,
        "kernel.apparmor_restrict_unprivileged_userns": 1,
    }
    assert f.container.startswith("Docker") and not f.cap_sys_admin and f.seccomp_filtered
    assert f.bare_bwrap_error is None  # not tried

    # absent files are absent, not 0; CAP_SYS_ADMIN is bit 21 of CapEff
    proc2, root2 = str(tmp_path / "proc2"), str(tmp_path / "root2")
    _write(f"{proc2}/sys/user/max_user_namespaces", "15000\n")
    _write(f"{proc2}/self/status", _status(cap_eff=1 << 21, seccomp=0))
    os.makedirs(root2)
    f = host_facts(proc=proc2, root=root2, try_bwrap=False)
    assert f.sysctls == {
        "kernel.unprivileged_userns_clone": None,
        "user.max_user_namespaces": 15000,
        "kernel.apparmor_restrict_unprivileged_userns": None,
    }
    assert f.cap_sys_admin and not f.seccomp_filtered
    assert f.container in (None,) or f.container.startswith("container=")  # the environment may say so


@pytest.mark.parametrize("name", SYSCTL_NAMES)
def test_each_setting_that_switches_user_namespaces_off_is_named_with_what_to_ask_for(name):
    forbidding, ask = next((v, a) for n, v, _, a in USERNS_SYSCTLS if n == name)
    sysctls = {n: None for n in SYSCTL_NAMES} | {name: forbidding}
    err = "bwrap: No permissions to creating new namespace, likely because the kernel does not allow ..."
    f = HostFacts(uid=1000, bwrap=BWRAP, sysctls=sysctls, bare_bwrap_error=err)
    causes = namespace_causes(f)
    assert len(causes) == 1, causes
    assert causes[0].startswith(f"{name} = {forbidding} ") and causes[0].endswith(f"needs {ask}"), causes
    if name.startswith("kernel.apparmor"):
        assert "AppArmor profile for bwrap that allows `userns`" in causes[0]
    # none of them matters to root: a privileged bubblewrap makes no user namespace
    assert namespace_causes(HostFacts(uid=0, bwrap=BWRAP, sysctls=sysctls, cap_sys_admin=True)) == []


def test_a_setuid_bubblewrap_is_named_for_a_normal_user():
    # setuid bubblewrap refuses --size (the private /tmp's limit); root runs it as root, unaffected
    (cause,) = namespace_causes(HostFacts(uid=1000, bwrap=BWRAP, bwrap_setuid=True))
    assert "installed setuid root" in cause and "--size" in cause
    assert namespace_causes(HostFacts(uid=0, bwrap=BWRAP, bwrap_setuid=True, cap_sys_admin=True)) == []


def test_a_container_that_denies_namespaces_is_named():
    err = "bwrap: Creating new namespace failed: Operation not permitted"
    docker = "Docker (/.dockerenv exists)"
    # root in a container without CAP_SYS_ADMIN
    causes = namespace_causes(HostFacts(uid=0, bwrap=BWRAP, container=docker, cap_sys_admin=False))
    assert len(causes) == 1 and "without CAP_SYS_ADMIN" in causes[0] and docker in causes[0]
    # a user whose sysctls allow user namespaces, but a seccomp filter denies unshare
    f = HostFacts(
        uid=1000,
        bwrap=BWRAP,
        sysctls={"user.max_user_namespaces": 15000},
        container=docker,
        seccomp_filtered=True,
        bare_bwrap_error=err,
    )
    (cause,) = namespace_causes(f)
    assert "in a container (Docker" in cause and "seccomp filter" in cause and err in cause
    assert "the user-namespace settings do not explain it" in cause
    # nothing stops a bare bubblewrap: no cause (a failing probe names its own problem)
    assert namespace_causes(HostFacts(uid=1000, bwrap=BWRAP, sysctls={"user.max_user_namespaces": 15000})) == []


def test_missing_bubblewrap_says_how_to_install_it():
    (cause,) = namespace_causes(HostFacts(uid=1000, bwrap=None))
    assert "no bwrap binary" in cause and "apt-get install bubblewrap" in cause and "dnf install bubblewrap" in cause


def test_a_failing_bubblewrap_gets_its_cause_in_the_report_and_the_refusal(tmp_path, monkeypatch):
    # bubblewrap as it fails where namespaces are denied; the real machine's facts otherwise
    d = tmp_path / "fakebin"
    d.mkdir()
    (d / "bwrap").write_text(
        "#!/bin/sh\necho 'bwrap: Creating new namespace failed: Operation not permitted' >&2\nexit 1\n"
    )
    (d / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{d}:{os.environ['PATH']}")
    monkeypatch.setattr(isolation_probe, "_probe_level", lambda cfg, level: (["probe failed"], []))
    rep = probe_isolation(small_limits("auto"))
    assert not rep.bwrap_ok and rep.bwrap_causes, rep
    if os.getuid() == 0:  # no user-namespace setting applies to root: the bare bubblewrap's error is the cause
        assert any("Operation not permitted" in c for c in rep.bwrap_causes), rep.bwrap_causes
    with pytest.raises(SandboxUnavailable, match="Refusing to run untrusted code") as e:
        choose_level(small_limits("auto", allow_fallback=False), rep)
    assert f"(why: {rep.bwrap_causes[0]}" in str(e.value)


def _report(bwrap_ok: bool, fallback_ok: bool, causes=()) -> IsolationReport:
    return IsolationReport(
        level=None,
        bwrap_ok=bwrap_ok,
        bwrap_problems=[] if bwrap_ok else ["probe program did not run: sandbox failure: bwrap: ..."],
        fallback_ok=fallback_ok,
        fallback_problems=[] if fallback_ok else ["the fallback needs root (to run programs as a separate uid)"],
        limitations=["world-readable host files are readable"] if fallback_ok else [],
        bwrap_causes=list(causes),
    )


CAUSE = "user.max_user_namespaces = 0 (how many ...): no user namespace for uid 1000; needs ..."


@pytest.mark.parametrize(
    "bwrap_ok, fallback_ok, argv, status, says",
    [
        (True, False, [], 0, ["isolation: bwrap"]),
        (False, False, [], 1, ["bubblewrap: FAILS", f"why: {CAUSE}", "isolation: none"]),
        # root: the fallback works but is not allowed
        (False, True, [], 1, [f"why: {CAUSE}", "not allowed (--allow-fallback)", "isolation: none"]),
        (False, True, ["--allow-fallback"], 0, [f"why: {CAUSE}", "isolation: fallback (DEGRADED"]),
        # bubblewrap works, but the settings ask for the fallback, which needs root
        (True, False, ["--isolation", "fallback"], 1, ["isolation: none", "refused: no usable sandbox"]),
    ],
)
def test_the_command_exits_non_zero_exactly_when_code_cannot_be_graded(
    monkeypatch, capsys, bwrap_ok, fallback_ok, argv, status, says
):
    rep = _report(bwrap_ok, fallback_ok, causes=[] if bwrap_ok else [CAUSE])
    facts = HostFacts(uid=1000, bwrap=BWRAP, sysctls={n: None for n in SYSCTL_NAMES} | {"user.max_user_namespaces": 0})
    monkeypatch.setattr(isolation_probe, "probe_isolation", lambda cfg: rep)
    monkeypatch.setattr(isolation_probe, "host_facts", lambda **kw: facts)
    assert check_main(argv) == status
    out = capsys.readouterr().out
    assert all(s in out for s in says), out
    assert "user.max_user_namespaces=0" in out  # the settings are always shown
    assert ("On a cluster, as a normal user" in out) == bool(status), out


# --------------------------------------------------------------------------- for real, on this machine


def test_the_command_as_this_user(isolation_report):
    done = subprocess.run(
        [sys.executable, "-m", MODULE], capture_output=True, text=True, timeout=120, cwd=REPO, check=False
    )
    out = done.stdout
    assert out.startswith(f"uid {os.getuid()}"), out + done.stderr
    for name in SYSCTL_NAMES:
        assert f"{name}=" in out
    if isolation_report.bwrap_ok:
        assert done.returncode == 0 and out.rstrip().endswith("isolation: bwrap"), out
    else:
        assert done.returncode == 1 and "isolation: none" in out and "bubblewrap: FAILS" in out, out


@pytest.fixture(scope="module")
def user():
    u = Unprivileged()
    yield u
    u.close()


def _need(user):
    if user.skip_reason:
        pytest.skip(user.skip_reason)


def test_the_command_as_an_unprivileged_user(user):
    _need(user)
    done = user.run(["-m", MODULE])
    out = done.stdout
    assert f"uid {user.uid}," in out and "(root)" not in out, out + done.stderr
    assert "fallback: unavailable: the fallback needs root" in out
    if done.returncode == 0:
        assert out.rstrip().endswith("isolation: bwrap"), out
        assert "bubblewrap: works, in a user namespace" in out, out
    else:  # this machine gives users no sandbox: the command must say so, and what failed
        assert done.returncode == 1 and "isolation: none" in out and "bubblewrap: FAILS" in out, out


def test_the_command_without_bubblewrap_on_path(user):
    _need(user)
    done = user.run(["-m", MODULE], PATH="/nonexistent")
    assert done.returncode == 1, done
    assert "bubblewrap: not installed" in done.stdout and "why: no bwrap binary on PATH" in done.stdout, done


def test_the_command_where_user_namespaces_are_off(user):
    """In a user namespace whose user.max_user_namespaces is 0 (the host's setting is untouched),
    bubblewrap really fails for the unprivileged uid, and the command names the setting."""
    _need(user)
    if os.getuid() != 0:
        pytest.skip("staging a user namespace with user namespaces off needs root")
    if not isolation_probe.bwrap_path():
        missing("bubblewrap is not installed here: run `make sandbox`")
    done = user.run(["-m", MODULE], no_userns=True)
    if done.returncode == 97:
        pytest.skip("cannot stage a user namespace here: " + done.stderr.strip())
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "user.max_user_namespaces=0" in out and "bubblewrap: FAILS" in out, out
    assert "why: user.max_user_namespaces = 0 " in out and "isolation: none" in out, out


def test_the_command_with_a_setuid_bubblewrap(user):
    """A setuid-root copy of this machine's bubblewrap, first on the unprivileged uid's PATH: the
    sandbox cannot use it (--size), and the command says so."""
    _need(user)
    bwrap = isolation_probe.bwrap_path()
    if os.getuid() != 0 or not bwrap:
        pytest.skip("needs root (to make a setuid copy) and bubblewrap")
    d = user.dir + "/suid-bin"
    os.mkdir(d, 0o755)
    if os.statvfs(d).f_flag & os.ST_NOSUID:
        pytest.skip(f"{d} is on a nosuid mount")
    shutil.copy(bwrap, d + "/bwrap")
    os.chmod(d + "/bwrap", 0o4755)
    done = user.run(["-m", MODULE], PATH=f"{d}:/usr/bin:/bin")
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "--size option is not permitted in setuid mode" in out, out
    assert f"why: {d}/bwrap is installed setuid root" in out, out
