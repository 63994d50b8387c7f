"""The trainer's memory handed to colocated rollout servers while they generate (``rollout.colocate``).

Megatron-Core's own RL hooks do the work (read from megatron-core 0.16.1):
``DistributedDataParallel.offload_grad_buffers`` frees each gradient buffer's storage (the views
into it stay valid) and ``restore_grad_buffers`` reallocates it zeroed; the optimizer's
``offload_to_cpu`` / ``restore_from_cpu`` move its state (Adam moments, the fp32 main parameters of
mixed precision) to host memory and back. The model's own weights stay: the servers' weights are
reloaded from them at the next sync, and the probe check runs the model then (so with an optimizer
that updates the model's fp32 weights in place, without a separate copy, its state stays too). Between
:func:`offload_trainer` and :func:`restore_trainer` nothing may train.

A Megatron-Core without these hooks (older than 0.16) keeps the memory, with one warning.
"""

from __future__ import annotations

import warnings


def _grad_buffers(chunk) -> list:
    return [
        b
        for b in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))
        if getattr(b, "grad_data", None) is not None
    ]


def grad_buffer_bytes(model) -> int:
    """Bytes the gradient buffers of ``model`` (DDP-wrapped chunks) hold now (0 once offloaded)."""
    return sum(b.grad_data.untyped_storage().nbytes() for chunk in model for b in _grad_buffers(chunk))


def _on_gpu(state) -> bool:
    return any(p.is_cuda for chunk in state.model for p in chunk.parameters())


def optimizer_holds_model_weights(state) -> bool:
    """Whether the optimizer's parameters are the model's own (fp32 training without a separate
    fp32 copy): Megatron's ``offload_to_cpu`` would then move the model's weights off the device,
    which the weight sync and the probe check still read."""
    model = {id(p) for chunk in state.model for p in chunk.parameters()}
    return any(id(p) in model for group in getattr(state.optimizer, "param_groups", []) for p in group["params"])


def _hooks_missing(state) -> list:
    missing = [
        f"{type(c).__name__}.offload_grad_buffers" for c in state.model if not hasattr(c, "offload_grad_buffers")
    ]
    if not hasattr(state.optimizer, "offload_to_cpu"):
        missing.append(f"{type(state.optimizer).__name__}.offload_to_cpu")
    return missing


def offload_trainer(state) -> int:
    """Free the gradient buffers and move the optimizer state to host memory; returns the bytes of
    gradient buffer freed. Undo with :func:`restore_trainer` before the next update."""
    missing = _hooks_missing(state)
    if missing:
        warnings.warn(
            f"rollout.colocate: this Megatron-Core lacks {', '.join(missing)} (0.16 has them): the trainer "
            "keeps its gradient buffers and optimizer state on the device while the servers generate",
            stacklevel=2,
        )
        return 0
    on_gpu = _on_gpu(state)
    freed = grad_buffer_bytes(state.model)
    for chunk in state.model:
        chunk.offload_grad_buffers(synchronize=on_gpu, empty_cache=False)
    # Megatron moves only CUDA tensors (and back with .cuda()): nothing to do on a CPU
    if on_gpu and not optimizer_holds_model_weights(state):
        state.optimizer.offload_to_cpu()  # also empties the CUDA cache
        state.optimizer_offloaded = True
    return freed


def restore_trainer(state) -> None:
    """Undo :func:`offload_trainer`: the gradient buffers back (zeroed), the optimizer state on the device."""
    if _hooks_missing(state):
        return
    on_gpu = _on_gpu(state)
    for chunk in state.model:
        chunk.restore_grad_buffers(synchronize=on_gpu)
    if state.optimizer_offloaded:
        state.optimizer.restore_from_cpu()
        state.optimizer_offloaded = False
