"""The whole RL loop on a tiny model: embedded engine -> grading pool -> actor at TP=2 -> weight
sync, checkpoints and resume. The engine's sampling log-probs must agree with the trainer's
recompute (same weights, same temperature): that checks weight sync and the temperature path."""
import json
import os

import pytest

from tests.distributed.helper import run_distributed


def _run(rank, world, overrides, stop_after=None):
    from megatron_klear.config import load_config
    from megatron_klear.rl.loop import RLLoop

    loop = RLLoop(load_config(None, overrides))
    metrics = loop.run(stop_after=stop_after)
    engine_weights = None
    if rank == 0:
        engine_weights = {k: v.clone() for k, v in loop.engine.model.state_dict().items()} if hasattr(loop.engine, "model") else None
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
        f"model.path={setup['model']}", f"rl.prompts=[{setup['prompts']}]", f"train.save_dir={save}",
        "train.steps=3", "train.save_interval=1", "rl.prompts_per_step=4", "rl.oversample_prompts=6",
        "rl.responses_per_prompt=6", "rl.mini_batch_prompts=2", "rl.max_tokens_per_micro_batch=256", "rl.max_prompt_length=64",
        "rollout.max_new_tokens=24", "optim.lr=1e-3", "optim.min_lr=1e-3", "optim.decay_style=constant",
        "reward.workers=1", "parallel.tp=2", "rollout.chunk_prompts=4",
    ]


def test_rl_loop_runs_syncs_and_resumes(setup):
    import torch

    save = os.path.join(setup["root"], "run")
    args = _overrides(setup, save)
    metrics, engine_w, trainer_w = run_distributed(_run, 2, args, 2)[0]
    lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [1, 2]
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
    # resume: step 3 continues from the saved prompt position
    run_distributed(_run, 2, args)
    lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [1, 2, 3]


def test_rl_loop_with_an_http_engine_reloads_weights_from_disk(setup):
    """rollout.engine=http against our SGLang-API server: the trainer exports its weights to
    rollout.sync_dir and the server reloads them after every step. If it did not, the sampling
    log-probs of step 2 would come from the old weights and disagree with the trainer's."""
    from megatron_klear.rollout.embedded_http import EmbeddedHTTPEngine

    server = EmbeddedHTTPEngine.launch(setup["model"], startup_timeout=120)
    try:
        save = os.path.join(setup["root"], "http-run")
        args = _overrides(setup, save) + [
            "rollout.engine=http", f"rollout.urls=[{server.url}]", "parallel.tp=1", "train.steps=2",
            "optim.lr=5e-3", "optim.min_lr=5e-3",
        ]
        run_distributed(_run, 1, args)
    finally:
        server.close()
    lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    trained = [m for m in lines if m.get("actor/optimizer_steps")]
    assert len(lines) == 2 and trained, lines
    for m in lines:
        if m.get("actor/optimizer_steps"):
            assert m["actor/logprob_mismatch_max"] < 1e-3, m
    assert os.path.isdir(os.path.join(save, "weights", "current"))
