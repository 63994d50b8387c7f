"""``rollout.weight_sync=distributed`` (the default for servers): SGLang's
``update_weights_from_distributed``. Each stage leader broadcasts its own stage's tensors, packed
into buckets, over its own process group with every server (NCCL on GPU, gloo on CPU); global rank 0
drives the servers over HTTP. No file, and no stage funnels through rank 0.

:class:`DistributedWeightSync` is the sync itself; its groups are :mod:`.distributed_groups`, its
bucket schedule :mod:`.distributed_buckets`, the wire format (shared with the stand-in server)
:mod:`.update_group`.
"""
from __future__ import annotations

import torch

from megatron_klear.platform import broadcast_from_rank0, rank, send_object
from megatron_klear.rollout.weight_sync.distributed_buckets import BucketSchedule
from megatron_klear.rollout.weight_sync.distributed_groups import UpdateGroups, WeightSyncError
from megatron_klear.rollout.weight_sync.gather import drain, iter_stage_hf_tensors
from megatron_klear.rollout.weight_sync.update_group import FLATTENED_BUCKET


class DistributedWeightSync(UpdateGroups, BucketSchedule):
    """The trainer side of SGLang's distributed weight update, for every server at once.

    **Groups** (:meth:`connect`, on the first sync): one per pipeline stage, led by that stage's
    leader, every server joined (:mod:`.distributed_groups`).

    **A sync** (:meth:`sync`, version ``v``): rank 0 pauses generation (``/pause_generation``
    ``abort``) and opens a session (``/begin_weight_update``) on every server while the first
    bucket is gathered; then, stage after stage, the leader streams its buckets
    (:mod:`.distributed_buckets`). Then rank 0 closes the session (``/end_weight_update``), sets the
    version (``/update_weight_version``), continues generation and checks that every server
    reports ``v``.

    **Failures** end the sync with :class:`WeightSyncError` on every rank, in bounded time: group
    creation waits at most ``group_timeout`` seconds, each bucket's broadcast ``bucket_timeout``
    (a dead peer fails it at once with gloo). The error names the server (its HTTP answer) or the
    stage. Generation stays paused and the servers' groups are dropped: an SGLang server that got
    part of the buckets holds a mix of weights (SGLang loads each bucket as it arrives) and must not
    serve, the stand-in server discards the whole session (its weights and version are the old
    ones). A restarted run re-creates the groups and sends every weight before generating.
    """

    def __init__(self, model_chunks, engine, *, bucket_mb: float = 1024.0, backend: str = "auto",
                 master_addr: str = "", master_port: int = 0, group_timeout: float = 120.0,
                 bucket_timeout: float = 300.0, control_timeout: float = 60.0,
                 group_name: str = "klear_weights", load_format: str | None = None):
        self.model_chunks = model_chunks
        self.engine = engine  # global rank 0 only
        self.bucket_bytes = max(1, int(float(bucket_mb) * (1 << 20)))
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"rollout.sync_backend must be auto, nccl or gloo, got {backend!r}")
        self.backend = backend
        self.master_addr, self.master_port = master_addr, int(master_port)
        self.group_timeout, self.bucket_timeout = float(group_timeout), float(bucket_timeout)
        self.control_timeout = float(control_timeout)
        self.group_name = group_name
        # How a bucket travels: "flattened_bucket" (one broadcast of its bytes back to back: fewer,
        # larger NCCL calls for one device copy) or "auto" (SGLang's default load_format: one
        # broadcast per tensor, no copy: cheaper with gloo, where the copy costs CPU time). None:
        # flattened with NCCL, per tensor with gloo.
        if load_format is None:
            load_format = FLATTENED_BUCKET if backend == "nccl" else "auto"
        if load_format not in (FLATTENED_BUCKET, "auto"):
            raise ValueError(f"load_format must be {FLATTENED_BUCKET} or auto, got {load_format!r}")
        self.load_format = load_format
        self.pg = None  # on stage leaders, once connected
        self.connected = False
        self.leaders, self.part = None, None
        self.stats = {}  # of the last sync: bytes, buckets, seconds, streamed_stages
        self._started = None  # rank 0: the future of the servers' pause + begin of the current sync
        self._layouts = {}  # stage -> [(names, dtypes, shapes) per bucket] of the last sync (per-tensor format)

    # -- the rollout manager's path (push(version) -> metrics) ---------------------------------------
    to_servers = True

    @classmethod
    def from_config(cls, model_chunks, engine, r) -> "DistributedWeightSync":
        """From a ``rollout`` config section (its ``sync_*`` keys and control timeout)."""
        return cls(model_chunks, engine, bucket_mb=r.sync_bucket_mb, backend=r.sync_backend,
                   master_addr=r.sync_master_addr, master_port=r.sync_master_port,
                   group_timeout=r.sync_group_timeout_s, bucket_timeout=r.sync_bucket_timeout_s,
                   control_timeout=r.control_timeout_s)

    def push(self, version: int) -> dict:
        stats = self.sync(version=version)
        return {"weights/sync_bytes": stats.get("bytes", 0), "weights/sync_buckets": stats.get("buckets", 0)}

    def _device(self) -> torch.device:
        """Where a bucket's tensors are broadcast from: the GPU with NCCL, the CPU with gloo."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- a sync -------------------------------------------------------------------------------------
    def sync(self, version) -> dict:
        """Collective: every weight to every server as weight version ``version``; returns stats
        (bytes, buckets, seconds) on rank 0."""
        import concurrent.futures
        import time

        if not self.connected:
            self.connect()
        me = rank()
        t0 = time.monotonic()
        error = None
        if me == 0:  # pause + begin on the servers while the first bucket is gathered
            def start():
                try:
                    self.engine.pause_generation("abort")
                    self.engine.begin_weight_update()
                    return None
                except Exception as e:  # noqa: BLE001 -- the first bucket's answer
                    return f"rollout: cannot start the weight update: {e}"

            starter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-start")
            self._started = starter.submit(start)
            starter.shutdown(wait=False)
        totals = {"bytes": 0, "buckets": 0, "streamed_stages": 0}
        for stage in sorted(self.leaders):
            leader, err = self.leaders[stage], None
            if me == leader:
                err = self._send_stage(stage, totals)
                if leader != 0:
                    send_object(("end", (err, totals)), 0)
            elif self.part is not None and self.part.stage == stage:  # the leader's TP and EP peers
                drain(iter_stage_hf_tensors(self.model_chunks, self.part))
            if me == 0 and leader != 0:
                err = self._coordinate(stage, totals)
            err = broadcast_from_rank0(err)
            if err:
                return self._fail(err)
        if me == 0:
            try:
                if self._started.result() is not None:
                    raise WeightSyncError(self._started.result())
                self.engine.end_weight_update()
                self.engine.set_weight_version(version)
                self.engine.continue_generation()
                self.engine.check_weight_versions(version)
            except Exception as e:  # noqa: BLE001
                error = f"rollout: the weight update of version {version} did not complete: {e}"
        error = broadcast_from_rank0(error)
        if error:
            return self._fail(error)
        self.stats = {**totals, "seconds": time.monotonic() - t0}
        return self.stats

    def _fail(self, error: str):
        """Every rank: drop the groups (servers: rank 0, best effort), keep generation paused, raise."""
        if rank() == 0:
            self._leave_server_groups()
        self._drop_local()
        raise WeightSyncError(
            f"{error}. Generation on the servers stays paused: a server that received part of the buckets "
            "must not serve a mix of weights (restart the run: it re-creates the groups and sends every "
            "weight before generating)")

