"""Oversampling shortfall (issue 11, item 8): DAPO's dynamic sampling in RLLoop.step.

When fewer than rl.prompts_per_step groups survive the zero-spread filter, the step generates
further batches (up to rl.max_generation_batches), then trains on what there is (logged) or fails,
per rl.on_shortfall. The step runs here with a scripted rollout (what
``FullBatches.generate_batch`` returns for each generation batch) and a recording actor: the
loop's and the rollout manager's own logic, no model.
"""

from types import SimpleNamespace

import pytest

from megatron_klear.config import ConfigError, JobConfig, load_config
from megatron_klear.rl.batch import RolloutSample
from megatron_klear.rl.loop import RLLoop
from megatron_klear.rl.rollout.manager import RolloutManager
from megatron_klear.rl.rollout.sampling import FullBatches, ShortfallError, dynamic_sampling, merge_rollout_metrics
from megatron_klear.rl.rollout.schedules import Synchronous


def _batch(groups_kept: int, generated: int, reward: float, tag: str, n: int = 2):
    """What rollout() returns for one generation batch: ``groups_kept`` groups of ``n`` samples."""
    samples = [
        RolloutSample(
            prompt_ids=[1], response_ids=[2, 3], advantage=1.0 if j == 0 else -1.0, group=g, meta={"from": f"{tag}{g}"}
        )
        for g in range(groups_kept)
        for j in range(n)
    ]
    metrics = {
        "rollout/reward_mean": reward,
        "rollout/groups_generated": generated,
        "rollout/groups_kept": groups_kept,
        "rollout/samples_trained": len(samples),
        "rollout/response_length_max": 10 * (groups_kept + 1),
        "time/generate_s": 1.0,
    }
    return samples, metrics


class _Prompts:
    def __init__(self):
        self.taken = []

    def state_dict(self):
        return {"taken": list(self.taken)}

    def load_state_dict(self, state):
        self.taken = list(state["taken"])

    def progress(self):
        return {"data/position": sum(self.taken)}

    def take(self, n):
        start = sum(self.taken)
        self.taken.append(n)
        return [SimpleNamespace(id=f"p{start + i}") for i in range(n)]


def _manager(script, calls, **rl):
    """A RolloutManager (servers on their own GPUs, nothing started) whose generation batches are
    scripted; ``calls`` records (batch, first prompt, prompts) of each."""
    cfg = JobConfig()
    for k, v in {"prompts_per_step": 4, "mini_batch_prompts": 2, "oversample_prompts": 8, **rl}.items():
        setattr(cfg.rl, k, v)
    cfg.validate()
    manager = RolloutManager(cfg)

    def generate_batch(prompts, step, batch):
        calls.append((batch, prompts[0].id, len(prompts)))
        return script[batch]

    manager.batches = Synchronous(FullBatches(cfg, None, None, None, []))
    manager.batches.producer.generate_batch = generate_batch
    manager.pushed, manager.pushed_version = [], 0  # (the start-up push gave the servers version 0)
    manager.weights = SimpleNamespace(push=lambda v: manager.pushed.append(v) or {}, to_servers=False)
    return manager


class _Actor:
    """Records what it trains on; each update changes the weights (a new version)."""

    def __init__(self, trained):
        self.trained, self.weight_version = trained, 0

    def update(self, samples):
        self.trained.append(samples)
        self.weight_version += 1
        return {"actor/loss": 0.5}

    def skip_step(self):
        return {"actor/skipped": 1}


def _loop(script, **rl):
    """An RLLoop with only what step() touches: the manager above, a recording actor."""
    loop = object.__new__(RLLoop)
    loop.calls, loop.trained = [], []
    loop.rollout = _manager(script, loop.calls, **rl)
    loop.cfg, loop.rl_step, loop.steps, loop.prompts = loop.rollout.cfg, 0, 10, _Prompts()
    loop.actor = _Actor(loop.trained)
    loop.state = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"lr": 1e-6}]))
    return loop


def test_further_batches_until_the_quota_is_met():
    # 3 groups survive of the first 8 prompts, 2 of the next 8: the step trains on 4 (3 + the first
    # of the second batch), numbered 0..3, and does not generate a third batch
    loop = _loop([_batch(3, 8, 0.5, "a"), _batch(2, 8, 0.0, "b"), _batch(4, 8, 0.0, "c")], max_generation_batches=3)
    m = loop.step()
    assert loop.calls == [(0, "p0", 8), (1, "p8", 8)] and loop.prompts.taken == [8, 8]
    (samples,) = loop.trained
    assert [s.group for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s.meta["from"] for s in samples[::2]] == ["a0", "a1", "a2", "b0"]
    assert m["rollout/generation_batches"] == 2 and m["rollout/groups_kept"] == 4
    assert m["rollout/shortfall_groups"] == 0 and m["rollout/samples_trained"] == 8
    assert m["rollout/groups_generated"] == 16 and m["time/generate_s"] == 2.0
    assert m["rollout/reward_mean"] == 0.25 and m["rollout/response_length_max"] == 40
    assert m["actor/loss"] == 0.5 and loop.rl_step == 1
    assert loop.rollout.pushed == [1]  # the new weights go out as version 1


def test_shortfall_trains_on_what_there_is_and_logs_it():
    loop = _loop([_batch(1, 8, 0.5, "a"), _batch(1, 8, 0.5, "b")], max_generation_batches=2)
    with pytest.warns(UserWarning, match="only 2 of rl.prompts_per_step=4"):
        m = loop.step()
    assert [s.meta["from"] for s in loop.trained[0][::2]] == ["a0", "b0"]
    assert [s.group for s in loop.trained[0]] == [0, 0, 1, 1]
    assert m["rollout/shortfall_groups"] == 2 and m["rollout/generation_batches"] == 2


def test_shortfall_fails_when_asked_to():
    loop = _loop([_batch(3, 8, 0.5, "a")], on_shortfall="fail")  # the authors: one batch, then fail
    with pytest.raises(ShortfallError, match=r"only 3 of rl.prompts_per_step=4 .* after 1 generation batch"):
        loop.step()
    assert loop.trained == [] and loop.rl_step == 0 and loop.rollout.pushed == []


def test_a_step_with_no_group_left_skips_the_update_and_the_push():
    loop = _loop([_batch(0, 8, 0.0, "a")], on_shortfall="train")
    with pytest.warns(UserWarning, match="only 0 of"):
        m = loop.step()
    assert m["actor/skipped"] == 1 and loop.trained == [] and loop.rollout.pushed == []
    assert loop.rl_step == 1  # the step counts: its prompts were consumed


def test_the_manager_generates_the_seeds_of_each_batch_from_the_step():
    """generate(prompts, step) hands the step number to every batch: batch b of step s samples with
    its own seed (rl/rollout/sampling.py sampling_params), so a resumed run repeats the same draws."""
    from megatron_klear.rl.rollout.sampling import sampling_params

    calls, steps = [], []
    manager = _manager([_batch(1, 8, 0.5, "a"), _batch(3, 8, 0.5, "b")], calls, max_generation_batches=2)
    producer = manager.batches.producer
    script = producer.generate_batch
    producer.generate_batch = lambda prompts, step, batch: steps.append(step) or script(prompts, step, batch)
    samples, m = manager.generate(_Prompts(), step=7, weight_version=7)
    assert steps == [7, 7] and [c[0] for c in calls] == [0, 1] and m["rollout/groups_kept"] == 4
    seeds = {sampling_params(manager.cfg, [2], step=s, batch=b).seed for s in (7, 8) for b in (0, 1)}
    assert len(seeds) == 4  # no two (step, batch) pairs share a seed


def test_the_default_is_one_batch_and_a_full_batch_needs_no_more():
    loop = _loop([_batch(6, 8, 0.5, "a")])
    m = loop.step()
    assert loop.calls == [(0, "p0", 8)] and len({s.group for s in loop.trained[0]}) == 4
    assert m["rollout/generation_batches"] == 1 and m["rollout/shortfall_groups"] == 0


def test_dynamic_sampling_and_metric_merging_directly():
    rl = JobConfig().rl
    rl.prompts_per_step, rl.max_generation_batches = 2, 5
    script = iter([_batch(0, 4, 0.0, "a"), _batch(0, 4, 1.0, "b"), _batch(5, 4, 0.0, "c")])
    samples, m = dynamic_sampling(lambda b: next(script), rl)
    assert m["rollout/generation_batches"] == 3 and {s.meta["from"] for s in samples} == {"c0", "c1"}
    merged = merge_rollout_metrics(
        [
            {"rollout/groups_generated": 1, "rollout/accuracy": 1.0},
            {"rollout/groups_generated": 3, "rollout/accuracy": 0.0},
        ]
    )
    assert merged == {"rollout/groups_generated": 4, "rollout/accuracy": 0.25}


@pytest.mark.parametrize(
    "overrides,msg",
    [
        (
            ["rl.prompts_per_step=128", "rl.oversample_prompts=64"],
            "oversample_prompts=64 must be >= rl.prompts_per_step=128",
        ),
        (["rl.max_generation_batches=0"], "max_generation_batches must be >= 1"),
        (["rl.on_shortfall=skip"], "on_shortfall must be train or fail"),
    ],
)
def test_config_validation(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, overrides)
    load_config(
        None,
        ["rl.prompts_per_step=128", "rl.oversample_prompts=256", "rl.max_generation_batches=3", "rl.on_shortfall=fail"],
    )


def test_a_whole_batch_logs_the_generation_after_its_quota_of_groups_ended():
    """``time/generate_after_quota_s``: the seconds between the ``rl.prompts_per_step``-th group's
    end and the batch's (what partial rollouts could cut)."""
    import concurrent.futures
    import time

    from megatron_klear.data.prompts import Prompt
    from megatron_klear.rewards.result import GradeResult
    from megatron_klear.rl.rollout.sampling import generate_and_grade
    from megatron_klear.rollout.base import Completion, SamplingParams

    class Engine:  # groups end 0.05, 0.05, 0.2 and 0.2 s apart
        def generate_iter(self, prompts, params, n, chunk_size=None, cancel=None):
            for i, wait in enumerate((0.05, 0.05, 0.2, 0.2)):
                time.sleep(wait)
                yield i, [Completion([7] * (i + j + 1), [-1.0] * (i + j + 1), "stop") for j in range(n)]

    class Pool:
        def submit(self, item):
            f = concurrent.futures.Future()
            f.set_result(GradeResult(reward=1.0, passed=1, total=1))
            return f

    tokenizer = SimpleNamespace(
        eos_token=None, pad_token=None, decode=lambda ids, **kw: "x", convert_ids_to_tokens=lambda ids: []
    )
    cfg = JobConfig()
    cfg.rl.prompts_per_step, cfg.rl.oversample_prompts, cfg.rl.responses_per_prompt = 2, 4, 2
    prompts = [Prompt(id=f"p{i}", task="math", prompt_ids=[i + 1], answer="1") for i in range(4)]
    _, m = generate_and_grade(Engine(), Pool(), tokenizer, prompts, SamplingParams(), cfg, [])
    # the second group ended after >= 0.1 s; the last two groups took >= 0.4 s more
    assert 0.4 <= m["time/generate_after_quota_s"] <= m["time/generate_s"] - 0.1
    cfg.rl.prompts_per_step = 4  # the quota is the whole batch: nothing after it
    _, m = generate_and_grade(Engine(), Pool(), tokenizer, prompts, SamplingParams(), cfg, [])
    assert m["time/generate_after_quota_s"] < 0.05
