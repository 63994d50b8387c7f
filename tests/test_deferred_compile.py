"""platform/deferred_compile.py: Megatron-Core's ``jit_fuser`` compiles a fused function at its
first call (through torch.compile, once, with the decorator's options) instead of importing
TorchDynamo and Inductor at Megatron-Core's import, on every machine (on CUDA too, so that
``model.fusions=off`` can run them eagerly); with KLEAR_EAGER_TORCH_COMPILE=1 Megatron-Core's own
``jit_fuser`` stays."""

import json
import math
import subprocess
import sys
import types

import pytest
import torch

from megatron_klear.platform import deferred_compile
from megatron_klear.platform.deferred_compile import compile_on_first_call

# a fresh process: Megatron-Core imported after megatron_klear, then one of its fused functions
# (bias + tanh-GeLU) called twice through torch.compile's real TorchDynamo (the eager backend:
# the function is traced, no C++ is generated)
PROCESS = r"""
import json, sys
import torch
import megatron_klear
import megatron.core
from megatron.core import jit
from megatron.core.fusions.fused_bias_gelu import bias_gelu
from megatron_klear.platform.deferred_compile import compile_on_first_call

state = {"deferred": jit.jit_fuser is compile_on_first_call, "dynamo_at_import": "torch._dynamo" in sys.modules,
         "inductor_at_import": "torch._inductor" in sys.modules}
real, calls = torch.compile, []

def spy(fn, **options):
    calls.append([fn.__name__, options])
    return real(fn, backend="eager", **options)

torch.compile = spy
g = torch.Generator().manual_seed(0)
b, y = torch.randn(7, dtype=torch.float64, generator=g), torch.randn(3, 7, dtype=torch.float64, generator=g)
first, second = bias_gelu(b, y), bias_gelu(b, y + 1)
state.update(calls=calls, dynamo_after_call="torch._dynamo" in sys.modules,
             b=b.tolist(), y=y.tolist(), first=first.tolist(), second=second.tolist())
print(json.dumps(state))
"""


def _gelu_tanh(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def test_megatrons_fusions_compile_at_their_first_call_and_compute_what_they_did():
    proc = subprocess.run([sys.executable, "-c", PROCESS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["deferred"] and not got["dynamo_at_import"] and not got["inductor_at_import"], got
    assert got["calls"] == [["bias_gelu", {}]]  # compiled once, at the first call, with no options added
    assert got["dynamo_after_call"]
    for shift, key in ((0.0, "first"), (1.0, "second")):
        for row_y, row_out in zip(got["y"], got[key]):
            for bias, y, out in zip(got["b"], row_y, row_out):
                assert abs(out - _gelu_tanh(bias + y + shift)) < 1e-8, (key, bias, y, out)


def test_the_decorator_forms_compile_once_with_their_options(monkeypatch):
    monkeypatch.setattr(deferred_compile, "_FUSIONS", [True])  # (a model built before may have turned them off)
    calls = []

    def spy(fn, **options):
        calls.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(torch, "compile", spy)

    @compile_on_first_call
    def double(x):
        """doubles"""
        return 2 * x

    @compile_on_first_call(dynamic=False, mode="max-autotune")
    def plus(x, y=1):
        return x + y

    assert calls == [] and double.__name__ == "double" and double.__doc__ == "doubles"
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert plus(1, y=2) == ("compiled", 3)
    assert calls == [("double", {}), ("plus", {"dynamic": False, "mode": "max-autotune"})]


class _Inner:
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.jit_fuser = torch.compile

    def get_filename(self, name):
        return "megatron/core/jit.py"


@pytest.mark.parametrize("cuda", [False, True])
def test_every_machine_gets_the_deferred_fuser(monkeypatch, cuda):
    """The loader's decision with the device's fact injected: with or without CUDA the deferred
    fuser replaces torch.compile (the switch of model.fusions lives in it); the module's own
    loader still answers the rest."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    loader = deferred_compile._Loader(_Inner())
    module = types.ModuleType(deferred_compile.MODULE)
    loader.exec_module(module)
    assert module.jit_fuser is compile_on_first_call
    assert loader.get_filename(deferred_compile.MODULE) == "megatron/core/jit.py"


@pytest.mark.parametrize("eager", ["1", None])
def test_install_adds_its_finder_once_and_not_when_asked_for_the_eager_fuser(monkeypatch, eager):
    monkeypatch.delitem(sys.modules, deferred_compile.MODULE, raising=False)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, deferred_compile._Finder)])
    if eager:
        monkeypatch.setenv("KLEAR_EAGER_TORCH_COMPILE", eager)
    else:
        monkeypatch.delenv("KLEAR_EAGER_TORCH_COMPILE", raising=False)
    deferred_compile.install()
    deferred_compile.install()
    finders = [f for f in sys.meta_path if isinstance(f, deferred_compile._Finder)]
    assert len(finders) == (0 if eager else 1)
