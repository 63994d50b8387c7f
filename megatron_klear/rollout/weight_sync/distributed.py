"""``rollout.weight_sync=distributed`` (the default for servers): SGLang's
``update_weights_from_distributed``, or vLLM's weight-transfer API with the project's transfer
engine. Each stage leader broadcasts its own stage's tensors, packed into buckets, over its own
process group with every server (NCCL on GPU, gloo on CPU); global rank 0 drives the servers over
HTTP through the engine's :class:`~megatron_klear.rollout.base.WeightWire`. No file, and no stage
funnels through rank 0.

:class:`DistributedWeightSync` is the sync itself; its groups are :mod:`.distributed_groups`, its
bucket schedule :mod:`.distributed_buckets`, the process-group format (shared with the servers'
side) :mod:`megatron_klear.rollout.servers.update_group`.
"""

from __future__ import annotations

import torch

from megatron_klear.platform import broadcast_from_rank0, rank, send_object
from megatron_klear.rollout.base import FleetError
from megatron_klear.rollout.servers.update_group import FLATTENED_BUCKET
from megatron_klear.rollout.weight_sync.delta import DeltaImages
from megatron_klear.rollout.weight_sync.distributed_buckets import BucketSchedule
from megatron_klear.rollout.weight_sync.distributed_groups import UpdateGroups, WeightSyncError
from megatron_klear.rollout.weight_sync.gather import drain, iter_stage_hf_tensors


class DistributedWeightSync:
    """The trainer side of SGLang's distributed weight update, for every server at once.

    **Groups** (``self.groups``, :class:`.distributed_groups.UpdateGroups`, formed at the first
    sync): one per pipeline stage, led by that stage's leader, every server joined. **Buckets**
    (``self.buckets``, :class:`.distributed_buckets.BucketSchedule`): how each stage's tensors
    travel over them.

    **A sync** (:meth:`sync`, version ``v``): rank 0 pauses generation (``/pause_generation``
    in the section's ``rollout.pause_mode``: ``abort``, or ``retract`` in asynchronous RL), flushes every
    server's cache once (``/flush_cache``, retried while a request is
    still leaving: SGLang 0.5.23 fails a bucket sent with ``flush_cache=True`` if one is queued, so
    buckets go with ``flush_cache=False``) and opens a session (``/begin_weight_update``) while the
    first bucket is gathered; then, stage after stage, the leader streams its buckets
    (:mod:`.distributed_buckets`). Then rank 0 closes the session (``/end_weight_update``), sets the
    version (``/update_weight_version``), continues generation and checks that every server
    reports ``v``.

    **No broadcast without its post.** A bucket is broadcast only once its post has reached every
    member and none refused it within ``post_grace`` seconds (SGLang refuses a bucket without an
    open session, for an unknown group, or cannot be reached, at once, before it receives): a
    broadcast to a group with a member that does not receive never completes. A refused bucket is
    not broadcast to anyone and the attempt fails naming the server.

    **Bounded waits.** Group creation waits at most ``group_timeout`` seconds; so does the first
    broadcast of a new group (with NCCL, ``/init_weights_update_group`` returns once the TCP store
    connects and the communicator is built at the first collective: the first bucket is then a
    single tensor, waited for under ``group_timeout``); each later bucket ``bucket_timeout``. gloo
    fails a broadcast to a dead peer at once. NCCL's ``wait`` does not block the host, so the works
    are polled to the deadline and the communicator aborted after it; the group is built with
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` so that NCCL's watchdog (at the group's timeout) aborts
    it and raises instead of ending the trainer. What a bucket's answer says: over gloo, that the
    server received it; over NCCL only that it was accepted (SGLang enqueues the receive on its GPU
    stream and answers), so after an NCCL sync every server generates one token within the control
    timeout (the wire's received check), which it can only do once every bucket arrived; one
    that cannot is dropped as gone. A server left waiting on a broadcast a lost peer never sends
    waits for its own group's timeout (torch's 30-minute default: SGLang's
    ``/init_weights_update_group`` does not take one) or until SGLang's scheduler watchdog
    (``--watchdog-timeout``, 300 s while a batch runs; the check's request is one) ends it; restart it
    and it rejoins. The CPU tests run the gloo side; the NCCL side is not run by any test here (one
    GPU cannot hold two ranks of one NCCL communicator; it needs two GPUs, docs/sglang.md).

    **Delta syncs** (``delta``, ``rollout.sync_delta``): each stage leader keeps the last values it
    sent (:class:`~.delta.DeltaImages`) and after the first sync posts, per bucket, each tensor's
    count of changed elements and broadcasts their positions and values instead of the tensor (or
    the tensor whole when that is smaller); buckets are then always gathered whole (their pieces are
    known once compared). A full sync follows new groups, a failed attempt and every ``full_every``
    delta syncs; the images take a sync's changes only once it succeeded on every server.

    **A lost worker** (:meth:`sync`): the sync is tried again, up to ``max_attempts`` times, with the
    groups re-formed without the workers that are gone (fresh group names), every bucket sent again;
    the groups are also re-formed when the workers changed between syncs (one lost during
    generation, one rejoining). Fewer than ``rollout.min_live_workers`` left: :class:`FleetError`
    naming them. Any other failure ends the sync with :class:`WeightSyncError` on every rank (the
    decision is rank 0's, broadcast), naming the server (its HTTP answer) or the stage. Generation
    then stays paused and the servers' groups are dropped: an SGLang server that got part of the
    buckets holds a mix of weights (SGLang loads each bucket as it arrives) and must not serve; the
    stand-in server discards the whole session (its weights and version are the old ones). A
    restarted run re-creates the groups and sends every weight before generating.
    """

    def __init__(
        self,
        model_chunks,
        engine,
        *,
        bucket_mb: float = 1024.0,
        backend: str = "auto",
        master_addr: str = "",
        master_port: int = 0,
        group_timeout: float = 120.0,
        bucket_timeout: float = 300.0,
        control_timeout: float = 60.0,
        group_name: str = "klear_weights",
        load_format: str | None = None,
        post_grace: float = 0.05,
        max_attempts: int = 3,
        delta: bool = False,
        full_every: int = 50,
    ):
        self.engine = engine  # global rank 0 only
        self.bucket_bytes = max(1, int(float(bucket_mb) * (1 << 20)))
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"rollout.sync_backend must be auto, nccl or gloo, got {backend!r}")
        # How a bucket travels: "flattened_bucket" (one broadcast of its bytes back to back: fewer,
        # larger NCCL calls for one device copy) or "auto" (SGLang's default load_format: one
        # broadcast per tensor, no copy: cheaper with gloo, where the copy costs CPU time). None:
        # flattened with NCCL, per tensor with gloo.
        if load_format is None:
            load_format = FLATTENED_BUCKET if backend == "nccl" else "auto"
        if load_format not in (FLATTENED_BUCKET, "auto"):
            raise ValueError(f"load_format must be {FLATTENED_BUCKET} or auto, got {load_format!r}")
        if int(max_attempts) < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.max_attempts = int(max_attempts)  # a sync tried again after losing a worker, re-formed
        self.control_timeout = float(control_timeout)
        self.groups = UpdateGroups(
            engine,
            backend=backend,
            master_addr=master_addr,
            master_port=master_port,
            group_timeout=group_timeout,
            bucket_timeout=bucket_timeout,
            control_timeout=control_timeout,
            group_name=group_name,
        )
        # rollout.sync_delta: each stage leader's images of what it sent (weight_sync/delta.py)
        self.delta = DeltaImages(full_every) if delta else None
        # a bucket is broadcast once every server has had post_grace seconds to refuse its post
        self.buckets = BucketSchedule(
            self.groups,
            model_chunks,
            bucket_bytes=self.bucket_bytes,
            load_format=load_format,
            post_grace=post_grace,
            control_timeout=control_timeout,
            delta=self.delta,
        )
        self.model_chunks = model_chunks
        self.stats = {}  # of the last sync: bytes, buckets, seconds, streamed_stages
        self._totals = {}

    # -- the rollout manager's path (push(version) -> metrics) ---------------------------------------
    to_servers = True

    @classmethod
    def from_config(cls, model_chunks, engine, r) -> "DistributedWeightSync":
        """From a ``rollout`` config section (its ``sync_*`` keys and control timeout).
        ``rollout.sync_delta``: ``on`` (refused, naming the servers, where they take no delta
        buckets), ``auto`` (on where they do), ``off``. Collective: rank 0 decides for every rank."""
        refusal = None
        if r.sync_delta != "off":
            refusal = broadcast_from_rank0(engine.wire.delta_refusal() if rank() == 0 else None)
        if r.sync_delta == "on" and refusal:
            raise WeightSyncError(f"rollout.sync_delta=on: {refusal}; or set rollout.sync_delta=off|auto")
        takes = refusal is None
        return cls(
            model_chunks,
            engine,
            bucket_mb=r.sync_bucket_mb,
            backend=r.sync_backend,
            master_addr=r.sync_master_addr,
            master_port=r.sync_master_port,
            group_timeout=r.sync_group_timeout_s,
            bucket_timeout=r.sync_bucket_timeout_s,
            control_timeout=r.control_timeout_s,
            delta=r.sync_delta == "on" or (r.sync_delta == "auto" and takes),
            full_every=r.sync_full_every,
        )

    def push(self, version: int) -> dict:
        stats = self.sync(version=version)
        metrics = {
            "weights/sync_bytes": stats.get("bytes", 0),
            "weights/sync_buckets": stats.get("buckets", 0),
            "weights/sync_reforms": stats.get("reforms", 0),
        }
        if self.delta is not None and stats.get("elements"):
            metrics["weights/sync_full"] = float(self.delta.full)
            metrics["weights/sync_changed_frac"] = stats["changed"] / stats["elements"]
        return metrics

    # -- a sync -------------------------------------------------------------------------------------
    def sync(self, version) -> dict:
        """Collective: every weight to every server as weight version ``version``; returns stats
        (bytes, buckets, seconds, reforms) on rank 0.

        Up to ``max_attempts`` attempts. The groups are (re-)formed first whenever the servers that
        take control calls (live and rejoining) are not the groups' members, or when a member is
        rejoining (lost or demoted since the groups were formed: a server restarted at its URL has
        none of them). After a failed attempt rank 0 finds the members that are gone
        (no answer to ``/model_info``, which a paused server still answers), drops them from the
        fleet, and, if any was dropped and at least ``rollout.min_live_workers`` remain, every rank
        re-forms the groups without them and sends every bucket again (a server that got part of
        them is still paused and in its session, which the next attempt restarts). A failure with
        no member gone (a server refusing a bucket, a stale layout) ends the sync as before
        (:meth:`_fail`); so does the last attempt. A member whose delta loader failed (it marked its
        group: :mod:`megatron_klear.rollout.in_server.sglang_delta`; alive, its weights partly
        written) keeps its place: the groups are re-formed with it and the next attempt sends every
        weight whole."""
        import time

        t0 = time.monotonic()
        reforms = 0
        for attempt in range(1, self.max_attempts + 1):
            error = self._attempt(version)
            if error is None:
                if self.delta is not None:
                    self.delta.commit()
                self.stats = {**self._totals, "seconds": time.monotonic() - t0, "reforms": reforms}
                return self.stats
            if self.delta is not None:  # a server may hold part of the attempt: the next sends everything
                self.delta.discard()
            verdict = self._after_failure(error, version, last=attempt == self.max_attempts)
            kind, message = broadcast_from_rank0(verdict)
            if kind == "fleet":
                return self._fail(message, fleet=True)
            if kind == "fail":
                return self._fail(message)
            # re-form: the surviving servers leave the old groups (rank 0), every rank drops its side.
            # Each server answers the leave after whatever it still had in hand for the old group (a
            # bucket it waited for): wait as long as a bucket may take, so that nothing of the old
            # attempt reaches the next one's session.
            if rank() == 0:
                self.groups.leave_server_groups(timeout=self.groups.bucket_wait() + self.control_timeout)
                self.buckets.forget_failed_loads(timeout=self.control_timeout)
            self.groups.drop_local()
            self.groups.reforms += 1
            reforms += 1
        raise AssertionError("unreachable: the last attempt ends in _fail")

    def _attempt(self, version) -> str | None:
        """Collective: one try of a whole sync (the groups formed if needed); the error text (the
        same on every rank) or None."""
        import concurrent.futures

        me = rank()
        reform = None
        if me == 0 and self.groups.connected:
            members = set(self.groups.workers)
            now = set(self.engine.workers())
            # a member now rejoining was lost (or demoted) since the groups were formed: a server
            # restarted at its URL keeps the URL but not the groups
            back = members & set(self.engine.rejoining_workers())
            if now != members or back:
                reform = sorted((now ^ members) | back)
        if broadcast_from_rank0(reform):  # membership changed since the groups were formed
            if me == 0:
                self.groups.leave_server_groups()
            self.groups.drop_local()
            self.groups.reforms += 1
        formed = not self.groups.connected
        if formed:
            try:
                self.groups.connect()
            except WeightSyncError as e:
                return str(e)
        if self.delta is not None:  # new groups: a server may hold no image (it joined, restarted)
            self.delta.begin(force_full=formed)
        self._totals = totals = {"bytes": 0, "buckets": 0, "streamed_stages": 0, "changed": 0, "elements": 0}
        started = None  # rank 0: the servers' start calls, run while the first bucket is gathered
        if me == 0:  # pause, flush once, begin on the servers while the first bucket is gathered

            def start():
                try:
                    self.engine.wire.start_update()
                    return None
                except Exception as e:  # noqa: BLE001 -- the first bucket's answer
                    return f"rollout: cannot start the weight update: {e}"

            starter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-start")
            started = starter.submit(start)
            starter.shutdown(wait=False)
        self.buckets.begin_attempt(started)  # no posts, no member lost yet
        for stage in sorted(self.groups.leaders):
            leader, err = self.groups.leaders[stage], None
            if me == leader:
                err = self.buckets.send_stage(stage, totals)
                if leader != 0:
                    send_object(("end", (err, totals)), 0)
            elif self.groups.part is not None and self.groups.part.stage == stage:  # the leader's TP and EP peers
                drain(iter_stage_hf_tensors(self.model_chunks, self.groups.part))
            if me == 0 and leader != 0:
                err = self.buckets.coordinate(stage, totals)
            err = broadcast_from_rank0(err)
            if err:
                return err
        error = None
        if me == 0:
            try:
                if self.buckets.started.result() is not None:
                    raise WeightSyncError(self.buckets.started.result())
                if self.buckets.delta_posted:  # a server's delta loader reports a failure by marking its group
                    failed = self.buckets.check_loads()
                    if failed is not None:
                        raise WeightSyncError(failed)
                # a rejoining worker that does not report the version is dropped; over NCCL a
                # bucket's answer does not say it arrived (gloo's does): one token from each shows it
                self.engine.wire.finish_update(version, check_received=self.groups.backend == "nccl")
            except Exception as e:  # noqa: BLE001
                error = f"rollout: the weight update of version {version} did not complete: {e}"
        return broadcast_from_rank0(error)

    def _after_failure(self, error: str, version, last: bool):
        """Rank 0 (None elsewhere): what a failed attempt leads to -- ``("retry", error)`` when
        members were gone (now dropped), ``("fleet", message)`` when fewer than
        ``rollout.min_live_workers`` remain, ``("fail", error)`` otherwise. A rejoining member named
        by the error is dropped again (it was not serving) and the sync retried without it."""
        if rank() != 0:
            return None

        if self.buckets.started is not None:
            self.buckets.started.result()  # the servers' start calls have ended (they report to the fleet)
        for post in self.buckets.posts:  # a bucket not broadcast still has posts in flight: let them end
            post.result()
        serving = self.engine.workers()
        # the groups' members, and the serving workers a group being formed was meant for (a worker
        # gone before the first sync fails the groups' creation)
        members = list(dict.fromkeys([*(self.groups.workers or []), *serving]))
        serving = set(serving)
        alive = dict(zip(members, self.engine.alive(members)))
        if self.delta is not None:  # a delta loader that failed before the broadcast ended left a mark
            self.buckets.check_loads([w for w in members if alive[w] and w in serving])
        rejoining = set(self.engine.rejoining_workers())
        dropped = [w for w in members if w not in serving]  # dropped by a control call already
        try:
            for w in members:
                if w in self.buckets.load_failed:  # alive, its weights partly written: the retry sends it everything
                    continue
                if w in serving and (not alive[w] or w in self.buckets.disconnected):
                    how = (
                        "no answer to /model_info"
                        if not alive[w]
                        else "its connection was lost, or it no longer holds the update group"
                    )
                    self.engine.drop_worker(w, f"gone during the weight sync of version {version} ({how}): {error}")
                    dropped.append(w)
                elif w in serving and w in rejoining and w in error:
                    self.engine.drop_worker(w, f"failed the weight sync of version {version} as it rejoined: {error}")
                    dropped.append(w)
            self.engine.check_fleet()  # (a control call of the attempt may have dropped one already)
        except FleetError as e:
            return ("fleet", f"{e}. The weight sync of version {version} failed: {error}")
        if (not dropped and not self.buckets.load_failed) or last:
            return ("fail", error)
        return ("retry", error)

    def _fail(self, error: str, fleet: bool = False):
        """Every rank: drop the groups (servers: rank 0, best effort), keep generation paused, raise
        (:class:`~megatron_klear.rollout.base.FleetError` when too few workers remain)."""

        if rank() == 0:
            self.groups.leave_server_groups()
        self.groups.drop_local()
        message = (
            f"{error}. Generation on the servers stays paused: a server that received part of the buckets "
            "must not serve a mix of weights (restart the run: it re-creates the groups and sends every "
            "weight before generating)"
        )
        raise (FleetError if fleet else WeightSyncError)(message)

    def close(self) -> None:
        """Drop the groups (servers and trainer side); not collective."""
        self.groups.close()
