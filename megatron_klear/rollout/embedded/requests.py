"""What the embedded engine decodes: :class:`PromptRequest`, and the checks every prompt and
request passes before any forward (token ids in the vocabulary, sampling parameters, seeds,
SGLang's context-length refusal)."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import torch

from megatron_klear.rollout.base import SamplingParams
from megatron_klear.rollout.embedded.rules import context_length_error, token_id_list


@dataclass
class PromptRequest:
    """One prompt to sample ``len(seeds)`` responses for (:meth:`EmbeddedEngine.generate_requests`).

    ``params``: temperature / top_p / top_k / stop_token_ids (``params.seed`` is not used; the
    samples' seeds are ``seeds``). ``max_new_tokens`` overrides ``params.max_new_tokens`` and may
    be 0 (an empty response, finish_reason "length"). ``ignore_eos`` disables the EOS ids and
    ``stop_token_ids`` (SGLang's rule). ``key``: the caller's handle, passed to
    ``control.aborted(key)``."""

    prompt: list
    params: SamplingParams
    seeds: list
    max_new_tokens: int | None = None
    ignore_eos: bool = False
    key: object = None


def check_prompts(prompts, vocab_size: int) -> list:
    """``prompts`` as lists of int token ids (a tensor row is accepted), each non-empty and inside
    ``[0, vocab_size)``; else a ValueError naming the prompt and position."""
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"rollout.embedded: prompts must be a list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"rollout.embedded: prompts[{i}] must be a non-empty list of token ids, got {p!r:.100}")
        for k, t in enumerate(p):
            if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise ValueError(
                    f"rollout.embedded: prompts[{i}][{k}] = {t!r} is not a token id of the model's "
                    f"vocabulary [0, {vocab_size})"
                )
        out.append([int(t) for t in p])
    return out


def check_requests(requests, vocab_size: int, context_length: int) -> list:
    """Each :class:`PromptRequest` checked and normalised: its prompt (:func:`check_prompts`),
    ``max_new_tokens`` resolved (an int >= 0), its sampling parameters, one int seed per sample,
    ``stop_token_ids`` as a list, and SGLang's refusal of a request over ``context_length``."""
    if not isinstance(requests, (list, tuple)):
        raise ValueError(f"rollout.embedded: requests must be a list of PromptRequest, got {type(requests).__name__}")
    prompts = check_prompts([r.prompt for r in requests], vocab_size)
    out = []
    for i, (r, prompt) in enumerate(zip(requests, prompts)):
        max_new = r.params.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, numbers.Integral) or max_new < 0:
            raise ValueError(
                f"rollout.embedded: requests[{i}]: max_new_tokens must be an integer >= 0, got {max_new!r}"
            )
        dataclasses.replace(r.params, max_new_tokens=max(1, int(max_new))).validate()
        if (
            not isinstance(r.seeds, (list, tuple))
            or not r.seeds
            or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in r.seeds)
        ):
            raise ValueError(
                f"rollout.embedded: requests[{i}]: seeds must list one integer seed per sample (at least "
                f"one), got {r.seeds!r:.200}"
            )
        err = context_length_error(len(prompt), int(max_new), context_length)
        if err is not None:
            raise ValueError(err)
        stop = token_id_list(r.params.stop_token_ids, "stop_token_ids")
        out.append(
            dataclasses.replace(
                r,
                prompt=prompt,
                max_new_tokens=int(max_new),
                seeds=[int(s) for s in r.seeds],
                params=dataclasses.replace(r.params, stop_token_ids=stop),
            )
        )
    return out
