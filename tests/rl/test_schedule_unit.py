"""Warm-up units and Adam betas (issue 11, item 7).

The authors' verl trainer steps its lr scheduler once per RL step, from lr 0, so their "10 warm-up
steps" are 10 RL steps (80 optimizer steps at 8 mini-batches per step), with AdamW betas
(0.9, 0.999). ``optim.schedule_unit`` makes the unit explicit; the GPPO configs use theirs.
The actor's update runs here with the real schedule (training/setup.py's build_scheduler) and the
real Actor.update bookkeeping, with the model's forward/backward stubbed out.
"""

import os
from types import SimpleNamespace

import pytest
import torch

from megatron_klear.config import ConfigError, JobConfig, load_config
from megatron_klear.rl.actor import Actor
from megatron_klear.rl.losses import LossCounts
from megatron_klear.training.setup import build_scheduler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Optimizer:
    """The interface Actor.update and Megatron's scheduler use; records the lr of every step."""

    def __init__(self):
        self.param_groups = [{"params": [torch.zeros(1)], "lr": 0.0, "weight_decay": 0.0}]
        self.lrs = []

    def zero_grad(self):
        pass

    def step(self):
        self.lrs.append(self.param_groups[0]["lr"])
        return True, 1.0, None


def _lrs_over_rl_steps(unit: str, rl_steps: int, mini_batches: int, warmup: int = 10, lr: float = 1e-6):
    cfg = JobConfig()
    cfg.optim.lr = cfg.optim.min_lr = lr
    cfg.optim.decay_style, cfg.optim.warmup_steps, cfg.optim.schedule_unit = "constant", warmup, unit
    opt = _Optimizer()
    total = rl_steps * (1 if unit == "rl_step" else mini_batches)
    state = SimpleNamespace(model=[], optimizer=opt, scheduler=build_scheduler(opt, cfg.optim, total), config=cfg)
    actor = Actor(state, cfg.rl)
    counts = LossCounts(num_tokens=1.0, num_seqs=1.0, num_positive_tokens=0.0, num_positive_seqs=0.0)
    actor.plan = lambda samples, weight_version=None: [(counts, [])] * mini_batches
    actor.recompute_old_logprobs = lambda plans: None
    actor._run = lambda mbs, loss_fn, forward_only: []
    per_step = []
    for _ in range(rl_steps):
        n = len(opt.lrs)
        out = actor.update([object()])
        assert out["actor/optimizer_steps"] == mini_batches
        per_step.append(opt.lrs[n:])
    return per_step


def test_rl_step_unit_warms_up_over_rl_steps():
    steps = _lrs_over_rl_steps("rl_step", rl_steps=12, mini_batches=8)
    for s, lrs in enumerate(steps, start=1):
        assert len(lrs) == 8 and len(set(lrs)) == 1, lrs  # one lr for the whole RL step
        assert lrs[0] == pytest.approx(1e-6 * min(s, 10) / 10)  # linear from 0 over 10 RL steps
    assert steps[9][0] == pytest.approx(1e-6) and steps[8][0] < 1e-6


def test_optimizer_step_unit_warms_up_over_optimizer_steps():
    flat = [lr for lrs in _lrs_over_rl_steps("optimizer_step", rl_steps=3, mini_batches=8) for lr in lrs]
    assert flat == pytest.approx([1e-6 * min(k, 10) / 10 for k in range(1, 25)])


def test_rl_step_unit_counts_steps_that_change_no_weight():
    """The schedule's unit is the RL step: a step that keeps no group (skip_step) or whose every
    mini-batch overflows (fp16: no update applied) still advances it, once, so that warm-up and
    decay stay aligned with train.steps; the weight version moves only with an applied update."""
    cfg = JobConfig()
    cfg.optim.lr = cfg.optim.min_lr = 1e-6
    cfg.optim.decay_style, cfg.optim.warmup_steps, cfg.optim.schedule_unit = "constant", 10, "rl_step"
    opt = _Optimizer()
    state = SimpleNamespace(model=[], optimizer=opt, scheduler=build_scheduler(opt, cfg.optim, 20), config=cfg)
    actor = Actor(state, cfg.rl)
    counts = LossCounts(num_tokens=1.0, num_seqs=1.0, num_positive_tokens=0.0, num_positive_seqs=0.0)
    actor.plan = lambda samples, weight_version=None: [(counts, [])] * 2
    actor.recompute_old_logprobs = lambda plans: None
    actor._run = lambda mbs, loss_fn, forward_only: []
    actor.update([object()])  # RL step 1: lr 1e-7 (warm-up 1/10), version 1
    assert actor.skip_step() == {"actor/skipped": 1, "actor/optimizer_steps": 0}  # step 2: no update
    overflow = opt.step
    opt.step = lambda: (opt.lrs.append(opt.param_groups[0]["lr"]), (False, None, None))[1]
    actor.update([object()])  # step 3: both mini-batches overflow, nothing applied
    opt.step = overflow
    actor.update([object()])  # step 4: at the 4th RL step's lr
    assert opt.lrs[-2:] == pytest.approx([4e-7, 4e-7]) and actor.weight_version == 2


@pytest.mark.parametrize("name,mini_batches", [("gppo_qwen3_8b_math.yaml", 16), ("gppo_qwen3_8b_code.yaml", 32)])
def test_gppo_configs_use_the_authors_schedule_and_betas(name, mini_batches):
    cfg = load_config(os.path.join(ROOT, "examples", "configs", name))
    o = cfg.optim
    assert (o.schedule_unit, o.warmup_steps, o.adam_beta1, o.adam_beta2) == ("rl_step", 10, 0.9, 0.999)
    assert cfg.rl.mini_batch_prompts == mini_batches and o.decay_style == "constant"


def test_schedule_unit_is_validated_and_rl_only():
    with pytest.raises(ConfigError, match="optim.schedule_unit must be"):
        load_config(None, ["optim.schedule_unit=epoch"])
    with pytest.raises(ConfigError, match="schedule_unit=rl_step is for RL jobs"):
        load_config(None, ["optim.schedule_unit=rl_step"])
    ok = load_config(
        None, ["optim.schedule_unit=rl_step", "rl.prompts=[p.jsonl]", "rl.max_tokens_per_micro_batch=36864"]
    )
    assert ok.optim.schedule_unit == "rl_step"
