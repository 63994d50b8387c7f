"""``rollout.weight_sync=memory`` (the default with ``rollout.colocate``): the trainer hands its
weights to the servers that share its machine in memory, bucket by bucket, as slime and verl do,
instead of writing an HF checkpoint every step for the servers to reload.

Each bucket's tensors are copied into one buffer (one storage, each tensor a view of it) and pickled
with :mod:`multiprocessing`'s pickler (:func:`~.sharing.share_bucket`): on a GPU the storage becomes a CUDA IPC
handle, on the CPU a shared-memory file (torch's ``file_system`` sharing strategy), so what goes over
HTTP is a handle of some hundred bytes, not the weights. SGLang 0.5.23 reads it with
``MultiprocessingSerializer.deserialize`` (its ``SafeUnpickler`` admits torch's rebuild functions of
``torch.multiprocessing.reductions``) on every TP rank and loads the tensors through the model's own
``load_weights``; the trainer keeps the buffer alive until every server has answered, then drops it.

Each rank of a server maps a copy on its own GPU (SGLang's TP rank ``i`` opens entry ``i`` of
``serialized_named_tensors``, and CUDA IPC reaches only the devices a process sees): the trainer
rank on that GPU of that machine holds it (:mod:`.machines`: ranks and servers report the physical
GPU each runs on), rank 0 relays each bucket to those ranks (:mod:`.relay`), and each server gets,
rank by rank, the handles of the copy on that rank's GPU, every handle pickled for its one opener.
The push goes through disk (:class:`~.disk.DiskPush`, ``rollout.sync_dir``) when a family has no
such route (SGLang's ``/update_weights_from_tensor``, the project's vLLM transfer engine) or a server
rank is on no trainer rank's GPU, and the log says why, once. Nothing is written under ``sync_dir``
by this path.

After the last bucket every rank drops its copies and returns its cached blocks to the device
before the servers take back their KV cache, and generation continues only once the KV cache is
back.
"""

from __future__ import annotations

import collections
import concurrent.futures
import sys
import time

from megatron_klear.platform import barrier, broadcast_from_rank0, device, gather_to_rank0, is_rank0
from megatron_klear.platform.gpus import physical_index, this_rank_gpu
from megatron_klear.rollout.weight_sync.gather import iter_buckets, iter_model_hf_weights
from megatron_klear.rollout.weight_sync.machines import machine_addresses, place_server_ranks
from megatron_klear.rollout.weight_sync.relay import BucketRelay
from megatron_klear.rollout.weight_sync.sharing import (
    bucket_layout,
    expandable_refusal,
    share_bucket,
    share_views,
)


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
        self.ranks = None  # rank 0: every rank's (machine_addresses(), physical GPU) (asked once: [] elsewhere)
        self.why_not = None  # rank 0's reason to go through disk (decided before each push)
        self.placed = {}  # {worker: [the rank whose copy each of its ranks maps]}
        self.relay = None  # a BucketRelay when other ranks than 0 hold copies
        self.said = None  # what the log said last (said again only when it changes)

    def _plan(self) -> None:
        """Collective, before each push (servers come and go): through disk or in memory, and which
        rank's copy each server rank maps (:mod:`.machines`); a new set of relay ranks gets its group."""
        if self.ranks is None:
            local, _ = this_rank_gpu()
            self.ranks = gather_to_rank0((sorted(machine_addresses()), physical_index(local))) or []
        why, placed = None, {}
        if is_rank0():
            why = self.engine.wire.tensor_refusal() or expandable_refusal()
            if why is None:
                placed, refusals = place_server_ranks(self.engine.wire.tensor_gpus(), self.ranks)
                why = "; ".join(refusals) or None
            relays = sorted({r for ranks in placed.values() for r in ranks} - {0})
            said = (
                f"{why}; the weights go through disk ({self.fallback.sync_dir})"
                if why
                else f"rank 0 relays each bucket to rank(s) {relays}, each holding the copy its GPU's server ranks map"
                if relays
                else None
            )
            if said and said != self.said:
                print(f"rollout.weight_sync=memory: {said}", file=sys.stderr, flush=True)
            self.said = said
        self.why_not, self.placed = broadcast_from_rank0((why, placed))
        copies = collections.Counter(r for ranks in self.placed.values() for r in ranks)
        relays = {r: n for r, n in sorted(copies.items()) if r != 0}
        if not relays:
            self.relay = None
        elif self.relay is None or self.relay.copies != relays:
            self.relay = BucketRelay(relays, device())

    def _post(self, bucket, loading, loader, wire) -> tuple:
        """Rank 0: ``bucket`` shared (every server rank the handles of its GPU's copy) and posted once
        the servers have loaded the bucket before (``loading``: its load and buffer, or None);
        returns the new ``(load, buffer)``."""
        payload, buffer = share_bucket(bucket)
        handles = self._handles(bucket, buffer, payload)
        if loading is not None:
            loading[0].result()  # every server has copied it: its buffer goes
        return loader.submit(wire.load_tensors, handles), buffer

    def _handles(self, bucket, buffer, payload: str) -> dict:
        """Rank 0: ``{worker: [handles of each of its ranks]}`` for one bucket, every handle pickled
        for its one opener (rank 0's first is ``payload``, :func:`share_bucket`'s)."""
        layout = bucket_layout(bucket)[0]
        need = sum(ranks.count(0) for ranks in self.placed.values())
        mine = [payload] + [share_views(layout, buffer) for _ in range(need - 1)]
        by_rank = {0: mine, **(self.relay.send(layout, buffer) if self.relay is not None else {})}
        return {w: [by_rank[r].pop() for r in ranks] for w, ranks in self.placed.items()}

    def push(self, version: int) -> dict:
        self._plan()
        if self.why_not:
            return {**self.fallback.push(version), "weights/in_memory": 0}
        t0 = time.perf_counter()
        metrics = self.placement.before_load(self.state)
        relay = self.relay
        wire = self.engine.wire if is_rank0() else None
        if is_rank0():
            self.placement.resume_weights(self.engine)
            wire.start_update()
        elif relay is not None and relay.relaying:
            relay.start()  # it receives rank 0's buckets while this rank takes part in the gather
        sent = buckets = 0
        # the servers load bucket k while the ranks gather bucket k+1 (two buckets' buffers at most)
        loader = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights-in-memory") if is_rank0() else None
        )
        loading = None  # (the servers' load of the bucket in flight, its buffer)
        failure = None  # rank 0: what stopped the posts; the gather still runs to its end (collective)
        try:
            for bucket in iter_buckets(iter_model_hf_weights(self.state.model), self.bucket_bytes):
                if is_rank0() and failure is None:  # (the gather is collective: every rank walks the same buckets)
                    try:
                        loading = self._post(bucket, loading, loader, wire)
                    except Exception as e:  # noqa: BLE001 -- raised below, once every rank is past the gather
                        failure, loading = e, None
                    sent += sum(t.numel() * t.element_size() for _, t in bucket)
                    buckets += 1
                del bucket  # (no copy outlives the push: see _return_cached_memory)
            if loading is not None:
                try:
                    loading[0].result()
                except Exception as e:  # noqa: BLE001 -- as above
                    failure = e
        finally:
            loading = None
            if loader is not None:
                loader.shutdown(wait=True)
        if relay is not None:
            if is_rank0():
                relay.end()  # every server has loaded the last bucket: the relay ranks drop theirs
            elif relay.relaying:
                relay.join()  # (a failure here was answered to rank 0, which fails the push below)
        # every rank's copies are gone: their cached blocks go back to the device before the servers
        # take back their KV cache (finished_load), and generation continues only after that
        _return_cached_memory()
        # a failure on rank 0 (or one a relay rank answered it) ends the push on every rank, together:
        # none is left inside a collective
        failed = broadcast_from_rank0(f"{type(failure).__name__}: {failure}" if failure is not None else None)
        if failed is not None:
            if failure is not None:
                raise failure
            raise RuntimeError(f"rollout.weight_sync=memory: the push of version {version} failed on rank 0: {failed}")
        if is_rank0():
            wire.finish_update(
                version,
                check_received=False,
                before_resume=lambda: metrics.update(self.placement.finished_load(self.engine, version)),
            )
        else:
            metrics.update(self.placement.finished_load(self.engine, version))  # (collective)
        barrier()
        return {
            **metrics,
            "weights/in_memory": 1,
            "weights/in_memory_copies": 1 + (len(relay.relays) if relay is not None else 0),
            "weights/sync_bytes": sent,
            "weights/sync_buckets": buckets,
            "weights/sync_s": time.perf_counter() - t0,
        }

    def close(self) -> None:
        """Nothing is held between pushes (nor by the disk fallback)."""


def _return_cached_memory() -> None:
    """Every rank: the caching allocator's free blocks (the buckets' buffers, dropped by now) back
    to the device."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
