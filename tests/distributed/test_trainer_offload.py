"""rollout.colocate, the trainer's side (training/offload.py): while the servers generate, the
gradient buffers are freed (Megatron-Core 0.16's DistributedDataParallel.offload_grad_buffers) and
given back zeroed before the next update, which must then be exactly the update without offloading.
The optimizer-state half (training/offload.py HostStash) moves device tensors only: its logic in
tests/training/test_host_stash.py, on a GPU in tests/gpu."""

import pytest
import torch

from tests.distributed.helper import run_distributed
from tests.distributed.test_actor import make_samples


def _two_updates(rank, world, model_dir, offload):
    from megatron.core import parallel_state

    from megatron_klear.checkpoint.model_weights import iter_hf_tensors
    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel
    from megatron_klear.rl.actor import Actor
    from megatron_klear.training.offload import grad_buffer_bytes, offload_trainer, restore_trainer
    from megatron_klear.training.setup import build_training_state

    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            "optim.lr=1e-2",
            "optim.min_lr=1e-2",
            "optim.decay_style=constant",
            "rl.mini_batch_prompts=2",
            "rl.prompts_per_step=4",
            "rl.max_tokens_per_micro_batch=48",
            "optim.distributed_optimizer=true",
        ],
    )
    init_parallel(cfg.parallel, seed=1)
    state = build_training_state(cfg, total_steps=10)
    actor = Actor(state, cfg.rl, logprob_chunk_size=7)
    actor.update(make_samples(seed=0))
    seen = None
    if offload:
        allocated = torch.cuda.memory_allocated if torch.cuda.is_available() else (lambda: 0)
        held, device_before = grad_buffer_bytes(state.model), allocated()
        freed = offload_trainer(state)
        grads = [p.main_grad for chunk in state.model for p in chunk.parameters()]
        seen = (held, freed, grad_buffer_bytes(state.model), max(g.untyped_storage().nbytes() for g in grads))
        device_freed = device_before - allocated()
        restore_trainer(state)
        back = grad_buffer_bytes(state.model)
        zero = all(not g.any() for g in grads)  # the views into the buffer are valid again, zeroed
        seen += (back, zero, device_freed)
    metrics = actor.update(make_samples(seed=1))
    weights = {
        k: v.detach().cpu().clone()
        for k, v in iter_hf_tensors(state.model, tp_group=parallel_state.get_tensor_model_parallel_group())
    }
    return seen, metrics, weights


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3

    return make_tiny_qwen3(str(tmp_path_factory.mktemp("offload") / "m"), num_layers=2, seed=5)


def test_the_update_after_an_offload_is_the_update_without_one(model_dir):
    plain = run_distributed(_two_updates, 2, model_dir, False)  # DP=2, distributed optimizer
    offloaded = run_distributed(_two_updates, 2, model_dir, True)
    for (_, m0, w0), (seen, m1, w1) in zip(plain, offloaded):
        held, freed, during, main_grad_bytes, back, zero, _ = seen
        assert held > 0 and freed == held and during == 0 and main_grad_bytes == 0
        assert back == held and zero
        assert m1["actor/loss"] == m0["actor/loss"] and m1["actor/grad_norm"] == m0["actor/grad_norm"]
        for k in w0:
            assert torch.equal(w0[k], w1[k]), k


def test_a_megatron_core_without_the_hooks_keeps_the_memory_and_says_so():
    from types import SimpleNamespace

    from megatron_klear.training.offload import offload_trainer, restore_trainer

    state = SimpleNamespace(model=[torch.nn.Linear(2, 2)], optimizer=SimpleNamespace())
    with pytest.warns(UserWarning, match="offload_grad_buffers"):
        assert offload_trainer(state) == 0
    restore_trainer(state)  # nothing to undo


def _holds_model_weights(rank, world, model_dir):
    from megatron_klear.config import load_config
    from megatron_klear.platform import init_parallel
    from megatron_klear.training.offload import optimizer_holds_model_weights
    from megatron_klear.training.setup import build_training_state

    out = {}
    for distributed in (True, False):
        cfg = load_config(None, [f"model.path={model_dir}", f"optim.distributed_optimizer={str(distributed).lower()}"])
        if not out:
            init_parallel(cfg.parallel, seed=1)
        out[distributed] = optimizer_holds_model_weights(build_training_state(cfg, total_steps=1))
    return out


def test_an_optimizer_updating_the_models_own_weights_is_recognised(model_dir):
    """fp32 without the distributed optimizer: Megatron's FP32Optimizer steps the model's parameters
    themselves, so moving its parameters to host memory would move the model (kept on the device);
    the distributed optimizer's fp32 shards are its own tensors (copied into the model after a step)."""
    out = run_distributed(_holds_model_weights, 1, model_dir)[0]
    assert out == {True: False, False: True}
