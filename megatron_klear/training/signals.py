"""SIGTERM (a scheduler's preemption, torchrun forwarding Ctrl-C) -> checkpoint, then exit."""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class TerminationFlag:
    """Install with ``TerminationFlag().install()``; ``should_stop()`` is collective (every rank
    gets the same answer, so all of them save and stop at the same step)."""

    def __init__(self):
        self.received = False

    def install(self, signals=(signal.SIGTERM,)):
        for s in signals:
            signal.signal(s, self._handler)
        return self

    def _handler(self, signum, frame):
        self.received = True

    def should_stop(self) -> bool:
        from megatron_klear.platform import comm_device

        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=comm_device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
