"""The stand-in's GPUs (rollout/sglang_standin/gpus.py) behave as CUDA and SGLang 0.5.23 give them to
a server, so that an in-memory push the CPU tests accept is one a GPU server would accept: each TP
rank opens its own entry of ``serialized_named_tensors`` (``managers/tp_worker.py``
``deserialize_own_rank``), a handle on a GPU the rank cannot see fails as SGLang's patched rebuild
fails (``srt/utils/patch_torch.py`` ``Invalid device_uuid=``), a handle opened twice fails (torch's
producer-side count of a CUDA IPC handle's consumers), and each of these takes the server down
(its scheduler's exception). The trainer's handles (rollout/weight_sync/sharing.py) name the GPU of
the rank that made them (``LOCAL_RANK`` of ``CUDA_VISIBLE_DEVICES`` on the CPU)."""

import base64

import httpx
import pytest
import torch

from megatron_klear.platform import gpus

NORM = "model.norm.weight"


def _handle(monkeypatch, local_rank: int, value: float, visible: str | None = None) -> str:
    """A one-tensor bucket shared as trainer rank ``local_rank`` of this node shares it."""
    from megatron_klear.rollout.weight_sync.sharing import share_bucket

    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    payload, buffer = share_bucket([(NORM, torch.full((64,), value))])
    _held.append(buffer)  # alive until the server has read it
    return payload


_held = []


@pytest.fixture
def serve(tiny_hf):
    """``serve(tp, base, visible)``: an in-thread stand-in whose TP ranks run on local GPUs
    ``base..base+tp-1`` of those ``visible`` (its CUDA_VISIBLE_DEVICES) leaves."""
    from megatron_klear.rollout.embedded import EmbeddedEngine
    from megatron_klear.rollout.sglang_standin import serve_in_thread
    from megatron_klear.rollout.sglang_standin.gpus import ServerGPUs

    servers = []

    def start(tp=1, base=0, visible=None):
        env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
        engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
        server, url = serve_in_thread(engine, gpus=ServerGPUs(tp, base, env=env))
        servers.append(server)
        return engine, url

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
    _held.clear()


def _push(url, entries):
    """One bucket through a weight-update session; the answer of the load."""
    assert httpx.post(url + "/begin_weight_update", json={}, timeout=30).json()["success"]
    body = {"serialized_named_tensors": entries, "flush_cache": False, "abort_all_requests": False}
    answer = httpx.post(url + "/update_weights_from_tensor", json=body, timeout=60)
    if answer.status_code == 200:
        assert httpx.post(url + "/end_weight_update", json={}, timeout=30).json()["success"]
    return answer


def _info(url):
    return httpx.get(url + "/server_info", timeout=10).json()


def test_each_tp_rank_opens_its_own_gpus_copy(serve, monkeypatch):
    engine, url = serve(tp=2, base=1)  # ranks on GPUs 1 and 2 of a node whose GPUs it all sees
    info = _info(url)
    assert (info["tp_size"], info["base_gpu_id"], info["gpu_id_step"]) == (2, 1, 1)
    entries = [_handle(monkeypatch, 1, 4.0), _handle(monkeypatch, 2, 4.0)]
    answer = _push(url, entries)
    assert answer.status_code == 200 and answer.json()["success"], answer.text
    assert engine.weights.model.model.norm.weight.tolist() == [4.0] * 64
    assert _info(url)["gpu_opens"] == {"opens": 2, "cross_device_opens": 0}
    # the same GPUs' copies in the other order open (CUDA peer access) but cross devices: counted
    answer = _push(url, [_handle(monkeypatch, 2, 5.0), _handle(monkeypatch, 1, 5.0)])
    assert answer.json()["success"] and _info(url)["gpu_opens"] == {"opens": 4, "cross_device_opens": 2}


@pytest.mark.parametrize(
    "case, message",
    [
        ("another GPU than it sees", "Invalid device_uuid="),
        ("the same pickle for both ranks", "opened a CUDA IPC handle another rank or request opened before"),
        ("one entry for two ranks", "IndexError"),
        ("ranks handed different weights", "TP rank 1 was handed other tensors than TP rank 0"),
    ],
)
def test_what_a_gpu_server_dies_of_the_stand_in_dies_of(serve, monkeypatch, case, message):
    """Each of these ends a GPU server's scheduler (no handler in ``update_weights_from_tensor``):
    the stand-in answers 500 with the error and keeps it as its fault (the launched one then exits)."""
    if case == "another GPU than it sees":
        # one server per GPU as CUDA_VISIBLE_DEVICES=$GPU launches it, handed GPU 0's copy
        engine, url = serve(tp=1, visible="1")
        entries = [_handle(monkeypatch, 0, 3.0)]
    else:
        engine, url = serve(tp=2)
        one = _handle(monkeypatch, 0, 3.0)
        entries = {
            "the same pickle for both ranks": [one, one],
            "one entry for two ranks": [one],
            "ranks handed different weights": [one, _handle(monkeypatch, 1, 9.0)],
        }[case]
    before = engine.weights.model.model.norm.weight.clone()
    answer = _push(url, entries)
    assert answer.status_code == 500 and message in answer.text, answer.text
    assert torch.equal(engine.weights.model.model.norm.weight, before)  # nothing loaded


def test_a_handle_names_the_physical_gpu_behind_the_ranks_local_one(monkeypatch):
    """LOCAL_RANK 1 under CUDA_VISIBLE_DEVICES=4,6 is physical GPU 6 of this node (CUDA's
    enumeration); the envelope passes SGLang's own allow-list of globals."""
    from megatron_klear.rollout.in_server.shared_tensors import CPU_HANDLE, open_shared_bucket
    from megatron_klear.rollout.weight_sync import sharing
    from tests.rollout.sglang_contract import sglang_unpickle

    assert sharing.CPU_HANDLE == CPU_HANDLE
    payload = _handle(monkeypatch, 1, 2.0, visible="4,6")
    named, handle = open_shared_bucket(payload)
    assert handle["device"] == gpus.double_uuid(gpus.node_name(), 6) and handle["node"] == gpus.node_name()
    assert [n for n, _ in named] == [NORM] and named[0][1].tolist() == [2.0] * 64
    assert sglang_unpickle(base64.b64decode(payload))["tensors"][0][0] == NORM
    # two pickles of one buffer are two handles (one opener each)
    assert open_shared_bucket(_handle(monkeypatch, 1, 2.0, visible="4,6"))[1]["token"] != handle["token"]
    _held.clear()
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        gpus.physical_index(2, {"CUDA_VISIBLE_DEVICES": "4,6"})


def test_a_server_whose_ranks_are_past_its_visible_gpus_does_not_start(tiny_hf):
    from megatron_klear.rollout.sglang_standin.gpus import ServerGPUs

    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        ServerGPUs(tp_size=2, base_gpu_id=0, env={"CUDA_VISIBLE_DEVICES": "3"})


def test_the_allocator_switch_around_a_share_buffer_keeps_the_users_other_settings():
    """torch resets the allocator options a setting string leaves out
    (``AcceleratorAllocatorConfig::parseArgs``): the switch sets the whole string, expandable
    segments off, and puts the user's own back."""
    from megatron_klear.rollout.weight_sync.sharing import _with_expandable, expandable_segments_on

    user = "max_split_size_mb:128,expandable_segments:True,garbage_collection_threshold:0.8"
    assert (
        _with_expandable(user, False)
        == "max_split_size_mb:128,garbage_collection_threshold:0.8,expandable_segments:False"
    )
    assert expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": user})
    assert not expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    assert expandable_segments_on({"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
