"""Delta weight syncs into SGLang servers (rollout/in_server/sglang_delta.py): the body the client sends
passes SGLang 0.5.23's request struct and its ``SafeUnpickler`` allow-list (both read from its
wheel); 50 delta syncs through the wire into a stand-in server started with the project's custom
weight loader leave it bit-identical (per-tensor checksums, probe log-probs) to a second server given
one full sync of the same weights; a server started without the loader is named by the client
before any delta is sent, and so are quantized and speculative servers; a loader that cannot find its
group ends the server, as SGLang's scheduler does, and any other failure marks the group instead: the
server keeps serving, its weights untouched, and names the failure to the next call on the group."""

import base64

import httpx
import pytest
import torch

from megatron_klear.checkpoint.hf_io import HFReader
from megatron_klear.rollout.in_server.sglang_delta import LOADER, SPEC_NAME, read_spec
from megatron_klear.rollout.servers.update_group import DENSE, agree_ready
from megatron_klear.rollout.sglang.api import SGLangAPI
from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine
from megatron_klear.rollout.weight_sync.delta import DeltaImages
from tests.rollout.sglang_contract import control_contract_errors, sglang_unpickle
from tests.rollout.update_sender import GroupSender


def test_a_delta_bucket_is_a_tensor_request_sglang_accepts():
    names, dtypes, shapes, counts = ["a.weight", "b.weight"], ["bfloat16", "float32"], [[4, 8], [3]], [5, DENSE]
    path, body = SGLangAPI().bucket_call(
        names, dtypes, shapes, group_name="g1", load_format="flattened_bucket", counts=counts, ranks=2
    )
    assert path == "/update_weights_from_tensor"
    assert control_contract_errors(path, body) == []
    assert body["load_format"] == LOADER and body["flush_cache"] is False
    assert len(body["serialized_named_tensors"]) == 2  # one entry per TP rank of the widest server
    named = sglang_unpickle(base64.b64decode(body["serialized_named_tensors"][1], validate=True))
    assert [n for n, _ in named] == [SPEC_NAME]
    assert read_spec(named) == {
        "group_name": "g1",
        "load_format": "flattened_bucket",
        "names": names,
        "dtypes": dtypes,
        "shapes": shapes,
        "counts": counts,
    }
    # whole buckets keep SGLang's own route
    assert SGLangAPI().bucket_call(names, dtypes, shapes, group_name="g1", load_format=None)[0] == (
        "/update_weights_from_distributed"
    )


@pytest.fixture(scope="module")
def servers(tiny_hf):
    """A: started with the delta loader; B: without it."""
    keys = dict(dtype="bfloat16", weight_sync_timeout=30, startup_timeout=120, timeout=60)
    a = EmbeddedHTTPEngine.launch(tiny_hf["untied"], custom_weight_loader=[LOADER], **keys)
    try:
        b = EmbeddedHTTPEngine.launch(tiny_hf["untied"], **keys)
    except BaseException:
        a.close()
        raise
    yield a, b
    a.close()
    b.close()


def _checksums(url):
    r = httpx.get(url + "/weights_checker", timeout=60).json()
    assert r["success"], r
    return r["ranks"][0]["checksums"]


def test_the_client_names_a_server_started_without_the_loader(servers):
    from megatron_klear.rollout.sglang import SGLangEngine

    a, b = servers
    both = SGLangEngine.at([a.url, b.url], control_timeout_s=30)
    try:
        refusal = both.wire.delta_refusal()
        assert b.url in refusal and a.url not in refusal and f"--custom-weight-loader {LOADER}" in refusal
        assert SGLangEngine.at([a.url], control_timeout_s=30).wire.delta_refusal() is None
    finally:
        both.close()


def test_quantized_and_speculative_servers_are_refused_delta_syncs_by_name():
    """What SGLang 0.5.23's /server_info reports (ServerArgs.resolved_dict: ``quantization`` as the
    flag set it, ``speculative_algorithm``) decides."""

    class Reported:  # the servers' /server_info answers
        infos = {
            "http://q:1": {"custom_weight_loader": [LOADER], "quantization": "fp8"},
            "http://s:1": {"custom_weight_loader": [LOADER], "quantization": None, "speculative_algorithm": "EAGLE3"},
            "http://ok:1": {"custom_weight_loader": [LOADER], "quantization": None, "speculative_algorithm": None},
        }

        def server_info(self, w):
            return self.infos[w]

    api = SGLangAPI()
    assert api.delta_refusal(Reported(), ["http://ok:1"]) is None
    refusal = api.delta_refusal(Reported(), list(Reported.infos))
    assert "http://q:1 serves quantized weights (quantization=fp8)" in refusal
    assert "http://s:1 runs speculative decoding (speculative_algorithm=EAGLE3" in refusal
    assert "http://ok:1" not in refusal


def test_a_checkpoint_quantized_by_its_config_and_weights_permuted_after_loading_are_refused_delta(tmp_path):
    """SGLang's /server_info reports only the --quantization flag: a checkpoint that declares its
    quantization in config.json is read from the model path where the trainer can; a server listing
    SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED (SGLANG_EXPOSE_OWN_ENV_VARS) permutes MoE weights after loading."""
    import json

    quantized = tmp_path / "fp8"
    quantized.mkdir()
    (quantized / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    listed = [{"env_vars": {"SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED": "true"}}]

    class Reported:
        infos = {
            "http://q:1": {"custom_weight_loader": [LOADER], "model_path": str(quantized)},
            "http://p:1": {"custom_weight_loader": [LOADER], "model_path": str(plain), "internal_states": listed},
            "http://ok:1": {"custom_weight_loader": [LOADER], "model_path": str(plain)},
            "http://far:1": {"custom_weight_loader": [LOADER], "model_path": "/not/readable/here"},
        }

        def server_info(self, w):
            return self.infos[w]

    api = SGLangAPI()
    assert api.delta_refusal(Reported(), ["http://ok:1", "http://far:1"]) is None
    refusal = api.delta_refusal(Reported(), list(Reported.infos))
    assert (
        "http://q:1 serves quantized weights (its checkpoint's config.json declares quantization_config fp8" in refusal
    )
    assert "http://p:1 runs with SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED=true" in refusal
    assert "http://ok:1" not in refusal and "http://far:1" not in refusal


def test_fifty_delta_syncs_leave_a_server_bit_identical_to_a_full_sync(servers, tiny_hf):
    a, b = servers
    reader = HFReader(tiny_hf["untied"])
    try:
        weights = {k: reader.get(k).to(torch.bfloat16) for _, keys in reader.files() for k in sorted(keys)}
    finally:
        reader.close()
    probe = [5, 17, 33, 60, 7]
    before = a.probe(a.url, probe, 6)
    start = _checksums(a.url)
    sa, sb = GroupSender(a, a.url, "delta_sglang_a"), GroupSender(b, b.url, "delta_sglang_b")
    try:
        images, g, sent = DeltaImages(full_every=1000), torch.Generator().manual_seed(0), []
        for version in range(1, 51):
            if version > 1:
                for t in weights.values():  # a few elements of each tensor move, as a small lr moves bf16
                    mask = torch.rand(t.shape, generator=g) < 0.02
                    step = (0.01 * torch.randn(t.shape, generator=g)).to(t.dtype)
                    t.add_(torch.where(mask, step, torch.zeros_like(t)))
            sent.append(sa.sync(sorted(weights.items()), version, images))
        full = sb.sync(sorted(weights.items()), 50)
    finally:
        sa.close()
        sb.close()
    got_a, got_b = _checksums(a.url), _checksums(b.url)
    assert got_a == got_b  # bit for bit, every tensor
    assert got_a != start
    pa, pb = a.probe(a.url, probe, 6), b.probe(b.url, probe, 6)
    assert pa.token_ids == pb.token_ids and pa.logprobs == pb.logprobs
    assert pa.logprobs != before.logprobs
    assert sent[0] == full and max(sent[1:]) < 0.15 * full, (sent[:3], full)


def test_a_delta_request_for_a_group_it_never_joined_or_cannot_read_leaves_the_server_serving(tiny_hf):
    """Nothing of the loader's raises inside SGLang's scheduler (which would end the server): a
    request naming a group this server never joined is answered (the sender's check of the group
    then says so), and one whose description cannot be read marks every group of the server."""
    from megatron_klear.rollout.embedded import EmbeddedEngine
    from megatron_klear.rollout.sglang_standin import serve_in_thread

    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    server, url = serve_in_thread(engine, custom_weight_loader=[LOADER])
    try:
        assert httpx.post(url + "/begin_weight_update", json={}, timeout=30).json()["success"]
        _, body = SGLangAPI().bucket_call(
            ["model.norm.weight"], ["float32"], [[32]], group_name="never_joined", load_format=None, counts=[1]
        )
        r = httpx.post(url + "/update_weights_from_tensor", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["success"], r.text
        check = SGLangAPI().group_check_call("never_joined")
        answer = httpx.post(url + check[0], json=check[1], timeout=30).json()
        assert not answer["success"] and "Group never_joined not in" in answer["message"], answer
        # a description that is not one (another tensor's name): every group the server holds is marked
        state = server.state
        state.update_groups["held"] = object()
        garbled = base64.b64encode(__import__("pickle").dumps([("not.a.spec", torch.zeros(1))])).decode()
        body = {**body, "serialized_named_tensors": [garbled]}
        r = httpx.post(url + "/update_weights_from_tensor", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["success"], r.text
        assert [n for n in state.update_groups if n.startswith("held (delta load failed: ValueError: ")], list(
            state.update_groups
        )
        assert httpx.get(url + "/health", timeout=5).status_code == 200  # serving
    finally:
        server.server_close()


def test_a_failed_delta_load_marks_the_group_and_the_server_keeps_serving(servers):
    import torch.distributed as dist

    from megatron_klear.rollout.servers.update_group import index_dtype
    from megatron_klear.rollout.sglang import SGLangEngine

    url = servers[0].url
    client = SGLangEngine.at([url], control_timeout_s=30)
    sender = GroupSender(client, url, "marked_group")
    try:
        before = _checksums(url)
        wire = client.wire
        wire.start_update()
        # a delta bucket with a NaN among its changed values (the sender's rule broken on purpose)
        post = wire.post_bucket(
            ["model.norm.weight"], ["bfloat16"], [[64]], group_name="marked_group", counts=[1], timeout=30
        )
        assert post.refusals(0.2) == {}
        assert agree_ready(sender.pg, "cpu", True)  # (the NaN is found after the receive)
        dist.broadcast(torch.tensor([3], dtype=index_dtype(64)), src=0, group=sender.pg)
        dist.broadcast(torch.tensor([float("nan")], dtype=torch.bfloat16), src=0, group=sender.pg)
        assert post.result() == {}  # answered: SGLang would have ended its scheduler on a raise
        refused = wire.check_group("marked_group", [url])
        marked = wire.failed_load(refused[url], "marked_group")
        assert marked is not None and marked.startswith("marked_group (delta load failed: ValueError: ")
        assert "NaN among its changed values" in marked
        assert wire.failed_load(refused[url], "another_group") is None
        wire.finish_update(7, check_received=False)
        assert _checksums(url) == before  # nothing of the refused bucket was written
        assert len(wire.probe(url, [5, 6, 7], 3).token_ids) == 3  # serving
        # the client drops the marked group; a group formed afresh takes updates again
        wire.leave_group(marked)
        fresh = GroupSender(client, url, "marked_group_2")
        try:
            fresh.sync([("model.norm.weight", torch.full((64,), 0.5, dtype=torch.bfloat16))], 8)
        finally:
            fresh.close()
        after = _checksums(url)
        assert after["model.norm.weight"] != before["model.norm.weight"]
        assert {k: v for k, v in after.items() if k != "model.norm.weight"} == {
            k: v for k, v in before.items() if k != "model.norm.weight"
        }
    finally:
        sender.close()
        client.close()


def test_the_loader_refuses_a_bucket_that_would_not_fit_before_receiving_it(monkeypatch):
    """The free-memory check on a GPU server (its device facts injected): a bucket whose pieces and
    densified tensors exceed the free memory is refused before anything is received."""
    from megatron_klear.rollout.in_server import sglang_delta

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 20, 80 << 30))
    with pytest.raises(MemoryError, match=r"takes 4 MiB, 3 MiB are free on cuda:0"):
        sglang_delta._check_memory(torch.device("cuda:0"), 4 << 20)
    sglang_delta._check_memory(torch.device("cuda:0"), 2 << 20)
    sglang_delta._check_memory(torch.device("cpu"), 1 << 40)  # a CPU server: not checked


def test_the_loaders_pieces_write_only_the_changed_elements():
    """densified + nan_masked_copies, as SGLang's weight loaders meet them: a fused parameter written
    through a narrowed (non-contiguous) view keeps every element but the changed ones; a tensor
    without changes is not handed over; a NaN among the changes is refused."""
    from megatron_klear.rollout.in_server.sglang_delta import densified, nan_masked_copies
    from megatron_klear.rollout.servers.update_group import delta_segments

    segments = delta_segments(["q", "k", "n"], ["float32"] * 3, [[2, 3], [2, 3], [4]], [2, 0, DENSE])
    tensors = [
        torch.tensor([1, 5], dtype=torch.int32),
        torch.tensor([10.0, 50.0]),
        torch.empty(0, dtype=torch.int32),
        torch.empty(0),
        torch.arange(4.0),
    ]
    out = list(densified(segments, tensors, {"q": [2, 3], "k": [2, 3], "n": [4]}))
    assert [(name, whole) for name, _, whole in out] == [("q", False), ("n", True)]
    fused = torch.zeros(2, 6)  # q and k side by side, as a qkv parameter holds them
    with nan_masked_copies():
        fused[:, :3].copy_(out[0][1])
    assert fused.tolist() == [[0, 10, 0, 0, 0, 0], [0, 0, 50, 0, 0, 0]]
    assert torch.Tensor.copy_(torch.zeros(2), torch.tensor([float("nan"), 1.0]))[0].isnan()  # restored
    with nan_masked_copies():  # a loader that broadcasts a delta into another shape: refused, nothing written
        target = torch.zeros(2, 3)
        with pytest.raises(ValueError, match=r"copied a delta tensor of shape \(3,\) into one of shape \(2, 3\)"):
            target.copy_(torch.tensor([float("nan"), 1.0, float("nan")]))
        assert not target.any()
        target.copy_(torch.ones(3))  # a whole tensor of another shape: copied as always
    assert target.tolist() == [[1, 1, 1], [1, 1, 1]]
    bad = [torch.tensor([0], dtype=torch.int32), torch.tensor([float("nan")])]
    with pytest.raises(ValueError, match="NaN among its changed values"):
        list(densified(delta_segments(["q"], ["float32"], [[2]], [1]), bad, {"q": [2]}))


def test_a_delta_into_fused_expert_parameters_writes_only_its_changed_elements(tmp_path):
    """The stand-in's MoE layers hold each layer's experts fused (``gate_up_proj`` [E, 2I, H]) and
    load a per-expert checkpoint tensor through a narrowed view of it, as SGLang's FusedMoE does
    (``expert_data.narrow(...).copy_``): a delta handed to that loader (densified, under the masked
    copy) changes its own elements of the fused parameter and nothing else."""
    from megatron_klear.models.tiny import make_tiny_qwen3_moe
    from megatron_klear.rollout.embedded import EmbeddedEngine
    from megatron_klear.rollout.in_server.sglang_delta import densified, nan_masked_copies
    from megatron_klear.rollout.servers.update_group import delta_segments
    from megatron_klear.rollout.sglang_standin.weight_routes import LoaderModel

    engine = EmbeddedEngine.from_pretrained(make_tiny_qwen3_moe(str(tmp_path / "moe"), seed=3))
    fused = dict(engine.weights.model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    before = fused.detach().clone()
    e, half = 2, fused.shape[1] // 2
    name = f"model.layers.0.mlp.experts.{e}.up_proj.weight"  # the up rows of expert 2
    shape = [half, fused.shape[2]]
    segments = delta_segments([name], [str(fused.dtype).split(".")[1]], [shape], [2])
    positions = torch.tensor([1, half * fused.shape[2] - 1], dtype=torch.int32)
    values = torch.tensor([7.0, -7.0], dtype=fused.dtype)
    delta = list(densified(segments, [positions, values], {name: shape}))
    with nan_masked_copies():
        LoaderModel(engine.weights).load_weights([(n, t) for n, t, _ in delta])
    expected = before.clone()
    expected[e, half:].view(-1)[positions.long()] = values
    assert torch.equal(fused.detach(), expected)
    assert int((fused.detach() != before).sum()) == 2


def test_a_delta_bucket_refused_before_the_receive_is_agreed_and_never_broadcast(servers):
    """The loader finds a bucket it cannot take before receiving anything (here a count larger than
    its tensor; on a GPU also too little free memory to densify it): every member of the group
    agrees not to receive it, at once, and the sender does not broadcast (before: the loader
    answered Success without receiving and the sender's broadcast waited for the bucket timeout, 300
    s by default, at every delta sync); the group is marked with the reason."""
    import time

    from megatron_klear.rollout.sglang import SGLangEngine

    url = servers[0].url
    client = SGLangEngine.at([url], control_timeout_s=30)
    sender = GroupSender(client, url, "unready_group")
    try:
        wire = client.wire
        wire.start_update()
        t0 = time.monotonic()
        post = wire.post_bucket(
            ["model.norm.weight"], ["bfloat16"], [[64]], group_name="unready_group", counts=[65], timeout=30
        )
        work, flag = agree_ready(sender.pg, "cpu", True, async_op=True)
        deadline = time.monotonic() + 20
        while not work.is_completed():
            assert time.monotonic() < deadline, "the loader never took part in the agreement"
            time.sleep(0.01)
        assert int(flag.item()) == 0 and time.monotonic() - t0 < 20
        assert post.result() == {}
        marked = wire.failed_load(wire.check_group("unready_group", [url])[url], "unready_group")
        assert marked is not None and "count 65 is not -1 or 0..64" in marked, marked
        wire.finish_update(9, check_received=False)
        wire.leave_group(marked)
    finally:
        sender.close()
        client.close()
