"""model.fusions and the check that a GPU node can compile them (platform/compile_check.py,
platform/deferred_compile.py): what the check finds missing, its error, and Megatron-Core's fused
SwiGLU over the lengths a packed run hands it (varying per micro-batch, 0 for an empty expert)
staying under Dynamo's recompile limit."""

import os

import pytest
import torch

from megatron_klear.platform import deferred_compile
from megatron_klear.platform.compile_check import check_fusions_compile, compile_gaps


def _which(*found):
    return lambda name: f"/usr/bin/{name}" if name in found else None


def test_compile_gaps_name_the_compiler_the_headers_and_the_caches(tmp_path):
    headers = tmp_path / "include"
    headers.mkdir()
    (headers / "Python.h").write_text("")
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "USER": "me", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    assert compile_gaps(env, _which("gcc"), str(headers)) == []
    assert compile_gaps(env, _which("clang"), str(headers)) == []  # Triton takes gcc, else clang
    gaps = compile_gaps(env, _which("cc"), str(tmp_path / "none"))  # `cc` alone: Triton does not look for it
    assert len(gaps) == 2 and "neither gcc nor clang" in gaps[0] and "Python.h" in gaps[1], gaps
    assert "CC=icx" in compile_gaps({**env, "CC": "icx"}, _which("gcc"), str(headers))[0]
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root): the permission case cannot be built")
        gaps = compile_gaps({**env, "TRITON_CACHE_DIR": str(locked / "cache")}, _which("gcc"), str(headers))
        assert len(gaps) == 1 and "TRITON_CACHE_DIR" in gaps[0], gaps
    finally:
        locked.chmod(0o700)


def test_a_failed_compile_is_reported_with_its_cause_what_is_missing_and_the_switch():
    def no_compiler(device):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    gaps = ["a C compiler (neither gcc nor clang on PATH: install gcc, or set CC)"]
    with pytest.raises(RuntimeError) as e:
        check_fusions_compile("cuda", compile_fn=no_compiler, gaps_fn=lambda: gaps)
    text = str(e.value)
    assert "Failed to find C compiler" in text and "neither gcc nor clang" in text and "model.fusions=off" in text
    check_fusions_compile("cuda", compile_fn=lambda device: None, gaps_fn=lambda: gaps)  # it compiled: no error


@pytest.fixture
def fusions_on():
    before = deferred_compile.fusions()
    deferred_compile.set_fusions(True)
    yield
    deferred_compile.set_fusions(before)


def test_megatrons_fused_swiglu_over_packed_lengths_stays_under_the_recompile_limit(monkeypatch, fusions_on):
    """The function Megatron-Core runs with ``bias_activation_fusion`` (and the MoE experts' GLU),
    compiled through the project's ``jit_fuser`` by real TorchDynamo with a backend that counts the
    graphs it is handed: a packed run's token counts vary per micro-batch and an empty expert gets
    0 rows. Dynamo marks the length dynamic after the second size, and specialises 0 and 1: a few
    graphs, far under ``recompile_limit`` (past it, Dynamo would run the function uncompiled)."""
    import torch._dynamo
    from megatron.core.fusions.fused_bias_swiglu import swiglu

    graphs, real = [], torch.compile

    def counting(gm, example_inputs):
        graphs.append([tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in example_inputs])
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **options: real(fn, backend=counting, **options))
    torch._dynamo.reset()
    fused = deferred_compile.compile_on_first_call(swiglu.__wrapped__)
    lengths = (37, 300, 5, 120, 0, 1, 1024, 64, 2, 999, 0, 77)
    g = torch.Generator().manual_seed(0)
    for n in lengths:
        y = torch.randn(n, 2 * 24, generator=g)
        a, b = torch.chunk(y, 2, -1)
        torch.testing.assert_close(fused(y), torch.nn.functional.silu(a) * b, rtol=0, atol=0)
    limit = torch._dynamo.config.recompile_limit
    assert 1 <= len(graphs) <= 4 < limit, graphs
    torch._dynamo.reset()


def test_with_the_fusions_off_a_jit_fuser_function_is_never_compiled(monkeypatch, fusions_on):
    calls = []
    monkeypatch.setattr(
        torch, "compile", lambda fn, **o: calls.append(fn.__name__) or (lambda *a: ("compiled", fn(*a)))
    )

    @deferred_compile.compile_on_first_call
    def double(x):
        return 2 * x

    deferred_compile.set_fusions(False)
    assert double(3) == 6 and calls == []
    deferred_compile.set_fusions(True)
    assert double(3) == ("compiled", 6) and calls == ["double"]
