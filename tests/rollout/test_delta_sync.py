"""Delta weight syncs (``rollout.sync_delta``), without servers: the sender's images
(rollout/weight_sync/delta.py) and the receiver's side of the format (rollout/servers/update_group.py)
agree bit for bit over 50 syncs of sparse, dense and unchanged tensors, in both wire layouts; a tensor
whose changes would not be smaller goes whole; a full sync follows every ``full_every`` delta syncs,
a failure and new groups; the config refuses what cannot work, by name."""

import pytest
import torch

from megatron_klear.platform.errors import ConfigError
from megatron_klear.rollout.config import RolloutConfig
from megatron_klear.rollout.servers.update_group import (
    DENSE,
    apply_delta,
    delta_segments,
    flatten_segments,
    segments_layout,
)
from megatron_klear.rollout.weight_sync.delta import DeltaImages

SHAPES = {"embed": (50, 16), "q": (16, 16), "norm": (16,), "frozen": (8, 4)}


def _weights(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in SHAPES.items()}


def _step(weights, g, lr):
    """An optimizer-like step: a few elements of most tensors move, one tensor moves everywhere,
    ``frozen`` never."""
    for name, t in weights.items():
        if name == "frozen":
            continue
        if name == "norm":
            t.add_(lr * torch.ones_like(t))
            continue
        mask = torch.rand(t.shape, generator=g) < 0.03
        t.add_(torch.where(mask, torch.randn(t.shape, generator=g).to(t.dtype), torch.zeros_like(t)))


def _received(segments, pieces, flattened):
    """What the receiver gets for ``pieces``: the same tensors, or cut out of one flattened buffer."""
    if not flattened:
        return [p.clone() for p in pieces]
    flat = flatten_segments(pieces)
    return [
        flat[a:b].view(dt).reshape(shape).clone()
        for (_, _, dt, shape), (a, b) in zip(segments, segments_layout(segments))
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("flattened", [False, True], ids=["per_piece", "flattened"])
def test_fifty_delta_syncs_leave_the_receiver_bit_identical_to_the_sender(dtype, flattened):
    weights, g = _weights(dtype), torch.Generator().manual_seed(1)
    sender, receiver = DeltaImages(full_every=1000), {}
    sent_bytes, full_bytes = [], sum(t.numel() * t.element_size() for t in weights.values())
    for sync in range(50):
        if sync:
            _step(weights, g, lr=1e-2)
        assert sender.begin() is (sync == 0)  # only the first is full
        bucket = list(weights.items())
        counts, pieces, changed, elements = sender.encode(bucket)
        names = [n for n, _ in bucket]
        segments = delta_segments(names, [t.dtype for _, t in bucket], [list(t.shape) for _, t in bucket], counts)
        applied = dict(apply_delta(receiver, segments, _received(segments, pieces, flattened)))
        sender.commit()
        for name, t in weights.items():  # bitwise: the receiver holds exactly the sender's tensor
            assert torch.equal(applied[name].view(torch.uint8), t.view(torch.uint8)), (sync, name)
        if sync:
            by_name = dict(zip(names, counts))
            assert by_name["frozen"] == 0 and by_name["norm"] == DENSE  # unchanged: nothing; all changed: whole
            assert 0 < by_name["q"] < weights["q"].numel() // 5
            assert changed < elements
        sent_bytes.append(sum(p.numel() * p.element_size() for p in pieces))
    assert sent_bytes[0] == full_bytes and max(sent_bytes[1:]) < 0.3 * full_bytes, sent_bytes


def test_a_full_sync_follows_every_full_every_delta_syncs_a_failure_and_new_groups():
    images, w = DeltaImages(full_every=2), _weights(torch.float32)
    fulls = []
    for sync in range(7):
        force = sync == 5  # the groups were re-formed (a server joined)
        fulls.append(images.begin(force_full=force))
        images.encode(list(w.items()))
        if sync == 3:
            images.discard()  # a failed sync: a server may hold part of it
        else:
            images.commit()
    assert fulls == [True, False, False, True, True, True, False]


def test_a_change_to_every_element_goes_whole_and_a_new_shape_too():
    images = DeltaImages()
    images.begin()
    images.encode([("a", torch.zeros(10)), ("b", torch.zeros(4))])
    images.commit()
    images.begin()
    counts, pieces, _, _ = images.encode([("a", torch.ones(10)), ("b", torch.zeros(5))])
    assert counts == [DENSE, DENSE] and [p.shape for p in pieces] == [torch.Size([10]), torch.Size([5])]


def test_a_non_float_tensor_always_goes_whole():
    """The servers' delta loaders mark unchanged elements with NaN, which an integer tensor cannot
    hold: one changed element of an integer buffer still sends the whole tensor."""
    images = DeltaImages()
    images.begin()
    images.encode([("idx", torch.zeros(1000, dtype=torch.int32)), ("w", torch.zeros(1000))])
    images.commit()
    images.begin()
    idx, w = torch.zeros(1000, dtype=torch.int32), torch.zeros(1000)
    idx[3], w[3] = 1, 1.0
    counts, pieces, _, _ = images.encode([("idx", idx), ("w", w)])
    assert counts == [DENSE, 1] and pieces[0].dtype == torch.int32 and pieces[0].numel() == 1000


def test_changes_without_an_image_are_refused_naming_the_tensor():
    segments = delta_segments(["w"], ["float32"], [[4]], [1])
    with pytest.raises(ValueError, match="no image of w"):
        apply_delta({}, segments, [torch.tensor([2], dtype=torch.int32), torch.tensor([1.0])])
    with pytest.raises(ValueError, match="count 9 is not -1 or 0..4"):
        delta_segments(["w"], ["float32"], [[4]], [9])


def test_the_flattened_layout_aligns_every_piece():
    segments = delta_segments(["a", "b"], ["bfloat16", "float32"], [[3], [5]], [DENSE, 2])
    layout = segments_layout(segments)
    assert [(kind, str(dt)) for _, kind, dt, _ in segments] == [
        ("dense", "torch.bfloat16"),
        ("index", "torch.int32"),
        ("value", "torch.float32"),
    ]
    assert layout == [(0, 6), (8, 16), (16, 24)]  # 2 bytes of padding before the int32 positions


def test_the_config_refuses_delta_where_it_cannot_work():
    with pytest.raises(ConfigError, match="needs rollout.weight_sync=distributed, got 'disk'"):
        RolloutConfig(engine="vllm", urls=["http://s:1"], sync_delta="on", weight_sync="disk").validate()
    with pytest.raises(ConfigError, match="sync_delta must be off, on or auto"):
        RolloutConfig(engine="vllm", urls=["http://s:1"], sync_delta="yes").validate()
    for engine in ("vllm", "sglang"):  # SGLang: through the delta loader its servers are started with
        RolloutConfig(engine=engine, urls=["http://s:1"], sync_delta="on").validate()
    yaml_on = RolloutConfig(engine="vllm", urls=["http://s:1"], sync_delta=True)  # YAML reads on as true
    yaml_on.validate()
    assert yaml_on.sync_delta == "on"


def test_each_dialect_posts_delta_buckets_its_own_way():
    from megatron_klear.rollout.sglang.api import SGLangAPI
    from megatron_klear.rollout.vllm.api import VLLMAPI

    path, body = VLLMAPI().bucket_call(["w"], ["float32"], [[4]], group_name="g", load_format=None, counts=[1])
    assert path == "/update_weights" and body["update_info"]["counts"] == [1]
    assert "counts" not in VLLMAPI().bucket_call(["w"], ["float32"], [[4]], group_name="g", load_format=None)[1]
    path, _ = SGLangAPI().bucket_call(["w"], ["float32"], [[4]], group_name="g", load_format=None, counts=[1])
    assert path == "/update_weights_from_tensor"  # tests/rollout/test_sglang_delta.py checks the body
    assert VLLMAPI().delta_refusal(None, ["http://s:1"]) is None


def test_a_full_sync_holds_one_copy_of_the_weights_not_two():
    """The stage leader's images are one copy of its weights; a full sync after delta syncs does
    not keep them beside the copies it is making (the peak was twice the stage's weights)."""
    images, w = DeltaImages(full_every=1), _weights(torch.float32)
    size = sum(t.numel() * t.element_size() for t in w.values())

    def held():
        whole = sum(v.numel() * v.element_size() for v in images.images.values())
        return whole + sum(v.numel() * v.element_size() for _, v in images.pending.values())

    images.begin()
    images.encode(list(w.items()))
    images.commit()
    assert held() == size
    for t in w.values():
        t.view(-1)[0] += 1.0
    assert images.begin() is False  # a delta sync reads the images
    images.encode(list(w.items()))
    images.commit()
    assert images.begin() is True  # full_every=1: a full sync now
    images.encode(list(w.items()))
    assert held() == size  # its copies only
    images.commit()
    assert held() == size and all(torch.equal(images.images[k], v) for k, v in w.items())


def _agree_on_a_delta_bucket(rank, world):
    """Group rank 0 sends a delta bucket; rank 2, one TP rank of a server, cannot take it (a reason
    found before the receive) while rank 1, its other TP rank, can: what each rank ends with."""
    import torch.distributed as dist

    from megatron_klear.rollout.servers.update_group import NotReceived, agree_ready, delta_segments
    from megatron_klear.rollout.servers.update_group import receive_delta_bucket as receive

    segments = delta_segments(["w"], ["float32"], [[4]], [DENSE])
    if rank == 0:
        ready = agree_ready(dist.group.WORLD, "cpu", True)
        if ready:  # (not reached: a sender broadcasts only after a yes)
            dist.broadcast(torch.ones(4), src=0)
        return ready
    refusal = MemoryError("densifying this bucket takes 9 MiB, 1 MiB are free") if rank == 2 else None
    try:
        receive(dist.group.WORLD, "cpu", segments if rank == 1 else None, "auto", refusal)
    except NotReceived as e:
        return f"NotReceived: {e}"
    except MemoryError as e:
        return f"MemoryError: {e}"
    return "received"


def test_one_tp_rank_that_cannot_take_a_delta_bucket_makes_every_member_skip_it():
    """Every member of an update group agrees before any piece of a delta bucket is broadcast: one
    TP rank's refusal (before: rank 0 of that server blocked in the receive while the sender waited
    for the bucket timeout, and the server stayed wedged) reaches the sender and the other ranks."""
    from tests.distributed.helper import run_distributed

    sender, other_rank, refusing = run_distributed(_agree_on_a_delta_bucket, 3, timeout=120)
    assert sender is False
    assert other_rank.startswith("NotReceived: another member of the update group could not take")
    assert refusing == "MemoryError: densifying this bucket takes 9 MiB, 1 MiB are free"


def test_a_wait_on_an_nccl_collective_that_never_completes_aborts_its_group_at_the_deadline(monkeypatch):
    """Over NCCL ``work.wait()`` only orders the streams and a collective whose peer is gone never
    completes: a delta loader's receive (and the sender's wait) polls until its deadline, then aborts
    the group's communicator and raises, which the loader answers by marking its group."""
    import time

    from megatron_klear.rollout.servers import update_group

    monkeypatch.setattr(update_group.dist, "get_backend", lambda pg: "nccl")
    aborted = []
    monkeypatch.setattr(update_group, "abort_update_group", aborted.append)

    class NeverCompletes:
        def is_completed(self):
            return False

        def wait(self):
            raise AssertionError("NCCL's wait would not block the host: never reached")

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="the delta bucket's receive did not complete within 0.2 s"):
        update_group.wait_bounded("pg", [NeverCompletes()], 0.2, "the delta bucket's receive")
    assert aborted == ["pg"] and time.monotonic() - t0 < 5


def test_the_loader_is_told_how_long_to_wait_for_a_delta_bucket():
    import base64
    import pickle

    from megatron_klear.rollout.in_server.sglang_delta import read_spec
    from megatron_klear.rollout.sglang.api import SGLangAPI

    _, body = SGLangAPI().bucket_call(
        ["w"], ["float32"], [[4]], group_name="g", load_format=None, counts=[1], timeout=42
    )
    spec = read_spec(pickle.loads(base64.b64decode(body["serialized_named_tensors"][0])))
    assert spec["timeout_s"] == 42.0
