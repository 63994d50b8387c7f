"""Before a GPU training run's first forward: can this node compile Megatron-Core's fusions?

With ``model.fusions=auto`` on CUDA, the fused SwiGLU, bias-dropout-add and MoE activations are
``torch.compile`` functions (``megatron.core.jit.jit_fuser``). Inductor generates Triton kernels,
and Triton builds each kernel's launcher with the node's C compiler against Python's headers and
keeps it in a cache directory: a node without ``gcc`` or ``Python.h`` (a slim container, a
cluster's minimal image) fails at the first forward, deep inside Triton. :func:`check_fusions_compile`
compiles one tiny function on the device before anything else runs and, if that fails, names what
is missing and the switch that avoids it (``model.fusions=off``).
"""

from __future__ import annotations

import os
import shutil
import sysconfig


def _writable_dir(path: str) -> bool:
    """Whether ``path`` is, or could be created as, a directory this process can write."""
    probe = path
    while probe and not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return os.path.isdir(probe) and os.access(probe, os.W_OK | os.X_OK)


def compile_gaps(env=None, which=shutil.which, include_dir: str | None = None) -> list:
    """What this node lacks to build Triton's kernels, one phrase each ([] when nothing is found
    missing): a C compiler (``$CC``, else gcc or clang on ``PATH``: Triton's ``runtime/build.py``
    ``_build`` looks for those two and no other), ``Python.h`` where this interpreter's
    headers belong, and writable cache directories (Triton's ``$TRITON_CACHE_DIR``, default
    ``~/.triton/cache``; Inductor's ``$TORCHINDUCTOR_CACHE_DIR``, default
    ``/tmp/torchinductor_<user>``)."""
    env = os.environ if env is None else env
    gaps = []
    cc = env.get("CC")
    if cc:
        if not which(cc):
            gaps.append(f"the C compiler CC={cc} (not found on PATH)")
    elif not any(which(c) for c in ("gcc", "clang")):
        gaps.append("a C compiler (neither gcc nor clang on PATH: install gcc, or set CC)")
    header = os.path.join(include_dir or sysconfig.get_paths()["include"], "Python.h")
    if not os.path.exists(header):
        gaps.append(f"Python's headers ({header}: the python3-dev or python3-devel package of this Python)")
    home = env.get("HOME") or os.path.expanduser("~")
    triton = env.get("TRITON_CACHE_DIR") or os.path.join(env.get("TRITON_HOME") or home, ".triton", "cache")
    user = env.get("USER") or env.get("LOGNAME") or "user"
    inductor = env.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join("/tmp", f"torchinductor_{user}")
    for what, path in (("TRITON_CACHE_DIR", triton), ("TORCHINDUCTOR_CACHE_DIR", inductor)):
        if not _writable_dir(path):
            gaps.append(f"a writable {what} ({path} is not writable: point {what} at a local directory)")
    return gaps


def _compile_one(device: str) -> None:
    """torch.compile a SwiGLU-shaped function (Inductor, Triton on CUDA) and check its answer."""
    import torch

    def swiglu(x):
        a, b = torch.chunk(x, 2, dim=-1)
        return torch.nn.functional.silu(a) * b

    x = torch.linspace(-2.0, 2.0, 256, device=device).reshape(4, 64)
    got = torch.compile(swiglu)(x)
    if not torch.allclose(got, swiglu(x), rtol=1e-5, atol=1e-6):
        raise RuntimeError("the compiled function's answer differs from the eager one")


def check_fusions_compile(device: str = "cuda", compile_fn=None, gaps_fn=compile_gaps) -> None:
    """Compile and run one tiny function on ``device`` as the fusions will be; on failure raise
    RuntimeError naming the error, what :func:`compile_gaps` finds missing, and ``model.fusions=off``."""
    try:
        (compile_fn or _compile_one)(device)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        gaps = gaps_fn()
        missing = "; missing: " + "; ".join(gaps) if gaps else ""
        raise RuntimeError(
            f"model.fusions=auto: torch.compile of a test function failed on {device} "
            f"({type(e).__name__}: {first}){missing}. Megatron-Core's fused kernels (SwiGLU, bias-dropout-add, the "
            "MoE activations) are compiled by Inductor and Triton, which need a C compiler and Python's headers on "
            "every GPU node and a writable cache. Install them (docs/training.md, 'What a GPU node needs'), or set "
            "model.fusions=off to run every fused function eagerly"
        ) from e
