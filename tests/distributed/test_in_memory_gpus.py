"""rollout.weight_sync=memory on one node of four GPUs, as a colocated job lays it out: a TP=4 trainer
(one rank per GPU, ``LOCAL_RANK`` its GPU) and three servers on the same GPUs, two TP=1 servers and
one TP=2 server, started as docs/sglang.md says (every GPU visible, each server its own GPUs with
``--base-gpu-id``). The stand-in models the GPUs as CUDA and SGLang do
(rollout/sglang_standin/gpus.py): a rank that opens a handle of a GPU it cannot see, or one opened
before, takes its server down. Each server rank must map the copy of the trainer rank on its own GPU
(no cross-device open, one sharing process per GPU), and every server must end on the trainer's
weights, checked by checksums against the trainer's own checkpoint, not by a probe within tolerance.

Servers started the way the docs used to say (``CUDA_VISIBLE_DEVICES=$GPU``: each sees its GPU as
GPU 0) are refused by name before anything is sent, and the push goes through disk: before, every
server was handed rank 0's copy, and all but the first died of it."""

import time

import httpx
import pytest

from tests.distributed.helper import run_distributed
from tests.distributed.test_weight_sync_distributed import _checksums

pytestmark = pytest.mark.slow

WORLD = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("gpus")
    shape = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 4}
    return {
        "a": make_tiny_qwen3(str(root / "a"), seed=5, **shape),  # what the servers start from
        "b": make_tiny_qwen3(str(root / "b"), seed=6, **shape),  # the trainer's weights
    }


def _push_to(rank, world, model, good, old_style):
    """Every rank builds the trainer (TP=4) from ``model`` and pushes twice in memory: to the servers
    ``good``, then to ``old_style`` (whose plan must refuse them, so the disk fallback takes it)."""
    from types import SimpleNamespace

    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel, is_rank0
    from megatron_klear.rl.rollout.placement import Dedicated
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.weight_sync.in_memory import InMemoryPush
    from megatron_klear.training.setup import build_training_state

    cfg = load_config(None, [f"model.path={model}", f"parallel.tp={world}"])
    init_parallel(cfg.parallel)
    state = build_training_state(cfg, total_steps=1)
    out = {}
    for name, urls in (("good", good), ("old_style", old_style)):
        engine = SGLangEngine.at(urls, control_timeout_s=30) if is_rank0() else None
        fallback = SimpleNamespace(
            sync_dir="/nowhere", push=lambda v, name=name: out.setdefault("fallback", []).append(name) or {}
        )
        push = InMemoryPush(state, engine, Dedicated(), bucket_mb=0.05, fallback=fallback)
        out[name] = push.push(version=1 if name == "good" else 2)
        if engine is not None:
            engine.close()
    # a server that fails at the second bucket: rank 0 stops posting, and every rank ends the push
    # together, naming it, instead of the others waiting inside the gather for rank 0
    engine = SGLangEngine.at(good, control_timeout_s=30) if is_rank0() else None
    if engine is not None:
        engine.wire.load_tensors = _second_call_raises(engine.wire.load_tensors, "the server died loading bucket 2")
    out["failure"] = _failed_push(InMemoryPush(state, engine, Dedicated(), bucket_mb=0.05, fallback=None), 3, engine)
    # a relay rank (rank 2, holding the TP=2 server's first copy) that fails to share its copy of the
    # second bucket: it answers rank 0 with its error and keeps to the relay's protocol, and every
    # rank ends the push together, naming it (before, rank 0 waited for it at the next bucket)
    from megatron_klear.rollout.weight_sync import relay as relay_module

    if rank == 2:
        relay_module.share_views = _second_call_raises(relay_module.share_views, "no memory left to share on GPU 2")
    engine = SGLangEngine.at(good, control_timeout_s=30) if is_rank0() else None
    push = InMemoryPush(state, engine, Dedicated(), bucket_mb=0.05, fallback=None)
    out["relay_failure"] = _failed_push(push, 4, engine)
    return out


def _second_call_raises(fn, message: str):
    """``fn``, except that its second call (and every later one) raises RuntimeError(``message``)."""
    calls = []

    def wrapped(*args):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError(message)
        return fn(*args)

    return wrapped


def _failed_push(push, version: int, engine) -> tuple | None:
    """``(message, seconds)`` of the RuntimeError ``push.push(version)`` ends with (None: it did not
    fail); rank 0's ``engine`` is closed after it."""
    t0 = time.monotonic()
    try:
        push.push(version=version)
    except RuntimeError as e:
        return str(e), time.monotonic() - t0
    finally:
        if engine is not None:
            engine.close()
    return None


def _info(url):
    return httpx.get(url + "/server_info", timeout=10).json()


def test_each_server_rank_maps_the_copy_on_its_own_gpu_and_ends_on_the_trainers_weights(models):
    from megatron_klear.rollout.embedded import EmbeddedEngine
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine

    launch = [dict(base_gpu_id=0), dict(base_gpu_id=1), dict(tp_size=2, base_gpu_id=2)]
    # one server per GPU as CUDA_VISIBLE_DEVICES=$GPU starts them: GPU 0 by each one's own count
    old = [dict(env={"CUDA_VISIBLE_DEVICES": str(k)}) for k in (0, 1)]
    servers = []
    try:
        for kwargs in launch + old:
            servers.append(EmbeddedHTTPEngine.launch(models["a"], startup_timeout=120, **kwargs))
        good, old_style = [s.url for s in servers[:3]], [s.url for s in servers[3:]]
        start = _checksums(good[0])
        (out, *others) = run_distributed(_push_to, WORLD, models["b"], good, old_style, timeout=400)
        m = out["good"]
        assert m["weights/in_memory"] == 1 and m["weights/sync_buckets"] > 1, m
        assert m["weights/in_memory_copies"] == 4, m  # ranks 0-3 each hold the copy on its GPU
        # the trainer's weights (its checkpoint read into the same engine as the servers') by checksum
        reference = EmbeddedEngine.from_pretrained(models["b"]).weights.checksums()
        assert reference != start
        sharers = []
        for url, ranks in zip(good, (1, 1, 2)):
            info = _info(url)
            assert _checksums(url) == reference, url
            assert info["weight_version"] == "1"
            # every rank opened one handle a bucket (the push, the first bucket of each failing one
            # below), each of the copy on its own GPU
            opens = ranks * (m["weights/sync_buckets"] + 2)
            assert info["gpu_opens"] == {"opens": opens, "cross_device_opens": 0}, info
            sharers.append(set(info["tensor_sharers"]))
        # one sharing process per GPU: the TP=2 server mapped two ranks' copies, no two servers the same
        assert [len(x) for x in sharers] == [1, 1, 2] and len(set().union(*sharers)) == 4, sharers
        # the old launch: refused by name before anything was sent, through disk, both servers alive
        assert out["fallback"] == ["old_style"] and out["old_style"]["weights/in_memory"] == 0
        for url in old_style:
            info = _info(url)
            assert info["gpu_opens"]["opens"] == 0 and info["weight_version"] != "2", info
        # a relay rank's failure: answered to rank 0, raised there and on every rank, naming it
        for o in (out, *others):
            message, seconds = o["relay_failure"]
            assert "the bucket relay failed on rank(s) {2: 'RuntimeError: no memory left to share on GPU 2'}" in message
            assert seconds < 60
        # the failure mid-push: raised on rank 0, and on every other rank at once, naming it
        assert out["failure"][0] == "the server died loading bucket 2", out["failure"]
        for o in others:
            message, seconds = o["failure"]
            assert "failed on rank 0: RuntimeError: the server died loading bucket 2" in message and seconds < 60
    finally:
        for s in servers:
            s.close()
