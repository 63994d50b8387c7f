"""SGLang's rules that the embedded engine follows: the stop ids of a checkpoint, its context length
and the refusal of a request that does not fit it, and the temperature below which sampling is
greedy. Each function names the SGLang 0.5.23 code it mirrors."""

from __future__ import annotations

import numbers
import os

# SGLang's get_context_length (srt/utils/hf_transformers/common.py): the first of these config keys.
CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)
# Turn-final markers SGLang treats as stop tokens when the tokenizer has them (attach_additional_stop_token_ids).
ADDITIONAL_STOP_TOKEN_TEXTS = ("<|eom_id|>", "<|content_model_end_sampling|>", "<|ifm|im_end|>")
GREEDY_TEMPERATURE_EPS = 1e-6  # SGLang's _SAMPLING_EPS: a temperature below it is greedy (top-1 at temperature 1)


def token_id_list(value, where: str) -> list:
    """``value`` (None, a token id, or a list / tuple / set of them) as a list of ints; anything else
    is a ValueError naming ``where``."""
    if value is None:
        return []
    values = [value] if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    if not isinstance(values, (list, tuple, set, frozenset)) or not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values
    ):
        raise ValueError(f"rollout.embedded: {where} must be a token id or a list of token ids, got {value!r}")
    return [int(v) for v in values]


def eos_token_ids_of(model, tokenizer=None) -> list:
    """The ids SGLang stops at for this checkpoint (``ModelConfig._get_hf_eos_token_id``): config.json's
    ``eos_token_id``, generation_config.json's ``eos_token_id`` (Qwen instruct checkpoints list
    ``<|im_end|>`` and ``<|endoftext|>`` there), and, with a tokenizer, its ``eos_token_id`` and the
    turn-final markers of :data:`ADDITIONAL_STOP_TOKEN_TEXTS` it has. A request's ``stop_token_ids``
    add to them; ``ignore_eos`` disables both (``Req._check_token_based_finish``)."""
    ids = token_id_list(getattr(model.config, "eos_token_id", None), "config.json eos_token_id")
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        ids += token_id_list(getattr(gen, "eos_token_id", None), "generation_config.json eos_token_id")
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.append(int(tokenizer.eos_token_id))
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        ids += [int(added[t]) for t in ADDITIONAL_STOP_TOKEN_TEXTS if t in added]
    return sorted(set(ids))


def derived_context_length(config) -> int:
    """SGLang's default context length for an HF config (``get_context_length``): the first of
    :data:`CONTEXT_LENGTH_KEYS`, times the RoPE scaling factor unless the scaling names
    ``original_max_position_embeddings`` or is llama3; 2048 without any."""
    rope = getattr(config, "rope_scaling", None) or {}
    factor = 1
    if isinstance(rope, dict) and rope:
        factor = rope.get("factor", 1) or 1
        if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
            factor = 1
    for key in CONTEXT_LENGTH_KEYS:
        value = getattr(config, key, None)
        if value is not None:
            return int(factor * value)
    return 2048


def resolve_context_length(config, context_length: int | None = None) -> int:
    """``context_length`` (SGLang's ``--context-length``) checked against the config's, or the config's:
    not above the derived one unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1`` (SGLang's message)."""
    derived = derived_context_length(config)
    if context_length is None:
        return derived
    if isinstance(context_length, bool) or not isinstance(context_length, numbers.Integral) or context_length < 1:
        raise ValueError(f"rollout.embedded: context_length must be a positive integer, got {context_length!r}")
    if context_length > derived and os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "").lower() not in (
        "1",
        "true",
    ):
        raise ValueError(
            f"User-specified context_length ({context_length}) is greater than the derived context_length "
            f"({derived}). This may lead to incorrect model outputs or CUDA errors. Note that the derived "
            "context_length may differ from max_position_embeddings in the model's config. To allow overriding "
            "this maximum, set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"
        )
    return int(context_length)


def context_length_error(prompt_tokens: int, max_new_tokens, context_length: int) -> str | None:
    """SGLang's refusal (``TokenizerManager._validate_one_request``, same text) of a request that does
    not fit ``context_length``, or None. ``max_new_tokens`` None is not checked (SGLang then generates
    up to the context)."""
    if prompt_tokens >= context_length:
        return (
            f"The input ({prompt_tokens} tokens) is longer than the model's context length ({context_length} tokens)."
        )
    if max_new_tokens is not None and prompt_tokens + max_new_tokens > context_length:
        return (
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {prompt_tokens + max_new_tokens} tokens: {prompt_tokens} tokens from "
            f"the input messages and {max_new_tokens} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit."
        )
    return None
