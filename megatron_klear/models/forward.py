"""Forward-only passes through Megatron's pipeline schedules, gathering full logits.

Used by the parity check and by anything that needs full logits on small inputs (tests, debugging);
training and RL log-probs never gather the vocabulary.
"""

from __future__ import annotations

import torch


def forward_logits(model_chunks, tokens: torch.Tensor, vocab_size: int | None = None):
    """Full-vocabulary logits [b, s, vocab] for right-padded ``tokens`` [b, s].

    Runs through ``get_forward_backward_func`` (so any PP works); returns the logits on the last
    pipeline stage's ranks and None elsewhere. ``vocab_size`` trims the TP padding rows.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_klear.platform import device

    b, s = tokens.shape
    tokens = tokens.to(device())
    positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, -1)

    def step(data_iterator, model):
        batch = next(data_iterator)
        out = model(batch["tokens"], batch["position_ids"], None)

        def collect(output):
            return output.sum() * 0.0, {"logits": output.detach()}

        return out, collect

    for chunk in model_chunks:
        chunk.eval()
    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter([{"tokens": tokens, "position_ids": positions}]) for _ in model_chunks]
            if len(model_chunks) > 1
            else iter([{"tokens": tokens, "position_ids": positions}]),
            model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
            num_microbatches=1,
            seq_length=s,
            micro_batch_size=b,
            forward_only=True,
        )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    logits = gather_from_tensor_model_parallel_region(results[0]["logits"])  # [b, s, vocab]
    return logits[..., :vocab_size] if vocab_size else logits
