"""A run resumed after a step that changed no weight labels, tags, masks and trains as the run that
went on: the engine's label, the tokens' versions, the tokens counted and the update's loss and
gradient norm (the weight version is saved with the checkpoint: docs/async.md, "The weight
version"). The real loop, the embedded engine, a tiny Qwen3."""

import pytest

from tests.distributed.helper import run_distributed
from tests.distributed.test_rl_loop import _overrides, setup  # noqa: F401 -- the fixture, shared


def _run_skipping(rank, world, overrides, skip_at, stop_after=None):
    """The real loop whose step ``skip_at`` (1-based) keeps no group (its samples, generated and
    graded, are dropped: every group filtered). Returns per step that updated: the actor's weight
    version, the engine's label, the token versions, the tokens it counts under
    rl.mask_stale_tokens, the responses, and the update's loss and gradient norm."""
    from megatron_klear.config import load_config
    from megatron_klear.platform import is_rank0
    from megatron_klear.rl.actor import mini_batch_counts
    from megatron_klear.rl.loop import RLLoop

    loop = RLLoop(load_config(None, overrides))
    if is_rank0():
        producer = loop.rollout.batches.producer
        produce = producer.produce

        def skipping(prompts, step, weight_version):
            samples, metrics = produce(prompts, step, weight_version)
            return ([] if step + 1 == skip_at else samples), metrics

        producer.produce = skipping
    trained, update = [], loop.actor.update

    def recording(samples):
        v = loop.actor.weight_version
        counted = mini_batch_counts(samples, list(range(len(samples))), weight_version=v, mask_stale=True)
        trained.append(
            {
                "step": loop.rl_step,
                "version": v,
                "label": loop.rollout.engine.weight_version,
                "token_versions": [list(s.versions) for s in samples],
                "counted": counted.num_tokens,
                "responses": [list(s.response_ids) for s in samples],
            }
        )
        out = update(samples)
        trained[-1].update(loss=float(out["actor/loss"]), grad_norm=float(out["actor/grad_norm"]))
        return out

    loop.actor.update = recording
    loop.run(stop_after=stop_after)
    return trained


def test_a_run_resumed_after_a_skipped_step_tags_masks_and_trains_as_the_uninterrupted_one(setup):  # noqa: F811
    """Step 2 keeps no group; a run saved after it and resumed trains step 3 at the same weight
    version, its engine labelled alike, on tokens tagged with the same versions and as many counted
    under rl.mask_stale_tokens, to the same loss and gradient norm, as the run that went on (the
    version is saved with the checkpoint; before, the resumed engine was labelled with the step,
    one ahead of the uninterrupted engine's label)."""
    args = [a for a in _overrides(setup, "") if not a.startswith(("parallel.tp", "train.save_dir"))]
    args += ["rl.mask_stale_tokens=true", "train.steps=3", "rl.filter_zero_spread=false"]
    whole = run_distributed(_run_skipping, 1, args + [f"train.save_dir={setup['root']}/whole"], 2)[0]
    resumed_dir = f"train.save_dir={setup['root']}/resumed"
    run_distributed(_run_skipping, 1, args + [resumed_dir], 2, 2)  # saved after the skipped step
    resumed = run_distributed(_run_skipping, 1, args + [resumed_dir], 2)[0]
    assert [t["step"] for t in whole] == [1, 3] and [t["step"] for t in resumed] == [3]
    want, got = whole[-1], resumed[0]
    assert want["version"] == got["version"] == 1  # step 1 changed the weights, step 2 nothing
    assert want["label"] == got["label"] == 1  # the engine that sampled step 3 was labelled with it
    assert got["token_versions"] == want["token_versions"]
    assert all(v == 1 for vs in got["token_versions"] for v in vs)  # fresh: the version it trains at
    assert got["counted"] == want["counted"] > 0
    assert got["responses"] == want["responses"]
    # trained alike: the same weights (restored from the checkpoint) on the same tokens
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), (got["loss"], want["loss"])
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6), (got["grad_norm"], want["grad_norm"])
    assert want["grad_norm"] > 0
