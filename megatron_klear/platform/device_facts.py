"""What the machine offers the GPU paths, read in one place and passed down.

The checks that depend on the hardware and the installed GPU stack (which FP8 recipe a device can
run, whether Transformer Engine has an attention backend for a dtype, which fused kernels to turn
on) take a :class:`DeviceFacts` instead of probing where they are used, so that each of them runs
on a CPU machine with the facts of an H100, a B200 or an old TE injected (the tests do), and a GPU
job reads its facts once, at :func:`device_facts`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass, field

# NCCL settings that the two ends of an update group must agree on: a communicator whose ends
# disagree on cuMem / NVLS buffers hangs or fails on a same-node weight update. NCCL reads them once
# per process. SGLang sets them in its own processes (:func:`sglang_nccl_env`: 0 unless the server's
# environment set them or a flag asks for them), so the launch scripts export both as 0 to every
# step (trainer and servers alike); a trainer whose values differ from its servers' is warned
# (:func:`nccl_update_group_gaps`). The cost: 0 turns them off for the trainer's own collectives too
# (NVLink SHARP for Megatron's all-reduces on NVSwitch machines; cuMem buffers, which NCCL
# suspension releases: docs/training.md says what to measure on a GPU).
NCCL_UPDATE_GROUP_KEYS = ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE")


def parse_version(text: str | None) -> tuple:
    """``"2.10.0.dev0+abc"`` -> ``(2, 10, 0)``; None -> ``()`` (compares below every version)."""
    if not text:
        return ()
    out = []
    for part in text.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


@dataclass(frozen=True)
class DeviceFacts:
    """The GPU, the CUDA build and the GPU packages of this process (empty on a CPU machine)."""

    cuda: bool = False  # a CUDA device is usable
    device_name: str | None = None
    capability: tuple | None = None  # (major, minor), e.g. (9, 0) for H100
    cuda_version: str | None = None  # the CUDA torch was built with (torch.version.cuda)
    te_version: str | None = None  # Transformer Engine's PyTorch package, None when absent
    mcore_version: str | None = None
    apex_fused_wgrad: bool = False  # apex's fused_weight_gradient_mlp_cuda (local gradient-accumulation fusion)
    nccl_env: dict = field(default_factory=dict)  # the NCCL_* settings of this process
    nccl_version: str | None = None  # the NCCL torch runs with ("2.29.7"), None without CUDA
    nccl_suspend_api: bool = False  # torch's ProcessGroupNCCL has suspend/resume (PyTorch 2.12+)

    @property
    def te(self) -> bool:
        return self.te_version is not None

    def te_at_least(self, *version: int) -> bool:
        return self.te and parse_version(self.te_version) >= version

    def cuda_at_least(self, *version: int) -> bool:
        return parse_version(self.cuda_version) >= version

    def describe(self) -> str:
        if not self.cuda:
            return "no CUDA device"
        cap = ".".join(map(str, self.capability)) if self.capability else "?"
        return (
            f"{self.device_name or 'GPU'} (compute capability {cap}), CUDA {self.cuda_version or '?'}, "
            f"Transformer Engine {self.te_version or 'absent'}, megatron-core {self.mcore_version or '?'}"
        )


def _installed_version(*dists: str) -> str | None:
    for name in dists:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def probe() -> DeviceFacts:
    """Read this process's facts (no cache: :func:`device_facts` is the cached one)."""
    import torch

    cuda = torch.cuda.is_available()
    te_version = None
    if importlib.util.find_spec("transformer_engine") is not None:
        try:  # TE's core without its PyTorch part cannot run a layer: both must import
            import transformer_engine
            import transformer_engine.pytorch
        except ImportError:
            te_version = None
        else:
            te_version = getattr(transformer_engine, "__version__", None) or _installed_version("transformer-engine")
    return DeviceFacts(
        cuda=cuda,
        device_name=torch.cuda.get_device_name() if cuda else None,
        capability=tuple(torch.cuda.get_device_capability()) if cuda else None,
        cuda_version=torch.version.cuda,
        te_version=te_version,
        mcore_version=_installed_version("megatron-core", "megatron_core"),
        apex_fused_wgrad=importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
        nccl_env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        nccl_version=_nccl_version() if cuda else None,
        nccl_suspend_api=_nccl_suspend_api(),
    )


def _nccl_version() -> str | None:
    """torch.cuda.nccl.version(): a tuple (2.x) or one int (older: 21803 for 2.18.3)."""
    try:
        import torch.cuda.nccl

        v = torch.cuda.nccl.version()
    except (ImportError, RuntimeError, AttributeError):
        return None
    if isinstance(v, int):
        v = (v // 10000, v // 100 % 100, v % 100) if v >= 10000 else (v // 1000, v // 100 % 10, v % 100)
    return ".".join(str(int(x)) for x in v[:3])


def _nccl_suspend_api() -> bool:
    try:
        from torch.distributed import ProcessGroupNCCL
    except ImportError:  # a torch built without NCCL (the CPU wheel)
        return False
    return all(hasattr(ProcessGroupNCCL, name) for name in ("suspend", "resume", "memory_stats"))


@functools.lru_cache(maxsize=1)
def device_facts() -> DeviceFacts:
    """This process's facts, read once."""
    return probe()


def sglang_nccl_env(env: dict, server_args: dict | None = None) -> dict:
    """``NCCL_CUMEM_ENABLE`` and ``NCCL_NVLS_ENABLE`` as an SGLang 0.5.23 server runs with them,
    from the environment it was started in and its server arguments (``/server_info``), by
    ``srt/entrypoints/engine.py`` ``_set_envs_and_config``: a value the environment sets is kept,
    an unset one becomes 0; ``--enable-symm-mem`` sets both to 1, ``--enable-nccl-nvls`` the
    second. (Its two other cases are left out: cuMem on by default across multi-node NVLink
    fabrics, and for the KV-shard gather's symmetric scratch.)"""
    args = server_args or {}
    symm, nvls = bool(args.get("enable_symm_mem")), bool(args.get("enable_nccl_nvls"))
    out = {}
    for key, forced in zip(NCCL_UPDATE_GROUP_KEYS, (symm, symm or nvls)):
        out[key] = "1" if forced else env.get(key, "0")
    return out


def nccl_update_group_gaps(facts: DeviceFacts, server_args: dict | None = None, server_env: dict | None = None) -> list:
    """The NCCL settings of ``facts`` that differ from what the servers run with
    (:func:`sglang_nccl_env` of ``server_env``, by default this process's own: the launch scripts
    start every step with the job's environment), each as ``"NAME=value (servers: v)"``; [] when
    they agree."""
    servers = sglang_nccl_env(facts.nccl_env if server_env is None else server_env, server_args)
    return [
        f"{k}={facts.nccl_env.get(k, '<unset>')} (servers: {v})"
        for k, v in servers.items()
        if facts.nccl_env.get(k) != v
    ]
