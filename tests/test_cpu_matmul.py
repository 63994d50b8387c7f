"""platform/cpu_matmul.py: the measured bf16/fp16-against-fp32 slowdown of this CPU's matrix products
and the warning a CPU run in half precision gets (the hook in training/setup.py is exercised by
tests/distributed/test_fp16_overflow.py)."""

import pytest
import torch

from megatron_klear.platform.cpu_matmul import (
    SLOW,
    check_cpu_matmul,
    half_matmul_slowdown,
    one_thread,
    slow_half_matmul_warning,
)


def test_the_warning_names_the_dtype_the_factor_the_cpu_and_the_way_out():
    text = slow_half_matmul_warning(torch.bfloat16, 97.4, "AVX2")
    assert text.startswith("model.dtype=bf16 on a CPU whose bf16 matrix products run 97x slower than fp32")
    assert "capability: AVX2" in text and text.endswith("set model.dtype=fp32 for CPU runs where time matters")
    assert slow_half_matmul_warning(torch.float16, SLOW, "AVX2").startswith("model.dtype=fp16")
    # a fast kernel (AVX-512 with BF16 or AMX: 0.5-2x fp32's time), or an fp32 model: nothing to say
    assert slow_half_matmul_warning(torch.bfloat16, 1.7, "AVX512") is None
    assert slow_half_matmul_warning(torch.bfloat16, SLOW - 0.1, "AVX2") is None
    assert slow_half_matmul_warning(torch.float32, 500.0, "AVX2") is None


def test_the_slowdown_is_measured_once_and_matches_this_cpus_kernels():
    assert half_matmul_slowdown(torch.float32) == 1.0 and check_cpu_matmul(torch.float32) is None
    ratio = half_matmul_slowdown(torch.bfloat16)
    assert ratio > 0 and half_matmul_slowdown(torch.bfloat16) == ratio  # cached: one measurement a process
    warning = check_cpu_matmul(torch.bfloat16)
    assert (warning is not None) == (ratio >= SLOW)
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        # no AVX-512: torch 2.13's bf16 product is its scalar fallback (~100x at 1024, ~50x at 256 on
        # one thread, idle; 7x on two threads beside another busy process: hence one thread)
        assert ratio >= SLOW and "capability: AVX2" in warning
    # an independent measurement at another size agrees on which side of the line this CPU is
    a, times, threads = torch.randn(384, 384), {}, torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
        for dtype in (torch.float32, torch.bfloat16):
            x = a.to(dtype)
            torch.mm(x, x)
            times[dtype] = min(_timed(torch.mm, x, x) for _ in range(3))
    assert torch.get_num_threads() == threads  # the process's setting is back
    independent = times[torch.bfloat16] / times[torch.float32]
    if ratio >= 3 * SLOW or ratio <= SLOW / 3:  # clear cases only: timings on a shared CPU are noisy
        assert (independent >= SLOW) == (ratio >= SLOW), (ratio, independent)


def _timed(fn, *args) -> float:
    import time

    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


@pytest.fixture(autouse=True)
def _fresh_measurement():
    half_matmul_slowdown.cache_clear()
    yield
