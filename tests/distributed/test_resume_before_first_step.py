"""Resuming the optimizer, before and after its first step.

A checkpoint written before the first optimizer step (RL steps whose groups were all filtered,
or a SIGTERM right at the start) has no Adam moments. Resuming from it must not ask for them (the
load used to fail: "optimizer.state.exp_avg... not in state dict"), and the resumed optimizer must
step like a fresh one (asking Megatron for a loading state dict creates moments without a step
count, which torch's Adam cannot step)."""

import pytest
import torch

from tests.distributed.helper import run_distributed


def _check(rank, world, hf_dir, root, layout):
    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel
    from megatron_klear.training.checkpointing import CheckpointManager
    from megatron_klear.training.setup import build_training_state

    cfg = load_config(
        None,
        [
            f"model.path={hf_dir}",
            f"train.save_dir={root}/run",
            "train.steps=2",
            "optim.lr=1e-2",
            "optim.min_lr=1e-2",
            "optim.decay_style=constant",
            *layout,
        ],
    )
    init_parallel(cfg.parallel, seed=0)

    def step(state):
        for chunk in state.model:
            for p in chunk.parameters():
                p.main_grad.fill_(0.01)
        ok, _, _ = state.optimizer.step()
        return ok, [p.detach().clone() for c in state.model for p in c.parameters()]

    first = build_training_state(cfg, total_steps=2)
    # on the CPU Megatron-Core's torch Adam steps with the fused kernel (training/setup.py)
    inner = [o.optimizer for o in getattr(first.optimizer, "chained_optimizers", [first.optimizer])]
    assert inner and all(g["fused"] for o in inner for g in o.param_groups), inner
    manager = CheckpointManager(cfg.train.save_dir, keep_last=2, model_source=hf_dir)

    def resumed_steps_as_the_run(at: int) -> bool:
        """Save ``first`` at ``at``, step it; a fresh state loaded from that save steps the same."""
        ckpt = manager.save(first, at, {"note": f"after {at} optimizer steps"})
        _, want = step(first)
        resumed = build_training_state(cfg, total_steps=2)
        manager.load(resumed, ckpt)
        ok, got = step(resumed)
        return ok and all(torch.equal(a, b) for a, b in zip(got, want))

    assert resumed_steps_as_the_run(0)  # before any optimizer step
    # and after one: the saved moments and step count come back (the distributed optimizer's fresh
    # state dict used to assert one step count on the CPU, and its loaded step was shared)
    assert resumed_steps_as_the_run(1)
    return True


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.tp=2"],
        # the distributed optimizer (DP=2) refuses to give a state dict before its first step
        # (megatron-core's DistributedOptimizer.state_dict asserts one step count)
        ["parallel.tp=1", "optim.distributed_optimizer=true"],
    ],
    ids=["tp2", "distributed-optimizer"],
)
def test_resume_from_a_checkpoint_saved_before_the_first_optimizer_step(tiny_hf, tmp_path, layout):
    assert run_distributed(_check, 2, tiny_hf["untied"], str(tmp_path), layout) == [True, True]
