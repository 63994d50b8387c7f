"""One GPPO actor update (old log-prob recompute + two mini-batch optimizer steps) at TP=2, PP=2
and DP=2 equals the single-process update: same losses, grad norms and parameter changes."""

import math

import pytest

from tests.distributed.helper import run_distributed


def make_samples(seed=0, prompts=4, per_prompt=3, vocab=300):
    import random

    from megatron_klear.rl.batch import RolloutSample

    rng = random.Random(seed)
    samples = []
    for g in range(prompts):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(3, 9))]
        for _ in range(per_prompt):
            resp = [rng.randrange(5, vocab) for _ in range(rng.randint(2, 14))]
            samples.append(
                RolloutSample(
                    prompt_ids=prompt,
                    response_ids=resp,
                    advantage=rng.uniform(-1.5, 1.5),
                    group=g,
                    positive=rng.random() < 0.4,
                    rollout_logprobs=[-rng.uniform(3.0, 8.0) for _ in resp],
                )
            )
    return samples


def _update(rank, world, model_dir, overrides):
    return _update_with(rank, world, model_dir, overrides, make_samples(), None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3

    return make_tiny_qwen3(str(tmp_path_factory.mktemp("actor") / "m"), num_layers=2, seed=5)


@pytest.fixture(scope="module")
def reference(model_dir):
    return run_distributed(_update, 1, model_dir, [])[0]


def test_reference_update_is_sane(reference):
    metrics, delta = reference
    assert metrics["actor/optimizer_steps"] == 2
    # First mini-batch: old log-probs were recomputed with the same weights, so ratio == 1 there;
    # after one optimizer step the second mini-batch sees ratios != 1.
    assert metrics["actor/ratio_max"] > 1.0
    assert (
        metrics["actor/logprob_mismatch_mean"] > 0
        and metrics["actor/logprob_mismatch_max"] >= metrics["actor/logprob_mismatch_mean"]
    )
    assert all(s["update_ok"] for s in metrics["actor/steps"])
    assert max(float(d.abs().max()) for d in delta.values()) > 1e-3  # the weights moved


@pytest.mark.parametrize(
    "world,extra",
    [(2, ["parallel.tp=2"]), (2, ["parallel.pp=2"]), (2, ["parallel.cp=2"]), (2, [])],
    ids=["tp2", "pp2", "cp2", "dp2"],
)
def test_layouts_match_one_process(model_dir, reference, world, extra):
    ref_delta = reference[1]
    results = run_distributed(_update, world, model_dir, extra)
    metrics = results[0][0]
    delta = {}
    for _, d in results:
        delta.update(d)  # PP: each stage reports its own layers
    assert set(delta) == set(ref_delta)
    _assert_same_update((metrics, delta), reference, loss_tol=1e-5, rel_tol=1e-4, weight_tol=2e-4)


def _assert_same_update(got, want, *, loss_tol, rel_tol, weight_tol, keys=("actor/entropy",)):
    """Two updates' per-step losses and grad norms, token metrics and weight changes agree."""
    import torch

    (metrics, delta), (ref_metrics, ref_delta) = got, want
    for a, b in zip(metrics["actor/steps"], ref_metrics["actor/steps"], strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=loss_tol, abs_tol=1e-7), (a, b)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=rel_tol), (a, b)
    for k in ("actor/clip_frac_high", "actor/clip_frac_low", "actor/logprob_mismatch_mean", *keys):
        assert math.isclose(metrics[k], ref_metrics[k], rel_tol=rel_tol, abs_tol=1e-7), k
    for k, v in ref_delta.items():
        assert torch.allclose(delta[k], v, atol=weight_tol, rtol=0), (k, (delta[k] - v).abs().max())


def _update_recomputing_every_old_logprob(rank, world, model_dir):
    return _update_with(rank, world, model_dir, [], make_samples(), None, reuse_first_forward=False)


def test_the_first_mini_batch_s_own_forward_gives_the_recomputed_old_log_probs(model_dir, reference):
    """The update takes the first mini-batch's old log-probs from its own forward (no pass before
    it): the same losses, grad norms, clip fractions and weight changes as recomputing them."""
    recomputed = run_distributed(_update_recomputing_every_old_logprob, 1, model_dir)[0]
    _assert_same_update(
        reference, recomputed, loss_tol=1e-6, rel_tol=1e-6, weight_tol=1e-6, keys=("actor/ratio_max", "actor/entropy")
    )


# -- stale tokens (issue 22): per-token weight versions through the Megatron actor ---------------------
def _update_with(rank, world, model_dir, overrides, samples, weight_version, reuse_first_forward=True):

    from megatron_klear.checkpoint.model_weights import iter_hf_tensors
    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel
    from megatron_klear.rl.actor import Actor
    from megatron_klear.training.setup import build_training_state

    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            "optim.lr=1e-2",
            "optim.min_lr=1e-2",
            "optim.decay_style=constant",
            "optim.weight_decay=0.0",
            "rl.mini_batch_prompts=2",
            "rl.prompts_per_step=4",
            "rl.max_tokens_per_micro_batch=48",
            *overrides,
        ],
    )
    init_parallel(cfg.parallel, seed=1)
    state = build_training_state(cfg, total_steps=10)
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    before = {k: v.clone() for k, v in iter_hf_tensors(state.model, tp_group=group)}
    actor = Actor(state, cfg.rl, logprob_chunk_size=7)
    actor.reuse_first_forward = reuse_first_forward
    if weight_version is not None:
        actor.weight_version = weight_version
    metrics = actor.update(samples)
    after = {k: v.clone() for k, v in iter_hf_tensors(state.model, tp_group=group)}
    return metrics, {k: (after[k] - before[k]) for k in after}


def _as_continued(samples, version):
    """Every sample as a partial response continued once (two pieces concatenated), all of ``version``."""
    import dataclasses

    out = []
    for k, s in enumerate(samples):
        cut = 1 + k % (len(s.response_ids) - 1)
        versions = [version] * cut + [version] * (len(s.response_ids) - cut)
        out.append(
            dataclasses.replace(
                s,
                response_ids=s.response_ids[:cut] + s.response_ids[cut:],
                rollout_logprobs=s.rollout_logprobs[:cut] + s.rollout_logprobs[cut:],
                versions=versions,
            )
        )
    return out


def test_fresh_partial_samples_update_as_the_synchronous_step_bit_for_bit(model_dir):
    """Tokens all of the trainer's version: the update (losses, grad norms, every parameter change)
    equals the synchronous one exactly, with rl.mask_stale_tokens and rl.tis_cap on."""
    import torch

    samples = make_samples()
    ref_metrics, ref_delta = run_distributed(_update_with, 1, model_dir, ["rl.tis_cap=2.0"], samples, None)[0]
    metrics, delta = run_distributed(
        _update_with, 1, model_dir, ["rl.tis_cap=2.0", "rl.mask_stale_tokens=true"], _as_continued(samples, 3), 3
    )[0]
    assert [s["loss"] for s in metrics["actor/steps"]] == [s["loss"] for s in ref_metrics["actor/steps"]]
    assert [s["grad_norm"] for s in metrics["actor/steps"]] == [s["grad_norm"] for s in ref_metrics["actor/steps"]]
    assert metrics["actor/tis_weight_mean"] == ref_metrics["actor/tis_weight_mean"] > 0
    assert metrics["actor/stale_tokens_masked"] == 0.0
    assert set(delta) == set(ref_delta)
    for k, v in ref_delta.items():
        assert torch.equal(delta[k], v), k
    assert max(float(d.abs().max()) for d in delta.values()) > 1e-3


def test_masked_stale_response_counts_as_absent(model_dir):
    """With rl.mask_stale_tokens, a response whose tokens are all stale leaves the loss and every
    normaliser: the update equals the one without that response (up to summation order)."""
    import dataclasses

    import torch

    samples = make_samples()
    stale_ids = {1, 7}  # one response of group 0 and one of group 2 (each mini-batch keeps the rest)
    versioned = [
        dataclasses.replace(s, versions=[2 if i in stale_ids else 3] * len(s.response_ids))
        for i, s in enumerate(samples)
    ]
    kept = [s for i, s in enumerate(samples) if i not in stale_ids]
    ref_metrics, ref_delta = run_distributed(_update_with, 1, model_dir, [], kept, None)[0]
    metrics, delta = run_distributed(_update_with, 1, model_dir, ["rl.mask_stale_tokens=true"], versioned, 3)[0]
    assert metrics["actor/stale_tokens_masked"] == sum(len(samples[i].response_ids) for i in stale_ids)
    for a, b in zip(metrics["actor/steps"], ref_metrics["actor/steps"]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-7), (a, b)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a, b)
    for k, v in ref_delta.items():
        assert torch.allclose(delta[k], v, atol=2e-4, rtol=0), (k, (delta[k] - v).abs().max())  # Adam: ~lr * sign(g)
    # not masked, the stale responses are trained on: the update differs
    _, unmasked = run_distributed(_update_with, 1, model_dir, [], versioned, 3)[0]
    assert max(float((unmasked[k] - v).abs().max()) for k, v in ref_delta.items()) > 2e-3


def _partly_stale(samples):
    """Versions 2 then 3 (the trainer's) within responses, some responses entirely of version 2."""
    import dataclasses

    out = []
    for k, s in enumerate(samples):
        n = len(s.response_ids)
        cut = n if k % 4 == 0 else (k * 3) % n
        out.append(dataclasses.replace(s, versions=[2] * cut + [3] * (n - cut)))
    return out


@pytest.fixture(scope="module")
def stale_reference(model_dir):
    return run_distributed(
        _update_with, 1, model_dir, ["rl.mask_stale_tokens=true", "rl.tis_cap=2.0"], _partly_stale(make_samples()), 3
    )[0]


@pytest.mark.parametrize("extra", [["parallel.cp=2"], ["parallel.pp=2"]], ids=["cp2", "pp2"])
def test_masked_stale_tokens_match_one_process(model_dir, stale_reference, extra):
    """The stale flag travels with the other per-token values (CP padding and slicing, the last
    pipeline stage): masked updates at CP=2 and PP=2 equal the single-process one."""
    import torch

    ref_metrics, ref_delta = stale_reference
    assert 0 < ref_metrics["actor/stale_tokens_masked"]
    results = run_distributed(
        _update_with,
        2,
        model_dir,
        ["rl.mask_stale_tokens=true", "rl.tis_cap=2.0", *extra],
        _partly_stale(make_samples()),
        3,
    )
    metrics, delta = results[0][0], {}
    for _, d in results:
        delta.update(d)
    for a, b in zip(metrics["actor/steps"], ref_metrics["actor/steps"]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-7), (a, b)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a, b)
    for k in ("actor/tis_weight_mean", "actor/stale_tokens_masked", "actor/logprob_mismatch_mean"):
        assert math.isclose(metrics[k], ref_metrics[k], rel_tol=1e-5), k
    for k, v in ref_delta.items():
        assert torch.allclose(delta[k], v, atol=2e-4, rtol=0), (k, (delta[k] - v).abs().max())
