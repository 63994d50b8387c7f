"""How much slower this CPU multiplies matrices in bf16 / fp16 than in fp32, measured once.

PyTorch's CPU build runs bf16 matrix products through oneDNN only where the CPU has AVX-512
(fast with AVX512-BF16 or AMX); a CPU with AVX2 alone (many AMD EPYC and older Intel machines)
falls back to a scalar loop, ~100x slower than fp32 on the same machine (torch 2.13, measured
at 1024x1024). A model trained in bf16 on such a CPU spends nearly all its time there, so a CPU
run in bf16 or fp16 is warned (``training/setup.py``), with the figure and the way out:
``model.dtype: fp32``, as the tiny CPU configs have.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch

SIZE = 256  # 2 * 256^3 flops: ~0.1 s in the slow loop, microseconds in a fast kernel
SLOW = 4.0  # warn from this ratio up (a fast bf16 kernel is 0.5-2x fp32's time; the scalar loop 25-100x)


@functools.lru_cache(maxsize=None)
def half_matmul_slowdown(dtype: torch.dtype, size: int = SIZE, repeats: int = 5) -> float:
    """Seconds of a ``size`` x ``size`` matrix product in ``dtype`` over its fp32 seconds on this
    CPU (each the best of ``repeats``, after a warm-up, on one thread: a multi-threaded fp32 GEMM
    beside other busy processes loses more to them than the scalar loop, and the ratio with it);
    1.0 for fp32 itself."""
    if dtype == torch.float32:
        return 1.0
    with one_thread():
        return _ratio(dtype, size, repeats)


@contextlib.contextmanager
def one_thread():
    """torch's CPU operators on one thread inside, the process's setting back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _ratio(dtype: torch.dtype, size: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(0)
    a32 = torch.randn(size, size, generator=gen)

    def best(a: torch.Tensor) -> float:
        torch.mm(a, a)  # warm-up: the kernel's first call chooses and allocates
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, a)
            times.append(time.perf_counter() - start)
        return max(min(times), 1e-7)

    return best(a32.to(dtype)) / best(a32)


def slow_half_matmul_warning(dtype: torch.dtype, slowdown: float, capability: str) -> str | None:
    """The warning for a CPU run of a ``dtype`` model whose matrix products are ``slowdown`` times
    slower than fp32's; None when they are not (or the model is fp32)."""
    if dtype == torch.float32 or slowdown < SLOW:
        return None
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    return (
        f"model.dtype={name} on a CPU whose {name} matrix products run {slowdown:.0f}x slower than fp32 "
        f"(torch's CPU capability: {capability}; fast {name} needs AVX-512, best with AVX512-BF16 or AMX): "
        "set model.dtype=fp32 for CPU runs where time matters"
    )


def check_cpu_matmul(dtype: torch.dtype) -> str | None:
    """:func:`slow_half_matmul_warning` for this CPU (measured: a few milliseconds)."""
    if dtype == torch.float32:
        return None
    return slow_half_matmul_warning(dtype, half_matmul_slowdown(dtype), torch.backends.cpu.get_cpu_capability())
