"""Weights between a live (TP/PP-sharded) Megatron model and HF names, through the one mapping.

Used to load an HF checkpoint straight into a model (parity checks, a quick start without
conversion) and, in reverse, to produce HF-named full tensors from the model (export, RL weight
sync).
"""
from __future__ import annotations

import torch

from megatron_klear.checkpoint.mapping import (
    MappingError,
    canonical_name,
    rules_by_megatron,
    to_hf,
    to_megatron,
    tp_shard,
)


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def layer_offset(model) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    m = unwrap(model)
    return get_transformer_layer_offset(m.config, vp_stage=getattr(m, "vp_stage", None))


def named_canonical_params(model, *, include_tied_copy: bool = True):
    """(canonical name, parameter) for every parameter of one model chunk.

    With tied embeddings and PP > 1 the last stage holds a copy of the embedding as
    ``output_layer.weight``; it is named as the embedding (loading fills it) unless
    ``include_tied_copy`` is False (exporting: the first stage's embedding is the one).
    """
    m = unwrap(model)
    offset = layer_offset(m)
    for name, p in m.named_parameters():
        cname = canonical_name(name, offset)
        if cname == "output_layer.weight" and m.arch.tie_word_embeddings:
            if not include_tied_copy:
                continue
            cname = "embedding.word_embeddings.weight"
        yield cname, p


def padded_vocab_of(model) -> int:
    m = unwrap(model)
    return m.vocab_size


@torch.no_grad()
def load_hf_weights(model_chunks, reader) -> set:
    """Copy the HF tensors (an :class:`HFReader`) into this rank's model chunks.

    Returns the set of HF keys this rank consumed.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    consumed = set()
    for chunk in model_chunks:
        m = unwrap(chunk)
        rules = rules_by_megatron(m.arch)
        for cname, param in named_canonical_params(chunk):
            rule = rules.get(cname)
            if rule is None:
                raise MappingError(f"model parameter '{cname}' has no HF mapping")
            full = to_megatron(rule, [reader.get(k) for k in rule.hf], m.arch, m.vocab_size)
            shard = tp_shard(rule, full, tp_rank, tp_size)
            if shard.shape != param.shape:
                raise MappingError(
                    f"'{cname}': TP shard has shape {tuple(shard.shape)}, parameter has {tuple(param.shape)}"
                )
            param.data.copy_(shard)
            consumed.update(rule.hf)
    return consumed


def gather_tp(rule, shard: torch.Tensor, group) -> torch.Tensor:
    """All-gather a TP-sharded parameter and reassemble the full canonical tensor."""
    import torch.distributed as dist

    from megatron_klear.checkpoint.mapping import tp_unshard

    size = dist.get_world_size(group) if group is not None else 1
    if rule.tp_dim is None or size == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return tp_unshard(rule, parts)


def iter_hf_tensors(model_chunks, *, tp_group=None):
    """Yield (hf_name, full tensor) for this pipeline stage's parameters.

    Every TP rank of the stage must call it (TP shards are all-gathered); the tied output layer of
    the last stage is skipped (it is the embedding).
    """
    for chunk in model_chunks:
        m = unwrap(chunk)
        rules = rules_by_megatron(m.arch)
        seen = set()
        for cname, param in named_canonical_params(chunk, include_tied_copy=False):
            if cname in seen:
                continue
            seen.add(cname)
            rule = rules[cname]
            full = gather_tp(rule, param.detach(), tp_group)
            yield from zip(rule.hf, to_hf(rule, full, m.arch))
