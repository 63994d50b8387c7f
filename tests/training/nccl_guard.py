"""NCCL's suspension rules, enforced on the CPU's gloo groups (the device facts of a GPU job).

On a GPU, Megatron's groups (and the default group) are NCCL groups; their communicators are created
at a group's first collective, ``suspend()`` / ``resume()`` are collective over the group's ranks,
a group never used answers "NCCL communicator not initialized.", and a collective on a suspended
communicator is undefined. Here the same groups are gloo groups, so :func:`install` makes them
behave as those rules say: every collective of a process group (each method of
``torch.distributed.ProcessGroup`` that c10d's functions call) records that the group is in use and
raises :class:`SuspendedCollective` on a group that is suspended; :class:`Backend` is a group's
NCCL backend as PyTorch 2.12+ exposes it (its ``suspend`` and ``resume`` synchronize the group's
ranks, as NCCL's do). The groups that are NCCL on a GPU: :func:`device_groups`."""

from __future__ import annotations

import torch.distributed as dist

COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "reduce",
    "allgather",
    "all_gather_single",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "_allgather_base",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced",
    "_reduce_scatter_base",
    "all_to_all_single",
    "alltoall",
    "alltoall_base",
    "barrier",
    "send",
    "recv",
)
SUSPEND_BYTES = 1 << 20  # what each suspended communicator reports it released

USED = set()  # id() of the groups a collective ran on (their communicator exists)
SUSPENDED = set()  # id() of the groups suspended now
EVENTS = []  # ("suspend" | "resume", group index in device_groups())


class SuspendedCollective(RuntimeError):
    """A collective ran on a suspended communicator (undefined under NCCL)."""


def install() -> None:
    """Every ProcessGroup collective in this process obeys the rules above (idempotent)."""
    for name in COLLECTIVES:
        original = getattr(dist.ProcessGroup, name, None)
        if original is None or getattr(original, "_guarded", False):
            continue
        setattr(dist.ProcessGroup, name, _guarded(name, original))


def _guarded(name, original):
    def call(self, *args, **kwargs):
        if id(self) in SUSPENDED:
            raise SuspendedCollective(f"{name} on a suspended communicator (group {_describe(self)})")
        USED.add(id(self))
        return original(self, *args, **kwargs)

    call._guarded = True
    return call


def _describe(group) -> str:
    try:
        return f"{group.group_name} of ranks {dist.get_process_group_ranks(group)}"
    except (RuntimeError, ValueError):
        return "?"


def device_groups() -> list:
    """The groups a GPU job would run on NCCL, in their creation order: the default group and
    Megatron's parallel groups (not its gloo groups, not the project's control and relay groups)."""
    from megatron.core import parallel_state

    device = {id(dist.group.WORLD)}
    for attr, value in vars(parallel_state).items():
        if attr.startswith("_") and "GLOO" not in attr and isinstance(value, dist.ProcessGroup):
            device.add(id(value))
    return [g for g in dist.distributed_c10d._world.pg_group_ranks if id(g) in device]


class Backend:
    """One group's NCCL backend (PyTorch 2.12+): ``memory_stats`` / ``suspend`` / ``resume``."""

    def __init__(self, group):
        self.group = group

    def _created(self) -> None:
        if id(self.group) not in USED:
            raise RuntimeError("NCCL communicator not initialized.")

    def memory_stats(self) -> dict:
        self._created()
        released = id(self.group) in SUSPENDED
        return {"total": SUSPEND_BYTES, "suspend": 0 if released else SUSPEND_BYTES, "suspended": int(released)}

    def suspend(self) -> None:
        self._created()
        if id(self.group) in SUSPENDED:
            raise RuntimeError("ncclCommSuspend: the communicator is suspended already")
        self.group.barrier().wait()  # NCCL synchronizes the group's ranks inside the call
        SUSPENDED.add(id(self.group))
        EVENTS.append(("suspend", self._index()))

    def resume(self) -> None:
        if id(self.group) not in SUSPENDED:
            raise RuntimeError("ncclCommResume: the communicator is not suspended")
        SUSPENDED.discard(id(self.group))
        self.group.barrier().wait()
        EVENTS.append(("resume", self._index()))

    def _index(self) -> int:
        return [id(g) for g in device_groups()].index(id(self.group))


def suspension():
    """A :class:`~megatron_klear.training.comm_memory.CommSuspension` of this process's device groups
    under these rules (installed)."""
    from megatron_klear.training.comm_memory import CommSuspension

    install()
    return CommSuspension(enabled=True, groups_of=device_groups, backend_of=Backend)
