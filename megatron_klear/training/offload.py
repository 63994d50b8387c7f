"""The trainer's memory handed to colocated rollout servers while they generate (``rollout.colocate``).

Megatron-Core's own RL hooks free the gradient buffers (read from megatron-core 0.16.1):
``DistributedDataParallel.offload_grad_buffers`` frees each gradient buffer's storage (the views
into it stay valid) and ``restore_grad_buffers`` reallocates it zeroed. The optimizer's state (Adam
moments, the fp32 main parameters of mixed precision) goes to host memory through
:class:`HostStash`, not through the optimizer's ``offload_to_cpu`` / ``restore_from_cpu``: those
call ``.cpu()`` and ``.cuda()``, fresh pageable host memory at every offload (its page faults, and
copies at pageable speed), where the stash keeps one host buffer per tensor for the whole run,
pinned, and copies asynchronously with one synchronization at the end. The model's own weights
stay: the servers' weights are reloaded from them at the next sync, and the probe check runs the
model then (so with an optimizer that updates the model's fp32 weights in place, without a separate
copy, its state stays too). Between :func:`offload_trainer` and :func:`restore_trainer` nothing may
train.

A Megatron-Core without these hooks (older than 0.16) keeps the memory, with one warning.
"""

from __future__ import annotations

import warnings

import torch


class HostStash:
    """The optimizer's tensors that live on a device (its groups' parameters: the fp32 main weights
    of mixed precision; its state: Adam's moments), moved to host buffers that are kept from one
    :meth:`offload` to the next (``pin``: page-locked, as the copies to and from a GPU want them) and
    back by :meth:`restore`. Each tensor's slot in the optimizer (a parameter's ``.data``, a state
    entry) is pointed at the host copy, then at a new device tensor: every holder of the parameter
    object sees the move, as with Megatron-Core's own hook. ``on_device``: which tensors move
    (those not on the CPU; a test names its own)."""

    def __init__(self, pin: bool, on_device=None):
        self.pin = pin
        self.on_device = on_device or (lambda t: t.device.type != "cpu")
        self.host = {}  # {slot key: the host buffer, kept for the run}
        self.moved = {}  # {slot key: the device its tensor came from}: what restore() puts back

    @staticmethod
    def _slots(optimizer):
        """``(key, tensor, put)`` for every tensor the optimizer holds; ``put(t)`` puts ``t`` in its
        slot. Chained optimizers (one per parameter kind) are walked one by one."""
        for i, part in enumerate(getattr(optimizer, "chained_optimizers", None) or [optimizer]):
            inner = getattr(part, "optimizer", None)
            if inner is None or getattr(part, "is_stub_optimizer", False):
                continue
            for g, group in enumerate(inner.param_groups):
                for j, p in enumerate(group["params"]):
                    if not isinstance(p, torch.Tensor):
                        continue
                    yield (i, g, j, None), p.data, lambda t, p=p: setattr(p, "data", t)
                    for k, v in inner.state.get(p, {}).items():
                        if isinstance(v, torch.Tensor):
                            yield (i, g, j, k), v, lambda t, d=inner.state[p], k=k: d.__setitem__(k, t)

    def offload(self, optimizer, keep=frozenset()) -> int:
        """Every device tensor of ``optimizer`` to its host buffer (allocated at the first offload);
        returns the bytes moved. A tensor whose storage is in ``keep`` (the model's weights: with
        fp32 weights Megatron-Core's distributed optimizer steps on a view of each weight's shard,
        ``distrib_optimizer.py`` ``_build_model_and_main_param_groups``) stays: moving it frees
        nothing -- the weight stays -- and :meth:`restore` would bring back a copy, the weight's
        memory twice from then on."""
        moved = 0
        for key, t, put in self._slots(optimizer):
            if not self.on_device(t) or t.untyped_storage().data_ptr() in keep:
                continue
            host = self.host.get(key)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = self.host[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
            host.copy_(t, non_blocking=self.pin)
            self.moved[key] = t.device
            put(host)
            moved += t.numel() * t.element_size()
        self._synchronize()
        return moved

    def restore(self, optimizer) -> None:
        """What :meth:`offload` moved back onto its device (new device tensors, the host buffers kept)."""
        for key, t, put in self._slots(optimizer):
            device = self.moved.pop(key, None)
            if device is not None:
                put(t.to(device, non_blocking=self.pin, copy=True))
        self._synchronize()

    def _synchronize(self) -> None:
        if self.pin and torch.cuda.is_available():  # the asynchronous copies end before anything reuses
            torch.cuda.synchronize()


def _grad_buffers(chunk) -> list:
    return [
        b
        for b in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))
        if getattr(b, "grad_data", None) is not None
    ]


def grad_buffer_bytes(model) -> int:
    """Bytes the gradient buffers of ``model`` (DDP-wrapped chunks) hold now (0 once offloaded)."""
    return sum(b.grad_data.untyped_storage().nbytes() for chunk in model for b in _grad_buffers(chunk))


def model_storages(model) -> set:
    """The storage addresses of the model's weights (DDP-wrapped chunks): what :meth:`HostStash.offload` keeps."""
    return {p.untyped_storage().data_ptr() for chunk in model for p in chunk.parameters()}


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
    return missing


def offload_trainer(state) -> int:
    """Free the gradient buffers and move the optimizer state to host memory (pinned buffers kept
    on ``state.host_stash``); returns the bytes of gradient buffer freed. Undo with
    :func:`restore_trainer` before the next update."""
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
    # only device tensors move: nothing to do on a CPU
    if on_gpu and not optimizer_holds_model_weights(state):
        if state.host_stash is None:
            state.host_stash = HostStash(pin=True)
        state.host_stash.offload(state.optimizer, keep=model_storages(state.model))
        state.optimizer_offloaded = True
        torch.cuda.empty_cache()
    return freed


def restore_trainer(state) -> None:
    """Undo :func:`offload_trainer`: the gradient buffers back (zeroed), the optimizer state on the device."""
    if _hooks_missing(state):
        return
    on_gpu = _on_gpu(state)
    for chunk in state.model:
        chunk.restore_grad_buffers(synchronize=on_gpu)
    if state.optimizer_offloaded:
        state.host_stash.restore(state.optimizer)
        state.optimizer_offloaded = False
