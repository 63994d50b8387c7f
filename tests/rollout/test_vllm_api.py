"""The vLLM client's reading of answers it must survive (no server: tests/rollout/test_vllm_server.py
runs the real one): an answer aborted by a push is sent again, one aborted on request is the output
so far, malformed answers fail naming the URL and sample, version spans become per-token versions,
and the body carries exactly the keys vLLM reads (it ignores unknown ones silently)."""

import pytest

from megatron_klear.rollout.base import EngineError, SamplingParams
from megatron_klear.rollout.servers.dialect import AbortedByServer
from megatron_klear.rollout.sglang.api import SGLangAPI
from megatron_klear.rollout.vllm.api import VLLMAPI

WHERE = "http://w:1/inference/v1/generate"


def choice(tokens, reason="stop", spans=None, index=0, lps=None):
    lps = lps if lps is not None else [-0.5 - i for i in range(len(tokens))]
    return {
        "index": index,
        "finish_reason": reason,
        "token_ids": tokens,
        "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(tokens, lps)]} if tokens else None,
        "weight_versions": spans,
    }


def test_answers_become_completions_with_per_token_versions():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    payload = {
        "choices": [
            choice([7, 8], "length", [{"version": "4", "start": 0, "end": 2}], 1),
            choice([5, 6, 9], "stop", spans),
        ]
    }
    comps, finals = VLLMAPI().read_generate(payload, 2, where=WHERE, routing=None, allow_abort=False)
    assert [c.token_ids for c in comps] == [[5, 6, 9], [7, 8]]  # in index order
    assert comps[0].versions == [3, 3, 4] and finals == ["4", "4"]
    assert comps[0].logprobs == [-0.5, -1.5, -2.5] and comps[1].finish_reason == "length"
    before_any_push = {"choices": [choice([1], "stop", [{"version": "default", "start": 0, "end": 1}])]}
    comps, finals = VLLMAPI().read_generate(before_any_push, 1, where=WHERE, routing=None, allow_abort=False)
    assert comps[0].versions == [None] and finals == ["default"]


def test_an_abort_is_sent_again_unless_the_stream_asked_for_it():
    payload = {"choices": [choice([4, 5], "abort", [{"version": "2", "start": 0, "end": 2}])]}
    with pytest.raises(AbortedByServer, match="sample 0 aborted"):
        VLLMAPI().read_generate(payload, 1, where=WHERE, routing=None, allow_abort=False)
    comps, _ = VLLMAPI().read_generate(payload, 1, where=WHERE, routing=None, allow_abort=True)
    assert comps[0].aborted and comps[0].token_ids == [4, 5]
    empty = {"choices": [choice([], "abort", [])]}  # aborted before its first token
    comps, finals = VLLMAPI().read_generate(empty, 1, where=WHERE, routing=None, allow_abort=True)
    assert comps[0].token_ids == [] and finals == [None]


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"choices": []}, "answered 0 samples, expected 1"),
        ({"error": {"message": "x"}}, "no choices list"),
        ({"choices": [choice([1, 2], lps=[-1.0])]}, "logprobs.content does not match token_ids"),
        ({"choices": [{**choice([1]), "logprobs": None}]}, "was logprobs: 0 sent"),
        ({"choices": [choice([1], "repetition")]}, "finished with 'repetition'"),
        ({"choices": [choice([1, 2], spans=[{"version": "1", "start": 0, "end": 1}])]}, "cover 1 tokens"),
    ],
)
def test_malformed_answers_fail_naming_the_url_and_sample(payload, message):
    with pytest.raises(EngineError, match=message) as e:
        VLLMAPI().read_generate(payload, 1, where=WHERE, routing=None, allow_abort=False)
    assert "http://w:1" in str(e.value)


def test_the_body_holds_exactly_what_vllm_reads():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, stop_token_ids=[3], seed=5)
    body = VLLMAPI().generate_body([1, 2], params, 4, 123, routing=False)
    assert body == {
        "token_ids": [1, 2],
        "sampling_params": {
            "max_tokens": 16,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "n": 4,
            "logprobs": 0,
            "stop_token_ids": [3],
            "skip_special_tokens": False,
            "detokenize": False,
            "seed": 123,
        },
    }
    penalised = SamplingParams(max_new_tokens=4, repetition_penalty=1.05)
    assert (
        VLLMAPI().generate_body([1], penalised, 1, None, routing=False)["sampling_params"]["repetition_penalty"] == 1.05
    )
    # SGLang takes it too (its rule counts the response's tokens only: the stand-in applies it)
    assert (
        SGLangAPI().generate_body([1], penalised, 1, None, routing=False)["sampling_params"]["repetition_penalty"]
        == 1.05
    )
    assert "repetition_penalty" not in SGLangAPI().generate_body([1], params, 1, None, routing=False)["sampling_params"]
    with pytest.raises(EngineError, match="router replay"):
        VLLMAPI().generate_body([1], params, 1, None, routing=True)


class _Answers:
    """Canned HTTP answers by path (``Transport.request``'s signature); an exception is raised."""

    def __init__(self, answers):
        self.answers = answers

    def request(self, method, path, body=None, timeout=None, url=None, expect_json=True):
        answer = self.answers[path]
        if isinstance(answer, Exception):
            raise answer
        return answer


class _OneWorker:
    def on_workers(self, fn, tolerate_loss=False):
        return [fn("http://w:1")]


@pytest.mark.parametrize(
    "answers, message",
    [
        (
            {"/server_info?config_format=json": EngineError("... failed with HTTP 404: Not Found")},
            "VLLM_SERVER_DEV_MODE=1",
        ),
        (
            {"/server_info?config_format=json": {"vllm_config": {"model_config": {"logprobs_mode": "raw_logprobs"}}}},
            "--logprobs-mode processed_logprobs",
        ),
        (
            {
                "/server_info?config_format=json": {
                    "vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}
                },
                "/inference/v1/generate": EngineError("... failed with HTTP 403: Scale-out endpoints are disabled"),
            },
            "--enable-scale-out",
        ),
    ],
)
def test_a_server_started_without_what_the_loop_needs_is_refused_by_name(answers, message):
    from megatron_klear.rollout.config import RolloutConfig
    from megatron_klear.rollout.vllm.upkeep import VLLMUpkeep

    upkeep = VLLMUpkeep(_Answers(answers), _OneWorker(), None, RolloutConfig(engine="vllm", urls=["http://w:1"]))
    with pytest.raises(EngineError, match=message) as e:
        upkeep.check_started()
    assert "http://w:1" in str(e.value)


def test_a_server_without_the_transfer_engine_is_named_for_the_in_memory_route():
    """weight_sync=memory into vLLM needs the project's transfer engine: a server started with
    another backend (or none) is named, with the flag, and the push goes through disk."""
    with_engine = {"vllm_config": {"weight_transfer_config": {"backend": "megatron_klear"}}}
    without = {"vllm_config": {"weight_transfer_config": {"backend": "nccl"}}}
    api = VLLMAPI()
    assert api.tensor_refusal(_Answers({"/server_info?config_format=json": with_engine}), ["http://w:1"]) is None
    refusal = api.tensor_refusal(_Answers({"/server_info?config_format=json": without}), ["http://w:1"])
    assert "http://w:1 has weight-transfer backend 'nccl'" in refusal
    assert (
        "rollout.weight_sync=memory" in refusal
        and '--weight-transfer-config \'{"backend": "megatron_klear"}\'' in refusal
    )
    path, body = api.tensor_call(["cGF5bG9hZA==", "b3RoZXI="], None, "http://w:1")  # one per worker process
    assert (path, body) == ("/update_weights", {"update_info": {"tensors": ["cGF5bG9hZA==", "b3RoZXI="]}})
    assert SGLangAPI().tensor_refusal(None, ["http://w:1"]) is None


def test_each_vllm_worker_process_runs_on_the_physical_gpu_its_servers_cuda_visible_devices_gives():
    """Worker process r runs on local GPU r; the server's CUDA_VISIBLE_DEVICES comes from dev mode's
    /server_info (system_env.env_vars, vLLM's collect_env lists the CUDA variables)."""
    info = {
        "vllm_config": {"parallel_config": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1}},
        "system_env": {"env_vars": "NCCL_DEBUG=WARN\nCUDA_VISIBLE_DEVICES=6,3\nOMP_NUM_THREADS=1\n"},
    }
    assert VLLMAPI().tensor_gpus(_Answers({"/server_info?config_format=json": info}), "http://w:1") == [6, 3]
    info["system_env"]["env_vars"] = "NCCL_DEBUG=WARN\n"  # every GPU visible
    assert VLLMAPI().tensor_gpus(_Answers({"/server_info?config_format=json": info}), "http://w:1") == [0, 1]


def test_colocated_vllm_releases_the_kv_cache_alone_with_its_own_route_not_a_level_1_sleep():
    """vLLM 0.32's /sleep?level=1 offloads the weights too, and waking only kv_cache then leaves the
    engine asleep with its scheduler paused; the KV cache alone goes through a completed pause and
    /release_kv_cache_memory. Everything: a level-2 sleep."""
    from megatron_klear.rollout.config import RolloutConfig
    from megatron_klear.rollout.vllm.upkeep import VLLMUpkeep

    class Recording:
        def __init__(self):
            self.calls = []

        def request(self, method, path, body=None, timeout=None, url=None, expect_json=True):
            self.calls.append((method, path))
            return {}

    class Members(_OneWorker):
        def on_workers(self, fn, tolerate_loss=False):
            return {"http://w:1": fn("http://w:1")}

    transport = Recording()
    upkeep = VLLMUpkeep(transport, Members(), None, RolloutConfig(engine="vllm", urls=["http://w:1"]))
    assert upkeep.release_memory(["kv_cache"]) == ["http://w:1"]
    assert transport.calls == [("POST", "/sleep?level=0&mode=abort"), ("POST", "/release_kv_cache_memory")]
    transport.calls.clear()
    upkeep.resume_memory(["kv_cache"])
    assert transport.calls == [("POST", "/wake_up?tags=kv_cache")]
    transport.calls.clear()
    upkeep.release_memory(None)
    assert transport.calls == [("POST", "/sleep?level=2&mode=abort")]
