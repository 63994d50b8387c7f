"""Log-probs without materialising the logits: the output layer hands over its input.

``GPTModel`` ends with ``logits = output_layer(hidden, weight=...)``, a [tokens, vocab/TP] tensor
(32K tokens x 76K columns in bf16 is 5 GB per micro-batch, before any float32 softmax). With
:func:`defer_output_layer` the output layer instead returns its (sequence-gathered) input and
remembers the weight it would have used; the loss then computes logits chunk by chunk with
:func:`megatron_klear.training.logprobs.chunked_logprobs_from_hidden`, recomputing them in
backward (peak: one chunk). Parameter names, checkpoints and the weight's gradient path are
unchanged: the weight's gradient comes back through autograd into Megatron's DDP hooks as usual.
"""

from __future__ import annotations

import types


def _deferred_forward(self, input_, weight=None, runtime_gather_output=None):
    if self.sequence_parallel:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        # all-gather forward, reduce-scatter backward (so the loss must not all-reduce the
        # hidden gradient again)
        input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True)
    # a plain attribute, not nn.Module's setattr: a Parameter assigned that way would be
    # registered as a second parameter (and saved in checkpoints)
    self.__dict__["deferred_weight"] = self.weight if weight is None else weight
    return input_, None


def defer_output_layer(model) -> None:
    """Make ``model`` (a GPTModel with ``post_process``) return final hidden states [b, s, h]."""
    head = model.output_layer
    head.forward = types.MethodType(_deferred_forward, head)
    head.deferred = True


def deferred_head(model):
    """The output layer if it was deferred, else None."""
    head = getattr(model, "output_layer", None)
    return head if getattr(head, "deferred", False) else None
