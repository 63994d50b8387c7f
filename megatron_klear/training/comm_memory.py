"""What Megatron's NCCL communicators hold on this rank's GPU, and :class:`CommSuspension`, which
releases it while colocated servers generate (``rollout.suspend_nccl``; docs/sglang.md).

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
            if _no_communicator(e):  # it holds nothing
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


SUSPEND_MIN_NCCL = (2, 29, 7)  # ncclCommSuspend / ncclCommResume / ncclCommMemStats


def suspend_refusal(facts) -> str | None:
    """Why this process cannot suspend its NCCL communicators (``facts``: its
    :class:`~megatron_klear.platform.device_facts.DeviceFacts`), or None when it can."""
    from megatron_klear.platform.device_facts import parse_version

    if not facts.cuda:
        return "no CUDA device (no NCCL communicator to release)"
    if not facts.nccl_suspend_api:
        return "this PyTorch's ProcessGroupNCCL has no suspend/resume (PyTorch 2.12 or newer has them)"
    if parse_version(facts.nccl_version) < SUSPEND_MIN_NCCL:
        return f"NCCL {facts.nccl_version or '?'} has no ncclCommSuspend (NCCL 2.29.7 or newer has it)"
    return None


class CommSuspension:
    """This rank's NCCL communicators, suspended (their GPU memory released: NCCL's
    ``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)`` through PyTorch's backend ``suspend()``) and resumed.

    Both are collective: every rank of a group takes part, so every rank visits its groups in the
    same order (their creation order: :func:`nccl_groups`). A group whose communicator was never
    created (no collective ran on it) holds nothing and is left alone, and only the groups suspended
    are resumed. Nothing may run a collective on a suspended group (NCCL does not resume by itself):
    the colocated placement (``rl/rollout/placement.py``) suspends after the last collective of a
    weight push and resumes around every collective of the window (the probe check's scoring, a
    save) and before the next update. ``enabled=False``: both do nothing.

    ``groups_of`` and ``backend_of`` are :func:`nccl_groups` and the group's backend for this rank's
    GPU; the tests give other ones."""

    def __init__(self, enabled: bool = True, groups_of=None, backend_of=None):
        self.enabled = enabled
        self.groups_of = groups_of or nccl_groups
        self.backend_of = backend_of or _device_backend
        self.suspended = []  # the groups suspended, in the order they were
        self.suspensions = 0

    @property
    def asleep(self) -> bool:
        return bool(self.suspended)

    def suspend(self) -> dict:
        """Collective: release every created communicator's memory (idempotent); metrics."""
        if not self.enabled or self.suspended:
            return {}
        _synchronize()  # nothing of this rank may still run on a communicator
        released = 0
        for group in self.groups_of():
            backend = self.backend_of(group)
            try:
                before = int(backend.memory_stats().get("suspend", 0))
                backend.suspend()
            except RuntimeError as e:
                if _no_communicator(e):  # never used: nothing to release, nothing to resume
                    continue
                raise
            self.suspended.append(group)
            released += before
        self.suspensions += 1
        return {"memory/nccl_released_gb": released / 1e9}

    def resume(self) -> None:
        """Collective: the suspended communicators get their memory back (idempotent)."""
        groups, self.suspended = self.suspended, []
        for group in groups:
            self.backend_of(group).resume()


def _no_communicator(error: RuntimeError) -> bool:
    """PyTorch's answer for a group whose NCCL communicator was never created (no collective ran on
    it yet): "NCCL communicator not initialized."."""
    return "not initialized" in str(error)


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
