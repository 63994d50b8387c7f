"""Whole RL runs on a rollout fleet that loses servers and gets them back (issue 21): two stand-in
SGLang servers behind the real sglang-router, killed (SIGKILL), frozen (SIGSTOP) and restarted at
their URL while the run goes on, by a director thread that watches the run's metrics JSONL and the
servers' request logs (tests/distributed/fleet_harness.py). Each server is a process of its own,
forked warm by one zygote per module (tests/distributed/fleet_server.py), so that a restart takes a
second rather than the 10-30 s of importing torch.

What must hold: the run finishes every step (every metrics line is there) while one server
remains; the step's metrics count the failures and the rejoins; no step trains on responses of
stale weights (the engine's sampling log-probs equal the trainer's recompute, every trained
step); a server restarted at its URL rejoins and ends with the trainer's final weights (its greedy
log-probs equal the trainer's, computed here from the final weights in float64); with every server
gone the step fails in bounded time with one error line naming them; a seeded chaos of kills and
restarts over 10 steps loses no step and leaves every server at the final version."""

import os
import random
import time

import pytest

from tests.distributed.fleet_harness import (
    Director,
    Server,
    Zygote,
    get_json,
    greedy_probe,
    probe_logprobs,
    read_metrics,
    router_flags,
    run_rl,
)
from tests.distributed.helper import TOY_RL_TRAINING, run_distributed

PROBE = [5, 17, 33, 60, 7]
# the watchdog at test pace: a frozen server is dropped within 2 x (0.5 + 3) s. (A /health probe of a
# busy server waits for its next decode step, SGLang's health generation: over 1 s on a loaded 2-core
# machine now and then, so 3 s, not 1, keeps a healthy server from being dropped.)
HEALTH = [
    "rollout.health_check_interval_s=0.5",
    "rollout.health_check_timeout_s=3",
    "rollout.health_failure_threshold=2",
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("fleet")
    model = make_tiny_qwen3(str(root / "m"), num_layers=2, seed=21)
    prompts = write_rl_prompts_jsonl(str(root / "prompts.jsonl"), 48, seed=3)
    zygote = Zygote(model, str(root)).wait_ready()
    try:
        yield {"model": model, "prompts": prompts, "root": str(root), "zygote": zygote}
    finally:
        zygote.close()


def _servers(fleet, tag, **kw):
    workdir = os.path.join(fleet["root"], tag)
    os.makedirs(workdir, exist_ok=True)
    servers = [Server(fleet["zygote"], workdir, name, **kw) for name in ("a", "b")]
    for s in servers:
        s.start()
    for s in servers:
        s.wait_healthy()
    return servers


def _args(fleet, save, router_url, steps, weight_sync):
    """A small RL job on the fleet: 4 prompts x 8 responses of 32 tokens per step, every group
    trained whether or not its rewards differ (rl.filter_zero_spread=false: every step trains and
    pushes its version; the weights change on the steps where a group has reward spread), every
    request in flight at once, the watchdog at test pace, the servers checked against the trainer
    after every push (rollout.verify_interval=1)."""
    return [
        f"model.path={fleet['model']}",
        f"rl.prompts=[{fleet['prompts']}]",
        f"train.save_dir={save}",
        f"train.steps={steps}",
        "train.save_interval=0",
        "rl.prompts_per_step=4",
        "rl.filter_zero_spread=false",
        "rl.responses_per_prompt=8",
        "rl.mini_batch_prompts=2",
        "rl.max_tokens_per_micro_batch=512",
        "rl.max_prompt_length=64",
        "rollout.max_new_tokens=32",
        *TOY_RL_TRAINING,
        "rollout.engine=sglang",
        f"rollout.urls=[{router_url}]",
        "rollout.max_concurrent_requests=8",
        f"rollout.weight_sync={weight_sync}",
        "rollout.control_timeout_s=3",
        "rollout.generate_timeout_s=120",
        "rollout.weight_update_timeout_s=20",
        "rollout.sync_group_timeout_s=10",
        "rollout.sync_bucket_timeout_s=5",
        "rollout.verify_interval=1",
        *HEALTH,
    ]


def _pushed(lines) -> int:
    """The weight version the servers should hold: the last step's (the steps that changed the
    weights), checked against the steps that made an optimizer step, counted here."""
    if not lines:
        return 0
    version = lines[-1]["weights/version"]
    trained = sum(1 for m in lines if m.get("actor/optimizer_steps"))
    assert version == trained, [(m["step"], m.get("actor/optimizer_steps"), m["weights/version"]) for m in lines]
    return version


def _total(lines, key) -> int:
    """A per-step count summed over the run (the metrics carry each step's own events)."""
    missing = [m["step"] for m in lines if key not in m]
    assert not missing, f"{key} missing from the metrics of steps {missing}"
    return sum(int(m[key]) for m in lines)


def _rejoined(d: Director, server: Server):
    """``server`` is back with the current weights: running, holding the version of the last push,
    whose step's metrics line is written (the push, its probe check and the admission are over).
    Returns that line's write time."""
    lines = d.steps()
    try:
        current = server.running() and server.weight_version() == str(_pushed(lines)) and _pushed(lines) > 0
    except OSError:
        return None
    return os.stat(d.metrics_path).st_mtime if current and len(d.steps()) == len(lines) else None


def _kill_mid_rollout(d: Director, server: Server, after: float) -> None:
    d.mid_rollout(server, after)
    time.sleep(0.2)  # its batch is decoding (token_delay): the answers are lost with the process
    server.kill()
    d.note(f"killed {server.name} mid-rollout after step {len(d.steps())}")


def _check_steps_and_samples(lines, steps):
    assert [m["step"] for m in lines] == list(range(1, steps + 1)), [m["step"] for m in lines]
    for m in lines:
        # trained on responses of the pushed weights: a sample from a server left with older weights
        # would differ here by far more (wherever the step before changed the weights)
        if m.get("actor/optimizer_steps"):
            assert m["actor/logprob_mismatch_max"] < 1e-3, (m["step"], m["actor/logprob_mismatch_max"])


def _holds_trainer_weights(fleet, servers, trainer_w):
    """Every server's greedy log-probs of the probe equal the trainer's final weights' (float64 here),
    and differ from the checkpoint's: the check would catch a server left with its start-up weights."""
    for s in servers:
        tokens, got = greedy_probe(s.url, PROBE)
        want = probe_logprobs(fleet["model"], trainer_w, PROBE, tokens)
        start = probe_logprobs(fleet["model"], None, PROBE, tokens)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (s.name, got, want)
        assert max(abs(a - b) for a, b in zip(got, start)) > 1e-3, (s.name, "the run did not change the weights")


def test_the_harness_kills_freezes_and_restarts_a_server_at_its_url_and_sees_its_requests(fleet):
    """What the run tests rely on: a request in flight is seen unanswered in the server's log; a
    killed server's connections fail at once; a frozen one answers nothing until continued; a
    restart serves the same URL from a new process with the checkpoint's weights."""
    import threading
    import urllib.error

    server = Server(fleet["zygote"], fleet["root"], "harness", token_delay=0.05).start().wait_healthy()
    try:
        first_pid, outcome = server.pid, {}

        def generate():
            try:
                outcome["answer"] = greedy_probe(server.url, PROBE, max_new_tokens=40)
            except (OSError, urllib.error.URLError) as e:
                outcome["error"] = e

        thread = threading.Thread(target=generate)
        since = time.time() - 1
        thread.start()
        deadline = time.monotonic() + 20
        while not server.unanswered(("/generate",), since) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [e["path"] for e in server.unanswered(("/generate",), since)] == ["/generate"]
        server.kill()
        thread.join(10)
        assert "error" in outcome and "answer" not in outcome, outcome  # 40 tokens x 50 ms: killed first
        assert not server.running() and not server.healthy()
        server.start().wait_healthy(10)
        assert server.pid != first_pid and get_json(server.url + "/model_info")["weight_version"] == "default"
        tokens, logprobs = greedy_probe(server.url, PROBE)
        assert (
            len(tokens) == 6
            and max(abs(a - b) for a, b in zip(logprobs, probe_logprobs(fleet["model"], None, PROBE, tokens))) < 1e-4
        )
        server.freeze()
        assert server.running() and not server.healthy()  # (2 s without an answer)
        server.thaw()
        assert server.healthy()
        assert {e["pid"] for e in server.events()} == {first_pid, server.pid}
    finally:
        server.close()
    assert not server.running()


def test_disk_sync_fleet_survives_kills_a_freeze_and_a_kill_mid_sync_and_the_servers_rejoin(fleet):
    """rollout.weight_sync=disk, 8 steps. Step 2: server a SIGKILLed mid-rollout, restarted at its
    URL after that step. Once a is back: server b SIGKILLed mid-sync (while it holds the reload call),
    restarted. Once b is back: a SIGSTOPped mid-rollout, continued after that step. Every step is
    in the metrics, the failures (3) and rejoins (3) are counted, and at the end both servers hold
    the trainer's final weights."""
    from tests.rollout.processes import router

    servers = _servers(fleet, "disk", token_delay=0.02, route_delays={"/update_weights_from_disk": 0.3})
    a, b = servers
    save = os.path.join(fleet["root"], "disk", "run")
    metrics_path = os.path.join(save, "metrics.jsonl")
    steps = 8  # 7 with every event at its earliest step, and one step of slack

    def script(d: Director):
        _kill_mid_rollout(d, a, d.wait_step(1))
        # held from inside step 2: step 3 starts once a is back, so a rejoins at step 3's push however
        # slowly it restarts on a busy machine
        with d.holding():
            d.wait_step(2)  # (restarted at once, a could be back before anything noticed it had gone)
            a.start().wait_healthy()
        d.note("restarted a after step 2")
        t = d.wait(lambda: _rejoined(d, a), 120, "a rejoined after its restart", poll_s=0.2)
        d.note(f"a rejoined by step {len(d.steps())}")
        path = d.mid_sync(b, t, routes=("/update_weights_from_disk",))
        with d.holding():  # (held from inside that push) b rejoins at the next step's push
            b.kill()
            d.note(f"killed b mid-sync ({path}) after step {len(d.steps())}")
            b.start().wait_healthy()
        t = d.wait(lambda: _rejoined(d, b), 120, "b rejoined after its restart", poll_s=0.2)
        d.note(f"b rejoined by step {len(d.steps())}")
        d.mid_rollout(a, t)
        time.sleep(0.2)
        a.freeze()
        k = len(d.steps())
        d.note(f"froze a mid-rollout after step {k}")
        d.wait_step(k + 1)
        a.thaw()
        d.note(f"thawed a after step {k + 1}")
        d.wait(lambda: _rejoined(d, a), 120, "a rejoined after its freeze", poll_s=0.2)
        d.note(f"a rejoined by step {len(d.steps())}")

    try:
        with router([s.url for s in servers], extra=router_flags()) as router_url:
            director = Director(script, metrics_path)
            _, trainer_w = director.during(
                run_distributed, run_rl, 1, _args(fleet, save, router_url, steps, "disk"), timeout=240
            )[0]
            lines = read_metrics(metrics_path)
            _check_steps_and_samples(lines, steps)
            assert _total(lines, "rollout/worker_failures") == 3, (director.actions, lines)
            assert _total(lines, "rollout/worker_rejoins") == 3, (director.actions, lines)
            assert lines[-1]["rollout/live_workers"] == 2, lines[-1]
            last = _pushed(lines)
            assert last == steps, lines
            for s in servers:
                assert s.weight_version() == str(last), (s.name, s.weight_version(), last)
            _holds_trainer_weights(fleet, servers, trainer_w)
            assert (a.starts, b.starts) == (2, 2)
    finally:
        for s in servers:
            s.close()


def test_distributed_sync_survives_a_kill_mid_sync_then_fails_naming_every_lost_server(fleet):
    """rollout.weight_sync=distributed. After step 1, server b is SIGKILLed while it holds
    /update_weights_from_distributed (the trainer is broadcasting to the group), then restarted: the
    sync finishes with a alone and b rejoins through a new group (its greedy log-probs then equal
    a's). In the rollout of the step after, a is SIGKILLed and b SIGSTOPped at once: that step fails
    within the watchdog's bound with one error line naming both servers."""
    from tests.rollout.processes import router

    servers = _servers(fleet, "dist", token_delay=0.02, route_delays={"/update_weights_from_distributed": 0.3})
    a, b = servers
    save = os.path.join(fleet["root"], "dist", "run")
    metrics_path = os.path.join(save, "metrics.jsonl")
    seen = {}

    def script(d: Director):
        path = d.mid_sync(b, d.wait_step(1), routes=("/update_weights_from_distributed",))
        with d.holding():  # (held from inside that push) b rejoins at the next step's push
            b.kill()
            d.note(f"killed b mid-sync ({path}) after step {len(d.steps())}")
            b.start().wait_healthy()
        d.wait(lambda: _rejoined(d, b), 120, "b rejoined after its restart", poll_s=0.2)
        # the probes must see one weight version on both servers: the loop goes on pushing meanwhile,
        # so they are taken again when a push (or a step's end) fell between them
        for _ in range(40):
            k = len(d.steps())
            seen["versions"] = (a.weight_version(), b.weight_version())
            seen["probes"] = [greedy_probe(s.url, PROBE) for s in servers]
            seen["versions_after"] = (a.weight_version(), b.weight_version())
            seen["probed_after"] = k
            if seen["versions"] == seen["versions_after"] == (str(k), str(k)) and len(d.steps()) == k:
                break
            time.sleep(0.05)
        d.note(f"b rejoined by step {k}; probed both")
        # the next step's rollout (the probes above may have outlasted this one's), before its push
        d.mid_rollout(a, d.wait_step(k + 1))
        time.sleep(0.2)
        a.kill()
        b.freeze()
        seen["gone_at"], seen["gone_after"] = time.monotonic(), len(d.steps())
        d.note(f"killed a and froze b mid-rollout after step {seen['gone_after']}")

    try:
        with router([s.url for s in servers], extra=router_flags()) as router_url:
            director = Director(script, metrics_path)
            with pytest.raises(RuntimeError) as failure:
                director.during(
                    run_distributed, run_rl, 1, _args(fleet, save, router_url, 8, "distributed"), timeout=240
                )
            failed_at = time.monotonic()
    finally:
        for s in servers:
            s.close()
    assert "gone_at" in seen, (director.actions, str(failure.value)[-3000:])
    # the watchdog: 2 missed probes 0.5 s apart, each up to 3 s, plus the control timeout (3 s) and the
    # process teardown; a hang would last rollout.generate_timeout_s (120 s)
    assert failed_at - seen["gone_at"] < 20, (failed_at - seen["gone_at"], director.actions, str(failure.value)[-2000:])
    error_line = [ln for ln in str(failure.value).strip().splitlines() if ln.strip()][-1]
    assert a.url in error_line and b.url in error_line, str(failure.value)[-3000:]
    lines = read_metrics(metrics_path)
    _check_steps_and_samples(lines, seen["gone_after"])
    assert _total(lines, "rollout/worker_failures") == 1, lines
    assert _total(lines, "rollout/worker_rejoins") == 1, lines
    # b, restarted with the checkpoint's weights, rejoined with the pushed ones: a's, version for version
    version = str(seen["probed_after"])  # every step pushes its version (rl.filter_zero_spread=false)
    assert seen["versions"] == seen["versions_after"] == (version, version), (seen, version)
    (tokens_a, lp_a), (tokens_b, lp_b) = seen["probes"]
    assert tokens_a == tokens_b and max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-5, seen["probes"]
    start = probe_logprobs(fleet["model"], None, PROBE, tokens_b)
    assert max(abs(x - y) for x, y in zip(lp_b, start)) > 1e-3, "the run did not change the weights"


def test_seeded_chaos_of_kills_and_restarts_loses_no_step(fleet):
    """10 steps, rollout.weight_sync=distributed. A seeded RNG plans three kills: each waits until
    both servers hold the current weights (one always remains), lets 0 or 1 more step pass, then
    SIGKILLs one server (which one: seeded) mid-rollout, mid-sync or at once (whatever is running),
    and restarts it at once or after the next step. No step is lost, the run ends in bounded time,
    the three failures and three rejoins are counted, and both servers end at the final version."""
    from tests.rollout.processes import router

    rng = random.Random(2105)
    plan = [
        (rng.choice(["rollout", "sync", "now"]), rng.choice("ab"), rng.choice([0, 1]), rng.choice([0, 1]))
        for _ in range(3)
    ]  # (when, whom, idle steps first, restart after the next step)
    servers = _servers(fleet, "chaos", token_delay=0.01, route_delays={"/update_weights_from_distributed": 0.3})
    by_name = {s.name: s for s in servers}
    save = os.path.join(fleet["root"], "chaos", "run")
    metrics_path = os.path.join(save, "metrics.jsonl")
    steps, done = 10, []

    def script(d: Director):
        for when, name, idle, later in plan:
            d.wait(
                lambda: all(_rejoined(d, s) for s in servers), 120, "both servers at the current version", poll_s=0.2
            )
            t = d.wait_step(len(d.steps()) + idle)
            k = len(d.steps())
            assert k <= 6, f"the chaos reached step {k}: too few steps left to rejoin ({d.actions})"
            who = by_name[name]
            if when == "rollout":
                d.mid_rollout(who, t)
            elif when == "sync":
                d.mid_sync(who, t, routes=("/update_weights_from_distributed",))
            who.kill()
            done.append((k + 1, when, name))
            d.note(f"killed {name} ({when}) in step {k + 1}")
            if later:
                d.wait_step(k + 1)
            with d.holding():  # a slow restart (a busy machine) costs no step of the run
                who.start().wait_healthy()
            d.note(f"restarted {name} after step {len(d.steps())}")

    t0 = time.monotonic()
    try:
        with router([s.url for s in servers], extra=router_flags()) as router_url:
            director = Director(script, metrics_path)
            director.during(
                run_distributed, run_rl, 1, _args(fleet, save, router_url, steps, "distributed"), timeout=300
            )
            wall = time.monotonic() - t0
            lines = read_metrics(metrics_path)
            _check_steps_and_samples(lines, steps)
            assert _total(lines, "rollout/worker_failures") == 3, (done, director.actions)
            assert _total(lines, "rollout/worker_rejoins") == 3, (done, director.actions)
            assert lines[-1]["rollout/live_workers"] == 2, lines[-1]
            for s in servers:
                assert s.running() and s.weight_version() == str(steps), (s.name, done, director.actions)
            assert wall < 180, (wall, director.actions)
    finally:
        for s in servers:
            s.close()
