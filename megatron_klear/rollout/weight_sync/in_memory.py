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

Only a server on rank 0's machine can map its memory: when servers run on several machines (a
colocated multi-node job), rank 0 relays each bucket to one trainer rank on each other machine
(:mod:`.relay`, chosen by :mod:`.machines`), and each server gets the handles of its own machine's
copy. The push goes through disk (:class:`~.disk.DiskPush`, ``rollout.sync_dir``) when a family has
no such route (SGLang's ``/update_weights_from_tensor``, the project's vLLM transfer engine) or a
server is on no trainer rank's machine, and the log says why, once. Nothing is written under
``sync_dir`` by this path.
"""

from __future__ import annotations

import concurrent.futures
import sys
import time

from megatron_klear.platform import barrier, broadcast_from_rank0, device, gather_to_rank0, is_rank0
from megatron_klear.rollout.weight_sync.gather import iter_buckets, iter_model_hf_weights
from megatron_klear.rollout.weight_sync.machines import machine_addresses, place_workers
from megatron_klear.rollout.weight_sync.relay import BucketRelay
from megatron_klear.rollout.weight_sync.sharing import bucket_layout, share_bucket


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
        self.addresses = None  # every rank's machine_addresses() on rank 0 (asked once: [] elsewhere)
        self.why_not = None  # rank 0's reason to go through disk (decided before each push)
        self.placed = {}  # {worker: the rank whose copies it maps}
        self.relay = None  # a BucketRelay when servers live on other machines than rank 0's
        self.said = None  # what the log said last (said again only when it changes)

    def _plan(self) -> None:
        """Collective, before each push (servers come and go): through disk or in memory, and which
        rank's copies each server maps (:mod:`.machines`); a new set of relay ranks gets its group."""
        if self.addresses is None:
            self.addresses = gather_to_rank0(sorted(machine_addresses())) or []
        why, placed = None, {}
        if is_rank0():
            why = self.engine.wire.tensor_refusal()
            if why is None:
                placed, unplaced = place_workers(self.engine.workers(), self.addresses)
                if unplaced:
                    why = (
                        f"{', '.join(unplaced)} on no trainer rank's machine (handles to memory reach servers "
                        "of the same machine only)"
                    )
            relays = sorted(set(placed.values()) - {0})
            said = (
                f"{why}; the weights go through disk ({self.fallback.sync_dir})"
                if why
                else f"rank 0 relays each bucket to rank(s) {relays} for the servers of their machines"
                if relays
                else None
            )
            if said and said != self.said:
                print(f"rollout.weight_sync=memory: {said}", file=sys.stderr, flush=True)
            self.said = said
        self.why_not, self.placed = broadcast_from_rank0((why, placed))
        relays = sorted(set(self.placed.values()) - {0})
        if not relays:
            self.relay = None
        elif self.relay is None or self.relay.relays != relays:
            self.relay = BucketRelay(relays, device())

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
        try:
            for bucket in iter_buckets(iter_model_hf_weights(self.state.model), self.bucket_bytes):
                if is_rank0():  # (the gather is collective: every rank walks the same buckets)
                    payload, buffer = share_bucket(bucket)
                    payloads = payload
                    if relay is not None:  # each server maps the copy of its own machine
                        by_rank = {0: payload, **relay.send(bucket_layout(bucket)[0], buffer)}
                        payloads = {w: by_rank[r] for w, r in self.placed.items()}
                    if loading is not None:
                        loading[0].result()  # every server has copied it: its buffer goes
                    loading = (loader.submit(wire.load_tensors, payloads), buffer)
                    sent += sum(t.numel() * t.element_size() for _, t in bucket)
                    buckets += 1
            if loading is not None:
                loading[0].result()
        finally:
            loading = None
            if loader is not None:
                loader.shutdown(wait=True)
        if relay is not None:
            if is_rank0():
                relay.end()  # every server has loaded the last bucket: the relay ranks drop theirs
            elif relay.relaying:
                relay.join()
        if is_rank0():
            wire.finish_update(version, check_received=False)
        metrics.update(self.placement.finished_load(self.engine, version))  # (collective)
        barrier()
        return {
            **metrics,
            "weights/in_memory": 1,
            "weights/in_memory_machines": 1 + (len(relay.relays) if relay is not None else 0),
            "weights/sync_bytes": sent,
            "weights/sync_buckets": buckets,
            "weights/sync_s": time.perf_counter() - t0,
        }

    def close(self) -> None:
        """Nothing is held between pushes (nor by the disk fallback)."""
