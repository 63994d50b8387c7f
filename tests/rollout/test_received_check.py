"""The check after a distributed weight update (rollout/sglang/upkeep.py Control.check_received):
over NCCL a bucket's answer does not say that its bytes arrived, a generation does (it runs after
every receive on the server's stream). A server whose forward does not come back -- as one waiting
on a broadcast a lost peer never sends -- is dropped within rollout.control_timeout_s; the others
answer. An answer aborted before its token (partial rollouts abort every request on a server) is
asked again."""

import threading

from megatron_klear.rollout.embedded import EmbeddedEngine
from megatron_klear.rollout.sglang import SGLangEngine
from megatron_klear.rollout.sglang_standin import serve_in_thread
from tests.rollout.processes import fake_worker, recorded


def test_a_server_whose_forward_never_returns_is_dropped_and_the_others_pass(tiny_hf):
    engines = [EmbeddedEngine.from_pretrained(tiny_hf["untied"]) for _ in range(2)]
    wedged, release = engines[1], threading.Event()
    forward = wedged.forward

    def waits_on_a_broadcast(*args, **kwargs):
        release.wait(60)
        return forward(*args, **kwargs)

    wedged.forward = waits_on_a_broadcast
    servers = [serve_in_thread(e, batch_window=0.001) for e in engines]
    urls = [u for _, u in servers]
    try:
        client = SGLangEngine.at(urls, control_timeout_s=1.5, min_live_workers=1)
        passed = client.wire.check_received()
        assert list(passed) == [urls[0]] and len(passed[urls[0]].token_ids) == 1
        assert client.workers() == [urls[0]]  # the wedged one is out of the fleet (it rejoins at a push)
        m = client.fleet_metrics()
        assert m["rollout/worker_failures"] == 1 and m["rollout/live_workers"] == 1
    finally:
        release.set()
        for server, _ in servers:
            server.shutdown()
            server.server_close()


def test_an_answer_aborted_before_its_token_is_asked_again_within_the_timeout(tmp_path):
    with (
        fake_worker(tmp_path, "twice", abort_first=2) as (twice, record, _),
        fake_worker(tmp_path, "always", abort_first=10**6) as (always, _, _),
    ):
        client = SGLangEngine.at([twice, always], control_timeout_s=1.0, min_live_workers=1)
        passed = client.wire.check_received()
        assert list(passed) == [twice] and passed[twice].finish_reason == "length"  # its one token
        assert len(recorded(record)) == 3  # two aborted answers, then the token
        assert client.workers() == [twice]  # an endless run of aborts is no token: dropped at the timeout
        assert client.fleet_metrics()["rollout/worker_failures"] == 1
