"""The grading pool: futures, asyncio, and timeouts and crashes reported with their reason."""

import array
import asyncio
import fcntl
import os
import signal
import termios
import time

import pytest

from megatron_klear.rewards import GradingPool, RewardConfig

from .conftest import T, code_response, small_limits

MATH_OK = {"id": "ok", "task": "math", "response": T + r"\boxed{(x+1)^2}", "answer": "x^2+2x+1"}
# ~0.1 s of sympy (trigonometric simplification) however warm the worker: 20x a 5 ms deadline
MATH_SLOW = {
    "id": "slow",
    "task": "math",
    "response": T + r"\boxed{\sin^{4}(x)\cos^{4}(x)}",
    "answer": r"\frac{3-4\cos(4x)+\cos(8x)}{128}",
}


def _worker_pid(pool):
    (w,) = pool._workers
    return w.proc.pid


def _wait_until_sent_to_stopped_worker(pool, timeout=30.0):
    """Until the dispatcher has written the submitted item into the (SIGSTOPped) worker's pipe: the
    worker holds an item, and bytes sent to it are unread (SIOCOUTQ of our end of the socketpair).
    A fixed sleep could lose that race on a loaded machine: the worker then dies idle, not grading."""
    (w,) = pool._workers
    deadline = time.monotonic() + timeout
    while True:
        unread = array.array("i", [0])
        if w.task is not None:
            fcntl.ioctl(w.conn.fileno(), termios.TIOCOUTQ, unread)
        if unread[0] > 0:
            return
        assert time.monotonic() < deadline, "the dispatcher did not hand the item to the worker"
        time.sleep(0.005)


@pytest.fixture
def make_pool():
    pools = []

    def make(**over):
        kw = dict(math_timeout_s=1.5, math_memory_mb=1536, sandbox=small_limits("auto"))
        kw.update(over)
        pools.append(GradingPool(RewardConfig(**kw), workers=1))
        return pools[-1]

    yield make
    for p in pools:
        p.close(cancel_pending=True)


@pytest.fixture
def pool1(make_pool):
    return make_pool()


def test_math_through_the_pool_and_results_in_order(pool1):
    items = [{"id": i, "task": "math", "response": T + rf"\boxed{{{i % 3}}}", "answer": "1"} for i in range(9)]
    res = pool1.grade_many(items)
    assert [r.reward for r in res] == [-1.0, 1.0, -1.0] * 3


def test_worker_memory_limit_is_in_place(pool1):
    pool1.grade_many([MATH_OK])
    with open(f"/proc/{_worker_pid(pool1)}/limits") as f:
        line = next(ln for ln in f if ln.startswith("Max address space"))
    assert int(line.split()[3]) == 1536 << 20


def test_soft_timeout_inside_the_worker_is_reported(make_pool):
    pool = make_pool(math_timeout_s=0.005)
    res = pool.submit(MATH_SLOW).result(timeout=30)
    assert res.error == "timeout: grading took more than 0.005 s"
    assert res.reward == -1.0 and res.passed == 0


def test_hung_worker_hits_the_hard_deadline_and_is_replaced(pool1):
    pool1.grade_many([MATH_OK])
    pid = _worker_pid(pool1)
    os.kill(pid, signal.SIGSTOP)  # a worker stuck where no signal reaches (e.g. C big-int code)
    t = time.monotonic()
    res = pool1.submit(MATH_OK).result(timeout=30)
    took = time.monotonic() - t
    assert res.error.startswith("timeout: no verdict within the hard deadline of 3.5 s")
    assert res.reward == -1.0
    assert 3.4 < took < 15
    assert _worker_pid(pool1) != pid
    assert pool1.grade_many([MATH_OK])[0].reward == 1.0  # the replacement works
    assert pool1.stats["killed"] == 1


def test_worker_crash_while_grading_is_reported(make_pool):
    pool1 = make_pool(crash_retries=0)
    pool1.grade_many([MATH_OK])
    pid = _worker_pid(pool1)
    os.kill(pid, signal.SIGSTOP)
    fut = pool1.submit(MATH_OK)
    _wait_until_sent_to_stopped_worker(pool1)
    os.kill(pid, signal.SIGKILL)
    res = fut.result(timeout=30)
    assert res.error == "grader crashed: worker killed by SIGKILL while grading this item"
    assert res.reward == -1.0
    assert pool1.grade_many([MATH_OK])[0].reward == 1.0


def test_a_crash_is_retried_once_on_a_fresh_worker(pool1):
    assert pool1.cfg.crash_retries == 1
    pool1.grade_many([MATH_OK])
    pid = _worker_pid(pool1)
    os.kill(pid, signal.SIGSTOP)
    fut = pool1.submit(MATH_OK)
    _wait_until_sent_to_stopped_worker(pool1)
    os.kill(pid, signal.SIGKILL)
    res = fut.result(timeout=30)
    assert res.reward == 1.0 and res.error is None
    assert pool1.stats["retried"] == 1


def test_idle_worker_death_is_repaired(pool1):
    pid = _worker_pid(pool1)
    os.kill(pid, signal.SIGKILL)
    res = pool1.submit(MATH_OK).result(timeout=30)
    assert res.reward == 1.0 and res.error is None


def test_bad_items_are_errors_and_do_not_stop_others(pool1):
    items = [
        {"id": 1, "task": "math", "response": T + r"\boxed{1}"},  # no answer
        {"id": 2, "task": "poetry", "response": "x"},
        {"id": 3, "task": "math", "response": "x", "answer": "1", "tests": {}},
        "not an object",
        MATH_OK,
    ]
    res = pool1.grade_many(items)
    assert "field 'answer'" in res[0].error
    assert "field 'task'" in res[1].error
    assert "field 'tests' does not belong to a math item" in res[2].error
    assert "expected a JSON object" in res[3].error
    assert res[4].reward == 1.0
    extra = dict(MATH_OK, prompt="What is (x+1)^2 expanded?", source="synthetic")  # carried along
    assert pool1.grade_many([extra])[0].reward == 1.0


def test_prepare_sandbox_reports_the_level(pool1, isolation_report):
    assert pool1.isolation is None  # nothing probed for math-only use
    rep = pool1.prepare_sandbox()
    assert pool1.isolation is rep and rep.level == ("bwrap" if isolation_report.bwrap_ok else "fallback")


def test_code_timeout_and_crash_reasons_through_the_pool(pool1):
    tests = {"inputs": ["", ""], "outputs": ["1", "1"]}
    r_sleep, r_segv = pool1.grade_many(
        [
            {"id": 1, "task": "code", "response": code_response("import time\ntime.sleep(30)"), "tests": tests},
            {
                "id": 2,
                "task": "code",
                "response": code_response("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"),
                "tests": tests,
            },
        ]
    )
    assert r_sleep.tests == ["timeout (wall 2 s)"] * 2 and r_sleep.reward == 0.0
    assert r_segv.tests == ["killed by signal 11"] * 2 and r_segv.reward == 0.0
    assert r_sleep.error is None and r_segv.error is None  # the program failed, not the grader


def test_asyncio_api_does_not_block_the_loop(pool1):
    slow = {
        "id": "slow",
        "task": "code",
        "response": code_response("import time\ntime.sleep(0.6)\nprint(1)"),
        "tests": {"inputs": [""], "outputs": ["1"]},
    }

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        t = asyncio.create_task(ticker())
        results = await asyncio.gather(pool1.grade(slow), pool1.grade(MATH_OK))
        t.cancel()
        return results, ticks

    (r_code, r_math), ticks = asyncio.run(main())
    assert r_code.reward == 1.0 and r_math.reward == 1.0
    assert ticks >= 5  # the event loop kept running while the program slept


def test_close_cancels_pending():
    cfg = RewardConfig(sandbox=small_limits("auto"))
    p = GradingPool(cfg, workers=1)
    slow = {
        "id": 0,
        "task": "code",
        "response": code_response("import time\ntime.sleep(0.5)\nprint(1)"),
        "tests": {"inputs": [""], "outputs": ["1"]},
    }
    futs = [p.submit(slow) for _ in range(5)]
    deadline = time.monotonic() + 30
    while not (futs[0].running() or futs[0].done()):  # the worker took it (a fixed sleep could lose that race)
        assert time.monotonic() < deadline, "the dispatcher did not start the first item"
        time.sleep(0.005)
    p.close(cancel_pending=True)
    assert futs[0].result().reward == 1.0  # the running one finishes
    assert sum(f.cancelled() for f in futs) >= 3
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(MATH_OK)


def test_a_sigterm_to_every_process_leaves_the_graders_working(pool1):
    """Slurm and container runtimes stop a job with SIGTERM to every process of it: the forkserver
    and the workers ignore it (the trainer, finishing its step before it saves, still grades), and
    they still end with the pool."""
    import psutil

    pool1.grade_many([MATH_OK])
    # the pool's forkserver and workers (their command line names the pool's first preload module);
    # not the helpers other tests of this process left (tests/distributed's forkserver dies of SIGTERM)
    mark = "megatron_klear.rewards.forkserver_preload"
    helpers = [p for p in psutil.Process().children(recursive=True) if mark in " ".join(p.cmdline())]
    assert any(p.pid == _worker_pid(pool1) for p in helpers)
    for p in helpers:
        p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in helpers)
    assert pool1.grade_many([MATH_OK])[0].reward == 1.0
    pool1.close()
    psutil.wait_procs([p for p in helpers if p.pid == _worker_pid(pool1)], timeout=10)


def test_a_process_that_raises_past_an_open_pool_exits_with_its_error():
    """An error that ends the process before the pool's owner closes it (the RL command failing its
    checkpoint's disk-space check did): the workers ignore SIGTERM, so multiprocessing's own exit
    hook (SIGTERM, then join) waited for them forever and the process hung; the pool's exit hook
    closes it first, and the process ends with its error."""
    import subprocess
    import sys

    code = (
        "from megatron_klear.rewards import GradingPool, RewardConfig\n"
        "pool = GradingPool(RewardConfig(workers=1))\n"
        f"assert pool.grade_many([{MATH_OK!r}])[0].reward == 1.0\n"
        "raise RuntimeError('the run failed with its pool open')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "the run failed with its pool open" in proc.stderr, proc.stderr[-2000:]
