"""rollout.weight_sync=distributed, the trainer side: :class:`DistributedWeightSync` at TP=2 and PP=2
broadcasts every HF tensor, in buckets, to two embedded servers (subprocesses speaking SGLang's
protocol over gloo), which then hold exactly the trainer's weights under the new version. Faults end
in a clear error in bounded time with nothing half-applied served: a server killed mid-broadcast, a
port already taken, a server that never joins. Every control body follows SGLang 0.5.23's request
structs (``io_struct.py``)."""

import contextlib
import os
import signal
import socket
import time

import httpx
import pytest

from tests.distributed.helper import run_distributed
from tests.rollout.processes import fake_worker, recorded


def _sync(rank, world, model_dir, overrides, urls, kwargs, kill=None, versions=(1,), double=False):
    """Build the trainer, sync ``versions`` one after another; ``kill=(pid, k)``: SIGKILL that
    server once bucket ``k`` is gathered (bucket ``k-1`` may still be on the wire); ``double``:
    every parameter times 2 (exact) before each sync after the first. Returns ("ok", stats) or
    ("error", message, seconds)."""
    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel
    from megatron_klear.rollout.base import FleetError
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.weight_sync import DistributedWeightSync, WeightSyncError
    from megatron_klear.training.setup import build_training_state

    cfg = load_config(None, [f"model.path={model_dir}", *overrides])
    init_parallel(cfg.parallel)
    state = build_training_state(cfg, total_steps=1)
    kwargs = dict(kwargs)
    min_live = kwargs.pop("min_live_workers", 1)
    if kill is not None:
        from megatron_klear.rollout.weight_sync import (
            distributed_buckets as weight_sync,
        )  # where the sync reads iter_buckets

        pid, at, buckets = *kill, weight_sync.iter_buckets

        def buckets_and_kill(named, bucket_bytes):
            for k, bucket in enumerate(buckets(named, bucket_bytes), 1):
                if k == at:
                    os.kill(pid, signal.SIGKILL)
                yield bucket

        weight_sync.iter_buckets = buckets_and_kill
    engine = SGLangEngine.at(urls, control_timeout_s=5, min_live_workers=min_live) if rank == 0 else None
    sync = DistributedWeightSync(state.model, engine, **kwargs)
    t0 = time.monotonic()
    try:
        stats = []
        for k, v in enumerate(versions):
            if double and k:
                import torch

                with torch.no_grad():
                    for chunk in state.model:
                        for p in chunk.parameters():
                            p.mul_(2)
            stats.append(sync.sync(version=v))
    except (WeightSyncError, FleetError) as e:
        return ("error", str(e), time.monotonic() - t0)
    finally:
        sync.close()
    return ("ok", stats)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("dsync")
    return {
        "a": make_tiny_qwen3(str(root / "a"), num_layers=4, seed=5),  # what the servers start with
        "b": make_tiny_qwen3(str(root / "b"), num_layers=4, seed=6),
    }  # the trainer's weights


def _launch(model, n=2):
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine

    servers = []
    try:
        for _ in range(n):
            servers.append(EmbeddedHTTPEngine.launch(model, weight_sync_timeout=20, startup_timeout=120))
    except BaseException:
        for s in servers:
            s.close()
        raise
    return servers


@pytest.fixture(scope="module")
def servers(models):
    servers = _launch(models["a"])
    yield servers
    for s in servers:
        s.close()


def _checksums(url):
    return httpx.get(url + "/weights_checker", timeout=60).json()["ranks"][0]["checksums"]


def _version(url):
    return httpx.get(url + "/model_info", timeout=10).json()["weight_version"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra,load_format",
    [(["parallel.tp=2"], "flattened_bucket"), (["parallel.pp=2"], "auto")],
    ids=["tp2-flattened", "pp2-per-tensor"],
)
def test_every_server_gets_every_weight(models, servers, extra, load_format):
    import torch

    from megatron_klear.checkpoint.hf_io import HFReader
    from megatron_klear.rollout.embedded import EmbeddedEngine
    from megatron_klear.rollout.sglang import SGLangEngine

    urls = [s.url for s in servers]
    SGLangEngine.at(urls).load_from_disk(models["a"], version="a")
    engine = EmbeddedEngine.from_pretrained(models["b"])
    with torch.no_grad():  # what the second sync sends: the trainer doubles every weight in between
        for p in engine.model.parameters():
            p.mul_(2)
    want = engine.weights.checksums()
    assert _checksums(urls[0]) != want
    # small buckets: many of them, each gathered while the previous one is on the wire; the second
    # sync (per tensor) announces each bucket before gathering it and streams its tensors
    out = run_distributed(
        _sync,
        2,
        models["b"],
        extra,
        urls,
        {"bucket_mb": 0.02, "group_timeout": 30, "bucket_timeout": 30, "load_format": load_format},
        None,
        (3, 4),
        True,
    )
    assert out[0][0] == "ok", out[0]
    reader = HFReader(models["b"])
    total = sum(reader.get(k).numel() * reader.get(k).element_size() for k in reader.keys())
    for stats in out[0][1]:
        assert stats["bytes"] == total and stats["buckets"] >= 10, stats
    stages = 2 if "parallel.pp=2" in extra else 1
    assert [s["streamed_stages"] for s in out[0][1]] == [0, 0 if load_format == "flattened_bucket" else stages]
    for u in urls:
        assert _checksums(u) == want
        assert _version(u) == "4"
        assert httpx.get(u + "/ready").status_code == 200  # generation continued


@pytest.mark.slow
def test_a_server_killed_mid_broadcast_below_min_live_fails_the_sync_and_the_other_serves_the_old_weights(models):
    """With rollout.min_live_workers=2 the survivor alone is too few: the sync fails naming the
    lost server (tests/distributed/test_distributed_sync_fleet.py: with 1, it completes on the survivor)."""
    from megatron_klear.rollout.base import SamplingParams
    from megatron_klear.rollout.embedded import EmbeddedEngine
    from megatron_klear.rollout.sglang import SGLangEngine

    servers = _launch(models["a"])
    try:
        urls = [s.url for s in servers]
        before = _checksums(urls[0])
        t0 = time.monotonic()
        out = run_distributed(
            _sync,
            1,
            models["b"],
            [],
            urls,
            {"bucket_mb": 0.02, "group_timeout": 30, "bucket_timeout": 30, "min_live_workers": 2},
            (servers[1]._process.pid, 3),
        )
        assert time.monotonic() - t0 < 120
        status, message, seconds = out[0]
        assert status == "error" and urls[1] in message and "stays paused" in message, out[0]
        assert "fewer than rollout.min_live_workers = 2" in message, message
        assert seconds < 30, seconds
        # the survivor applied nothing: old weights, old version; it is paused until told otherwise
        assert _checksums(urls[0]) == before and _version(urls[0]) == "default"
        assert httpx.get(urls[0] + "/ready").status_code == 503
        client = SGLangEngine.at([urls[0]], control_timeout_s=10)
        client.wire.resume()
        greedy = SamplingParams(top_k=1, max_new_tokens=6)
        got = client.generate([[5, 17, 33]], greedy)[0][0].token_ids
        assert got == EmbeddedEngine.from_pretrained(models["a"]).generate([[5, 17, 33]], greedy)[0][0].token_ids
    finally:
        for s in servers:
            s.close()


def test_a_port_already_taken_is_named(models, servers):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        out = run_distributed(
            _sync, 1, models["b"], [], [s.url for s in servers], {"master_port": port, "group_timeout": 30}
        )
        assert time.monotonic() - t0 < 90
    status, message, seconds = out[0]
    assert status == "error" and f"port {port} is already in use" in message and "rollout.sync_master_port" in message
    assert seconds < 10, seconds
    # (bind(0) handed out an ephemeral port: the message says why such a port is a poor fixed choice)
    assert "ephemeral range" in message, message


def test_a_server_that_never_joins_is_named_within_the_group_timeout(models, tmp_path):
    from tests.rollout.sglang_contract import control_contract_errors

    with (
        fake_worker(tmp_path, "tp2", tp_size=2) as (joins, rec_joins, _),
        fake_worker(tmp_path, "hangs", hang_init=True) as (hangs, rec_hangs, _),
    ):
        out = run_distributed(_sync, 1, models["b"], [], [joins, hangs], {"group_timeout": 3})
    status, message, seconds = out[0]
    assert status == "error" and f"{hangs} never joined" in message and joins not in message.split("never joined")[0]
    assert "rollout.sync_group_timeout_s=3" in message
    assert seconds < 15, seconds
    # ranks: the trainer is 0, the TP=2 server 1-2, the other one 3
    first = recorded(rec_joins, "/init_weights_update_group")[0]
    assert (first["rank_offset"], first["world_size"]) == (1, 4)
    assert recorded(rec_hangs, "/init_weights_update_group")[0]["rank_offset"] == 3
    for rec in (rec_joins, rec_hangs):
        for path in ("/init_weights_update_group", "/destroy_weights_update_group"):
            for body in recorded(rec, path):
                assert not control_contract_errors(path, body), (path, body)


def test_control_calls_follow_sglangs_request_structs(tmp_path):
    import json

    from megatron_klear.rollout.sglang import SGLangEngine
    from tests.rollout.sglang_contract import CONTROL_ROUTES, control_contract_errors

    with fake_worker(tmp_path) as (url, record, _):
        e = SGLangEngine.at([url], control_timeout_s=5)
        e.wire.pause("abort")
        e.wire.begin()
        e.wire.receive_bucket(
            ["a.weight", "b.weight"],
            ["bfloat16", "bfloat16"],
            [[2, 3], [4]],
            group_name="g",
            load_format="flattened_bucket",
            timeout=5,
        )
        e.wire.end()
        e.wire.set_version(7)
        e.wire.resume()
        e.members.check_weight_versions(7)
        e.load_from_disk("/some/dir", version=8)
        e.release_memory(["weights", "kv_cache", "cuda_graph"])  # rollout.colocate
        e.resume_memory(["weights"])
        e.resume_memory(["kv_cache", "cuda_graph"])
        e.release_memory()
        calls = [json.loads(line) for line in open(record)]
    posts = [(c["path"], c["body"]) for c in calls if c["method"] == "POST"]
    assert [p for p, _ in posts[:6]] == [
        "/pause_generation",
        "/begin_weight_update",
        "/update_weights_from_distributed",
        "/end_weight_update",
        "/update_weight_version",
        "/continue_generation",
    ]
    for path, body in posts:
        if path == "/flush_cache":  # once before the disk load; SGLang's route takes no body
            assert body is None
            continue
        assert path in CONTROL_ROUTES, path
        assert not control_contract_errors(path, body), (path, body, control_contract_errors(path, body))
    assert posts[2][1]["names"] == ["a.weight", "b.weight"] and posts[2][1]["shapes"] == [[2, 3], [4]]
    assert posts[4][1] == {"new_version": "7", "abort_all_requests": False}
    memory = [(p, b) for p, b in posts if p.endswith("_memory_occupation")]
    assert memory == [
        ("/release_memory_occupation", {"tags": ["weights", "kv_cache", "cuda_graph"]}),
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
        ("/release_memory_occupation", {}),
    ], memory
    # one kept-alive connection for every control call (a fresh client per call cost ~20 ms each)
    assert len({tuple(c["client"]) for c in calls}) == 1, {tuple(c["client"]) for c in calls}


def _sync_with_a_stale_layout(rank, world, model_dir, urls, bucket):
    """Sync version 1, then corrupt the recorded layout (the first tensor of ``bucket`` renamed), sync
    2 (must fail), then sync 3. Returns (error of 2, seconds it took, versions served after 2, stats
    of 3, the index of the renamed tensor)."""
    import time

    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.weight_sync import DistributedWeightSync, WeightSyncError
    from megatron_klear.training.setup import build_training_state

    cfg = load_config(None, [f"model.path={model_dir}"])
    init_parallel(cfg.parallel)
    state = build_training_state(cfg, total_steps=1)
    engine = SGLangEngine.at(urls, control_timeout_s=5)
    sync = DistributedWeightSync(state.model, engine, bucket_mb=0.02, group_timeout=30, bucket_timeout=30)
    try:
        sync.sync(version=1)
        layout = sync.buckets.layouts[0]
        assert len(layout) > bucket
        layout[bucket][0][0] += ".stale"
        index = sum(len(meta[0]) for meta in layout[:bucket])
        t0 = time.monotonic()
        try:
            sync.sync(version=2)
            error = None
        except WeightSyncError as e:
            error = str(e)
        seconds = time.monotonic() - t0
        served = engine.members.weight_versions()
        engine.wire.resume()  # (paused by the failed sync)
        return error, seconds, served, sync.sync(version=3), index
    finally:
        sync.close()


@pytest.mark.parametrize("bucket", [0, 1], ids=["first-bucket", "second-bucket-posted-early"])
def test_a_stale_layout_fails_the_sync_cleanly_and_the_next_one_gathers_again(models, servers, bucket):
    """The streamed schedule announces each bucket from the last sync's layout; should the
    tensors ever stop following it, the sync fails at once (the announced bucket, and the next
    one when rank 0 already posted it, are completed with zeros so no server waits for its
    timeout), nothing is applied, and the next sync records the layout afresh."""
    from megatron_klear.rollout.embedded import EmbeddedEngine

    urls = [s.url for s in servers]
    ((error, seconds, served, stats, index),) = run_distributed(_sync_with_a_stale_layout, 1, models["b"], urls, bucket)
    assert error is not None and f"no longer follow the layout of the last sync: tensor {index} " in error, error
    assert seconds < 20, seconds  # not the 30 s bucket timeout
    assert set(served.values()) == {"1"}  # version 2 was never applied
    assert stats["streamed_stages"] == 0  # gathered whole again, recording a new layout
    want = EmbeddedEngine.from_pretrained(models["b"]).weights.checksums()
    for u in urls:
        assert _version(u) == "3" and _checksums(u) == want


def _nudge(model_chunks, version: int, stride: int) -> None:
    """A few elements of every parameter move (every ``stride``-th from ``version``): a sparse step."""
    import torch

    with torch.no_grad():
        for chunk in model_chunks:
            for p in chunk.parameters():
                p.view(-1)[version::stride].add_(0.25)


def _full_sync(model_chunks, url, version, keys) -> None:
    """One full sync of the trainer's weights to the server at ``url`` (rank 0's; None elsewhere)."""
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.weight_sync import DistributedWeightSync

    engine = SGLangEngine.at([url], control_timeout_s=10) if url else None
    full = DistributedWeightSync(model_chunks, engine, **keys)
    try:
        full.sync(version=version)
    finally:
        full.close()


def _delta_then_full(rank, world, model_dir, overrides, url_a, url_b):
    """Three syncs by deltas to server A (a few elements of every parameter move between them),
    then one full sync of the same weights to server B. Returns A's stats on rank 0."""

    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.weight_sync import DistributedWeightSync
    from megatron_klear.training.setup import build_training_state

    cfg = load_config(None, [f"model.path={model_dir}", *overrides])
    init_parallel(cfg.parallel)
    state = build_training_state(cfg, total_steps=1)
    keys = {"bucket_mb": 0.02, "group_timeout": 30, "bucket_timeout": 30, "load_format": "flattened_bucket"}

    def engine(url):
        return SGLangEngine.at([url], control_timeout_s=10) if rank == 0 else None

    stats, sync = [], DistributedWeightSync(state.model, engine(url_a), delta=True, full_every=50, **keys)
    try:
        for version in (1, 2, 3):
            if version > 1:
                _nudge(state.model, version, 37)
            stats.append(sync.sync(version=version))
    finally:
        sync.close()
    _full_sync(state.model, url_b if rank == 0 else None, 3, keys)
    return stats


@pytest.mark.slow
def test_delta_syncs_through_sglangs_custom_loader_match_a_full_sync_at_pp2(models):
    """rollout.sync_delta into SGLang-API servers started with the project's delta loader
    (rollout/in_server/sglang_delta.py): each stage leader sends its changes; the server ends
    bit-identical to one that took a full sync of the same weights. Only buckets that carry changes
    go through the loader: the first sync (every tensor whole) takes update_weights_from_distributed,
    where SGLang answers a failure instead of ending its scheduler."""
    from megatron_klear.rollout.in_server.sglang_delta import LOADER
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine

    keys = {"weight_sync_timeout": 20, "startup_timeout": 120}
    a = EmbeddedHTTPEngine.launch(models["a"], custom_weight_loader=[LOADER], **keys)
    try:
        b = EmbeddedHTTPEngine.launch(models["a"], **keys)
        try:
            out = run_distributed(_delta_then_full, 2, models["b"], ["parallel.pp=2"], a.url, b.url)
            got_a, got_b = _checksums(a.url), _checksums(b.url)
            updates = httpx.get(a.url + "/server_info", timeout=10).json()["weight_updates"]
        finally:
            b.close()
    finally:
        a.close()
    stats = out[0]
    assert got_a == got_b
    # the full sync's buckets through SGLang's own route, the delta syncs' through the loader
    assert updates.get("update_weights_from_distributed", 0) >= 2 and updates.get("update_weights_from_tensor", 0) >= 2
    full_bytes = stats[0]["bytes"]
    assert stats[0]["changed"] == stats[0]["elements"]  # the first sync sends everything whole
    for s in stats[1:]:
        assert 0 < s["changed"] < 0.05 * s["elements"] and s["bytes"] < 0.3 * full_bytes, (s, full_bytes)


@contextlib.contextmanager
def _loader_servers_and_a_reference(model_dir):
    """Three stand-in servers of ``model_dir``: two started with SGLang's delta loader, the third
    (the reference a full sync goes to) without it."""
    from megatron_klear.rollout.in_server.sglang_delta import LOADER
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine

    keys = {"weight_sync_timeout": 20, "startup_timeout": 120}
    servers = []
    try:
        for loader in ([LOADER], [LOADER], []):
            servers.append(EmbeddedHTTPEngine.launch(model_dir, custom_weight_loader=loader, **keys))
        yield servers
    finally:
        for s in servers:
            s.close()


def _delta_sync_to(model_dir, urls):
    """One rank's trainer and a delta sync (small buckets, 30 s timeouts) to the servers at
    ``urls``: ``(state, engine, sync, the sync's keys)``."""
    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.weight_sync import DistributedWeightSync
    from megatron_klear.training.setup import build_training_state

    cfg = load_config(None, [f"model.path={model_dir}"])
    init_parallel(cfg.parallel)
    state = build_training_state(cfg, total_steps=1)
    keys = {"bucket_mb": 0.02, "group_timeout": 30, "bucket_timeout": 30}
    engine = SGLangEngine.at(urls, control_timeout_s=10, min_live_workers=1)
    return state, engine, DistributedWeightSync(state.model, engine, delta=True, full_every=50, **keys), keys


def _delta_sync_losing_a_server(rank, world, model_dir, urls, url_c, pid):
    """Delta syncs to two servers; the second sync kills server ``pid`` mid-broadcast (a delta
    loader that raises ends an SGLang server the same way); a third sync follows, then one full sync
    of the same weights to ``url_c``. Returns the three syncs' stats."""
    import os
    import signal

    from megatron_klear.rollout.weight_sync import distributed_buckets as schedule

    state, engine, sync, keys = _delta_sync_to(model_dir, urls)
    buckets, armed = schedule.iter_buckets, [False]

    def killing(named, bucket_bytes):
        for k, bucket in enumerate(buckets(named, bucket_bytes), 1):
            if armed[0] and k == 3:
                armed[0] = False
                os.kill(pid, signal.SIGKILL)
            yield bucket

    schedule.iter_buckets = killing
    stats = []
    try:
        for version in (1, 2, 3):
            if version > 1:
                _nudge(state.model, version, 41)
            armed[0] = version == 2
            stats.append(sync.sync(version=version))
    finally:
        sync.close()
    _full_sync(state.model, url_c, 3, keys)
    return stats


@pytest.mark.slow
def test_a_server_lost_mid_delta_sync_makes_the_retry_and_the_next_sync_right(models):
    """A delta sync that loses a server mid-broadcast is retried on the survivor as a full sync (the
    survivor may hold part of the failed attempt); the sync after it is a delta again, and the
    survivor ends bit-identical to a server given one full sync of the same weights."""
    with _loader_servers_and_a_reference(models["a"]) as (a, b, c):
        out = run_distributed(_delta_sync_losing_a_server, 1, models["b"], [a.url, b.url], c.url, b._process.pid)
        got_a, got_c = _checksums(a.url), _checksums(c.url)
    first, lossy, after = out[0]
    assert first["changed"] == first["elements"]  # the first sync sends everything whole
    assert lossy["reforms"] >= 1 and lossy["changed"] == lossy["elements"], lossy  # the retry: whole
    assert 0 < after["changed"] < 0.05 * after["elements"], after  # a delta again
    assert got_a == got_c


def _delta_loads_that_fail(rank, world, model_dir, urls, url_c):
    """Delta syncs to two servers started with the loader: v1 full; v2 a delta bucket with a NaN
    among its changed values (the sender's rule broken on purpose: every server's loader fails on
    it); v3 a delta; then server B loses its group (as a server restarted since it joined) and v4
    is sent; then one full sync of the same weights to ``url_c``. Returns the syncs' stats and the
    serving workers after v2 and after v4."""
    import httpx

    from megatron_klear.rollout.servers.update_group import DENSE
    from megatron_klear.rollout.weight_sync.delta import DeltaImages

    state, engine, sync, keys = _delta_sync_to(model_dir, urls)
    encode, poison = DeltaImages.encode, [False]

    def encode_with_a_nan(self, bucket):
        counts, pieces, changed, elements = encode(self, bucket)
        k = 0
        for c in counts:
            if c > 0 and poison[0]:
                poison[0] = False
                pieces[k + 1] = pieces[k + 1].clone()
                pieces[k + 1][0] = float("nan")
            k += 1 if c == DENSE else 2
        return counts, pieces, changed, elements

    DeltaImages.encode = encode_with_a_nan
    stats, workers = [], []
    try:
        for version in (1, 2, 3, 4):
            if version > 1:
                _nudge(state.model, version, 41)
            poison[0] = version == 2
            if version == 4:  # B no longer holds the group: a delta post would reach no receiver there
                r = httpx.post(urls[1] + "/destroy_weights_update_group", json={"group_name": sync.groups.name(0)})
                assert r.json()["success"], r.text
            stats.append(sync.sync(version=version))
            if version in (2, 4):
                workers.append(list(engine.workers()))
    finally:
        DeltaImages.encode = encode
        sync.close()
    _full_sync(state.model, url_c, 4, keys)
    return stats, workers


@pytest.mark.slow
def test_a_failed_delta_load_leaves_the_server_up_and_the_retry_sends_it_everything(models):
    """A delta loader that fails (here a NaN among the changed values) does not end the SGLang-API
    server: it marks its update group, the sender finds the mark, re-forms the groups with the same
    servers and sends every weight whole; the next sync is a delta again. A server that no longer
    holds its group (restarted since it joined) is found before any delta bucket is posted to it: it
    is dropped from the fleet, still up, while the other takes the retry. The survivor ends
    bit-identical to a server given one full sync of the same weights."""
    with _loader_servers_and_a_reference(models["a"]) as (a, b, c):
        out = run_distributed(_delta_loads_that_fail, 1, models["b"], [a.url, b.url], c.url)
        got_a, got_c = _checksums(a.url), _checksums(c.url)
        b_up = httpx.get(b.url + "/model_info", timeout=10).status_code  # (paused since it was dropped)
        b_updates = httpx.get(b.url + "/server_info", timeout=10).json()["weight_updates"]
    (full, failed, delta, restarted), (after_failure, after_restart) = out[0]
    assert full["changed"] == full["elements"]
    assert failed["reforms"] == 1 and failed["changed"] == failed["elements"], failed  # the retry: whole
    assert after_failure == [a.url, b.url]  # both loaders failed; both kept their place
    assert 0 < delta["changed"] < 0.05 * delta["elements"], delta
    assert restarted["reforms"] == 1 and after_restart == [a.url]
    assert b_up == 200 and b_updates.get("update_weights_from_tensor", 0) >= 1  # up, and it took deltas
    assert got_a == got_c
