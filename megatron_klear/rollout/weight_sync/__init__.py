"""Trainer weights -> rollout engine, through the one HF <-> Megatron mapping.

Three paths, all collective (every trainer rank calls them), all fed by
:func:`megatron_klear.checkpoint.model_weights.iter_hf_tensors`: in each pipeline stage's replica
``(dp=0, cp=0)`` the TP peers send their shards to the stage leader (``tp=0``; point to point:
with gloo ~8x faster per byte than an all-gather), which turns them into HF-named full tensors. In a
MoE model with EP > 1 the experts are all-gathered over their expert groups, which Megatron lays
over the data-parallel ranks: the leader's EP peers in other replicas take part too
(:func:`stage_leaders`), and only the leader yields.

- :func:`sync_weights` (the in-process embedded engine): the stage leaders (``tp=0``) send the
  tensors to global rank 0, which streams them into the engine one tensor at a time.
- :func:`export_hf_for_engine` (``rollout.weight_sync=disk``): the same stream written as an HF
  checkpoint directory by rank 0, which servers load with ``/update_weights_from_disk``.
- :class:`DistributedWeightSync` (``rollout.weight_sync=distributed``, the default for servers):
  SGLang's ``update_weights_from_distributed``. Each stage leader broadcasts its own stage's
  tensors, packed into buckets, over its own process group with every server (NCCL on GPU, gloo
  on CPU); global rank 0 drives the servers over HTTP. No file, and no stage funnels through rank 0.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


def _groups():
    from megatron.core import parallel_state as ps

    return ps


def iter_model_hf_weights(model_chunks):
    """Collective. On global rank 0, yields (HF name, tensor) for the whole model, stage by stage;
    on every other rank, yields nothing (but must be iterated to the end)."""
    from megatron_klear.checkpoint.model_weights import iter_hf_tensors

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        yield from iter_hf_tensors(model_chunks)
        return
    rank = dist.get_rank()
    from megatron_klear.platform import comm_device

    dev = comm_device()
    leaders, part = stage_leaders()
    for stage in sorted(leaders):
        src = leaders[stage]
        mine = part is not None and part.stage == stage
        # the stage leader (TP rank 0) gets the full tensors; its TP peers send it their shards and
        # the EP peers take part in gathering the experts
        tensors = iter_stage_hf_tensors(model_chunks, part) if mine else iter(())
        if src == 0:
            if rank == 0:
                yield from tensors
            else:
                for _ in tensors:  # rank 0's TP / EP peers
                    pass
            continue
        # The stage lives elsewhere: its leader sends (header, tensor) pairs to rank 0.
        if rank == src:
            for name, t in tensors:
                dist.send_object_list([(name, tuple(t.shape), t.dtype)], dst=0)
                dist.send(t.contiguous().to(dev), dst=0)
            dist.send_object_list([None], dst=0)
        elif mine:
            for _ in tensors:
                pass
        elif rank == 0:
            while True:
                header = [None]
                dist.recv_object_list(header, src=src)
                if header[0] is None:
                    break
                name, shape, dtype = header[0]
                buf = torch.empty(shape, dtype=dtype, device=dev)
                dist.recv(buf, src=src)
                yield name, buf


def sync_weights(model_chunks, engine, *, version: int | None = None) -> None:
    """Collective: push the trainer's current weights into ``engine`` (held by global rank 0)."""
    stream = iter_model_hf_weights(model_chunks)
    if not dist.is_initialized() or dist.get_rank() == 0:
        engine.update_weights(stream, version=version)
    for _ in stream:  # ranks other than 0 (and anything the engine left unread)
        pass
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def export_hf_for_engine(model_chunks, arch, out_dir: str, *, tokenizer_dir: str | None = None) -> str | None:
    """Collective: write the current weights as an HF checkpoint directory (rank 0 writes)."""
    from megatron_klear.checkpoint.hf_io import HFWriter

    writer = HFWriter(out_dir) if (not dist.is_initialized() or dist.get_rank() == 0) else None
    for name, t in iter_model_hf_weights(model_chunks):
        writer.add(name, t)
    if writer is None:
        return None
    return writer.finish(dict(arch.hf_config), tokenizer_dir=tokenizer_dir,
                         manifest={"kind": "megatron_klear.weight_sync"})


def remove_old_versions(sync_dir: str, keep: str) -> list:
    """Delete the versioned weight directories (``step_*``) of ``sync_dir`` other than ``keep``;
    returns what was removed. Called once every server reports the new version."""
    import os
    import shutil

    removed = []
    for name in sorted(os.listdir(sync_dir)):
        if name.startswith("step_") and name != keep and os.path.isdir(os.path.join(sync_dir, name)):
            shutil.rmtree(os.path.join(sync_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


# ------------------------------------------------------------------------------------------------
# rollout.weight_sync=distributed: SGLang's update_weights_from_distributed
# ------------------------------------------------------------------------------------------------
class WeightSyncError(RuntimeError):
    pass


class StagePart(NamedTuple):
    """A rank's part in producing its pipeline stage's HF tensors (:func:`stage_leaders`)."""

    stage: int
    experts_only: bool  # an EP peer outside the leader's replica: it helps gather the experts only


def stage_leaders():
    """Collective. ``(leaders, part)``: ``leaders[s]`` = global rank of pipeline stage ``s``'s leader
    (``tp=0`` of the replica ``dp=0, cp=0``), and ``part`` = this rank's :class:`StagePart` when it
    takes part in producing its stage's tensors, else None: every rank of that replica (its TP
    shards go to the leader) and, in a MoE model, every rank of an expert group (ETP x EP) holding
    one of them -- Megatron lays expert parallelism over the data-parallel ranks, so the experts
    of the leader's replica live on ranks of other replicas, and each expert is all-gathered over
    its group (:func:`~megatron_klear.checkpoint.model_weights.iter_hf_tensors`)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {0: 0}, StagePart(0, False)
    from megatron_klear.platform import comm_device

    ps = _groups()
    rank, world = dist.get_rank(), dist.get_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    first_replica = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    is_leader = first_replica and ps.get_tensor_model_parallel_rank() == 0
    dev = comm_device()
    expert_peer = False
    if ps.get_expert_tensor_and_model_parallel_world_size() > 1:  # the same size on every rank
        flag = torch.tensor([int(first_replica)], dtype=torch.int64, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ps.get_expert_tensor_and_model_parallel_group())
        expert_peer = bool(flag.item()) and not first_replica
    mine = torch.tensor([rank if is_leader else -1, pp_rank], dtype=torch.int64, device=dev)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    leaders = {int(t[1]): int(t[0]) for t in every if int(t[0]) >= 0}
    assert len(leaders) == ps.get_pipeline_model_parallel_world_size(), leaders
    part = StagePart(pp_rank, expert_peer) if first_replica or expert_peer else None
    return leaders, part


def iter_stage_hf_tensors(model_chunks, part):
    """This rank's part (a :class:`StagePart`, or None: nothing) in producing its stage's HF
    tensors: the stage leader (TP rank 0) yields them; its TP peers send it their shards, the EP
    peers take part in gathering the experts, and both iterate to the end yielding nothing."""
    from megatron_klear.checkpoint.model_weights import iter_hf_tensors

    if part is None:
        return iter(())
    multi = dist.is_initialized() and dist.get_world_size() > 1
    tp_group = _groups().get_tensor_model_parallel_group() if multi else None
    return iter_hf_tensors(model_chunks, tp_group=tp_group, tp_to=0, experts_only=part.experts_only)


def route_address(url: str) -> str:
    """This host's address on the interface that routes to ``url``'s host (what a server there
    connects back to)."""
    import socket
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: no packet is sent, the kernel picks the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def iter_buckets(named_tensors, bucket_bytes: int):
    """Group ``(name, tensor)`` into lists of about ``bucket_bytes`` bytes, one dtype per list (a
    flattened bucket puts every tensor at a multiple of its item size); a tensor larger than the
    bucket travels alone."""
    bucket, size = [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class DistributedWeightSync:
    """The trainer side of SGLang's distributed weight update, for every server at once.

    **Groups.** One process group per pipeline stage, ``<group_name>`` (``..._stage<s>`` with PP > 1):
    rank 0 is that stage's leader (it hosts the TCP store at ``master_addr:master_port + s``), and
    every server joins with its TP ranks at ``rank_offset = 1 + sum of the TP sizes of the servers
    before it`` (``/init_weights_update_group``; a server answers once the whole group is formed, or
    fails after ``group_timeout``). Global rank 0 drives the servers' HTTP control for every stage,
    so each server sees one stage's calls after another (they are handled one at a time by an
    SGLang server; two stages posting concurrently could deadlock two servers against each other).

    **A sync** (:meth:`sync`, version ``v``): rank 0 pauses generation (``/pause_generation``
    ``abort``) and opens a session (``/begin_weight_update``) on every server, while the first
    bucket is gathered; then, stage after
    stage, the leader packs its HF tensors into buckets of ``bucket_bytes`` (one dtype per bucket) and
    for each bucket: rank 0 posts ``/update_weights_from_distributed`` (names, dtypes, shapes,
    ``flush_cache``, and ``load_format="flattened_bucket"`` with NCCL) to every server while the
    leader broadcasts the bucket (``src=0``: its bytes back to back with NCCL, each tensor in order
    with gloo, SGLang's two receive paths); the leader gathers bucket ``k+1`` (its TP peers' shards)
    while bucket ``k`` is on the wire, and sends ``k+1`` once every server acknowledged ``k``. From
    the second sync on (per-tensor format), a bucket is announced from the layout the last sync
    recorded before its tensors are gathered, and each tensor is broadcast as soon as it is
    (:meth:`_send_streamed_buckets`). Then rank
    0 closes the session (``/end_weight_update``), sets the version (``/update_weight_version``),
    continues generation and checks that every server reports ``v``.

    **Failures** end the sync with :class:`WeightSyncError` on every rank, in bounded time: group
    creation waits at most ``group_timeout`` seconds, each bucket's broadcast ``bucket_timeout``
    (a dead peer fails it at once with gloo). The error names the server (its HTTP answer) or the
    stage. Generation stays paused and the servers' groups are dropped: an SGLang server that got
    part of the buckets holds a mix of weights (SGLang loads each bucket as it arrives) and must not
    serve, our embedded server discards the whole session (its weights and version are the old
    ones). A restarted run re-creates the groups and sends every weight before generating.
    """

    def __init__(self, model_chunks, engine, *, bucket_mb: float = 1024.0, backend: str = "auto",
                 master_addr: str = "", master_port: int = 0, group_timeout: float = 120.0,
                 bucket_timeout: float = 300.0, control_timeout: float = 60.0,
                 group_name: str = "klear_weights", load_format: str | None = None):
        from megatron_klear.rollout.weight_sync.update_group import FLATTENED_BUCKET

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

    # -- plumbing -------------------------------------------------------------------------------------
    @staticmethod
    def _rank() -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @staticmethod
    def _multi() -> bool:
        return dist.is_initialized() and dist.get_world_size() > 1

    def _bcast(self, obj):
        """Rank 0's ``obj`` on every rank (the gloo control group)."""
        if not self._multi():
            return obj
        from megatron_klear.platform import control_group

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=control_group())
        return box[0]

    def _send(self, obj, dst: int) -> None:
        from megatron_klear.platform import control_group

        dist.send_object_list([obj], dst=dst, group=control_group())

    def _recv(self, src: int):
        from megatron_klear.platform import control_group

        box = [None]
        dist.recv_object_list(box, src=src, group=control_group())
        return box[0]

    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _name(self, stage: int) -> str:
        return self.group_name if len(self.leaders) == 1 else f"{self.group_name}_stage{stage}"

    # -- groups ---------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Collective: create the update groups with every server (see the class docstring)."""
        from megatron_klear.rollout.weight_sync.update_group import PortInUseError, join_update_group, open_master_store, set_group_timeout

        rank = self._rank()
        self.leaders, self.part = stage_leaders()
        assert self.leaders[0] == 0, "global rank 0 must lead pipeline stage 0"
        plan = None
        if rank == 0:
            try:
                layout = self.engine.update_group_layout()
                offsets, nxt = {}, 1
                for w, ranks in layout:
                    offsets[w] = nxt
                    nxt += ranks
                plan = {"workers": [w for w, _ in layout], "offsets": offsets, "world": nxt}
            except Exception as e:  # noqa: BLE001 -- reported on every rank
                plan = {"error": str(e)}
        plan = self._bcast(plan)
        if "error" in plan:
            raise WeightSyncError(plan["error"])
        self.workers, self.offsets, self.world = plan["workers"], plan["offsets"], plan["world"]
        error = None
        for stage in sorted(self.leaders):
            leader, name = self.leaders[stage], self._name(stage)
            result = None
            if rank == leader:  # host the store, then join as rank 0
                store, addr, port, err = None, None, None, None
                try:
                    addr = self.master_addr or route_address(self.workers[0])
                    port = self.master_port + stage if self.master_port else 0
                    store = open_master_store(addr, port, self.world, self.group_timeout)
                    port = store.port
                except PortInUseError as e:
                    err = (f"rollout: cannot host the weight-update group {name} on rank {rank}: {e} (set "
                           f"rollout.sync_master_port to a free port, or 0 to let the OS choose)")
                except Exception as e:  # noqa: BLE001
                    err = f"rollout: cannot host the weight-update group {name} on rank {rank}: {type(e).__name__}: {e}"
                if leader != 0:
                    self._send((addr, port, err), 0)
                result = (addr, port, err)
            if rank == 0:
                addr, port, err = result if leader == 0 else self._recv(leader)
                futures = None
                if err is None:
                    futures = self.engine.init_weights_update_group_async(
                        master_address=addr, master_port=port, world_size=self.world, rank_offsets=self.offsets,
                        group_name=name, backend=self.backend, timeout=self.group_timeout + self.control_timeout)
            if rank == leader and result[2] is None:
                join_err = None
                try:
                    self.pg = join_update_group(backend=self.backend, master_address=result[0], master_port=result[1],
                                                rank=0, world_size=self.world, group_name=name,
                                                timeout=self.group_timeout, store=store)
                    set_group_timeout(self.pg, self.bucket_timeout)
                except Exception as e:  # noqa: BLE001
                    join_err = f"{type(e).__name__}: {e}"
                    self.pg = None
                if leader != 0:
                    self._send(join_err, 0)
            if rank == 0:
                if err is not None:
                    error = err
                else:
                    join_err = join_err if leader == 0 else self._recv(leader)
                    error = self._group_outcome(name, addr, port, futures, join_err)
            error = self._bcast(error)
            if error:
                self._drop_local()
                raise WeightSyncError(error)
        self.connected = True

    def _group_outcome(self, name, addr, port, futures, join_err):
        """Rank 0: the error of one group's creation (naming the servers that failed or never
        joined), or None."""
        import concurrent.futures

        done, pending = concurrent.futures.wait(list(futures.values()), timeout=0 if join_err else None)
        if join_err is not None:  # give answers in flight a moment to arrive
            done, pending = concurrent.futures.wait(list(futures.values()), timeout=2.0)
        failed = {w: f.exception() for w, f in futures.items() if f in done and f.exception() is not None}
        silent = [w for w, f in futures.items() if f in pending]
        if join_err is None and not failed:
            return None
        where = f"{addr}:{port}"
        parts = []
        if failed:
            w, e = next(iter(failed.items()))
            parts.append(f"{w} answered: {e}")
        if silent:
            parts.append(f"{', '.join(silent)} never joined (no answer to /init_weights_update_group)")
        if join_err is not None and not parts:
            parts.append("every server answered, but the group did not form")
        tail = f"; the trainer's side: {join_err}" if join_err else ""
        self.engine.destroy_weights_update_group(name)
        return (f"rollout: the weight-update group {name} (store at {where}, backend {self.backend}, "
                f"rollout.sync_group_timeout_s={self.group_timeout:g}) could not be created: {'; '.join(parts)}{tail}. "
                f"Each server must reach {where} ({'NCCL' if self.backend == 'nccl' else 'gloo'} connections to the "
                "trainer's stage leaders: check rollout.sync_master_addr, firewalls, NCCL_SOCKET_IFNAME / "
                "GLOO_SOCKET_IFNAME)")

    def _drop_local(self) -> None:
        from megatron_klear.rollout.weight_sync.update_group import destroy_update_group

        if self.pg is not None:
            destroy_update_group(self.pg)
        self.pg = None
        self.connected = False

    def close(self) -> None:
        """Drop the groups (servers and trainer side); not collective."""
        if self.connected and self._rank() == 0 and self.engine is not None:
            for stage in sorted(self.leaders or {}):
                try:
                    self.engine.destroy_weights_update_group(self._name(stage))
                except Exception:  # noqa: BLE001 -- best effort at shutdown
                    pass
        self._drop_local()

    # -- one sync -------------------------------------------------------------------------------------
    def sync(self, version) -> dict:
        """Collective: every weight to every server as weight version ``version``; returns stats
        (bytes, buckets, seconds) on rank 0."""
        import concurrent.futures
        import time

        if not self.connected:
            self.connect()
        rank = self._rank()
        t0 = time.monotonic()
        error = None
        if rank == 0:  # pause + begin on the servers while the first bucket is gathered
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
            if rank == leader:
                err = self._send_stage(stage, totals)
                if leader != 0:
                    self._send(("end", (err, totals)), 0)
            elif self.part is not None and self.part.stage == stage:  # the leader's TP and EP peers
                for _ in iter_stage_hf_tensors(self.model_chunks, self.part):
                    pass
            if rank == 0 and leader != 0:
                err = self._coordinate(stage, totals)
            err = self._bcast(err)
            if err:
                return self._fail(err)
        if rank == 0:
            try:
                if self._started.result() is not None:
                    raise WeightSyncError(self._started.result())
                self.engine.end_weight_update()
                self.engine.set_weight_version(version)
                self.engine.continue_generation()
                self.engine.check_weight_versions(version)
            except Exception as e:  # noqa: BLE001
                error = f"rollout: the weight update of version {version} did not complete: {e}"
        error = self._bcast(error)
        if error:
            return self._fail(error)
        self.stats = {**totals, "seconds": time.monotonic() - t0}
        return self.stats

    def _fail(self, error: str):
        """Every rank: drop the groups (servers: rank 0, best effort), keep generation paused, raise."""
        if self._rank() == 0:
            for stage in sorted(self.leaders):
                try:
                    self.engine.destroy_weights_update_group(self._name(stage))
                except Exception:  # noqa: BLE001
                    pass
        self._drop_local()
        raise WeightSyncError(
            f"{error}. Generation on the servers stays paused: a server that received part of the buckets "
            "must not serve a mix of weights (restart the run: it re-creates the groups and sends every "
            "weight before generating)")

    def _post_bucket(self, stage: int, meta):
        """Rank 0: post one bucket's metadata to every server (once they paused and opened the
        session); the error text naming the server, or None."""
        names, dtypes, shapes = meta
        started = self._started.result()
        if started is not None:
            return started
        try:
            self.engine.update_weights_from_distributed(
                names, dtypes, shapes, group_name=self._name(stage),
                load_format=self.load_format if self.load_format != "auto" else None,
                flush_cache=True, timeout=self.bucket_timeout + self.control_timeout)
            return None
        except Exception as e:  # noqa: BLE001
            return f"rollout: bucket of stage {stage} ({len(names)} tensors, first {names[0]}) failed: {e}"

    def _coordinate(self, stage: int, totals: dict):
        """Rank 0 for a stage led by another rank: post each bucket the leader announces, acknowledge
        it; returns the stage's error or None."""
        err = None
        while True:
            kind, payload = self._recv(self.leaders[stage])
            if kind == "end":
                stage_err, stage_totals = payload
                for k, v in stage_totals.items():
                    totals[k] += v
                return stage_err or err
            err = self._post_bucket(stage, payload)
            self._send(err, self.leaders[stage])

    def _send_stage(self, stage: int, totals: dict):
        """The stage leader: stream the stage's buckets (see the class docstring); returns the first
        error or None. Drains the tensors after an error (the TP peers keep sending their shards).

        Two schedules. Without a layout (the first sync, or ``flattened_bucket``, whose bucket is
        one tensor made of all of them): gather a whole bucket, then announce and broadcast it,
        gathering the next one meanwhile. With the layout the last sync recorded (names, dtypes and
        shapes per bucket: a model's structure does not change), a bucket is announced before its
        tensors are gathered and each tensor is broadcast as soon as it is: the first tensors are
        on the wire at once instead of after a whole bucket's gather, and the gathers overlap the
        broadcasts throughout."""
        import concurrent.futures

        from megatron_klear.rollout.weight_sync.update_group import FLATTENED_BUCKET

        rank = self._rank()
        flattened = self.load_format == FLATTENED_BUCKET
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-http") if rank == 0 else None
        tensors = iter_stage_hf_tensors(self.model_chunks, self.part)
        layout = None if flattened else self._layouts.get(stage)
        try:
            if layout is None:
                error, layout = self._send_gathered_buckets(stage, tensors, totals, pool)
                if error is None and not flattened:
                    self._layouts[stage] = layout
                return error
            totals["streamed_stages"] += 1
            return self._send_streamed_buckets(stage, tensors, totals, pool, layout)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)

    # A bucket on the wire: {"meta": (names, dtypes, shapes), "handle": rank 0's HTTP future or None,
    # "works": its broadcasts, "payload": the tensors they send (referenced until they end), "nbytes"}
    def _launch_bucket(self, stage: int, meta, payload, totals: dict, pool) -> dict:
        """Announce one bucket (rank 0 posts it to the servers; another stage's leader asks rank 0
        to) and broadcast the tensors of it already at hand."""
        handle = pool.submit(self._post_bucket, stage, meta) if self._rank() == 0 else None
        if handle is None:
            self._send(("bucket", meta), 0)
        flight = {"meta": meta, "handle": handle, "works": [], "payload": [], "nbytes": 0}
        totals["buckets"] += 1
        for x in payload:
            self._broadcast_into(flight, x, totals)
        return flight

    def _broadcast_into(self, flight: dict, x: torch.Tensor, totals: dict) -> None:
        flight["works"].append(dist.broadcast(x, src=0, group=self.pg, async_op=True))
        flight["payload"].append(x)
        nbytes = x.numel() * x.element_size()
        flight["nbytes"] += nbytes
        totals["bytes"] += nbytes

    def _finish_bucket(self, stage: int, flight: dict):
        """Wait for a bucket: the servers' answer first, always consumed (rank 0's answers stay in
        step with the buckets; a server that refuses a bucket answers at once, and its broadcast
        would only run into the timeout), then the broadcasts. The error text, or None."""
        ack = flight["handle"].result() if flight["handle"] is not None else self._recv(0)
        if ack is not None:
            return ack
        try:
            for work in flight["works"]:
                work.wait()
        except Exception as e:  # noqa: BLE001 -- a dead peer, or the bucket timeout
            names = flight["meta"][0]
            return (f"rollout: the broadcast of a bucket of stage {stage} ({flight['nbytes'] / 2**20:.0f} MiB, "
                    f"{len(names)} tensors from {names[0]}) failed within rollout.sync_bucket_timeout_s="
                    f"{self.bucket_timeout:g}: {type(e).__name__}: {e}")
        return None

    @staticmethod
    def _meta_of(bucket) -> tuple:
        from megatron_klear.rollout.weight_sync.update_group import dtype_name

        return ([n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket], [list(t.shape) for _, t in bucket])

    def _send_gathered_buckets(self, stage: int, tensors, totals: dict, pool):
        """Gather a bucket whole, then send it while the next one is gathered. ``(error, layout)``."""
        from megatron_klear.rollout.weight_sync.update_group import FLATTENED_BUCKET, flatten_bucket

        dev = self._device()
        error, flight, layout = None, None, []
        for bucket in iter_buckets(tensors, self.bucket_bytes):
            if error is not None:
                continue
            if self.load_format == FLATTENED_BUCKET:  # one broadcast of the bucket's bytes back to back
                payload = [flatten_bucket([t.to(dev, non_blocking=True) for _, t in bucket])]
            else:  # SGLang's default: one broadcast per tensor, in order
                payload = [t.detach().to(dev, non_blocking=True).contiguous() for _, t in bucket]
            if flight is not None:
                error, flight = self._finish_bucket(stage, flight), None
                if error is not None:
                    continue
            meta = self._meta_of(bucket)
            layout.append(meta)
            flight = self._launch_bucket(stage, meta, payload, totals, pool)
        if flight is not None:
            error = self._finish_bucket(stage, flight)
        return error, layout

    def _send_streamed_buckets(self, stage: int, tensors, totals: dict, pool, layout) -> str | None:
        """Each bucket announced before its tensors are gathered (``layout``: the last sync's), each
        tensor broadcast as soon as it is gathered. The next bucket's tensors are gathered while the
        current one is on the wire (at most one bucket ahead) and go out once the servers answered
        it. The error text, or None."""
        from megatron_klear.rollout.weight_sync.update_group import dtype_name, dtype_of

        dev = self._device()
        expected = [(n, d, list(s), b) for b, meta in enumerate(layout) for n, d, s in zip(*meta)]
        counts = [len(meta[0]) for meta in layout]
        b, error, ahead, i = 0, None, [], 0
        flight = self._launch_bucket(stage, layout[0], [], totals, pool)

        def done_now(f) -> bool:  # rank 0 can tell without blocking; another leader learns it from rank 0
            return f["handle"] is not None and f["handle"].done() and all(w.is_completed() for w in f["works"])

        for name, t in tensors:
            if error is not None:
                continue  # drain: the TP / EP peers keep sending
            got = (name, dtype_name(t.dtype), list(t.shape))
            if i >= len(expected) or got != expected[i][:3]:
                want = expected[i][:3] if i < len(expected) else "the end of the stage"
                error = (f"rollout: stage {stage}'s weights no longer follow the layout of the last sync: tensor {i} "
                         f"is {got}, expected {want}")
                continue
            x = t.detach().to(dev, non_blocking=True).contiguous()
            if expected[i][3] == b:
                self._broadcast_into(flight, x, totals)
            else:  # the next bucket's: held until the servers have the current one
                ahead.append(x)
            i += 1
            while (error is None and len(flight["works"]) == counts[b] and b + 1 < len(layout)
                   and (len(ahead) == counts[b + 1] or done_now(flight))):
                error = self._finish_bucket(stage, flight)
                if error is None:
                    b += 1
                    flight, ahead = self._launch_bucket(stage, layout[b], ahead, totals, pool), []
        if error is None and i != len(expected):
            error = f"rollout: stage {stage} yielded {i} tensors, the layout of the last sync has {len(expected)}"
        if error is not None:
            self._layouts.pop(stage, None)  # the next sync gathers whole buckets again
            # The servers wait for the rest of the announced bucket: send zeros in its place (the sync
            # fails, so nothing of it is served), then take their answer (rank 0's stay in step).
            start = sum(counts[:b])
            for _, d, shape, _ in expected[start + len(flight["works"]):start + counts[b]]:
                self._broadcast_into(flight, torch.zeros(shape, dtype=dtype_of(d), device=dev), totals)
            self._finish_bucket(stage, flight)
            return error
        return self._finish_bucket(stage, flight)
