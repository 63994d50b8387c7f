"""Fixtures for the reward tests: the isolation levels this machine supports, small limits.

A test that needs real namespaces runs only where the start-up probe says bubblewrap works and is
skipped with the probe's reason otherwise; the fallback level (rlimits + separate uid + seccomp)
runs wherever the grader is root. The hostile suite runs on every level available.
"""

import pytest

from megatron_klear.rewards import RewardConfig, SandboxConfig, isolation_probe
from megatron_klear.rewards.isolation_probe import probe_isolation
from tests.components import missing

T = "<think>thinking</think>\n"


def small_limits(level: str, **over) -> SandboxConfig:
    """1 s of CPU, 2 s of wall clock: hostile programs die fast, honest ones finish in ms."""
    kw = dict(
        isolation=level,
        allow_fallback=True,
        cpu_s=1,
        wall_s=2,
        memory_mb=256,
        processes=16,
        output_limit_bytes=1 << 20,
        file_size_mb=4,
        tmpfs_mb=16,
    )
    kw.update(over)
    return SandboxConfig(**kw)


def code_response(code: str) -> str:
    return T + "Here is my solution.\n```python\n" + code + "\n```\n"


@pytest.fixture(scope="session")
def isolation_report():
    return probe_isolation(small_limits("auto"))


@pytest.fixture(scope="session", params=["bwrap", "fallback"])
def level(request, isolation_report):
    rep = isolation_report
    if request.param == "bwrap" and not rep.bwrap_ok:
        why = "bubblewrap isolation unavailable here: " + "; ".join(rep.bwrap_problems)
        if not isolation_probe.bwrap_path():  # not installed (make sandbox installs it): a missing component
            missing(why + " (run `make sandbox`)")
        pytest.skip(why)
    if request.param == "fallback" and not rep.fallback_ok:
        pytest.skip("fallback isolation unavailable here: " + "; ".join(rep.fallback_problems))
    return request.param


@pytest.fixture
def reward_cfg(level):
    return RewardConfig(sandbox=small_limits(level))


@pytest.fixture(scope="module")
def loopback_server(request):
    """Serves the test module's ``SECRET`` to whoever connects to the host's loopback (a program that
    reaches it has left the sandbox's network namespace); yields the port."""
    import socket
    import threading

    secret = request.module.SECRET
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            c.sendall(secret.encode())
            c.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    yield srv.getsockname()[1]
    stop.set()
    th.join()
    srv.close()
