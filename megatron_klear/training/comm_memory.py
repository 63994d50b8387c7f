"""What Megatron's NCCL communicators hold on this rank's GPU: memory a colocated trainer keeps
while its servers generate (``memory/nccl_gb`` at each weight push; docs/sglang.md says what
releasing it would take).

Read through PyTorch 2.12+'s ``Backend.memory_stats()`` (NCCL 2.29.7+'s ``ncclCommMemStats``):
``total`` bytes, of which ``suspend`` bytes are what ``ncclCommSuspend`` could release. Each NCCL
group's communicator for this rank's device is asked; one never created (no collective ran on the
group yet) holds nothing. A backend without the call (gloo; a PyTorch or NCCL older than those)
leaves the figure unknown: None, and no metric. Reading the figures is local to the rank (no
collective)."""

from __future__ import annotations

KEYS = ("total", "suspend")


def nccl_groups() -> list:
    """This process's NCCL process groups, in their creation order."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return []
    groups = []
    for group in list(c10d._world.pg_group_ranks):
        try:
            backend = str(dist.get_backend(group)).lower()
        except (RuntimeError, ValueError):  # a group this rank is not part of, or one destroyed
            continue
        if "nccl" in backend:
            groups.append(group)
    return groups


def _device_backend(group):
    """``group``'s backend for this rank's GPU (the object whose ``memory_stats`` is read)."""
    import torch

    return group._get_backend(torch.device("cuda", torch.cuda.current_device()))


def communicator_memory(groups=None, backend_of=None) -> dict | None:
    """``{"total": bytes, "suspend": bytes}`` over ``groups`` (default :func:`nccl_groups`), each
    group's figures from ``backend_of(group).memory_stats()`` (default: its backend for this rank's
    GPU); None when no group could say (none, or a PyTorch / NCCL without the call)."""
    groups = nccl_groups() if groups is None else list(groups)
    backend_of = backend_of or _device_backend
    held, answered = dict.fromkeys(KEYS, 0), False
    for group in groups:
        try:
            stats = backend_of(group).memory_stats()
        except AttributeError:  # a PyTorch older than 2.12: no group can say
            return None
        except RuntimeError as e:
            if "not initialized" in str(e):  # no communicator yet: it holds nothing
                answered = True
                continue
            return None  # "does not support" (not NCCL), "requires NCCL 2.29.7": none can say
        for key in KEYS:
            held[key] += int(stats.get(key, 0))
        answered = True
    return held if answered else None


def memory_metrics() -> dict:
    """The metrics of :func:`communicator_memory` in GB (``memory/nccl_gb``,
    ``memory/nccl_releasable_gb``); {} when unknown."""
    held = communicator_memory()
    if held is None:
        return {}
    return {"memory/nccl_gb": held["total"] / 1e9, "memory/nccl_releasable_gb": held["suspend"] / 1e9}
