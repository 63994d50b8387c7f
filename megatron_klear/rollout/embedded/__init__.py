"""The embedded rollout engine: an in-process torch engine over a transformers causal LM that
samples, stops and reports log-probs as SGLang does (for CPU runs, tests and small experiments).

- :mod:`.engine`: :class:`EmbeddedEngine`, the decode loop;
- :mod:`.weights`: loading weights by HF name or from a checkpoint directory, memory release;
- :mod:`.requests`: :class:`PromptRequest` and the checks of prompts and requests;
- :mod:`.rules`: SGLang's rules (stop ids, context length, greedy temperature);
- :mod:`.sampling`: temperature / top-k / top-p sampling and per-sample seeds.

Its SGLang-compatible HTTP server is :mod:`megatron_klear.rollout.sglang_standin`, which imports
the engine (never the other way round).
"""

from megatron_klear.rollout.embedded.engine import EmbeddedEngine, load_tokenizer, resolve_dtype
from megatron_klear.rollout.embedded.requests import PromptRequest
from megatron_klear.rollout.embedded.rules import (
    ADDITIONAL_STOP_TOKEN_TEXTS,
    CONTEXT_LENGTH_KEYS,
    GREEDY_TEMPERATURE_EPS,
    context_length_error,
    derived_context_length,
    eos_token_ids_of,
    resolve_context_length,
)
from megatron_klear.rollout.embedded.weights import WeightUpdateError

__all__ = [
    "ADDITIONAL_STOP_TOKEN_TEXTS",
    "CONTEXT_LENGTH_KEYS",
    "GREEDY_TEMPERATURE_EPS",
    "EmbeddedEngine",
    "PromptRequest",
    "WeightUpdateError",
    "context_length_error",
    "derived_context_length",
    "eos_token_ids_of",
    "load_tokenizer",
    "resolve_context_length",
    "resolve_dtype",
]
