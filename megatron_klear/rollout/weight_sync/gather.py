"""The trainer's weights as HF-named full tensors, gathered from TP / PP / EP: what every weight-sync
path sends.

Everything here is collective (every trainer rank calls it) and fed by
:func:`megatron_klear.checkpoint.model_weights.iter_hf_tensors`: in each pipeline stage's replica
``(dp=0, cp=0)`` the TP peers send their shards to the stage leader (``tp=0``; point to point:
with gloo ~8x faster per byte than an all-gather), which turns them into HF-named full tensors. In a
MoE model with EP > 1 the experts are all-gathered over their expert groups, which Megatron lays
over the data-parallel ranks: the leader's EP peers in other replicas take part too
(:func:`stage_leaders`), and only the leader yields.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch
import torch.distributed as dist


def _groups():
    from megatron.core import parallel_state as ps

    return ps


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


def drain(tensors) -> None:
    """Run a gather to its end without keeping what it yields: ranks that only take part in its
    collectives (a leader's TP / EP peers) still have to step through every tensor."""
    collections.deque(tensors, maxlen=0)


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
                drain(tensors)  # rank 0's TP / EP peers
            continue
        # The stage lives elsewhere: its leader sends (header, tensor) pairs to rank 0.
        if rank == src:
            for name, t in tensors:
                dist.send_object_list([(name, tuple(t.shape), t.dtype)], dst=0)
                dist.send(t.contiguous().to(dev), dst=0)
            dist.send_object_list([None], dst=0)
        elif mine:
            drain(tensors)
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
