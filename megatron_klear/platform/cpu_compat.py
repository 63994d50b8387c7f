"""Make Megatron-Core run on a machine without CUDA.

Megatron-Core is written for GPUs and, even with ``use_cpu_initialization``, allocates a handful of
tensors on ``device="cuda"`` (pipeline schedules, RoPE frequencies, optimizer scalars, DDP buffers),
calls ``torch.cuda.current_device()/current_stream()/synchronize()`` and compares
``param.type()`` with ``'torch.cuda.FloatTensor'``. None of that is reachable by a flag.

This module redirects exactly those calls while it is active:

* a :class:`torch.overrides.TorchFunctionMode` rewrites CUDA device arguments (``"cuda"``,
  ``"cuda:0"``, ``torch.device("cuda")``, a bare GPU index) to ``"cpu"``, turns ``Tensor.cuda()``
  into a no-op, drops ``pin_memory=True`` and reports CPU tensors' ``.type()`` under the CUDA name
  Megatron's optimizer checks for;
* ``torch.cuda`` helpers Megatron calls unconditionally get small CPU stand-ins (streams and
  events that do nothing, device index 0, no-op synchronize);
* the MoE all-to-all dispatcher's device-to-host copy of its split sizes, which converts only
  CUDA tensors, converts CPU ones too (:func:`_moe_dtoh`).

It is activated by :func:`megatron_klear.platform.init_parallel` only when CUDA is not available
and is never active on a GPU machine. ``torch.cuda.is_available()`` keeps returning False, so code
that branches on it still sees the truth.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_lock = threading.Lock()
_state = {"mode": None, "saved": {}}


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


def _fix_device(dev):
    return _CPU if _is_cuda(dev) else dev


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = dict(kwargs, device=_CPU)
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func in (torch.Tensor.to, torch.Tensor.pin_memory) and len(args) > 1:
            args = (args[0], _fix_device(args[1])) + tuple(args[2:])
        if func is torch.Tensor.pin_memory:
            return args[0]
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for torch.cuda.Stream / Event on the CPU: every operation is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cuda_stubs():
    null = _NullStream()
    return {
        # A device, not an index: Megatron passes it as `device=` also in autograd backward
        # functions, which run outside this mode (a mode is suspended while it handles a call such
        # as torch.autograd.backward), so it must be right without any redirection.
        "current_device": lambda: _CPU,
        "synchronize": lambda *a, **k: None,
        "current_stream": lambda *a, **k: null,
        "default_stream": lambda *a, **k: null,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "Stream": _NullStream,
        "Event": _NullStream,
        "set_device": lambda *a, **k: None,
        "empty_cache": lambda: None,
        "device_count": lambda: 0,
        "manual_seed": lambda *a, **k: None,
        "manual_seed_all": lambda *a, **k: None,
        "memory_allocated": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0,
        "reset_peak_memory_stats": lambda *a, **k: None,
    }


def _rng_stubs():
    # Activation recomputation saves/restores the "CUDA" RNG state around each recomputed layer;
    # on the CPU the CPU generator (saved separately by Megatron) is the only one.
    return {"get_rng_state": lambda *a, **k: torch.get_rng_state()}


def _moe_dtoh(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Megatron-Core's MoE all-to-all dispatcher moves its split sizes "to the CPU" and turns them
    into numpy arrays only when they are CUDA tensors (``maybe_move_tensor_to_cpu``); on the CPU
    they stay tensors, which ``all_to_all_single`` refuses as split sizes. Same contract, CPU
    tensors included."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _megatron_patches():
    """(module, name, replacement) for the Megatron-Core functions that hard-code CUDA tensors."""
    try:
        from megatron.core.transformer.moe import token_dispatcher
    except ImportError:  # no Megatron-Core MoE in this install
        return []
    return [(token_dispatcher, "maybe_move_tensor_to_cpu", _moe_dtoh)]


def activate() -> None:
    """Install the redirection (idempotent). Refuses on a machine with CUDA."""
    with _lock:
        if _state["mode"] is not None:
            return
        if torch.cuda.is_available():
            raise RuntimeError("cpu_compat must not be activated on a machine with CUDA")
        for module, stubs in ((torch.cuda, _cuda_stubs()), (torch.cuda.random, _rng_stubs())):
            for name, stub in stubs.items():
                _state["saved"][(module, name)] = getattr(module, name, None)
                setattr(module, name, stub)
        for module, name, stub in _megatron_patches():
            _state["saved"][(module, name)] = getattr(module, name, None)
            setattr(module, name, stub)
        mode = _CudaToCpu()
        mode.__enter__()
        _state["mode"] = mode


def deactivate() -> None:
    with _lock:
        mode = _state["mode"]
        if mode is None:
            return
        mode.__exit__(None, None, None)
        for (module, name), original in _state["saved"].items():
            if original is None:
                delattr(module, name)
            else:
                setattr(module, name, original)
        _state["saved"].clear()
        _state["mode"] = None
