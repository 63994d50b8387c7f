"""SGLang's distributed weight-update protocol on our embedded server (a subprocess), with this test
process as the sender (group rank 0): the group joins through a TCP store laid out as SGLang lays it
out, tensors arrive by broadcast (one per tensor, or one flattened bucket), a begin/end session is
required, nothing is applied before ``/end_weight_update`` and a failed session applies nothing
(the version the server reports says which weights it serves), the cache-flush rule, checksums."""

import threading
import uuid

import httpx
import pytest
import torch
import torch.distributed as dist

from megatron_klear.checkpoint.hf_io import HFReader
from megatron_klear.rollout.embedded import EmbeddedEngine
from megatron_klear.rollout.servers.update_group import (
    FLATTENED_BUCKET,
    destroy_update_group,
    dtype_name,
    ephemeral_range,
    flatten_bucket,
    join_update_group,
    open_master_store,
    port_in_use_message,
)
from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine


@pytest.fixture(scope="module")
def server(tiny_hf):
    s = EmbeddedHTTPEngine.launch(tiny_hf["untied"], weight_sync_timeout=20, startup_timeout=120)
    yield s
    s.close()


def post(url, path, body=None, timeout=60):
    r = httpx.post(url + path, json=body or {}, timeout=timeout)
    return r.status_code, (r.json() if r.content else None)


def checksums(url):
    r = httpx.get(url + "/weights_checker", timeout=60).json()
    assert r["success"], r
    return r["ranks"][0]["checksums"]


class Sender:
    """Group rank 0 in this process; the server joins as rank 1."""

    def __init__(self, url):
        self.url, self.name = url, f"test_{uuid.uuid4().hex[:8]}"
        store = open_master_store("127.0.0.1", 0, 2, 20)
        answer = {}
        t = threading.Thread(
            target=lambda: answer.update(
                r=post(
                    url,
                    "/init_weights_update_group",
                    {
                        "master_address": "127.0.0.1",
                        "master_port": store.port,
                        "rank_offset": 1,
                        "world_size": 2,
                        "group_name": self.name,
                        "backend": "gloo",
                    },
                )
            )
        )
        t.start()
        self.pg = join_update_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=store.port,
            rank=0,
            world_size=2,
            group_name=self.name,
            timeout=20,
            store=store,
        )
        t.join()
        assert answer["r"] == (200, {"success": True, "message": "Succeeded to initialize custom process group."})

    def send(self, named, *, flattened=True, **extra):
        body = {
            "names": [n for n, _ in named],
            "dtypes": [dtype_name(t.dtype) for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "group_name": self.name,
            **extra,
        }
        if flattened:
            body["load_format"] = FLATTENED_BUCKET
        answer = {}
        t = threading.Thread(target=lambda: answer.update(r=post(self.url, "/update_weights_from_distributed", body)))
        t.start()
        if flattened:
            dist.broadcast(flatten_bucket([x for _, x in named]), src=0, group=self.pg)
        else:
            for _, x in named:
                dist.broadcast(x.contiguous(), src=0, group=self.pg)
        t.join()
        return answer["r"]

    def close(self):
        post(self.url, "/destroy_weights_update_group", {"group_name": self.name})
        destroy_update_group(self.pg)


def _other_weights(tiny_hf_dir, other_dir):
    ref, other = HFReader(tiny_hf_dir), HFReader(other_dir)
    return [(k, other.get(k)) for k in sorted(ref.keys())]


def test_session_rules_and_unknown_groups(server):
    url = server.url
    assert post(url, "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}) == (
        400,
        {
            "success": False,
            "message": "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
        },
    )
    assert post(url, "/end_weight_update")[0] == 400
    assert post(url, "/begin_weight_update") == (200, {"success": True, "message": "Success"})
    status, body = post(url, "/begin_weight_update")
    assert status == 400 and "already open" in body["message"]
    status, body = post(
        url,
        "/update_weights_from_distributed",
        {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"},
    )
    assert status == 400 and "Group nope not in" in body["message"]
    status, body = post(url, "/end_weight_update")  # the failed session is discarded
    assert status == 400 and "nothing was applied" in body["message"]
    assert post(url, "/destroy_weights_update_group", {"group_name": "nope"}) == (
        400,
        {"success": False, "message": "The group to be destroyed does not exist."},
    )
    status, body = post(
        url,
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"},
    )
    assert status == 400 and "nccl needs CUDA" in body["message"]
    info = httpx.get(url + "/server_info").json()
    assert (info["tp_size"], info["pp_size"], info["dp_size"]) == (1, 1, 1)


def test_weights_apply_whole_at_end_of_session(server, tiny_hf, other_hf):
    url = server.url
    before = checksums(url)
    version = httpx.get(url + "/model_info").json()["weight_version"]
    new = _other_weights(tiny_hf["untied"], other_hf)
    sender = Sender(url)
    try:
        assert post(url, "/begin_weight_update")[0] == 200
        half = len(new) // 2
        status, body = sender.send(new[:half], flattened=False)  # SGLang's default: one broadcast per tensor
        assert status == 200 and body["success"], body
        assert checksums(url) == before  # staged, not served
        status, body = sender.send(new[half:], weight_version="v-other")  # one flattened bucket
        assert status == 200 and body["success"], body
        assert checksums(url) == before and httpx.get(url + "/model_info").json()["weight_version"] == version
        assert post(url, "/end_weight_update") == (200, {"success": True, "message": "Success"})
        assert checksums(url) == EmbeddedEngine.from_pretrained(other_hf).weights.checksums()
        assert httpx.get(url + "/model_info").json()["weight_version"] == "v-other"
        # a failed session applies nothing: one good bucket, then a tensor the model does not have
        back = [(k, HFReader(tiny_hf["untied"]).get(k)) for k, _ in new]
        assert post(url, "/begin_weight_update")[0] == 200
        assert sender.send(back[:3], weight_version="v-back")[0] == 200
        status, body = sender.send([("model.layers.99.mlp.up_proj.weight", torch.zeros(3, 2))])
        assert status == 400 and "model.layers.99" in body["message"], body
        status, body = post(url, "/end_weight_update")
        assert status == 400 and "nothing was applied" in body["message"] and "v-other" in body["message"]
        assert checksums(url) == EmbeddedEngine.from_pretrained(other_hf).weights.checksums()
        assert httpx.get(url + "/model_info").json()["weight_version"] == "v-other"
        # and the original weights back, all of them
        assert post(url, "/begin_weight_update")[0] == 200
        assert sender.send(back, weight_version=version)[0] == 200
        assert post(url, "/end_weight_update")[0] == 200
        assert checksums(url) == before
    finally:
        sender.close()


def test_cache_flush_refused_while_requests_hold_their_kv_cache(server, tiny_hf):
    """SGLang flushes the cache after an update and fails the call when running requests hold KV
    cache of the old weights (paused in place); paused with retract (or abort) it succeeds."""
    url = server.url
    same = [(k, HFReader(tiny_hf["untied"]).get(k)) for k in ["model.norm.weight"]]
    gen = {}
    long_request = threading.Thread(
        target=lambda: gen.update(
            r=httpx.post(
                url + "/generate",
                json={
                    "input_ids": [5, 6, 7],
                    "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 1.0},
                },
                timeout=120,
            )
        )
    )
    sender = Sender(url)
    try:
        long_request.start()
        for _ in range(200):  # until it decodes
            if httpx.get(url + "/server_info").json()["internal_states"][0]["num_running_reqs"]:
                break
            threading.Event().wait(0.02)
        assert post(url, "/pause_generation", {"mode": "in_place"})[0] == 200
        assert post(url, "/begin_weight_update")[0] == 200
        status, body = sender.send(same)
        assert status == 400 and "cache was not flushed" in body["message"], body
        assert post(url, "/end_weight_update")[0] == 400
        assert post(url, "/begin_weight_update")[0] == 200
        assert sender.send(same, flush_cache=False)[0] == 200  # the held request keeps its cache
        assert post(url, "/end_weight_update")[0] == 200
        assert post(url, "/pause_generation", {"mode": "retract"})[0] == 200
        assert post(url, "/begin_weight_update")[0] == 200
        assert sender.send(same)[0] == 200  # retracted: recomputed on continue
        assert post(url, "/end_weight_update")[0] == 200
    finally:
        post(url, "/abort_request", {"abort_all": True})
        post(url, "/continue_generation")
        long_request.join()
        sender.close()
    assert gen["r"].status_code == 200


def test_destroying_the_group_discards_what_its_sender_staged(server, tiny_hf, other_hf):
    url = server.url
    before = checksums(url)
    sender = Sender(url)
    assert post(url, "/begin_weight_update")[0] == 200
    assert sender.send(_other_weights(tiny_hf["untied"], other_hf)[:2])[0] == 200
    sender.close()  # a trainer that went away mid-update
    assert post(url, "/begin_weight_update")[0] == 200  # the stale session is gone
    assert post(url, "/end_weight_update") == (200, {"success": True, "message": "Success"})
    assert checksums(url) == before


def test_weights_checker_answers_sglangs_shape(server, tiny_hf):
    r = httpx.post(server.url + "/weights_checker", json={"action": "checksum"}).json()
    assert r["success"] and len(r["per_engine_checksum"]) == 64
    (rank,) = r["ranks"]
    assert rank["checksums"] == EmbeddedEngine.from_pretrained(tiny_hf["untied"]).weights.checksums()
    assert rank["parallelism_info"][0]["tp_size"] == 1
    status, body = post(server.url, "/weights_checker", {"action": "snapshot"})
    assert status == 400 and "not supported" in body["message"]


def test_a_taken_port_in_the_ephemeral_range_is_named_as_such(tmp_path):
    """A fixed port inside the host's ephemeral range can be taken by any outgoing connection or
    bind(0) between a job's restarts (what the Slurm tests met with ports from bind(0)): the error says
    so, with the range read from the kernel's file; a port below it gets the plain message."""
    proc_file = tmp_path / "ip_local_port_range"
    proc_file.write_text("32768\t60999\n")
    assert ephemeral_range(str(proc_file)) == (32768, 60999)
    assert ephemeral_range(str(tmp_path / "missing")) is None
    inside = port_in_use_message(33903, (32768, 60999))
    assert "port 33903 is already in use" in inside and "ephemeral range (32768-60999" in inside
    below = port_in_use_message(29600, (32768, 60999))
    assert below == "port 29600 is already in use on this host"
