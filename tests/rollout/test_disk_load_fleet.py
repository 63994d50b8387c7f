"""Weight loads from disk that survive a lost worker, and the cache flush before them (issue 21,
divergence 6), against fake workers (real processes, killed for real): a worker gone before the
load is dropped and the others load; too few left is a FleetError naming it; a worker that
answers with a failure is an error for a live one and a drop for a rejoining one; SGLang's
refusal to flush while a request is queued is retried, then named."""

import time

import pytest

from megatron_klear.rollout.base import FleetError
from megatron_klear.rollout.sglang import EngineError, SGLangEngine
from tests.rollout.processes import fake_worker, recorded

FAST = dict(control_timeout_s=3, max_retries=1, retry_backoff=0.05, health_check_timeout_s=1)


def test_a_refused_flush_is_retried_once_before_the_load_and_buckets_do_not_flush(tmp_path):
    with fake_worker(tmp_path, refuse_flush=2) as (url, record, _):
        client = SGLangEngine.at([url], **FAST)
        client.load_from_disk("/w/step_1", version=1)
        flushes = recorded(record, "/flush_cache")
        loads = recorded(record, "/update_weights_from_disk")
        client.wire.receive_bucket(["a"], ["bfloat16"], [[2]], group_name="g", timeout=5)
        bucket = recorded(record, "/update_weights_from_distributed")
    assert len(flushes) == 3 and flushes == [None] * 3  # two refusals, then flushed (SGLang's route has no body)
    assert loads == [{"model_path": "/w/step_1", "flush_cache": False, "weight_version": "1"}]
    assert bucket[0]["flush_cache"] is False


def test_a_flush_refused_every_time_is_named(tmp_path):
    with fake_worker(tmp_path, refuse_flush=100) as (url, record, _):
        client = SGLangEngine.at([url], **FAST)
        client.wire.flush_attempts = 3
        with pytest.raises(EngineError, match=rf"{url} refused to flush its cache 3 times .*Flush cache failed"):
            client.load_from_disk("/w/step_1", version=1)
        assert recorded(record, "/update_weights_from_disk") == []  # nothing loaded
        assert len(recorded(record, "/continue_generation")) == 1  # but the worker was resumed


def test_a_worker_gone_before_a_disk_load_is_dropped_and_the_other_loads(tmp_path):
    with fake_worker(tmp_path, "a") as (a, rec_a, _), fake_worker(tmp_path, "b") as (b, _, proc_b):
        client = SGLangEngine.at([a, b], **FAST)
        assert client.fleet_metrics()["rollout/live_workers"] == 2
        proc_b.kill()
        proc_b.wait()
        t0 = time.monotonic()
        client.load_from_disk("/w/step_2", version=2)
        assert time.monotonic() - t0 < 10
        assert client.workers() == [a] and list(client.fleet.lost()) == [b]
        assert client.members.weight_versions() == {a: "2"}
        metrics = client.fleet_metrics()
        assert metrics["rollout/live_workers"] == 1 and metrics["rollout/worker_failures"] == 1, metrics
        assert recorded(rec_a, "/update_weights_from_disk")[0]["weight_version"] == "2"


def test_too_few_workers_left_by_a_disk_load_is_a_fleet_error_naming_them(tmp_path):
    with fake_worker(tmp_path, "a") as (a, _, _), fake_worker(tmp_path, "b") as (b, _, proc_b):
        client = SGLangEngine.at([a, b], min_live_workers=2, **FAST)
        client.workers()
        proc_b.kill()
        proc_b.wait()
        t0 = time.monotonic()
        with pytest.raises(FleetError, match=rf"fewer than rollout.min_live_workers = 2. Lost: {b}"):
            client.load_from_disk("/w/step_2", version=2)
        assert time.monotonic() - t0 < 10


def test_a_failed_load_is_an_error_for_a_live_worker_and_a_drop_for_a_rejoining_one(tmp_path):
    with (
        fake_worker(tmp_path, "a") as (a, _, _),
        fake_worker(tmp_path, "b", fail_post="/update_weights_from_disk") as (b, _, _),
    ):
        client = SGLangEngine.at([a, b], **FAST)
        with pytest.raises(EngineError, match=rf"{b}/update_weights_from_disk failed"):
            client.load_from_disk("/w/step_3", version=3)
        assert sorted(client.fleet.live()) == sorted([a, b])  # a live worker that refuses is not dropped
        client.fleet.lose(b, "test: lost earlier")
        assert client.recall_workers() == [b]  # it answers again: rejoining
        client.load_from_disk("/w/step_4", version=4)  # its load fails: dropped again, no error
        assert client.fleet.live() == [a] and list(client.fleet.lost()) == [b]
        assert "rejoined failed" in client.fleet.lost()[b]


def test_a_bucket_is_not_broadcast_while_a_post_is_refused_within_the_grace(tmp_path):
    """BucketPost.refusals: the early answers decide whether the sender broadcasts (divergence 3)."""
    with (
        fake_worker(tmp_path, "ok") as (ok, _, _),
        fake_worker(tmp_path, "no", fail_post="/update_weights_from_distributed") as (no, _, _),
    ):
        client = SGLangEngine.at([ok, no], **FAST)
        post = client.wire.post_bucket(["a"], ["bfloat16"], [[2]], group_name="g", timeout=5)
        refused = post.refusals(5.0)
        assert list(refused) == [no] and "injected failure" in str(refused[no])
        assert post.result().keys() == {no}
        # a server that is not there at all refuses too (a connection refused, at once)
        t0 = time.monotonic()
        gone = "http://127.0.0.1:9"
        assert list(
            client.wire.post_bucket(["a"], ["bfloat16"], [[2]], group_name="g", workers=[ok, gone]).refusals(5.0)
        ) == [gone]
        assert time.monotonic() - t0 < 3


class _Hung:
    """A broadcast that never completes (an NCCL work whose peer never receives)."""

    def is_completed(self):
        return False

    def wait(self):
        raise AssertionError("wait() must not be reached on a hung NCCL work")


def test_nccl_waits_are_polled_to_a_deadline_and_a_new_groups_first_bucket_is_one_tensor():
    import torch

    from megatron_klear.rollout.weight_sync import DistributedWeightSync

    sync = DistributedWeightSync([], None, backend="nccl", bucket_mb=1, group_timeout=7, bucket_timeout=3)
    tensors = [(n, torch.zeros(4)) for n in "abc"]
    assert [[n for n, _ in b] for b in sync.buckets._buckets(iter(tensors))] == [["a"], ["b", "c"]]
    assert sync.groups.bucket_wait() == 7  # the first broadcast builds NCCL's communicator
    sync.groups.warm = True
    assert [[n for n, _ in b] for b in sync.buckets._buckets(iter(tensors))] == [["a", "b", "c"]]
    assert sync.groups.bucket_wait() == 3
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not complete within 0.2 s"):
        sync.buckets._wait_works([_Hung()], 0.2)
    assert time.monotonic() - t0 < 2
    gloo = DistributedWeightSync([], None, backend="gloo", bucket_mb=1)
    assert len(list(gloo.buckets._buckets(iter(tensors)))) == 1  # gloo connects at creation: no warm-up bucket
