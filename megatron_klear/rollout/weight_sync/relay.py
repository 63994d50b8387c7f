"""Buckets for colocated servers on other machines (``rollout.weight_sync=memory`` across nodes).

Rank 0 gathers the model's buckets (:mod:`.gather`); servers on its machine map its copy of each
bucket, but a server on another node can only map memory of its own node. :class:`BucketRelay`
sends each bucket from rank 0 to one trainer rank per other machine that hosts servers (its
*relay rank*, :mod:`.machines`), which copies it onto its device, shares it as rank 0 does
(:func:`~.sharing.share_views`) and hands the handles back to rank 0; rank 0 then posts to each
server the handles of its own machine. Only handles (some hundred bytes) go to the servers over
HTTP; each bucket crosses the network once per machine.

A relay rank may itself be taking part in the gather (a pipeline stage's leader sending its stage
to rank 0, a tensor-parallel peer): it receives in a thread of its own, over a gloo group of rank 0
and the relay ranks, so rank 0's send never waits on a rank that is waiting on rank 0. (NCCL
communicators used from two threads at once are not safe, hence gloo: the bucket crosses as host
memory, then goes onto the relay rank's device.) A relay rank holds two buckets at most: rank 0
posts bucket ``k+1`` only once every server has loaded bucket ``k``.
"""

from __future__ import annotations

import collections
import datetime
import threading

import torch
import torch.distributed as dist

from megatron_klear.rollout.weight_sync.sharing import ready_to_share, share_views, shared_buffer

#: how long rank 0 and a relay rank wait for each other at one bucket (the gather of a stage and a
#: server's load of the bucket before come in between)
TIMEOUT = datetime.timedelta(minutes=30)


class BucketRelay:
    """Collective to build (every rank creates the group). ``relays``: the relay ranks (not 0),
    ``device``: where a relay rank puts its copy (the device its servers map)."""

    def __init__(self, relays: list, device):
        self.relays = sorted(relays)
        self.device = torch.device(device)
        self.rank = dist.get_rank()
        self.group = dist.new_group([0, *self.relays], backend="gloo", timeout=TIMEOUT)
        self.thread = None
        self.error = None
        self.received = 0  # buckets this relay rank has shared (in the last push)

    @property
    def relaying(self) -> bool:
        """This rank is one of the relay ranks."""
        return self.rank in self.relays

    # -- rank 0 ----------------------------------------------------------------------------------
    def send(self, layout: list, buffer) -> dict:
        """Rank 0: the bucket (``buffer``, its tensors at ``layout``'s places: see
        :func:`~.sharing.bucket_layout`) to every relay rank; ``{relay rank: its handles}``."""
        dist.broadcast_object_list([(layout, buffer.numel())], src=0, group=self.group)
        host = buffer if buffer.device.type == "cpu" else buffer.to("cpu")
        dist.broadcast(host, src=0, group=self.group)
        payloads = [None] * (len(self.relays) + 1)
        dist.gather_object(None, payloads, dst=0, group=self.group)
        return dict(zip(self.relays, payloads[1:]))

    def end(self) -> None:
        """Rank 0, after the last bucket: the relay ranks drop their copies and stop receiving."""
        dist.broadcast_object_list([None], src=0, group=self.group)

    # -- a relay rank ----------------------------------------------------------------------------
    def start(self) -> None:
        """A relay rank, before the gather: receive buckets in a thread until rank 0's :meth:`end`."""
        ready_to_share(self.device)
        self.error, self.received = None, 0
        self.thread = threading.Thread(target=self._receive, name="weights-relay", daemon=True)
        self.thread.start()

    def join(self) -> None:
        """A relay rank, after the gather: wait for the end; raises what went wrong in the thread."""
        self.thread.join()
        self.thread = None
        if self.error is not None:
            raise RuntimeError(f"rollout.weight_sync=memory: the bucket relay on rank {self.rank} failed") from (
                self.error
            )

    def _receive(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        held = collections.deque(maxlen=2)  # the bucket the servers may still be loading, and this one
        try:
            while True:
                head = [None]
                dist.broadcast_object_list(head, src=0, group=self.group)
                if head[0] is None:
                    return
                layout, nbytes = head[0]
                host = shared_buffer(nbytes, torch.device("cpu"))
                dist.broadcast(host, src=0, group=self.group)
                buffer = host if self.device.type == "cpu" else host.to(self.device)
                held.append(buffer)
                dist.gather_object(share_views(layout, buffer), None, dst=0, group=self.group)
                self.received += 1
        except Exception as e:  # noqa: BLE001 -- raised by join() on the rank's own thread
            self.error = e
