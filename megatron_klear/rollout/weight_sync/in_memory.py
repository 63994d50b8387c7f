"""``rollout.weight_sync=memory`` (the default with ``rollout.colocate``): the trainer hands its
weights to the servers that share its machine in memory, bucket by bucket, as slime and verl do,
instead of writing an HF checkpoint every step for the servers to reload.

Each bucket's tensors are copied into one buffer (one storage, each tensor a view of it) and pickled
with :mod:`multiprocessing`'s pickler (:func:`share_bucket`): on a GPU the storage becomes a CUDA IPC
handle, on the CPU a shared-memory file (torch's ``file_system`` sharing strategy), so what goes over
HTTP is a handle of some hundred bytes, not the weights. SGLang 0.5.23 reads it with
``MultiprocessingSerializer.deserialize`` (its ``SafeUnpickler`` admits torch's rebuild functions of
``torch.multiprocessing.reductions``) on every TP rank and loads the tensors through the model's own
``load_weights``; the trainer keeps the buffer alive until every server has answered, then drops it.

Only servers on rank 0's machine can map its memory, and only families with such a route (SGLang's
``/update_weights_from_tensor``): otherwise the push goes through disk (:class:`~.disk.DiskPush`,
``rollout.sync_dir``), and the log says why, once. Nothing is written under ``sync_dir`` by this path.

On the CPU, torch serves file-name sharing through a ``torch_shm_manager`` process it forks from the
first process that shares, on first use, and that manager lives as long as any process holds one of
its storages (the servers keep its connection to the end). Started as torch starts it, it would
inherit every descriptor of the trainer (its stderr, a launcher's pipes, the sentinel a parent
waits on): a trainer that ended would still hold its launcher's pipes open until the servers exit
(measured: a spawned trainer's ``join`` waited its whole 60 s timeout). :func:`_start_shm_manager`
starts it once, first, with none of them.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import socket
import sys
import time
from urllib.parse import urlparse

from megatron_klear.platform import barrier, broadcast_from_rank0, is_rank0
from megatron_klear.rollout.weight_sync.gather import iter_buckets, iter_model_hf_weights

#: a bucket's tensors start at multiples of this many bytes (every dtype's alignment)
ALIGN = 64


def share_bucket(named: list) -> tuple:
    """``(payload, buffer)``: the tensors ``[(name, tensor)]`` copied into one buffer on their device
    and pickled as views of it with the multiprocessing pickler (base64); ``buffer`` must stay alive
    until the receiver has read them."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # (registers torch's reductions of tensors and storages with that pickler)

    offsets, total = [], 0
    for _, t in named:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    device = named[0][1].device
    with _cpu_shared_by_file_name(device):
        buffer = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
        if device.type == "cpu":  # in shared memory from the start: the pickler then copies nothing
            buffer.share_memory_()
    views = []
    for (name, t), start in zip(named, offsets):
        n = t.numel() * t.element_size()
        view = buffer[start : start + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        views.append((name, view))
    out = io.BytesIO()
    with _cpu_shared_by_file_name(device):
        ForkingPickler(out).dump(views)
    return base64.b64encode(out.getvalue()).decode("ascii"), buffer


@contextlib.contextmanager
def _cpu_shared_by_file_name(device):
    """CPU storages pickle as shared-memory file names (``file_system``), which another process
    opens by name; the default (``file_descriptor``) passes descriptors over a connection that only
    the sender's own children may use."""
    import torch.multiprocessing as mp

    if device.type != "cpu":
        yield
        return
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        _start_shm_manager()
        yield
    finally:
        mp.set_sharing_strategy(before)


_shm_manager_started = False


def _start_shm_manager() -> None:
    """Start this process's ``torch_shm_manager`` (see the module docstring) while its standard
    input and error point at ``/dev/null`` and every other descriptor is close-on-exec, so that it
    inherits none of them; then put everything back. Once per process (torch starts one manager per
    process, on its first file-name share). The caller has set the ``file_system`` strategy."""
    global _shm_manager_started
    if _shm_manager_started:
        return
    import fcntl
    import os

    import torch

    sys.stderr.flush()
    fds = [int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2]
    flags = {}
    for fd in fds:
        with contextlib.suppress(OSError):  # (the listing's own descriptor is gone by now)
            flags[fd] = fcntl.fcntl(fd, fcntl.F_GETFD)
            fcntl.fcntl(fd, fcntl.F_SETFD, flags[fd] | fcntl.FD_CLOEXEC)
    saved = [os.dup(0), os.dup(2)]
    null = os.open(os.devnull, os.O_RDWR)
    try:
        os.dup2(null, 0)
        os.dup2(null, 2)
        torch.empty(1).share_memory_()  # the first file-name share: the manager is forked and exec'd now
        _shm_manager_started = True
    finally:
        os.dup2(saved[0], 0)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)
        for fd, flag in flags.items():
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, fcntl.F_SETFD, flag)


def _local_addresses() -> set:
    names = {"localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname(), socket.getfqdn()}
    for host in list(names):
        with contextlib.suppress(OSError):
            names.update(socket.gethostbyname_ex(host)[2])
    return names


def remote_workers(workers: list) -> list:
    """The workers whose address is not this machine's (they cannot map its memory)."""
    local = _local_addresses()
    return [w for w in workers if (urlparse(w).hostname or "") not in local]


class InMemoryPush:
    """``rollout.weight_sync=memory`` (see the module docstring). ``placement``: the servers share the
    trainer's GPUs (:class:`~megatron_klear.rl.rollout.placement.Colocated`): the trainer gives way,
    the servers get their weights' memory back, the buckets are loaded (the servers load one while the
    ranks gather the next: two buckets' buffers at most), then the rest comes back.
    ``fallback``: the disk push, taken when this path cannot serve (said once)."""

    to_servers = True

    def __init__(self, state, engine, placement, bucket_mb: float, fallback):
        self.state, self.engine, self.placement = state, engine, placement
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.fallback = fallback
        self.why_not = None  # rank 0's reason to go through disk (decided at the first push)
        self.decided = False

    def _decide(self) -> None:
        why = None
        if is_rank0():
            wire = self.engine.wire
            why = wire.tensor_refusal()
            if why is None:
                far = remote_workers(self.engine.workers())
                if far:
                    why = f"{', '.join(far)} not on this machine (in-memory handles reach local servers only)"
            if why:
                print(
                    f"rollout.weight_sync=memory: {why}; the weights go through disk ({self.fallback.sync_dir})",
                    file=sys.stderr,
                    flush=True,
                )
        self.why_not = broadcast_from_rank0(why)
        self.decided = True

    def push(self, version: int) -> dict:
        if not self.decided:
            self._decide()
        if self.why_not:
            return {**self.fallback.push(version), "weights/in_memory": 0}
        t0 = time.perf_counter()
        metrics = self.placement.before_load(self.state)
        wire = self.engine.wire if is_rank0() else None
        if is_rank0():
            self.placement.resume_weights(self.engine)
            wire.start_update()
        sent = buckets = 0
        # the servers load bucket k while the ranks gather bucket k+1 (two buckets' buffers at most)
        loader = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights-in-memory") if is_rank0() else None
        )
        loading = None  # (the servers' load of the bucket in flight, its buffer)
        try:
            for bucket in iter_buckets(iter_model_hf_weights(self.state.model), self.bucket_bytes):
                if is_rank0():  # (the gather is collective: every rank walks the same buckets)
                    payload, buffer = share_bucket(bucket)
                    if loading is not None:
                        loading[0].result()  # every server has copied it: its buffer goes
                    loading = (loader.submit(wire.load_tensors, payload), buffer)
                    sent += sum(t.numel() * t.element_size() for _, t in bucket)
                    buckets += 1
            if loading is not None:
                loading[0].result()
        finally:
            loading = None
            if loader is not None:
                loader.shutdown(wait=True)
        if is_rank0():
            wire.finish_update(version, check_received=False)
            self.placement.finished_load(self.engine, version)
        barrier()
        return {
            **metrics,
            "weights/in_memory": 1,
            "weights/sync_bytes": sent,
            "weights/sync_buckets": buckets,
            "weights/sync_s": time.perf_counter() - t0,
        }

    def close(self) -> None:
        """Nothing is held between pushes (nor by the disk fallback)."""
