"""The whole RL loop on a tiny model: embedded engine -> grading pool -> actor at TP=2 -> weight
sync, checkpoints and resume. The engine's sampling log-probs must agree with the trainer's
recompute (same weights, same temperature): that checks weight sync and the temperature path."""

import json
import os
import shutil

import pytest

from tests.distributed.helper import run_distributed


def _run(rank, world, overrides, stop_after=None):
    from megatron_klear.config import load_config
    from megatron_klear.rl.loop import RLLoop

    loop = RLLoop(load_config(None, overrides))
    metrics = loop.run(stop_after=stop_after)
    engine_weights = None
    if rank == 0:
        engine_weights = (
            {k: v.clone() for k, v in loop.rollout.engine.model.state_dict().items()}
            if hasattr(loop.rollout.engine, "model")
            else None
        )
    from megatron_klear.rollout.weight_sync import iter_model_hf_weights

    trainer = {k: v.clone() for k, v in iter_model_hf_weights(loop.state.model)}
    return metrics, engine_weights, trainer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("rl")
    model = make_tiny_qwen3(str(root / "m"), num_layers=2, seed=21)
    prompts = write_rl_prompts_jsonl(str(root / "prompts.jsonl"), 24, seed=3)
    return {"model": model, "prompts": prompts, "root": str(root)}


def _overrides(setup, save):
    return [
        f"model.path={setup['model']}",
        f"rl.prompts=[{setup['prompts']}]",
        f"train.save_dir={save}",
        "train.steps=3",
        "train.save_interval=1",
        "rl.prompts_per_step=4",
        "rl.oversample_prompts=6",
        "rl.responses_per_prompt=6",
        "rl.mini_batch_prompts=2",
        "rl.max_tokens_per_micro_batch=256",
        "rl.max_prompt_length=64",
        "rollout.max_new_tokens=24",
        "optim.lr=1e-3",
        "optim.min_lr=1e-3",
        "optim.decay_style=constant",
        "reward.workers=1",
        "parallel.tp=2",
        "rollout.chunk_prompts=4",
    ]


def test_rl_loop_runs_syncs_and_resumes(setup):
    import torch

    save = os.path.join(setup["root"], "run")
    args = [*_overrides(setup, save), "rl.dump_rollouts=1"]
    metrics, engine_w, trainer_w = run_distributed(_run, 2, args, 2)[0]
    lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [1, 2]
    _check_dumped_old_logprobs(os.path.join(save, "rollouts"), lines)
    for m in lines:
        assert m["rollout/groups_generated"] == 6 and m["rollout/groups_kept"] <= 4
        assert -2.0 <= m["rollout/reward_mean"] <= 1.0
        if m.get("actor/optimizer_steps"):
            # engine log-probs (sampling) vs trainer recompute, same weights: float32 noise only
            assert m["actor/logprob_mismatch_max"] < 1e-3, m["actor/logprob_mismatch_max"]
    assert any(m.get("actor/optimizer_steps") for m in lines), "no step had a group with reward spread"
    # after the last sync the engine holds exactly the trainer's weights
    if engine_w is not None:
        for k, v in trainer_w.items():
            assert torch.allclose(engine_w[k].float(), v.float(), atol=1e-6), k
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    moved = os.path.join(setup["root"], "run_at_tp1")  # the same checkpoint, resumed at TP=1 below
    shutil.copytree(save, moved, ignore=shutil.ignore_patterns("run.lock"))
    # resume: step 3 continues from the saved prompt position
    _, _, at_tp2 = run_distributed(_run, 2, args)[0]
    lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [1, 2, 3]
    # resume on another layout: step 3 at TP=1 in one process generates the same rollouts (the engine
    # starts from the checkpoint's weights, the prompts from its position) and makes the TP=2 run's
    # update within float tolerance: the optimizer's moments, the data position and the weight
    # version crossed the change (a fresh Adam, or a prompt position off by one, fails it)
    args_tp1 = [a for a in args if not a.startswith(("parallel.tp=", "train.save_dir="))]
    _, _, at_tp1 = run_distributed(_run, 1, [*args_tp1, f"train.save_dir={moved}", "parallel.tp=1"])[0]
    tp1 = [json.loads(x) for x in open(os.path.join(moved, "metrics.jsonl"))]
    assert [m["step"] for m in tp1] == [1, 2, 3]
    want, got = lines[-1], tp1[-1]
    keys = ("rollout/reward_mean", "rollout/response_length_mean", "rollout/groups_kept", "actor/optimizer_steps")
    for key in (*keys, "data/position", "data/order_digest", "weights/version"):
        assert got[key] == want[key], (key, got[key], want[key])
    assert want.get("actor/optimizer_steps"), "step 3 made no update: the comparison would be vacuous"
    for key in ("actor/loss", "actor/grad_norm"):
        assert abs(got[key] - want[key]) <= 1e-4 * max(1.0, abs(want[key])), (key, got[key], want[key])
    for k, v in at_tp2.items():
        assert torch.allclose(at_tp1[k], v, atol=1e-5, rtol=0), (k, (at_tp1[k] - v).abs().max())


def _check_dumped_old_logprobs(directory, lines):
    """At TP=2 the trainer's per-response old log-probs (summed over both ranks, each holding the
    whole vocabulary's log-probs) are the engine's, response by response, within the step's largest
    token difference."""
    from megatron_klear.rl.rollout.records import read_step

    checked = 0
    for m in lines:
        trained = [r for r in read_step(directory, m["step"]) if r["trained"]]
        if not m.get("actor/optimizer_steps"):
            continue
        gaps = [abs(r["old_logprob_mean"] - r["behaviour_logprob_mean"]) for r in trained]
        assert max(gaps) <= m["actor/logprob_mismatch_max"] + 1e-6, (max(gaps), m["actor/logprob_mismatch_max"])
        checked += 1
    assert checked


def _probe_logprobs_of_trainer(model_dir, trainer_weights, prompt, response):
    """float64 log-probs of ``response`` after ``prompt`` under the trainer's final weights (an HF
    model built from the tiny checkpoint's config and loaded with the trainer's HF-named tensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).double().eval()
    missing, unexpected = model.load_state_dict({k: v.double() for k, v in trainer_weights.items()}, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    return [float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(response)]


def test_rl_loop_through_the_real_router_with_two_servers(setup):
    """rollout.urls is the sglang-router only. Generation is spread over both embedded servers;
    weight updates go to each worker (discovered through the router) as versioned directories
    (rollout.weight_sync=disk; the default, distributed, is tests/distributed/test_rl_weight_sync.py);
    at the end both hold the trainer's final weights: their log-probs for a probe sequence equal
    the trainer's. If a reload were skipped, step 2's sampling log-probs would disagree with the
    trainer's recompute and the probe would too."""
    from megatron_klear.rollout.base import SamplingParams
    from megatron_klear.rollout.sglang import SGLangEngine
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine
    from tests.rollout.processes import router

    servers = [EmbeddedHTTPEngine.launch(setup["model"], startup_timeout=120) for _ in range(2)]
    try:
        with router([s.url for s in servers]) as router_url:
            save = os.path.join(setup["root"], "router-run")
            args = _overrides(setup, save) + [
                "rollout.engine=sglang",
                f"rollout.urls=[{router_url}]",
                "parallel.tp=1",
                "train.steps=2",
                "optim.lr=5e-3",
                "optim.min_lr=5e-3",
                "rollout.max_concurrent_requests=4",
                "rollout.weight_sync=disk",
                # a random model ends ~9% of 48-token responses with </think> (reward -1 instead of
                # -0.5): enough reward spread that both steps train
                "rl.oversample_prompts=8",
                "rl.responses_per_prompt=8",
                "rollout.max_new_tokens=48",
            ]
            _, _, trainer_w = run_distributed(_run, 1, args)[0]
            lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
            last = lines[-1]["weights/version"]  # the steps that changed the weights
            # not only the trainer's own label: the steps that made an optimizer step, counted here
            assert last == sum(1 for m in lines if m.get("actor/optimizer_steps")), lines
            served = [SGLangEngine.at([s.url]).server_info().get("num_generate_requests", 0) for s in servers]
            assert all(n > 0 for n in served), served  # the router spread the prompts over both workers
            probe = [5, 17, 33, 60, 7]
            for s in servers:
                client = SGLangEngine.at([s.url])
                assert client.model_info()["weight_version"] == str(last)  # the weights' version
                out = client.generate([probe], SamplingParams(top_k=1, max_new_tokens=6))[0][0]
                want = _probe_logprobs_of_trainer(setup["model"], trainer_w, probe, out.token_ids)
                assert max(abs(a - b) for a, b in zip(out.logprobs, want)) < 1e-4, (s.url, out.logprobs, want)
    finally:
        for s in servers:
            s.close()
    assert len(lines) == 2 and last > 0, lines
    for m in lines:
        if m.get("actor/optimizer_steps"):
            assert m["actor/logprob_mismatch_max"] < 1e-3, m
    # one versioned directory per sync; older ones removed once every worker had the new one
    assert os.listdir(os.path.join(save, "weights")) == [f"step_{last:07d}"]


def test_a_frozen_worker_is_dropped_or_stops_the_run_in_bounded_time(setup):
    """Step 1 runs and is checkpointed; then a worker freezes (SIGSTOP). With
    rollout.min_live_workers = 2 the restarted run cannot go on with one worker: it fails at its
    start-up weight sync in bounded time, naming the frozen worker, instead of hanging. With the
    default (1) a restart drops the frozen worker (and takes it out of the router) and finishes the
    run on the other; the step's metrics say one worker is live and one was lost."""
    import signal
    import time

    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine
    from tests.rollout.processes import _get_json, router

    servers = [EmbeddedHTTPEngine.launch(setup["model"], startup_timeout=120) for _ in range(2)]
    frozen = servers[1]
    try:
        with router([s.url for s in servers]) as router_url:
            save = os.path.join(setup["root"], "fault-run")
            args = _overrides(setup, save) + [
                "rollout.engine=sglang",
                f"rollout.urls=[{router_url}]",
                "parallel.tp=1",
                "train.steps=2",
                "rollout.control_timeout_s=3",
                "rollout.health_check_interval_s=1",
                "rollout.health_check_timeout_s=3",
                "rollout.health_failure_threshold=2",
            ]
            run_distributed(_run, 1, args, 1)  # stop after step 1 (checkpointed)
            os.kill(frozen._process.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=frozen.url.replace(".", r"\.")):
                run_distributed(_run, 1, args + ["rollout.min_live_workers=2"])
            assert time.monotonic() - t0 < 60
            t0 = time.monotonic()
            run_distributed(_run, 1, args)  # resumes from step 1 without the frozen worker
            assert time.monotonic() - t0 < 120
            listed = [w["url"] for w in _get_json(router_url + "/workers")["workers"]]
            assert listed == [servers[0].url], listed
    finally:
        for s in servers:
            os.kill(s._process.pid, signal.SIGCONT)
            s.close()
    lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [1, 2]
    assert lines[-1]["rollout/live_workers"] == 1 and lines[-1]["rollout/worker_failures"] >= 1, lines[-1]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "2"


@pytest.mark.slow
def test_moe_rl_loop_at_ep2_with_router_replay(setup, tmp_path):
    """Qwen3-MoE through the loop at EP=2 (issue 12): the embedded engine records its experts, the
    old-log-prob pass replays them, the weights go back to the engine through the EP gather (per-expert
    names into transformers' fused experts) and equal the trainer's."""
    import torch

    from megatron_klear.models.tiny import make_tiny_qwen3_moe

    model = make_tiny_qwen3_moe(str(tmp_path / "moe"), num_layers=2, seed=23)
    save = str(tmp_path / "run")
    args = [a for a in _overrides({**setup, "model": model}, save) if not a.startswith(("parallel.tp", "train.steps"))]
    # a random tiny model rarely earns a reward spread: keep every group (zero advantages; the update,
    # its old-log-prob pass and the sync run all the same)
    args += ["parallel.ep=2", "train.steps=2", "rollout.router_replay=true", "rl.filter_zero_spread=false"]
    metrics, engine_w, trainer_w = run_distributed(_run, 2, args)[0]
    lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    stepped = [m for m in lines if m.get("actor/optimizer_steps")]
    assert len(stepped) == 2
    for m in stepped:
        assert m["actor/router_replay_micro_batches"] >= 1  # rank 0's micro-batches carried the engine's experts
        assert m["actor/logprob_mismatch_max"] < 1e-3, m["actor/logprob_mismatch_max"]
        assert m["actor/moe_aux_loss"] > 0
    assert sum(".mlp.experts." in k for k in trainer_w) == 2 * 8 * 3
    from megatron_klear.rollout.embedded import EmbeddedEngine

    fused = EmbeddedEngine.from_pretrained(model)  # the trainer's HF tensors through the engine's own loading
    fused.update_weights(trainer_w.items())
    want = {k: v for k, v in fused.model.state_dict().items()}
    assert engine_w.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(engine_w[k], v), k
