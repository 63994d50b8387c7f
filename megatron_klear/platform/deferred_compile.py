"""Megatron-Core's fusions compiled at their first call, not at its import, and switched off by ``model.fusions=off``.

Megatron-Core decorates its fused elementwise functions (bias-GeLU/SwiGLU/GeGLU, MoE activations,
norms) with ``megatron.core.jit.jit_fuser``, which is ``torch.compile``. ``torch.compile(fn)``
compiles nothing until ``fn`` is called, but it imports TorchDynamo and Inductor at once: ~3 s of
every process that imports ``megatron.core`` on a CPU (rank processes, conversions, the parity
check), over ~1.5 s for the rest of Megatron-Core. A CPU run calls none of those functions.

:func:`install` (called by ``megatron_klear/__init__.py``, before anything of ours imports
Megatron-Core) lets ``megatron/core/jit.py`` run as it is and then replaces its ``jit_fuser`` by
:func:`compile_on_first_call`: the same ``torch.compile``, with the same arguments, called when the
decorated function first runs -- and only while the fusions are on (:func:`set_fusions`, which
the model builder calls from ``model.fusions``: ``auto`` is on with CUDA, ``off`` never). With them
off every decorated function runs eagerly: Megatron-Core 0.16.1 has switches for some fusions
(``bias_activation_fusion``, ``bias_dropout_fusion``, ...) but none for the MoE experts'
activations (``transformer/moe/experts.py``), which are ``jit_fuser`` functions whatever the config
says. Functions decorated later get it too (Megatron's modules import ``jit_fuser`` from there).
A decorated function called inside a larger ``torch.compile`` region would break its graph at the
wrapper (nothing of this project compiles such a region). If ``megatron.core`` was imported before
``megatron_klear``, nothing changes.

``KLEAR_EAGER_TORCH_COMPILE=1`` keeps Megatron-Core's own ``jit_fuser`` everywhere.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
import threading

MODULE = "megatron.core.jit"

#: whether a decorated function is compiled (True) or runs eagerly (False): :func:`set_fusions`
_FUSIONS = [True]


def set_fusions(on: bool) -> None:
    """Turn the ``jit_fuser`` functions' compilation on or off for this process (``model.fusions``)."""
    _FUSIONS[0] = bool(on)


def fusions() -> bool:
    return _FUSIONS[0]


def compile_on_first_call(fn=None, **options):
    """``torch.compile(fn, **options)``, done when the returned function is first called (once, under
    a lock); as a decorator with or without arguments, as ``torch.compile`` is."""
    if fn is None:
        return lambda f: compile_on_first_call(f, **options)
    lock, compiled = threading.Lock(), []

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not _FUSIONS[0]:
            return fn(*args, **kwargs)
        if not compiled:
            with lock:
                if not compiled:
                    import torch

                    compiled.append(torch.compile(fn, **options))
        return compiled[0](*args, **kwargs)

    return run


class _Loader(importlib.abc.Loader):
    """The module's own loader, and then the replacement."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        import torch

        if getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = compile_on_first_call

    def __getattr__(self, name):  # get_source, get_filename, ...: the module's own loader's
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` through the other finders (once) and wraps its loader."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Idempotent; a no-op once ``megatron.core.jit`` is imported or with KLEAR_EAGER_TORCH_COMPILE=1."""
    if MODULE in sys.modules or os.environ.get("KLEAR_EAGER_TORCH_COMPILE") == "1":
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
