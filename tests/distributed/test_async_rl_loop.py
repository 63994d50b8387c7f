"""The RL loop with ``rl.async_steps=1 rollout.partial=true`` through the real sglang-router in front
of two stand-in servers (docs/async.md): the next batch generates while the actor trains, weights
reach the servers mid-generation with pause(retract) -> update -> continue (distributed sync, the
default for servers on their own GPUs: the update groups run over gloo here), a step aborts its
longest responses once it has its groups and continues them at the next. The run is stopped with a
non-empty partial buffer and a batch generated ahead, resumed, and must train on exactly what was
saved; at the end every server holds the trainer's final weights."""

import json
import os

import pytest

from tests.distributed.helper import TOY_RL_TRAINING, run_distributed


def _run(rank, world, overrides, stop_after=None):
    from megatron_klear.config import load_config
    from megatron_klear.rl.loop import RLLoop
    from megatron_klear.rollout.weight_sync import iter_model_hf_weights

    loop = RLLoop(load_config(None, overrides))
    trained = []
    update = loop.actor.update

    def recording(samples):
        trained.append(
            (
                loop.actor.weight_version,
                [(list(s.prompt_ids), list(s.response_ids), list(s.versions or [])) for s in samples],
            )
        )
        return update(samples)

    loop.actor.update = recording
    loop.run(stop_after=stop_after)
    return trained, {k: v.clone() for k, v in iter_model_hf_weights(loop.state.model)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("async-rl")
    model = make_tiny_qwen3(str(root / "m"), num_layers=2, seed=21)
    prompts = write_rl_prompts_jsonl(str(root / "prompts.jsonl"), 64, seed=3)
    return {"model": model, "prompts": prompts, "root": str(root)}


def _common(save: str, step: int) -> dict:
    import torch

    path = os.path.join(save, f"iter_{step:07d}", "common.pt")
    return torch.load(path, map_location="cpu", weights_only=True)["common"]


def test_async_partial_run_through_the_router_resumes_exactly(setup):
    from megatron_klear.rollout.base import SamplingParams
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine
    from tests.distributed.test_rl_loop import _probe_logprobs_of_trainer
    from tests.rollout.processes import router

    # at most 4 and 3 sequences running: a step's samples wait for room and join the running batch
    # as others finish (a random model's responses all run to the length limit), so the step has its
    # quota while later samples are still running, with tokens
    servers = [EmbeddedHTTPEngine.launch(setup["model"], startup_timeout=120, max_running_requests=n) for n in (4, 3)]
    save = os.path.join(setup["root"], "run")
    args = [
        f"model.path={setup['model']}",
        f"rl.prompts=[{setup['prompts']}]",
        f"train.save_dir={save}",
        "train.steps=4",
        "train.save_interval=1",
        "rl.prompts_per_step=2",
        "rl.oversample_prompts=6",
        "rl.responses_per_prompt=4",
        "rl.mini_batch_prompts=2",
        "rl.max_tokens_per_micro_batch=256",
        "rl.max_prompt_length=64",
        "rollout.max_new_tokens=48",
        *TOY_RL_TRAINING,
        "rl.filter_zero_spread=false",
        "rl.async_steps=1",
        "rollout.partial=true",
        "rl.max_staleness=2",
        "rl.tis_cap=2.0",
        "rollout.engine=sglang",
        "rollout.max_concurrent_requests=32",  # weights: distributed (the default for dedicated servers)
    ]
    try:
        with router([s.url for s in servers]) as router_url:
            args.append(f"rollout.urls=[{router_url}]")
            first, _ = run_distributed(_run, 1, args, 2)[0]  # stops after step 2: a checkpoint, not the end
            saved = _common(save, 2)["rollout"]
            second, trainer_w = run_distributed(_run, 1, args)[0]  # resumes: steps 3 and 4
            lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
            probe = [5, 17, 33, 60, 7]
            for s in servers:  # every server holds the trainer's final weights
                client = SGLangEngine.at([s.url])
                assert client.model_info()["weight_version"] == "4"
                out = client.generate([probe], SamplingParams(top_k=1, max_new_tokens=6))[0][0]
                want = _probe_logprobs_of_trainer(setup["model"], trainer_w, probe, out.token_ids)
                assert max(abs(a - b) for a, b in zip(out.logprobs, want)) < 1e-4, (s.url, out.logprobs, want)
    finally:
        for s in servers:
            s.close()

    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert [v for v, _ in first] == [0, 1] and [v for v, _ in second] == [2, 3]
    # the checkpoint kept the batch generated ahead for step 3 and the partial responses
    ahead = saved["ahead"]
    assert ahead["step"] == ahead["weight_version"] == 2 and ahead["samples"]
    partials = [
        (g["prompt"]["prompt_ids"], s)
        for g in saved["producer"]["groups"]
        for s in g["slots"]
        if s["tokens"] and s["finish_reason"] is None
    ]
    assert partials, "no partial response was buffered at the checkpoint"
    # the resumed step 3 trains on exactly the saved batch
    assert second[0][1] == [(s["prompt_ids"], s["response_ids"], s["versions"]) for s in ahead["samples"]]
    # tokens are at most rl.max_staleness=2 versions older than the policy they train
    for policy, samples in first + second:
        for _, response, versions in samples:
            assert len(versions) == len(response) and all(policy - 2 <= v <= policy for v in versions)
    # the buffered partials are continued: the first batch produced after the resume (step 4's)
    # carries every saved group that holds one (whether it is trained by step 4 depends on timing)
    held = {tuple(prompt) for prompt, _ in partials}
    assert lines[3]["rollout/resumed_groups"] >= len(held), (lines[3]["rollout/resumed_groups"], len(held))
    m = {k: sum(x.get(k, 0) for x in lines) for k in ("rollout/aborted_samples", "rollout/resumed_samples")}
    assert m["rollout/aborted_samples"] > 0 and m["rollout/resumed_samples"] > 0, m
    assert max(x["rollout/staleness_max"] for x in lines) <= 2
    assert max(x["rollout/staleness_max"] for x in lines) >= 1  # weights changed under running requests
    assert all(x["perf/overlap_s"] >= 0 and x["perf/samples_per_s"] > 0 for x in lines)
    assert any(x["perf/overlap_s"] > 0 for x in lines[1:])  # generation ran while the actor trained
