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


def expert_offset(model) -> int:
    """Global index of this rank's first local expert (0 for dense models and EP = 1)."""
    m = unwrap(model)
    if not m.arch.is_moe:
        return 0
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * (m.arch.num_experts // ep)


def named_canonical_params(model, *, include_tied_copy: bool = True):
    """(canonical name, parameter) for every parameter of one model chunk.

    With tied embeddings and PP > 1 the last stage holds a copy of the embedding as
    ``output_layer.weight``; it is named as the embedding (loading fills it) unless
    ``include_tied_copy`` is False (exporting: the first stage's embedding is the one).
    Experts are named by their global index.
    """
    m = unwrap(model)
    offset = layer_offset(m)
    eoffset = expert_offset(m)
    for name, p in m.named_parameters():
        cname = canonical_name(name, offset, expert_offset=eoffset, moe_layers=m.arch.moe_layers)
        if cname == "output_layer.weight" and m.arch.tie_word_embeddings:
            if not include_tied_copy:
                continue
            cname = "embedding.word_embeddings.weight"
        yield cname, p


@torch.no_grad()
def load_hf_weights(model_chunks, reader) -> set:
    """Copy the HF tensors (an :class:`HFReader`) into this rank's model chunks.

    Returns the set of HF keys this rank consumed.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    etp_size = parallel_state.get_expert_tensor_parallel_world_size()
    consumed = set()
    for chunk in model_chunks:
        m = unwrap(chunk)
        rules = rules_by_megatron(m.arch)
        for cname, param in named_canonical_params(chunk):
            rule = rules.get(cname)
            if rule is None:
                raise MappingError(f"model parameter '{cname}' has no HF mapping")
            full = to_megatron(rule, [reader.get(k) for k in rule.hf], m.arch, m.vocab_size)
            shard = tp_shard(rule, full, *((etp_rank, etp_size) if rule.expert else (tp_rank, tp_size)))
            if shard.shape != param.shape:
                raise MappingError(
                    f"'{cname}': TP shard has shape {tuple(shard.shape)}, parameter has {tuple(param.shape)}"
                )
            param.data.copy_(shard)
            consumed.update(rule.hf)
    return consumed


def gather_tp(rule, shard: torch.Tensor, group, *, to: int | None = None) -> torch.Tensor | None:
    """All-gather a TP-sharded parameter and reassemble the full canonical tensor. With ``to`` (a
    rank of ``group``), only that rank gets it: the others send it their shard and get None
    (point to point: with gloo, ~8x faster per byte than its all-gather, and no rank but one
    reassembles)."""
    import torch.distributed as dist

    from megatron_klear.checkpoint.mapping import tp_unshard

    size = dist.get_world_size(group) if group is not None else 1
    if rule.tp_dim is None or size == 1:
        return shard if to is None or size == 1 or dist.get_rank(group) == to else None
    if to is None:
        parts = [torch.empty_like(shard) for _ in range(size)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return tp_unshard(rule, parts)
    me = dist.get_rank(group)
    if me != to:
        dist.send(shard.contiguous(), dst=dist.get_global_rank(group, to), group=group)
        return None
    plain_rows = rule.tp_dim == 0 and rule.kind != "gate_up"  # unsharding is a concatenation of rows
    if plain_rows:  # receive straight into the full tensor's row blocks (contiguous): no concatenation
        full = torch.empty((shard.shape[0] * size, *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        parts = list(full.chunk(size, dim=0))
        parts[me].copy_(shard)
    else:
        parts = [shard if r == me else torch.empty_like(shard) for r in range(size)]
    works = [dist.irecv(parts[r], src=dist.get_global_rank(group, r), group=group) for r in range(size) if r != me]
    for w in works:
        w.wait()
    return full if plain_rows else tp_unshard(rule, parts)


def gather_experts(rule, full: torch.Tensor, ep_group, name_of) -> list:
    """All-gather one local expert's full tensor over the EP group: [(canonical name, tensor)] for
    the experts at the same local index on every EP rank (rank r holds experts r*n .. r*n+n-1)."""
    import torch.distributed as dist

    size = dist.get_world_size(ep_group) if ep_group is not None else 1
    if size == 1:
        return [(name_of(0), full)]
    parts = [torch.empty_like(full) for _ in range(size)]
    dist.all_gather(parts, full.contiguous(), group=ep_group)
    return [(name_of(r), t) for r, t in enumerate(parts)]


def _default_expert_groups(m):
    import torch.distributed as dist

    if not m.arch.is_moe or not dist.is_initialized() or dist.get_world_size() == 1:
        return None, None
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_group(), parallel_state.get_expert_tensor_parallel_group()


def iter_hf_tensors(
    model_chunks, *, tp_group=None, ep_group="auto", expert_tp_group="auto", tp_to=None, experts_only: bool = False
):
    """Yield (hf_name, full tensor) for this pipeline stage's parameters (in :func:`_streaming_order`).

    Every TP rank of the stage must call it (TP shards are all-gathered); the tied output layer of
    the last stage is skipped (it is the embedding). MoE models: experts are all-gathered over the
    expert-TP group and then over the EP group ("auto": Megatron's, when torch.distributed runs
    more than one process), so every rank of those groups must call it too -- with EP > 1 that is
    every rank of the stage, whatever its data-parallel rank; each yields every expert.
    ``tp_to`` (a rank of ``tp_group``): only that rank yields; the other TP ranks send it their
    shards and yield nothing (for a consumer on one rank: export, weight sync).
    ``experts_only``: take part in the experts' all-gathers only, yield nothing (a rank outside the
    consumer's TP group whose expert-parallel peers are in it: Megatron spreads an EP group over
    data-parallel ranks).
    """
    import re

    import torch.distributed as dist

    yields = not experts_only and (
        tp_to is None or tp_group is None or _group_size(tp_group) == 1 or dist.get_rank(tp_group) == tp_to
    )
    for chunk in model_chunks:
        m = unwrap(chunk)
        rules = rules_by_megatron(m.arch)
        groups = _default_expert_groups(m)
        ep_g = groups[0] if ep_group == "auto" else ep_group
        etp_g = groups[1] if expert_tp_group == "auto" else expert_tp_group
        n_local = m.arch.num_experts // _group_size(ep_g) if m.arch.is_moe else 0
        offset = expert_offset(m) if ep_g is not None else 0
        seen = set()
        for cname, param in _streaming_order(list(named_canonical_params(chunk, include_tied_copy=False))):
            if cname in seen:
                continue
            seen.add(cname)
            rule = rules[cname]
            if not rule.expert:
                if experts_only:
                    continue
                full = gather_tp(rule, param.detach(), tp_group, to=tp_to)
                if full is not None:
                    yield from zip(rule.hf, to_hf(rule, full, m.arch))
                continue
            full = gather_tp(rule, param.detach(), etp_g)
            e = re.search(r"\.experts\.(\d+)\.", cname)
            local = int(e.group(1)) - offset

            def name_of(r, cname=cname, e=e, local=local, n_local=n_local):
                return f"{cname[: e.start()]}.experts.{r * n_local + local}.{cname[e.end() :]}"

            experts = gather_experts(rule, full, ep_g, name_of)
            if not yields:
                continue
            for name, t in experts:
                yield from zip(rules[name].hf, to_hf(rules[name], t, m.arch))


def _streaming_order(params: list) -> list:
    """Model order, but the word embedding (a stage's largest TP-sharded tensor, vocabulary x
    hidden) last: a consumer that overlaps the gathers with its own work (the weight sync
    broadcasts each tensor while the next is gathered) then starts at once with the layers, and
    the embedding's long gather overlaps their broadcast instead of stalling the start. The same
    order on every rank of the collectives."""
    emb = "embedding.word_embeddings.weight"
    return [p for p in params if p[0] != emb] + [p for p in params if p[0] == emb]


def _group_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if group is not None else 1
