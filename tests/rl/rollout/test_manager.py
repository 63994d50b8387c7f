"""The rollout manager's verbs without an RLLoop or a model: the order of the calls the servers see
around an update (colocated or not), what a failed update leaves them with, and when the weight
check runs. The servers' own side of these calls (memory really freed, NaN weights after a resume,
SGLang's refusals) is tested against the stand-in server in tests/rollout/test_colocate.py."""

import pytest

from megatron_klear.config import JobConfig
from megatron_klear.rl.rollout.manager import RolloutManager
from megatron_klear.rl.rollout.placement import Colocated, Dedicated
from megatron_klear.rl.rollout.verify import verification_due
from megatron_klear.rollout.base import ServerEngine


class RecordingServers:
    """Records the calls a placement makes, in order; ``fail_load`` makes the next load raise."""

    memory_tags = ("weights", "kv_cache", "cuda_graph")  # what the engine says its servers can release

    def __init__(self):
        self.calls, self.fail_load = [], False

    def release_memory(self, tags):
        self.calls.append(("release", tuple(tags)))

    def resume_memory(self, tags, workers=None):
        self.calls.append(("resume", tuple(tags)))

    def load_from_disk(self, path, *, version, before_resume=None):
        self.calls.append(("load", path, version))
        if self.fail_load:
            raise RuntimeError("the server is gone")
        if before_resume is not None:  # between the server's load and its continue
            before_resume("w")
            self.calls.append(("continue",))


def _manager(placement, engine):
    cfg = JobConfig()
    cfg.rl.prompts = ["p.jsonl"]
    manager = RolloutManager(cfg)  # not colocated in the config: nothing connects
    manager.placement, manager.engine = placement, engine
    return manager


def test_colocated_servers_release_everything_and_a_load_resumes_the_weights_first():
    servers, place = RecordingServers(), Colocated(offload_trainer=False)
    place.make_room(servers, None)
    assert servers.calls == [("release", ("weights", "kv_cache", "cuda_graph"))]
    place.load(servers, "/w/step_0000001", 1)
    # weights' memory first (SGLang gives it back empty), the load, then the KV cache and CUDA graphs,
    # and only then does the server continue generating
    assert servers.calls[1:] == [
        ("resume", ("weights",)),
        ("load", "/w/step_0000001", 1),
        ("resume", ("cuda_graph", "kv_cache")),
        ("continue",),
    ]
    assert not place.released and not place.weights_lost and place.last_sync == ("/w/step_0000001", 1)
    place.load(servers, "/w/step_0000002", 2)  # nothing released: a plain load, no resume of unreleased tags
    assert servers.calls[5:] == [("load", "/w/step_0000002", 2), ("continue",)]


def test_a_failed_update_reloads_the_last_pushed_weights_and_a_good_one_leaves_the_servers_released():
    servers, place = RecordingServers(), Colocated(offload_trainer=False)
    manager = _manager(place, servers)
    place.load(servers, "/w/step_0000003", 3)
    servers.calls.clear()
    with manager.make_room():
        servers.calls.append(("update",))
    # released before the update, and still released after it: until the push
    assert servers.calls == [("release", ("weights", "kv_cache", "cuda_graph")), ("update",)]
    servers.calls.clear()
    with pytest.raises(ValueError, match="boom"):
        with manager.make_room():
            raise ValueError("boom")
    assert servers.calls == [
        ("release", ("weights", "kv_cache", "cuda_graph")),
        ("resume", ("weights",)),
        ("load", "/w/step_0000003", 3),
        ("resume", ("cuda_graph", "kv_cache")),
    ]
    assert not place.released and not place.weights_lost


def test_a_restore_that_fails_warns_and_the_update_error_is_the_one_raised():
    servers, place = RecordingServers(), Colocated(offload_trainer=False)
    manager = _manager(place, servers)
    place.load(servers, "/w/step_0000001", 1)
    servers.fail_load = True
    with pytest.warns(UserWarning, match=r"could not be given back .* version 1 .*the server is gone"):
        with pytest.raises(MemoryError, match="actor"):
            with manager.make_room():
                raise MemoryError("actor")
    # the weights' memory came back empty and the load failed: the placement says so
    assert place.weights_lost and place.released == {"kv_cache", "cuda_graph"}


def test_before_the_first_push_a_failure_has_nothing_to_restore():
    servers, place = RecordingServers(), Colocated(offload_trainer=False)
    manager = _manager(place, servers)
    with pytest.raises(RuntimeError):
        with manager.make_room():
            raise RuntimeError("the trainer failed to build")
    assert servers.calls == [("release", ("weights", "kv_cache", "cuda_graph"))]


def test_dedicated_servers_are_never_released():
    servers = RecordingServers()
    manager = _manager(Dedicated(), servers)
    with pytest.raises(RuntimeError):
        with manager.make_room():
            raise RuntimeError("x")
    Dedicated().load(servers, "/w/step_0000002", 2)
    assert servers.calls == [("load", "/w/step_0000002", 2)] and Dedicated().before_load(None) == {}


@pytest.mark.parametrize(
    "interval,checked",
    [
        (10, [1, 10, 20]),  # the first push of the process, then every 10 steps
        (0, [1]),  # only the first
        (-1, []),  # never
        (1, list(range(1, 21))),
    ],
)
def test_the_weight_check_runs_after_the_first_push_and_every_interval(interval, checked):
    # push number k of this process comes after RL step k (a fresh run, no step skipped)
    assert [v for v in range(1, 21) if verification_due(v, v, interval, since=v - 1)] == checked
    # rollout.sync_delta: the first delta sync after a full one is checked too (unless never)
    assert verification_due(2, 2, interval, since=1, first_delta=True) == (interval >= 0)


def test_a_resumed_run_checks_its_first_push_whatever_the_step():
    assert verification_due(1, 37, 10) and not verification_due(2, 38, 10) and verification_due(4, 40, 10)


def test_a_check_due_at_a_step_that_pushed_nothing_runs_at_the_next_push():
    # steps 9 and 10 changed no weight (nothing pushed): the check due at step 10 runs after step 11,
    # and the next one at step 20 as in a run without skips
    pushes = [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 20]
    due = [s for k, (prev, s) in enumerate(zip([0] + pushes, pushes)) if verification_due(k + 1, s, 10, since=prev)]
    assert due == [1, 11, 20]


def test_push_weights_checks_only_servers(monkeypatch):
    """The in-process engine is never probed; servers are after the first push and when due."""
    from types import SimpleNamespace

    import megatron_klear.rl.rollout.verify as verify

    checked = []
    monkeypatch.setattr(
        verify, "verify_servers", lambda *a, **k: checked.append(a[4]) or {"weights/verify_mean_diff_max": 0.0}
    )
    manager = _manager(Dedicated(), None)
    manager.actor = manager.tokenizer = manager.vocab_size = None
    manager.weights = SimpleNamespace(push=lambda v: {"weights/sync_bytes": v}, to_servers=False)
    assert manager.push_weights(1, step=1) == {"weights/sync_bytes": 1, "weights/version": 1, "weights/pushed": 1}
    assert checked == []
    manager.cfg.rollout.verify_interval = 2
    manager.weights = SimpleNamespace(push=lambda v: {}, to_servers=True)
    metrics = [manager.push_weights(v, step=v) for v in (2, 3, 4, 5)]
    assert checked == [2, 4] and metrics[0]["weights/verify_mean_diff_max"] == 0.0
    assert "weights/verify_mean_diff_max" not in metrics[1]
    # rollout.sync_delta: the first delta sync after a full one is checked whatever the interval
    checked.clear()
    manager.cfg.rollout.verify_interval = 100
    fulls = iter([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    manager.weights = SimpleNamespace(push=lambda v: {"weights/sync_full": next(fulls)}, to_servers=True)
    for v in range(6, 12):
        manager.push_weights(v, step=v)
    assert checked == [7, 10]


def test_a_version_already_pushed_sends_nothing_and_gives_colocated_servers_their_weights_back():
    """A step that changed no weight: no transfer, no new label; released servers reload the last
    pushed weights (the same version)."""
    from types import SimpleNamespace

    servers, place = RecordingServers(), Colocated(offload_trainer=False)
    manager = _manager(place, servers)
    sent = []
    manager.weights = SimpleNamespace(push=lambda v: sent.append(v) or {}, to_servers=False)
    manager.push_weights(3, step=5)
    place.load(servers, "/w/step_0000003", 3)
    servers.calls.clear()
    with manager.make_room():
        pass  # an update that changed nothing (every token masked)
    assert manager.push_weights(3, step=6) == {"weights/version": 3, "weights/pushed": 0} and sent == [3]
    assert servers.calls == [
        ("release", ("weights", "kv_cache", "cuda_graph")),
        ("resume", ("weights",)),
        ("load", "/w/step_0000003", 3),
        ("resume", ("cuda_graph", "kv_cache")),
    ]


def test_a_version_already_pushed_in_memory_is_pushed_again_to_servers_that_released_it():
    """A step that changed no weight (every token masked; fp16's first overflow) after an in-memory
    push (weight_sync=memory): the servers released weights that only the trainer holds, so the same
    version is pushed again in memory (before: give_back found no directory, warned, and the servers
    generated on released memory)."""
    from types import SimpleNamespace

    servers, place = RecordingServers(), Colocated(offload_trainer=False)
    manager = _manager(place, servers)

    def in_memory(version):  # what InMemoryPush does around its buckets, on one rank
        place.before_load(None)
        place.resume_weights(servers)
        servers.calls.append(("load in memory", version))
        return place.finished_load(servers, version)

    manager.weights = SimpleNamespace(push=in_memory, to_servers=False)
    place.make_room(servers, None)
    manager.push_weights(3, step=5)
    assert place.can_give_back()  # nothing released now
    servers.calls.clear()
    with manager.make_room():
        pass  # an update that changed nothing
    assert not place.can_give_back()
    metrics = manager.push_weights(3, step=6)
    assert metrics["weights/pushed"] == 1 and metrics["weights/repushed"] == 1 and metrics["weights/version"] == 3
    assert servers.calls == [
        ("release", ("weights", "kv_cache", "cuda_graph")),
        ("resume", ("weights",)),
        ("load in memory", 3),
        ("resume", ("cuda_graph", "kv_cache")),
    ]
    assert not place.released and not place.weights_lost


def test_a_version_already_pushed_offloads_the_trainer_before_colocated_servers_take_their_memory_back(monkeypatch):
    """A step that changed no weight, colocated with ``rollout.offload_trainer``: the trainer took its
    gradient buffers and optimizer state back for the update, so it gives them up again before the
    servers resume theirs (before: the servers resumed beside the trainer's full state)."""
    from megatron_klear.training import offload

    servers, place = RecordingServers(), Colocated(offload_trainer=True)
    monkeypatch.setattr(offload, "offload_trainer", lambda state: servers.calls.append(("trainer offloads",)) or 0)
    monkeypatch.setattr(offload, "restore_trainer", lambda state: servers.calls.append(("trainer takes back",)))
    manager = _manager(place, servers)
    place.before_load(None)  # the push of version 3
    place.load(servers, "/w/step_0000003", 3)
    manager.pushed_version = 3
    servers.calls.clear()
    with manager.make_room():
        pass  # an update that changed nothing
    metrics = manager.push_weights(3, step=6)
    assert metrics["weights/pushed"] == 0 and "memory/trainer_offloaded_gb" in metrics
    assert servers.calls == [
        ("release", ("weights", "kv_cache", "cuda_graph")),
        ("trainer takes back",),
        ("trainer offloads",),
        ("resume", ("weights",)),
        ("load", "/w/step_0000003", 3),
        ("resume", ("cuda_graph", "kv_cache")),
    ]


class FleetServers(ServerEngine):
    """A stand-in for a server engine with a fleet: records the rejoin calls around a push."""

    def __init__(self, calls):
        from megatron_klear.rollout.servers.fleet import Fleet

        self.calls, self.fleet = calls, Fleet(["a", "b"])
        self.fleet.lose("b", "killed")

    def _not_in_a_push(self, *args, **kwargs):
        raise AssertionError("a push does not call this")

    generate = update_weights = workers = worker_dtypes = probe = load_from_disk = _not_in_a_push
    check_context_length = check_memory_saver = stream = alive = check_fleet = _not_in_a_push
    wire = property(_not_in_a_push)

    def drop_worker(self, worker, why):
        return self.fleet.lose(worker, why)

    def rejoining_workers(self):
        return list(self.fleet.rejoining())

    def pushing(self):
        return self.fleet.pushing()

    def recall_workers(self):
        self.calls.append(("recall",))
        return ["b"] if self.fleet.recall("b") else []

    def admit_workers(self, version):
        self.calls.append(("admit", version))
        return [w for w in self.fleet.rejoining() if self.fleet.admit(w)]

    def fleet_metrics(self):
        return self.fleet.metrics()


@pytest.mark.parametrize("async_steps,mode", [(0, "abort"), (1, "retract")])
def test_the_pause_mode_of_a_push_follows_the_schedule_and_reaches_the_engine_it_builds(async_steps, mode, monkeypatch):
    import megatron_klear.rollout.factory as factory

    built = []
    monkeypatch.setattr(factory, "make_engine", lambda r, path, **kw: built.append(r) or RecordingServers())
    cfg = JobConfig()
    cfg.rl.prompts, cfg.rl.async_steps = ["p.jsonl"], async_steps
    cfg.rollout.engine, cfg.rollout.urls = "http", ["http://s:1"]  # the older name of sglang
    cfg.rollout.max_new_tokens = 1024
    cfg.validate()  # the mode is derived once, here
    assert (cfg.rollout.engine, cfg.rollout.pause_mode) == ("sglang", mode)
    cfg.rollout.colocate, cfg.rollout.weight_sync = not async_steps, "disk"
    monkeypatch.setattr(RecordingServers, "check_memory_saver", lambda self: None, raising=False)
    if cfg.rollout.colocate:
        RolloutManager(cfg)  # colocated: the engine is built at once, from the section
        assert [r.pause_mode for r in built] == [mode]


def test_a_push_recalls_lost_workers_includes_them_probes_them_whatever_the_interval_then_admits(monkeypatch):
    from types import SimpleNamespace

    import megatron_klear.rl.rollout.verify as verify

    calls = []
    engine = FleetServers(calls)
    manager = _manager(Dedicated(), engine)
    manager.actor = manager.tokenizer = manager.vocab_size = None
    manager.cfg.rollout.verify_interval = -1  # never due: the rejoining worker is still probed
    monkeypatch.setattr(
        verify, "verify_servers", lambda *a, **k: calls.append(("verify", a[4], k["only_rejoining"])) or {}
    )
    manager.weights = SimpleNamespace(
        push=lambda v: calls.append(("push", v, engine.fleet.serving())) or {}, to_servers=True
    )
    metrics = manager.push_weights(5, step=5)
    assert calls == [("recall",), ("push", 5, ["a", "b"]), ("verify", 5, True), ("admit", 5)]
    assert engine.fleet.live() == ["a", "b"]
    assert metrics["rollout/live_workers"] == 2 and metrics["rollout/worker_rejoins"] == 1
    assert metrics["rollout/worker_failures"] == 1  # the start-up push carries the loss before it
    calls.clear()
    manager.push_weights(6, step=6)  # nobody rejoining, check not due: no probe
    assert calls == [("recall",), ("push", 6, ["a", "b"]), ("admit", 6)]


def test_after_an_in_memory_push_a_failed_update_leaves_the_servers_released_and_says_so():
    """weight_sync=memory keeps no directory: a failed update cannot reload the last weights, so the
    servers stay released (nothing is loaded, nothing resumed: resumed weights would be NaN) and a
    warning says until when; a push from disk afterwards is restorable again."""
    servers, place = RecordingServers(), Colocated(offload_trainer=False)
    manager = _manager(place, servers)
    place.release_servers(servers)
    place.resume_weights(servers)  # an in-memory push: weights back, buckets loaded, then the rest
    place.finished_load(servers, 1)
    servers.calls.clear()
    with pytest.warns(UserWarning, match=r"keeps no copy to reload\): the servers stay released"):
        with pytest.raises(RuntimeError):
            with manager.make_room():
                raise RuntimeError("the update failed")
    assert servers.calls == [("release", ("weights", "kv_cache", "cuda_graph"))]  # no load, no resume
    place.load(servers, "/w/step_0000002", 2)
    servers.calls.clear()
    with pytest.raises(RuntimeError):
        with manager.make_room():
            raise RuntimeError("again")
    assert ("load", "/w/step_0000002", 2) in servers.calls  # from disk: given back


def test_a_server_whose_log_probs_are_nan_cannot_pass_the_probe():
    """A NaN-logit server (NaN weights, a delta that wrote the NaN of its unchanged elements) gives
    NaN log-probs: a NaN or infinite difference is a mismatch (``not mean <= tolerance``), never
    a pass by a comparison that is false for NaN."""
    import math

    from megatron_klear.rl.rollout.verify import first_mismatch

    workers = ["http://a", "http://b", "http://c"]
    diffs = [(1e-6, 1e-5, 16), (math.nan, math.nan, 16), (math.inf, math.inf, 16)]
    assert first_mismatch(workers, diffs, [1e-3] * 3)[0] == "http://b"
    assert first_mismatch(workers[2:], diffs[2:], [1e-3])[0] == "http://c"
    assert first_mismatch(workers[:1], diffs[:1], [1e-3]) is None


def test_after_a_stop_signal_nothing_is_pushed_and_the_step_says_so():
    """A stop signal during an update (interrupt() from the signal's thread): the update's weights are
    not pushed (the run saves and ends; the servers stop with the job; a resumed run pushes at
    start-up), the servers see no call, and the metrics name the skip; before the signal the same
    manager pushes."""
    from types import SimpleNamespace

    servers = RecordingServers()
    manager = _manager(Dedicated(), servers)
    sent = []
    manager.weights = SimpleNamespace(push=lambda v: sent.append(v) or {}, to_servers=False)
    assert manager.push_weights(1, step=1)["weights/pushed"] == 1 and sent == [1]
    manager.interrupt()  # (rank 0 of no distributed world, no batch in flight)
    metrics = manager.push_weights(2, step=2)
    assert metrics == {"weights/version": 1, "weights/pushed": 0, "weights/skipped_on_stop": 1}
    assert sent == [1] and servers.calls == [] and manager.pushed_version == 1
