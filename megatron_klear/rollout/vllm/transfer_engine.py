"""The server side of the in-memory weight transfer into vLLM (runs inside vLLM's worker processes):
:class:`UpdateGroupTransferEngine`, a vLLM ``WeightTransferEngine`` registered as
:data:`BACKEND` by the plugin of :mod:`.plugin` (vLLM loads ``vllm.general_plugins`` entry points in
every worker before it builds the engine). Start the server with
``--weight-transfer-config '{"backend": "megatron_klear"}'``.

It speaks the wire of the trainer's :class:`~megatron_klear.rollout.weight_sync.DistributedWeightSync`
(:mod:`megatron_klear.rollout.servers.update_group`: the group joined through the sender's TCP
store, then per bucket one broadcast per tensor in the order of its names, or one ``uint8``
broadcast of the flattened bucket), so that SGLang and vLLM servers take the same
bucket schedule and fleet rules: gloo on CPU (the tests run it against the real CPU server), NCCL
on GPU. vLLM's own ``nccl`` engine speaks another wire (its PyNccl communicator and packed buffers)
and has no CPU backend. Weights load as vLLM's own checkpoint-format engines load them: layerwise
reloading opened at ``start_weight_update`` and finalised at ``finish_weight_update``, every bucket
fed to ``model.load_weights`` by HF name.

Delta buckets (``rollout.sync_delta``, a bucket whose ``update_info`` has ``counts``): the engine
keeps the last value of every tensor a delta-mode sync sent it (its images, in host memory for a
GPU worker: one copy of the worker's share of the weights), writes each bucket's changes into them
and loads the resulting tensors as a full sync does (layerwise reloading needs every weight of the
model; vLLM's CPU build repacks its linear weights on load, so nothing is patched in place). The
wire carries the changes only; a sync without ``counts`` drops the images.

In memory (``rollout.weight_sync=memory``, a bucket whose ``update_info`` has ``tensors``): the
trainer on this machine shares each bucket (CUDA IPC handles, or shared-memory files on the CPU) and
every worker reads it, under SGLang's allow-list of tensor globals, and loads it; no group.

Only ``torch``, ``vllm``, :mod:`~megatron_klear.rollout.servers.update_group` and
:mod:`~megatron_klear.rollout.in_server.shared_tensors` are imported: vLLM's environment holds this
package without its dependencies (``make venv``)."""

from __future__ import annotations

import dataclasses

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from megatron_klear.rollout.servers.update_group import (
    FLATTENED_BUCKET,
    apply_delta,
    bucket_layout,
    delta_segments,
    destroy_update_group,
    dtype_of,
    join_update_group,
    receive_delta_bucket,
    timed,
    unflatten_bucket,
)
from megatron_klear.rollout.vllm.plugin import BACKEND  # noqa: F401 -- the name this engine is registered as


@dataclasses.dataclass
class UpdateGroupInit:
    """``/init_weight_transfer_engine``'s ``init_info``: the update group to join (SGLang's
    ``/init_weights_update_group`` fields), as rank ``rank_offset + this worker's rank``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "gloo"
    timeout_s: float = 120.0


@dataclasses.dataclass
class UpdateGroupBucket:
    """``/update_weights``' ``update_info``: one bucket's tensors, broadcast over ``group_name``; or,
    with ``tensors``, handed over in memory by a trainer on this machine (``rollout.weight_sync=memory``:
    the base64 of its multiprocessing pickle, :mod:`megatron_klear.rollout.in_server.shared_tensors`;
    no group)."""

    names: list = dataclasses.field(default_factory=list)
    dtype_names: list = dataclasses.field(default_factory=list)
    shapes: list = dataclasses.field(default_factory=list)
    group_name: str = ""
    load_format: str = "auto"
    counts: list | None = None  # a delta bucket: per tensor -1 (whole) or its number of changed elements
    tensors: str | list | None = None  # one pickle per worker rank (or one for a single worker)


class UpdateGroupTransferEngine(WeightTransferEngine):
    init_info_cls = UpdateGroupInit
    update_info_cls = UpdateGroupBucket
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.groups: dict = {}  # group name -> process group
        self.images: dict = {}  # delta syncs: name -> the last value sent (host memory)
        self.buffers: dict = {}  # a CPU worker's full syncs: name -> where it is received (_buffer)
        self.flat = torch.empty(0, dtype=torch.uint8)  # a CPU worker's flattened buckets

    def _worker_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def init_transfer_engine(self, init_info: UpdateGroupInit) -> None:
        stale = self.groups.pop(init_info.group_name, None)  # a trainer that died left it
        if stale is not None:
            destroy_update_group(stale)
        self.groups[init_info.group_name] = join_update_group(
            backend=init_info.backend,
            master_address=init_info.master_address,
            master_port=int(init_info.master_port),
            rank=int(init_info.rank_offset) + self._worker_rank(),
            world_size=int(init_info.world_size),
            group_name=init_info.group_name,
            timeout=float(init_info.timeout_s),
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with timed("start"):
            initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with timed("finish"):
            finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: UpdateGroupBucket) -> None:
        if update_info.tensors is not None:
            self._load_shared(update_info.tensors)
            return
        group = self.groups.get(update_info.group_name)
        if group is None:
            raise RuntimeError(
                f"weight update group {update_info.group_name!r} is not initialised here "
                f"(known: {sorted(self.groups)}); call /init_weight_transfer_engine first"
            )
        n = len(update_info.names)
        if update_info.counts is not None:
            with timed("receive_delta", tensors=n):
                tensors = self._receive_delta(group, update_info)
            with timed("load", tensors=n):
                self.model.load_weights(tensors)
            return
        self.images.clear()  # a full sync: the next delta sync starts with whole tensors
        with timed("receive", tensors=n):
            tensors = self._receive(group, update_info)
        with timed("load", tensors=n):
            self.model.load_weights(tensors)

    def _load_shared(self, payload) -> None:
        """A bucket the trainer shares in memory: read under SGLang's allow-list of tensor globals
        and loaded whole. ``payload``: one pickle per worker process, each made on that worker's
        GPU (entry ``rank`` is this worker's, as SGLang's TP rank reads its own entry), or one pickle
        for a single worker. A GPU worker loads copies: layerwise reloading may hold a tensor until its
        layer is complete, after the trainer has reused the memory behind the handle."""
        from megatron_klear.rollout.in_server.shared_tensors import load_shared_tensors

        if isinstance(payload, list):
            rank = self._worker_rank()
            if not 0 <= rank < len(payload):
                raise RuntimeError(
                    f"update_info.tensors has {len(payload)} entries, none for worker rank {rank} (one per "
                    "worker process, each made on that worker's GPU)"
                )
            payload = payload[rank]
        self.images.clear()  # whole tensors: the next delta sync starts from whole ones
        with timed("receive_shared"):
            named = load_shared_tensors(payload)
            if self.device.type != "cpu":
                named = [(name, t.to(self.device, copy=True)) for name, t in named]
        with timed("load", tensors=len(named)):
            self.model.load_weights(named)

    def _buffer(self, name: str, shape, dtype) -> torch.Tensor:
        """Where tensor ``name`` of a full sync is received. A CPU worker keeps one per tensor
        across syncs: memory freshly allocated for every sync (hundreds of MB, returned to the OS
        when freed) costs its page faults again each time, which took about a third of a sync to
        vLLM's CPU build (benchmarks/RESULTS.md). A GPU worker allocates (torch's caching allocator
        reuses its memory; a second copy of the weights would not fit)."""
        shape = torch.Size(int(d) for d in shape)
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=self.device)
        t = self.buffers.get(name)
        if t is None or t.shape != shape or t.dtype != dtype:
            t = self.buffers[name] = torch.empty(shape, dtype=dtype)
        return t

    def _receive(self, group, update_info: UpdateGroupBucket) -> list:
        """A full bucket's [(name, tensor)]. Layerwise reloading holds the tensors of a layer until
        all of them arrived (a later bucket may complete it): each keeps storage of its own."""
        names, dtypes, shapes = update_info.names, update_info.dtype_names, update_info.shapes
        if update_info.load_format == FLATTENED_BUCKET:  # one broadcast of the bucket's bytes
            layout = bucket_layout(names, dtypes, shapes)
            size = layout[-1][4]
            if self.device.type != "cpu":
                flat = torch.empty(size, dtype=torch.uint8, device=self.device)
            else:  # one buffer for every bucket, grown to the largest
                if self.flat.numel() < size:
                    self.flat = torch.empty(size, dtype=torch.uint8)
                flat = self.flat[:size]
            torch.distributed.broadcast(flat, src=0, group=group)
            return [(name, self._buffer(name, t.shape, t.dtype).copy_(t)) for name, t in unflatten_bucket(flat, layout)]
        if update_info.load_format in ("auto", None):  # SGLang's default: one broadcast per tensor, in order
            tensors = []
            for name, dt, shape in zip(names, dtypes, shapes):
                t = self._buffer(name, shape, dtype_of(dt))
                torch.distributed.broadcast(t, src=0, group=group)
                tensors.append((name, t))
            return tensors
        raise ValueError(f"load_format {update_info.load_format!r}: expected 'auto' or {FLATTENED_BUCKET!r}")

    def _receive_delta(self, group, update_info: UpdateGroupBucket) -> list:
        """A delta bucket: its pieces received, written into the images; [(name, tensor)] to load."""
        segments, refusal = None, None  # (agreed with every member before anything is received)
        try:
            if update_info.load_format not in (FLATTENED_BUCKET, "auto", None):
                raise ValueError(f"load_format {update_info.load_format!r}: expected 'auto' or {FLATTENED_BUCKET!r}")
            segments = delta_segments(
                update_info.names, update_info.dtype_names, update_info.shapes, update_info.counts
            )
        except ValueError as e:
            refusal = e
        pieces = receive_delta_bucket(group, self.device, segments, update_info.load_format or "auto", refusal)
        self.buffers.clear()  # (the images take their place: one host copy of the weights at most)
        pieces = [p.to("cpu") for p in pieces]
        # a GPU worker loads a copy of each image; a CPU worker the image itself (load_weights copies
        # it into the layer it rebuilds; the next sync's changes come after that)
        return [(name, t.to(self.device)) for name, t in apply_delta(self.images, segments, pieces)]

    def shutdown(self) -> None:
        for group in self.groups.values():
            destroy_update_group(group)
        self.groups.clear()
