"""Issue 21, the generation side of "the step survives a lost worker": rollout servers killed
(SIGKILL) or frozen (SIGSTOP) mid-generation, behind the real sglang-router and sent to directly;
every worker gone; a server restarted at its URL recalled and admitted; answers made with stale
weights. The servers are processes (the scriptable fake worker for faults, the stand-in server for
a real restart), so the faults are real."""

import os
import signal
import threading
import time

import pytest

from megatron_klear.rollout.base import SamplingParams
from megatron_klear.rollout.servers.fleet import LIVE, LOST, REJOINING, Fleet, FleetError
from megatron_klear.rollout.sglang import EngineError, SGLangEngine
from tests.rollout.processes import _get_json, fake_worker, free_port, recorded, router

# the watchdog's bound: 2 missed probes, 0.3 s apart, 0.5 s each -> a worker is dropped within ~2 s
WATCH = dict(
    control_timeout_s=5,
    max_retries=2,
    retry_backoff=0.05,
    health_check_interval_s=0.3,
    health_check_timeout_s=0.5,
    health_failure_threshold=2,
    generate_timeout_s=3600,
)
PARAMS = SamplingParams(max_new_tokens=3)
PROMPTS = [[i + 1, 2] for i in range(8)]


def _listed(router_url):
    return sorted(w["url"] for w in _get_json(router_url + "/workers")["workers"])


def _later(seconds, fn):
    t = threading.Timer(seconds, fn)
    t.start()
    return t


def _once(ready, fn, timeout: float = 30.0):
    """``fn()`` in a thread as soon as ``ready()`` holds (checked every 20 ms; at ``timeout`` anyway)."""

    def wait_then_call():
        deadline = time.monotonic() + timeout
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        fn()

    t = threading.Thread(target=wait_then_call, daemon=True)
    t.start()
    return t


# -- the fleet's bookkeeping -----------------------------------------------------------------------------
def test_fleet_states_counters_and_the_min_live_bound():
    fleet = Fleet(["a", "b", "c"], min_live=2)
    assert fleet.lose("a", "dead") and not fleet.lose("a", "dead again")  # a second report changes nothing
    assert (fleet.live(), fleet.lost()) == (["b", "c"], {"a": "dead"})
    with pytest.raises(FleetError, match=r"1 rollout server\(s\) left.*min_live_workers = 2.*a: dead; b: frozen"):
        fleet.lose("b", "frozen")
    assert fleet.recall("a") and fleet.state("a") == REJOINING and fleet.serving() == ["a", "c"]
    assert fleet.admit("a") and fleet.state("a") == LIVE
    assert fleet.add("d", REJOINING) and not fleet.add("d")
    assert fleet.admit("d")  # a new worker joins without counting as a rejoin
    fleet.count(resent=3, stale=1)
    assert fleet.metrics() == {
        "rollout/live_workers": 3,
        "rollout/worker_failures": 2,
        "rollout/worker_rejoins": 1,
        "rollout/resent_requests": 3,
        "rollout/stale_responses": 1,
    }
    assert fleet.demote("c", "stale weights") and fleet.state("c") == REJOINING and fleet.failures == 3
    with pytest.raises(ValueError, match="rollout.min_live_workers must be >= 1"):
        Fleet(["a"], min_live=0)
    with pytest.raises(ValueError, match="rollout.min_live_workers must be >= 1"):
        SGLangEngine.at(["http://127.0.0.1:9"], min_live_workers=0)


def test_during_a_push_the_rejoining_workers_count_for_min_live_until_the_strict_check_after_it():
    """A live worker lost in a push whose only other worker rejoins in it is not an error while the
    push runs; once it ended, the check counts live workers only: admitted, the push ends well; not
    admitted (or dropped), the end of the push raises FleetError."""
    fleet = Fleet(["a", "b"])
    fleet.lose("b", "killed")
    fleet.recall("b")
    with fleet.pushing():
        assert fleet.lose("a", "killed mid-sync") and fleet.live() == []  # b is about to serve
        assert fleet.admit("b")
    assert fleet.live() == ["b"]
    with pytest.raises(FleetError, match=r"0 rollout server\(s\) left.*Lost: b: killed mid-sync"):
        with fleet.pushing():
            fleet.recall("a")
            fleet.lose("b", "killed mid-sync")  # a rejoins: no error yet
    with pytest.raises(FleetError, match=r"0 rollout server\(s\) left"):
        with fleet.pushing():
            fleet.lose("a", "its weight load failed as it rejoined")  # the last candidate goes: at once
    with pytest.raises(FleetError, match=r"0 rollout server\(s\) left"):
        fleet.check()  # outside a push: live workers only


def test_control_calls_tolerate_a_gone_worker_not_a_refusal(tmp_path):
    """_on_workers(tolerate_loss=True): a worker that cannot be reached is dropped and the others'
    results come back as {worker: result}; an answer refusing the call still fails it and drops
    nobody; without tolerate_loss a gone worker fails the call as before."""
    dead = f"http://127.0.0.1:{free_port()}"
    with (
        fake_worker(tmp_path, "a") as (a, _, _),
        fake_worker(tmp_path, "r", fail_post="/update_weight_version") as (r, _, _),
    ):
        client = SGLangEngine.at([a], workers=[a, dead], control_timeout_s=2)
        with pytest.raises(EngineError, match=dead.replace(".", r"\.")):
            client.members.on_workers(client.model_info)
        assert client.fleet.state(dead) == LIVE
        got = client.members.on_workers(lambda w: client.model_info(w)["weight_version"], tolerate_loss=True)
        assert got == {a: "0"}
        assert client.fleet.state(dead) == LOST and client.workers() == [a]
        assert client.fleet_metrics()["rollout/worker_failures"] == 1
        assert client.fleet_metrics()["rollout/worker_failures"] == 0  # counts since the previous call
        refusing = SGLangEngine.at([a], workers=[a, r], control_timeout_s=2)
        with pytest.raises(EngineError, match="injected failure of /update_weight_version"):
            refusing.members.on_workers(
                lambda w: refusing.wire.post(w, "/update_weight_version", {"new_version": "1"}),
                tolerate_loss=True,
            )
        assert refusing.fleet.live() == [a, r]
        alone = SGLangEngine.at([dead], workers=[dead], control_timeout_s=2)
        with pytest.raises(FleetError, match=f"0 rollout server.*Lost: {dead}"):
            alone.members.on_workers(alone.model_info, tolerate_loss=True)


# -- a worker lost mid-generation ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "via_router,router_flags",
    [(True, ()), (True, ("--disable-health-check",)), (False, ())],
    ids=["router", "router-without-health-checks", "direct"],
)
def test_a_worker_killed_mid_generation_is_dropped_and_the_call_completes(tmp_path, via_router, router_flags):
    """Behind a router that checks its workers' health or not (the launch script disables it: the
    client keeps the router's list), or sent to directly."""
    with (
        fake_worker(tmp_path, "a", generate_delay=1.5) as (a, rec_a, proc_a),
        fake_worker(tmp_path, "b", generate_delay=1.5) as (b, rec_b, _),
        router([a, b], extra=router_flags) as r,
    ):
        client = SGLangEngine.at([r] if via_router else [a, b], max_concurrent_requests=8, **WATCH)
        assert sorted(client.workers()) == sorted([a, b])
        # killed once it holds a request (a fixed delay raced the router's first forward to it)
        _once(lambda: recorded(rec_a), proc_a.kill)
        t0 = time.monotonic()
        out = client.generate(PROMPTS, PARAMS, n=2)
        elapsed = time.monotonic() - t0
        assert len(out) == len(PROMPTS) and all(len(row) == 2 and row[0].token_ids == [7, 8, 9] for row in out)
        assert elapsed < 15, elapsed
        assert client.fleet.state(a) == LOST and client.fleet.live() == [b]
        metrics = client.fleet_metrics()
        assert metrics["rollout/live_workers"] == 1 and metrics["rollout/worker_failures"] == 1, metrics
        assert recorded(rec_a)  # a held requests when it died
        if via_router:
            assert _listed(r) == [b]  # the router no longer routes to it
        else:
            assert client.generation.retries == 0  # re-sent because the worker was dropped, no retry consumed
            assert metrics["rollout/resent_requests"] >= 1, metrics
        # the next call goes to b alone, at once
        assert len(client.generate(PROMPTS[:2], PARAMS)) == 2


@pytest.mark.parametrize(
    "via_router,router_flags",
    [(True, ()), (True, ("--disable-health-check",)), (False, ())],
    ids=["router", "router-without-health-checks", "direct"],
)
def test_a_worker_frozen_mid_generation_is_dropped_within_the_watchdogs_bound(tmp_path, via_router, router_flags):
    """SIGSTOP: the worker accepts connections but never answers; its requests would wait for the
    hour of generate_timeout. The watchdog drops it; its requests (direct) or every request in
    flight through the router (hedged) go to the live worker."""
    with (
        fake_worker(tmp_path, "a", generate_delay=1.0) as (a, rec_a, proc_a),
        fake_worker(tmp_path, "b", generate_delay=1.0) as (b, rec_b, _),
        router([a, b], extra=router_flags) as r,
    ):
        client = SGLangEngine.at([r] if via_router else [a, b], max_concurrent_requests=8, **WATCH)
        client.workers()
        try:
            _once(lambda: recorded(rec_a), lambda: os.kill(proc_a.pid, signal.SIGSTOP))  # frozen holding requests
            t0 = time.monotonic()
            out = client.generate(PROMPTS, PARAMS)
            elapsed = time.monotonic() - t0
        finally:
            os.kill(proc_a.pid, signal.SIGCONT)
        assert len(out) == len(PROMPTS) and all(row[0].token_ids == [7, 8, 9] for row in out)
        # dropped after 2 missed probes (<= 2 x (0.3 + 0.5) s), the re-sent requests take 1 s more
        assert elapsed < 10, elapsed
        assert client.fleet.state(a) == LOST
        assert "stopped answering /health" in client.fleet.lost()[a]
        metrics = client.fleet_metrics()
        assert metrics["rollout/worker_failures"] == 1 and metrics["rollout/resent_requests"] >= 1, metrics
        assert client.generation.retries == 0
        if via_router:
            assert _listed(r) == [b]


def test_every_worker_gone_fails_naming_them_in_bounded_time(tmp_path):
    with (
        fake_worker(tmp_path, "a", generate_delay=30) as (a, _, proc_a),
        fake_worker(tmp_path, "b", generate_delay=30) as (b, _, proc_b),
        router([a, b]) as r,
    ):
        client = SGLangEngine.at([r], **WATCH)
        client.workers()
        _later(0.3, proc_a.kill)
        _later(0.3, lambda: os.kill(proc_b.pid, signal.SIGSTOP))
        t0 = time.monotonic()
        with pytest.raises(FleetError) as e:
            client.generate(PROMPTS, PARAMS)
        assert time.monotonic() - t0 < 15
        msg = str(e.value)
        assert a in msg and b in msg and "fewer than rollout.min_live_workers = 1" in msg, msg
        # the first lost is removed from the router; the last stays listed, for a restarted job to find
        assert len(_listed(r)) == 1 and _listed(r)[0] in (a, b), _listed(r)
        os.kill(proc_b.pid, signal.SIGCONT)


# -- a worker that comes back --------------------------------------------------------------------------------
def test_a_restarted_server_is_recalled_admitted_after_the_version_and_served_again(tmp_path):
    """Two workers behind the router; one is killed mid-generation and restarted at its URL (fresh,
    weight_version "0"), recalled (rejoining: control calls but no generation), refused admission
    until it reports the pushed version, then admitted: the router lists it and it generates again."""
    port = free_port()
    with (
        fake_worker(tmp_path, "a", generate_delay=0.5) as (a, _, _),
        fake_worker(tmp_path, "b", generate_delay=0.5, port=port) as (b, _, proc_b),
        router([a, b]) as r,
    ):
        client = SGLangEngine.at([r], max_concurrent_requests=8, **WATCH)
        client.workers()
        _later(0.2, proc_b.kill)
        assert len(client.generate(PROMPTS, PARAMS)) == len(PROMPTS)
        assert client.fleet.state(b) == LOST and _listed(r) == [a]
        assert client.recall_workers() == []  # still dead
        with fake_worker(tmp_path, "b2", port=port) as (b2, rec_b2, _):
            assert b2 == b
            assert client.recall_workers() == [b] and client.fleet.state(b) == REJOINING
            assert sorted(client.workers()) == sorted([a, b])  # it takes the next push's control calls
            client.generate(PROMPTS, PARAMS)
            assert recorded(rec_b2) == []  # but no generation
            assert client.admit_workers(3) == []  # it still reports "0"
            client.wire.set_version(3)  # the push (here only the version) reaches both
            assert recorded(rec_b2, "/update_weight_version") == [{"new_version": "3", "abort_all_requests": False}]
            assert client.admit_workers(3) == [b] and client.members.expected_version == "3"
            assert sorted(client.fleet.live()) == sorted([a, b]) and _listed(r) == sorted([a, b])  # router order
            client.generate(PROMPTS, PARAMS)
            assert recorded(rec_b2)  # served again, through the router
            metrics = client.fleet_metrics()
            assert metrics["rollout/worker_failures"] == 1 and metrics["rollout/worker_rejoins"] == 1, metrics
            assert metrics["rollout/live_workers"] == 2


def test_a_worker_the_router_lists_later_joins_only_with_the_current_weights(tmp_path):
    """A server registered with the router while the job runs (POST /workers, by an operator or
    its launcher) holds unknown weights: the client takes it out of the router (rejoining) until a
    push has given it the current version."""
    import httpx

    with fake_worker(tmp_path, "a") as (a, _, _), fake_worker(tmp_path, "c") as (c, rec_c, _), router([a]) as r:
        client = SGLangEngine.at([r], **WATCH)
        assert client.workers() == [a]
        httpx.post(r + "/workers", json={"url": c}, timeout=5).raise_for_status()
        deadline = time.monotonic() + 10
        while c not in _listed(r) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.recall_workers() == [c] and client.fleet.state(c) == REJOINING
        assert _listed(r) == [a] and client.workers() == [a, c]
        client.generate(PROMPTS, PARAMS)
        assert recorded(rec_c) == []
        client.wire.set_version(5)
        assert client.admit_workers(5) == [c] and _listed(r) == sorted([a, c])
        assert client.fleet_metrics()["rollout/worker_rejoins"] == 0  # a new worker, not a rejoin
        client.generate(PROMPTS, PARAMS)
        assert recorded(rec_c)


@pytest.mark.parametrize("via_router", [True, False], ids=["router", "direct"])
def test_answers_made_with_stale_weights_are_never_returned(tmp_path, via_router):
    """b answers with weight_version "0" after the client expects "1": its answers are discarded and
    sent again; b leaves the live set (and the router); every answer returned is a's."""
    with (
        fake_worker(tmp_path, "a", generate_delay=0.2) as (a, rec_a, _),
        fake_worker(tmp_path, "b", generate_delay=0.2) as (b, rec_b, _),
        router([a, b]) as r,
    ):
        client = SGLangEngine.at([r] if via_router else [a, b], max_concurrent_requests=8, **WATCH)
        client.wire.post(a, "/update_weight_version", {"new_version": "1", "abort_all_requests": False})
        before = client.generate(PROMPTS[:4], PARAMS)  # no push yet: any version is accepted
        assert len(before) == 4 and recorded(rec_b)
        n_a, n_b = len(recorded(rec_a)), len(recorded(rec_b))
        client.members.set_expected_version(1)
        out = client.generate(PROMPTS, PARAMS)
        assert len(out) == len(PROMPTS)
        stale = len(recorded(rec_b)) - n_b  # b's answers once "1" was expected
        assert len(recorded(rec_a)) - n_a == len(PROMPTS)  # every answer returned is a's ...
        metrics = client.fleet_metrics()
        assert stale >= 1 and metrics["rollout/stale_responses"] == stale, (stale, metrics)  # ... none of b's
        assert client.fleet.state(b) == REJOINING and "weight_version '0'" in client.fleet._why[b][0]
        assert metrics["rollout/live_workers"] == 1 and metrics["rollout/worker_failures"] == 1, metrics
        if via_router:
            assert _listed(r) == [a]
