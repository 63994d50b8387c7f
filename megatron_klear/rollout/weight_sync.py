"""Trainer weights -> rollout engine, through the one HF <-> Megatron mapping.

Every trainer rank calls :func:`sync_weights` (it is collective): each pipeline stage's replica
``(dp=0, cp=0)`` all-gathers its TP shards and turns them into HF-named full tensors
(:func:`megatron_klear.checkpoint.model_weights.iter_hf_tensors`); the stage leaders
(``tp=0``) send them to global rank 0, which streams them into the engine one tensor at a time
(no rank holds the whole model at once beyond what the engine itself keeps).

For engines that load from disk (SGLang's ``update_weights_from_disk``, or our embedded HTTP
server), :func:`export_hf_for_engine` writes the same tensors as an HF checkpoint directory.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _groups():
    from megatron.core import parallel_state as ps

    return ps


def iter_model_hf_weights(model_chunks):
    """Collective. On global rank 0, yields (HF name, tensor) for the whole model, stage by stage;
    on every other rank, yields nothing (but must be iterated to the end)."""
    from megatron_klear.checkpoint.model_weights import iter_hf_tensors

    ps = _groups()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        yield from iter_hf_tensors(model_chunks)
        return
    rank = dist.get_rank()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    first_replica = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    tp_group = ps.get_tensor_model_parallel_group()
    is_leader = first_replica and ps.get_tensor_model_parallel_rank() == 0
    from megatron_klear.platform import comm_device

    dev = comm_device()
    # global rank of each stage's leader, known to everyone
    leader = torch.tensor([rank if is_leader else -1], dtype=torch.int64, device=dev)
    leaders = [torch.zeros_like(leader) for _ in range(world)]
    dist.all_gather(leaders, leader)
    stage_of = torch.tensor([pp_rank], dtype=torch.int64, device=dev)
    stages = [torch.zeros_like(stage_of) for _ in range(world)]
    dist.all_gather(stages, stage_of)
    stage_leader = {int(s): int(r) for r, s in zip(leaders, stages) if int(r) >= 0}
    assert len(stage_leader) == pp_size, stage_leader

    for stage in range(pp_size):
        src = stage_leader[stage]
        mine = first_replica and pp_rank == stage
        tensors = iter_hf_tensors(model_chunks, tp_group=tp_group) if mine else iter(())
        if src == 0:
            if rank == 0:
                yield from tensors
            else:
                for _ in tensors:  # TP peers of rank 0 take part in the all-gathers
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
