"""Buckets for the server ranks that rank 0's GPU does not serve (``rollout.weight_sync=memory``).

Rank 0 gathers the model's buckets (:mod:`.gather`), but each rank of a server maps a copy on its
own GPU of its own node (:mod:`.machines`). :class:`BucketRelay` sends each bucket from rank 0 to
the trainer ranks on those GPUs (its *relay ranks*, on rank 0's machine and others), each of which
copies it onto its device, shares it once per server rank it serves
(:func:`~.sharing.share_views`: one pickle per opener) and hands the handles back to rank 0; rank 0
then posts to each server, rank by rank, the handles of the copy on that rank's GPU. Only handles
(some hundred bytes) go to the servers over HTTP.

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
    """Collective to build (every rank creates the group). ``copies``: ``{relay rank (not 0): how
    many server ranks map its copy}``, ``device``: where a relay rank puts its copy (its own GPU,
    the one those server ranks run on)."""

    def __init__(self, copies: dict, device):
        self.copies = {int(r): int(n) for r, n in copies.items()}
        self.relays = sorted(self.copies)
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
        :func:`~.sharing.bucket_layout`) to every relay rank; ``{relay rank: [its handles, one per
        server rank it serves]}``. A relay rank that could not share it answers its error (it keeps
        to the protocol until :meth:`end`): raised here, naming the rank."""
        dist.broadcast_object_list([(layout, buffer.numel())], src=0, group=self.group)
        host = buffer if buffer.device.type == "cpu" else buffer.to("cpu")
        dist.broadcast(host, src=0, group=self.group)
        payloads = [None] * (len(self.relays) + 1)
        dist.gather_object(None, payloads, dst=0, group=self.group)
        failed = {r: p[1] for r, p in zip(self.relays, payloads[1:]) if isinstance(p, tuple) and p[:1] == ("error",)}
        if failed:
            raise RuntimeError(f"rollout.weight_sync=memory: the bucket relay failed on rank(s) {failed}")
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

    def join(self):
        """A relay rank, after the gather: wait for the end; returns what went wrong in the thread,
        or None (rank 0 was told at that bucket and fails the push on every rank)."""
        self.thread.join()
        self.thread = None
        return self.error

    def _receive(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        held = collections.deque(maxlen=2)  # the bucket the servers may still be loading, and this one
        cpu = self.device.type == "cpu"
        try:
            while True:
                head = [None]
                dist.broadcast_object_list(head, src=0, group=self.group)
                if head[0] is None:
                    return
                layout, nbytes = head[0]
                # on the CPU the copy the servers map; on a GPU plain host memory to stage it
                host = shared_buffer(nbytes, self.device) if cpu else torch.empty(max(nbytes, 1), dtype=torch.uint8)
                dist.broadcast(host, src=0, group=self.group)
                answer = ("error", repr(self.error)) if self.error is not None else None
                if answer is None:
                    try:
                        buffer = host if cpu else shared_buffer(nbytes, self.device).copy_(host)
                        held.append(buffer)
                        answer = [share_views(layout, buffer) for _ in range(self.copies[self.rank])]
                        self.received += 1
                    except Exception as e:  # noqa: BLE001 -- answered to rank 0, which fails the push
                        self.error, answer = e, ("error", f"{type(e).__name__}: {e}")
                dist.gather_object(answer, None, dst=0, group=self.group)
        except Exception as e:  # noqa: BLE001 -- the group itself broke (rank 0 gone): returned by join()
            self.error = e
