"""The forward(-backward) pass over one step's packed micro-batches, shared by SFT and RL.

Every micro-batch goes through Megatron's pipeline schedule (any TP/PP/CP/VPP); on the last
pipeline stage the vocabulary-parallel logits become per-token log-probs and entropies
(:mod:`megatron_klear.training.logprobs`, no vocabulary gather), and the caller's ``loss_fn`` turns those
into a scalar. Normalisation is the caller's: ``loss_fn`` divides by counts of the *whole* global
batch, and Megatron is configured to sum (not average) over micro-batches and data-parallel ranks,
so the gradient is exactly that of the global loss, however the batch is split.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megatron_klear.training.batches import PER_TOKEN_KEYS_DEFAULT, model_padding_rule, prepare_packed

LossFn = Callable[[dict, torch.Tensor, torch.Tensor], tuple]


def _vocab_info(model_chunk):
    from megatron.core import parallel_state

    from megatron_klear.checkpoint.model_weights import unwrap

    m = unwrap(model_chunk)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    v_local = m.vocab_size // tp_size
    group = parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None
    return group, tp_rank * v_local, m.arch.vocab_size


def run_micro_batches(
    model: list,
    micro_batches: list,
    loss_fn: LossFn,
    *,
    forward_only: bool = False,
    temperature: float = 1.0,
    chunk_size: int | None = 4096,
    per_token_keys=PER_TOKEN_KEYS_DEFAULT,
    pad_id: int = 0,
    before_forward=None,
) -> list:
    """Run this rank's ``micro_batches`` through the schedule; returns ``loss_fn``'s metrics per
    micro-batch on the last pipeline stage (an empty list elsewhere).

    ``loss_fn(batch, logprobs, entropy) -> (loss, metrics)`` sees this rank's (CP-local) slice of
    the micro-batch; ``logprobs``/``entropy`` are float32 ``[1, S_local]`` for ``batch["labels"]``.
    Gradients accumulate in the DDP buffers (call the optimizer afterwards).
    ``before_forward(batch, model)``: called with the local batch and the unwrapped model chunk
    before each forward (e.g. to set the routers' replayed experts).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_klear.checkpoint.model_weights import unwrap
    from megatron_klear.models.output_head import deferred_head
    from megatron_klear.platform import device
    from megatron_klear.training.logprobs import chunked_logprobs_from_hidden, vocab_parallel_logprobs_and_entropy

    dev = device()
    cp_size = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    group, vocab_start, vocab_size = _vocab_info(model[0])
    # With CP every segment is padded to 2*CP and the row to the rule's multiple, so that every CP
    # rank's tokens (and SP shard) split over TP and meet the FP8 recipe's requirement.
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    total_multiple = model_padding_rule(unwrap(model[0]).config, tp_size, cp_size).row_multiple

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        local, packed = prepare_packed(
            batch,
            cp_rank=cp_rank,
            cp_size=cp_size,
            per_token_keys=per_token_keys,
            pad_id=pad_id,
            device=dev,
            total_multiple=total_multiple,
        )
        if before_forward is not None:
            before_forward(local, unwrap(chunk))
        output = chunk(local["tokens"], local["position_ids"], None, packed_seq_params=packed)
        head = deferred_head(unwrap(chunk))

        def loss_func(output):
            common = dict(
                group=group,
                vocab_start_index=vocab_start,
                vocab_size=vocab_size,
                temperature=temperature,
                chunk_size=chunk_size,
            )
            if head is not None:  # output = final hidden states: logits one chunk at a time
                logprobs, entropy = chunked_logprobs_from_hidden(
                    output,
                    head.deferred_weight,
                    local["labels"],
                    reduce_grad_hidden=not head.sequence_parallel,
                    **common,
                )
            else:  # output = vocab-parallel logits
                logprobs, entropy = vocab_parallel_logprobs_and_entropy(output, local["labels"], **common)
            loss, metrics = loss_fn(local, logprobs, entropy)
            return loss, torch.ones((), dtype=torch.int), metrics

        return output, loss_func

    seq_len = max(int(b["tokens"].shape[1]) for b in micro_batches)
    n = len(micro_batches)
    if len(model) > 1:
        iterators = [iter(micro_batches) for _ in model]
    else:
        iterators = iter(micro_batches)
    for chunk in model:
        chunk.train(not forward_only)
    aux = None if forward_only else _MoEAux.start(model, n)
    context = torch.no_grad() if forward_only else torch.enable_grad()
    with context:
        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=model if len(model) > 1 else model[0],
            num_microbatches=n,
            seq_length=seq_len,
            micro_batch_size=1,
            forward_only=forward_only,
        )
    if aux is not None:
        aux.finish()
    return list(results or [])


_LAST_AUX = {"value": None}


def last_moe_aux_loss() -> float | None:
    """The load-balancing loss of the latest training :func:`run_micro_batches` of an MoE model
    (without its coefficient): the sum over MoE layers of the mean over the step's micro-batches
    (all data-parallel ranks). None for dense models or without an auxiliary loss. Every rank."""
    return _LAST_AUX["value"]


class _MoEAux:
    """The MoE load-balancing loss of one optimizer step, with the project's normalisation.

    Megatron-Core attaches ``coeff * aux_loss`` of each MoE layer to the router's output; with
    ``calculate_per_token_loss`` it multiplies by the micro-batch's token count and expects
    ``finalize_model_grads`` to divide by the step's tokens, which ours does not (our loss
    functions divide by the global counts themselves). So the routers attach the plain per
    micro-batch loss (their ``calculate_per_token_loss`` is turned off) with the coefficient
    divided by the number of micro-batches of the step over all data-parallel ranks: the gradient
    is that of ``coeff * sum_layers mean_micro-batches aux``, whatever the layout (DP/EP/TP/PP)."""

    def __init__(self, config, routers, coeff, total):
        self.config, self.routers, self.coeff, self.total = config, routers, coeff, total

    @classmethod
    def start(cls, model, n_local: int):
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
        from megatron.core.transformer.moe.router import Router

        from megatron_klear.checkpoint.model_weights import unwrap
        from megatron_klear.platform import comm_device

        config = unwrap(model[0]).config
        coeff = float(getattr(config, "moe_aux_loss_coeff", 0.0) or 0.0)
        if not getattr(config, "num_moe_experts", None) or coeff <= 0:
            _LAST_AUX["value"] = None
            return None
        routers = [m for chunk in model for m in unwrap(chunk).modules() if isinstance(m, Router)]
        total = torch.tensor([float(n_local)], dtype=torch.float64, device=comm_device())
        if dist.is_initialized() and parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        total = float(total.item())
        clear_aux_losses_tracker()
        for r in routers:
            r.calculate_per_token_loss = False
        config.moe_aux_loss_coeff = coeff / total
        return cls(config, routers, coeff, total)

    def finish(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        self.config.moe_aux_loss_coeff = self.coeff
        entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        # per layer, the sum over this rank's micro-batches of aux_loss (the tracker divides out the
        # coefficient it was given); TP/CP ranks hold the same values
        value = entry["values"].double().sum().reshape(1) if entry is not None else torch.zeros(1, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            from megatron_klear.platform import comm_device

            value = value.to(comm_device())
            dist.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
            dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
        _LAST_AUX["value"] = float(value.item()) / self.total


def reduce_metrics(per_micro_batch: list, keys: tuple) -> dict:
    """Sum metrics ``keys`` over micro-batches and over every rank that holds the last pipeline
    stage (data- and context-parallel replicas); every rank gets the result.

    ``keys`` is explicit because ranks of other pipeline stages have no metrics of their own but
    must take part in the same all-reduce. Metrics are sums: divide by the right global count.
    """
    from megatron.core import parallel_state

    from megatron_klear.platform import comm_device

    vec = torch.zeros(len(keys), dtype=torch.float64)
    for m in per_micro_batch:
        for i, k in enumerate(keys):
            vec[i] += float(m[k])
    vec = vec.to(comm_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Only last-stage ranks contributed; the ranks of a TP group hold identical values.
        dist.all_reduce(vec)
        vec /= parallel_state.get_tensor_model_parallel_world_size()
    return dict(zip(keys, vec.cpu().tolist()))
