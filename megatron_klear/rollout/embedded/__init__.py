"""The embedded rollout engine: KV-cache generation with an HF causal LM in plain torch.

The engine for CPU runs, tests and small experiments (SGLang is the production engine). It runs the
transformers model of a Qwen3 / Qwen2 / Llama checkpoint in eval mode without autograd, and decodes
all the sequences of a call together with its own loop over the model's forward (``DynamicCache``,
a left-padded attention mask and explicit position ids) instead of ``model.generate``, so that
sampling and log-probs are exactly the ones the trainer expects:

- sampling: ``logits / temperature``, then top-k and top-p, then a seeded draw
  (:mod:`megatron_klear.rollout.embedded.sampling` spells out the rules); ``temperature`` below 1e-6 is
  greedy, as in SGLang (``top_k=1``, log-probs at temperature 1);
- returned log-prob of each token: ``log_softmax(logits / temperature)`` over the model's FULL
  vocabulary, BEFORE top-k/top-p -- what :mod:`megatron_klear.training.logprobs` recomputes;
- stop: at an EOS id (finish_reason "stop", the stop token is kept in the response with its
  log-prob), else after ``max_new_tokens`` ("length"). The EOS ids are SGLang's
  (``ModelConfig._get_hf_eos_token_id`` and ``Req._check_token_based_finish`` in SGLang 0.5.23):
  config.json's ``eos_token_id`` (an int or a list), generation_config.json's ``eos_token_id``, the
  tokenizer's ``eos_token_id`` and the turn-final markers SGLang adds when the tokenizer has them
  (``<|eom_id|>``...), plus the request's ``stop_token_ids``; ``ignore_eos`` disables all of them
  (stop_token_ids included, as in SGLang);
- context length: ``engine.context_length`` is SGLang's (``get_context_length``: the first of
  ``max_sequence_length``, ``seq_length``, ``max_seq_len``, ``model_max_length``,
  ``max_position_embeddings`` in the config, times the RoPE scaling factor unless the scaling
  names ``original_max_position_embeddings`` or is llama3), or the ``context_length`` given (not
  above the derived one unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1``, as in SGLang). A
  prompt of ``context_length`` tokens or more, or a prompt plus ``max_new_tokens`` over it, is a
  ValueError with SGLang's message (``TokenizerManager._validate_one_request``);
- seeds: sample ``j`` of prompt ``i`` of a :meth:`EmbeddedEngine.generate` call uses a generator
  seeded with ``sampling.sample_seed(params.seed, i, j)`` (a random base seed when ``params.seed`` is
  None), so a sample does not depend on what else is in the batch.
  :meth:`EmbeddedEngine.generate_requests` takes :class:`PromptRequest` s with their per-sample seeds
  directly (the HTTP server uses it to decode many requests together, each with its own parameters).

Each prompt is prefilled once and its KV cache repeated for its samples; rows that finish are
dropped from the batch (and their cache) at the step they finish, so finished sequences cost nothing.
``max_batch_size`` bounds the rows decoded together (whole prompts at a time, at least one).
Prompts of one batch may have different sampling parameters: the forward is shared and each group
of equal ``(temperature, top_k, top_p)`` is sampled on its own.

A ``control`` object (the HTTP server's scheduler) may pause decoding between steps (the engine
lock is released meanwhile, so weights can be updated while paused; after a ``"retract"`` pause the
KV cache of the running sequences is recomputed with the current weights, after ``"in_place"`` it
is kept) and abort requests (their rows end with finish_reason ``"abort"``).

Limits, acceptable at CPU scale: transformers' ``DynamicCache`` grows by concatenation (one copy of
the cache per step), and the left padding of a batch stays until the batch ends.

Weights arrive by HF name (:meth:`EmbeddedEngine.update_weights`, every parameter exactly once), as
a subset by HF name (:meth:`EmbeddedEngine.load_named_weights`, all or nothing: the HTTP server
commits a distributed weight-update session with it) or from an HF checkpoint directory
(:meth:`EmbeddedEngine.load_weights_from_dir`, all or nothing: every tensor is read and checked
before the first one is copied).

``python -m megatron_klear.rollout.embedded --model DIR --port P`` serves the engine over a subset of
SGLang's native HTTP API (:mod:`.embedded_http`, which also holds the client
:class:`~megatron_klear.rollout.embedded_http.EmbeddedHTTPEngine`).
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import numbers
import os
import re
import secrets
import threading
from dataclasses import dataclass

import torch

from megatron_klear.platform.dtypes import torch_dtype
from megatron_klear.rollout.base import Completion, RolloutEngine, SamplingParams
from megatron_klear.rollout.embedded.sampling import SampleStreams, request_seeds, sample_tokens


# SGLang's get_context_length (srt/utils/hf_transformers/common.py): the first of these config keys.
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")
# Turn-final markers SGLang treats as stop tokens when the tokenizer has them (attach_additional_stop_token_ids).
ADDITIONAL_STOP_TOKEN_TEXTS = ("<|eom_id|>", "<|content_model_end_sampling|>", "<|ifm|im_end|>")
GREEDY_TEMPERATURE_EPS = 1e-6  # SGLang's _SAMPLING_EPS: a temperature below it is greedy


def resolve_dtype(dtype) -> torch.dtype:
    return torch_dtype(dtype, what="rollout.embedded: dtype")


def _dtype_kwarg() -> str:
    """transformers >= 4.56 takes ``dtype=``; older releases ``torch_dtype=``."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _id_list(value, where: str) -> list:
    if value is None:
        return []
    values = [value] if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    if not isinstance(values, (list, tuple, set, frozenset)) or not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values
    ):
        raise ValueError(f"rollout.embedded: {where} must be a token id or a list of token ids, got {value!r}")
    return [int(v) for v in values]


def eos_token_ids_of(model, tokenizer=None) -> list:
    """The ids SGLang stops at for this checkpoint: config.json's ``eos_token_id``, generation_config.json's
    ``eos_token_id`` (Qwen instruct checkpoints list ``<|im_end|>`` and ``<|endoftext|>`` there), and,
    with a tokenizer, its ``eos_token_id`` and the turn-final markers of
    :data:`ADDITIONAL_STOP_TOKEN_TEXTS` it has."""
    ids = _id_list(getattr(model.config, "eos_token_id", None), "config.json eos_token_id")
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        ids += _id_list(getattr(gen, "eos_token_id", None), "generation_config.json eos_token_id")
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.append(int(tokenizer.eos_token_id))
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        ids += [int(added[t]) for t in ADDITIONAL_STOP_TOKEN_TEXTS if t in added]
    return sorted(set(ids))


def derived_context_length(config) -> int:
    """SGLang's default context length for an HF config (``get_context_length``)."""
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
    """``context_length`` (SGLang's ``--context-length``) checked against the config's, or the config's."""
    derived = derived_context_length(config)
    if context_length is None:
        return derived
    if isinstance(context_length, bool) or not isinstance(context_length, numbers.Integral) or context_length < 1:
        raise ValueError(f"rollout.embedded: context_length must be a positive integer, got {context_length!r}")
    if context_length > derived and os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "").lower() not in ("1", "true"):
        raise ValueError(
            f"User-specified context_length ({context_length}) is greater than the derived context_length "
            f"({derived}). This may lead to incorrect model outputs or CUDA errors. Note that the derived "
            "context_length may differ from max_position_embeddings in the model's config. To allow overriding "
            "this maximum, set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
    return int(context_length)


def context_length_error(prompt_tokens: int, max_new_tokens, context_length: int) -> str | None:
    """SGLang's refusal (``TokenizerManager._validate_one_request``, same text) of a request that does
    not fit ``context_length``, or None. ``max_new_tokens`` None is not checked (SGLang then generates
    up to the context)."""
    if prompt_tokens >= context_length:
        return (f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                f"({context_length} tokens).")
    if max_new_tokens is not None and prompt_tokens + max_new_tokens > context_length:
        return (f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
                f"You requested a total of {prompt_tokens + max_new_tokens} tokens: {prompt_tokens} tokens from "
                f"the input messages and {max_new_tokens} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit.")
    return None


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


class WeightUpdateError(ValueError):
    """A weight update that does not fit the model; the message names the tensor."""


class EmbeddedEngine(RolloutEngine):
    """In-process :class:`RolloutEngine` over a transformers causal LM (see the module docstring)."""

    def __init__(self, model, *, eos_token_ids=None, max_batch_size: int | None = None, model_path: str | None = None,
                 context_length: int | None = None, tokenizer=None):
        if max_batch_size is not None and int(max_batch_size) < 1:
            raise ValueError(f"rollout.embedded: max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.eos_token_ids = (_id_list(eos_token_ids, "eos_token_ids") if eos_token_ids is not None
                              else eos_token_ids_of(model, tokenizer))
        self.max_batch_size = None if max_batch_size is None else int(max_batch_size)
        self.model_path = model_path
        self.context_length = resolve_context_length(model.config, context_length)
        self.weight_version = None
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.pad_token_id = 0  # any valid id: left-padding positions are masked out
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._lock = threading.RLock()
        self._broken = None  # why the weights are inconsistent (a failed update), else None
        self._released = None  # {parameter: shape} while the weights are released (release_weights)
        self.decode_steps = 0  # forwards run so far (the HTTP server's /health_generate watches it)
        # MoE models: record the experts each token was routed to (Completion.routed_experts, for
        # rollout.router_replay); the routers' top-k indices, one [tokens, top_k] per MoE layer
        self.record_routing = False
        self._routed = None  # the current forward's indices while recording
        routers = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]
        self._routers = [m for _, m in routers]
        # the model's layer index of each router (Completion.routed_experts' second axis, in order)
        self.routed_layers = [int(re.search(r"layers\.(\d+)\.", n).group(1)) for n, _ in routers]
        self.num_layers = int(getattr(getattr(model.config, "get_text_config", lambda: model.config)(),
                                      "num_hidden_layers", 0) or 0)
        for router in self._routers:
            router.register_forward_hook(self._record_route)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, path: str, *, dtype="float32", device="cpu", attn_implementation: str = "sdpa",
                        max_batch_size: int | None = None, config=None, context_length: int | None = None,
                        tokenizer="auto") -> "EmbeddedEngine":
        """Load an HF checkpoint directory (config.json + safetensors); ``config`` overrides its
        config.json (e.g. YaRN RoPE scaling for long-context evaluation). ``tokenizer``: "auto" loads
        the directory's tokenizer when it has one (its EOS id is an EOS, as in SGLang), None skips it."""
        from transformers import AutoModelForCausalLM

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"rollout.embedded: {path}: no config.json (not an HF checkpoint directory)")
        extra = {"config": config} if config is not None else {}
        model = AutoModelForCausalLM.from_pretrained(
            path, **{_dtype_kwarg(): resolve_dtype(dtype)}, attn_implementation=attn_implementation, **extra
        ).to(device)
        if isinstance(tokenizer, str) and tokenizer == "auto":
            tokenizer = load_tokenizer(path)
        return cls(model, max_batch_size=max_batch_size, model_path=os.path.abspath(path),
                   context_length=context_length, tokenizer=tokenizer)

    @classmethod
    def from_config(cls, config, *, dtype="float32", device="cpu", attn_implementation: str = "sdpa",
                    seed: int = 0, max_batch_size: int | None = None, context_length: int | None = None) -> "EmbeddedEngine":
        """A randomly initialised model from an HF config (a dict, a config.json path or a checkpoint
        directory); load real weights with :meth:`update_weights` before generating anything useful."""
        from transformers import AutoConfig, AutoModelForCausalLM

        if isinstance(config, str):
            path = os.path.join(config, "config.json") if os.path.isdir(config) else config
            with open(path, encoding="utf-8") as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"rollout.embedded: {path}:{e.lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(config, dict) or "model_type" not in config:
            raise ValueError("rollout.embedded: from_config needs an HF config dict with a 'model_type' key")
        hf_config = AutoConfig.for_model(**config)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation)
        return cls(model.to(device=device, dtype=resolve_dtype(dtype)), max_batch_size=max_batch_size,
                   context_length=context_length)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---------------------------------------------------------------- generation
    def generate(self, prompts: list, params: SamplingParams, n: int = 1) -> list:
        """Per prompt, ``n`` Completions; see the module docstring for sampling, log-probs and seeds."""
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
            raise ValueError(f"rollout.embedded: n must be an integer >= 1, got {n!r}")
        base = params.seed if params.seed is not None else secrets.randbits(63)
        count = len(prompts) if isinstance(prompts, (list, tuple)) else 0
        return self.generate_with_seeds(prompts, params, request_seeds(base, count, n))

    def generate_with_seeds(self, prompts: list, params: SamplingParams, seeds: list) -> list:
        """Like :meth:`generate` with explicit per-sample seeds: ``seeds[i]`` lists one seed per sample
        of prompt ``i``. ``params.seed`` is not used."""
        params.validate()
        prompts = self._check_prompts(prompts)
        if not isinstance(seeds, (list, tuple)) or len(seeds) != len(prompts):
            raise ValueError(f"rollout.embedded: seeds must hold one list per prompt ({len(prompts)}), got {seeds!r:.200}")
        return self.generate_requests([PromptRequest(p, params, s) for p, s in zip(prompts, seeds)])

    def generate_requests(self, requests: list, *, control=None, on_prompt_done=None) -> list:
        """Per :class:`PromptRequest`, its Completions (one per seed), all decoded together (in chunks
        of at most ``max_batch_size`` rows). ``on_prompt_done(i, completions)`` is called as soon as
        every sample of request ``i`` has finished. ``control`` (optional) has ``pause_mode()`` (None,
        "in_place" or "retract"), ``wait_while_paused()`` and ``aborted(key)``, checked between steps."""
        requests = self._check_requests(requests)
        results = [None] * len(requests)

        def done(i, completions):
            results[i] = completions
            if on_prompt_done is not None:
                on_prompt_done(i, completions)

        with self._lock:
            self._check_not_broken()
            todo = []
            for i, r in enumerate(requests):
                if r.max_new_tokens == 0 or (control is not None and control.aborted(r.key)):
                    reason = "length" if r.max_new_tokens == 0 else "abort"
                    done(i, [Completion(token_ids=[], logprobs=[], finish_reason=reason) for _ in r.seeds])
                else:
                    todo.append(i)
            with torch.inference_mode():
                for chunk in self._chunks(todo, requests):
                    self._generate_chunk([requests[i] for i in chunk], chunk, control, done)
        return results

    def _check_not_broken(self) -> None:
        if self._released is not None:
            raise RuntimeError("rollout.embedded: the weights are released (release_memory_occupation); resume them "
                               "and load weights before generating")
        if self._broken:
            raise RuntimeError(f"rollout.embedded: the weights are inconsistent {self._broken}; "
                               "call update_weights again with every tensor before generating")

    def _chunks(self, todo: list, requests: list) -> list:
        if self.max_batch_size is None:
            return [todo] if todo else []
        chunks, cur, rows = [], [], 0
        for i in todo:
            n = len(requests[i].seeds)
            if cur and rows + n > self.max_batch_size:
                chunks.append(cur)
                cur, rows = [], 0
            cur.append(i)
            rows += n
        return chunks + ([cur] if cur else [])

    def _check_requests(self, requests) -> list:
        if not isinstance(requests, (list, tuple)):
            raise ValueError(f"rollout.embedded: requests must be a list of PromptRequest, got {type(requests).__name__}")
        prompts = self._check_prompts([r.prompt for r in requests])
        out = []
        for i, (r, prompt) in enumerate(zip(requests, prompts)):
            max_new = r.params.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens
            if isinstance(max_new, bool) or not isinstance(max_new, numbers.Integral) or max_new < 0:
                raise ValueError(f"rollout.embedded: requests[{i}]: max_new_tokens must be an integer >= 0, got {max_new!r}")
            dataclasses.replace(r.params, max_new_tokens=max(1, int(max_new))).validate()
            if not isinstance(r.seeds, (list, tuple)) or not r.seeds or not all(
                    isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in r.seeds):
                raise ValueError(f"rollout.embedded: requests[{i}]: seeds must list one integer seed per sample (at least "
                                 f"one), got {r.seeds!r:.200}")
            err = context_length_error(len(prompt), int(max_new), self.context_length)
            if err is not None:
                raise ValueError(err)
            stop = _id_list(r.params.stop_token_ids, "stop_token_ids")
            out.append(dataclasses.replace(r, prompt=prompt, max_new_tokens=int(max_new), seeds=[int(s) for s in r.seeds],
                                           params=dataclasses.replace(r.params, stop_token_ids=stop)))
        return out

    def _check_prompts(self, prompts) -> list:
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"rollout.embedded: prompts must be a list of token-id lists, got {type(prompts).__name__}")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, torch.Tensor):
                p = p.tolist()
            if not isinstance(p, (list, tuple)) or not p:
                raise ValueError(f"rollout.embedded: prompts[{i}] must be a non-empty list of token ids, got {p!r:.100}")
            for k, t in enumerate(p):
                if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                    raise ValueError(f"rollout.embedded: prompts[{i}][{k}] = {t!r} is not a token id of the model's "
                                     f"vocabulary [0, {self.vocab_size})")
            out.append([int(t) for t in p])
        return out

    def _new_cache(self):
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            return DynamicCache()

    def _record_route(self, module, inputs, output) -> None:
        if self._routed is not None:
            self._routed.append(output[2].detach())  # transformers' router: (logits, weights, indices)

    def _forward(self, ids, mask, positions, cache, logits_to_keep: int = 0) -> torch.Tensor:
        """Logits of the last position; with ``record_routing``, ``self.last_routing`` = the experts
        of every position, ``[batch, positions, MoE layers, top_k]``."""
        self.decode_steps += 1
        self._routed = [] if self.record_routing and self._routers else None
        try:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             logits_to_keep=logits_to_keep, **{self._cache_kwarg: cache})
            if self._routed is not None:
                self.last_routing = torch.stack(self._routed, dim=1).reshape(*ids.shape, len(self._routed), -1).cpu()
        finally:
            self._routed = None
        return out.logits[:, -1]

    def _prefill(self, seqs: list):
        """Left-padded forward of ``seqs``: ``(logits of the last position, mask, last position, cache)``."""
        dev = self.device
        width = max(len(p) for p in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, p in enumerate(seqs):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(1) - 1).clamp_(min=0)
        cache = self._new_cache()
        logits = self._forward(ids, mask, positions, cache, logits_to_keep=1)
        if self.record_routing and self._routers:
            self.last_routing = [self.last_routing[i, width - len(p):] for i, p in enumerate(seqs)]
        return logits, mask, positions[:, -1:], cache

    def _checkpoint(self, control):
        """Between steps: block while the control is paused (with the engine lock released, so that
        weights can change meanwhile) until it continues or has aborts to serve; returns the pause
        mode waited in, or None."""
        mode = control.pause_mode()
        if mode is None:
            return None
        self._lock.release()
        try:
            control.wait_while_paused()
        finally:
            self._lock.acquire()
        self._check_not_broken()
        return mode

    def _generate_chunk(self, requests: list, indices: list, control, done) -> None:
        dev = self.device
        counts = [len(r.seeds) for r in requests]
        prompt_of = [p for p, c in enumerate(counts) for _ in range(c)]  # row -> request (rows prompt-major)
        logits, mask, last_pos, cache = self._prefill([r.prompt for r in requests])
        recording = self.record_routing and bool(self._routers)
        # per row: the experts of each token fed to the model so far ([tokens, MoE layers, top_k] pieces)
        routes = [[self.last_routing[p]] for p in prompt_of] if recording else None
        if any(c != 1 for c in counts):  # repeat each prompt's cache for its samples
            sel = torch.tensor(prompt_of, dtype=torch.long, device=dev)
            cache.batch_select_indices(sel)
            logits, mask, last_pos = logits[sel], mask[sel], last_pos[sel]

        rows = len(prompt_of)
        streams = SampleStreams([s for r in requests for s in r.seeds])
        stops = [frozenset() if r.ignore_eos else frozenset(self.eos_token_ids) | frozenset(r.params.stop_token_ids)
                 for r in requests]
        sampling = []
        for r in requests:
            t, k = r.params.temperature, r.params.top_k
            if t < GREEDY_TEMPERATURE_EPS:  # SGLang's greedy: top-1 at temperature 1
                t, k = 1.0, 1
            sampling.append((float(t), int(k), float(r.params.top_p)))
        first_row = [0] * len(requests)
        for p in range(1, len(requests)):
            first_row[p] = first_row[p - 1] + counts[p - 1]
        remaining = list(counts)
        active = list(range(rows))  # which row each batch entry holds
        tokens = [[] for _ in range(rows)]
        logprobs = [[] for _ in range(rows)]
        reasons = [None] * rows

        def finish(r, reason):
            reasons[r] = reason
            p = prompt_of[r]
            remaining[p] -= 1
            if remaining[p] == 0:
                done(indices[p], [Completion(token_ids=tokens[q], logprobs=logprobs[q], finish_reason=reasons[q],
                                             routed_experts=torch.cat(routes[q]).to(torch.int16) if recording else None)
                                  for q in range(first_row[p], first_row[p] + counts[p])])

        def keep_only(keep):  # drop finished rows from the batch and the cache
            nonlocal active, mask, last_pos, logits
            if len(keep) == len(active):
                return
            sel = torch.tensor(keep, dtype=torch.long, device=dev)
            cache.batch_select_indices(sel)
            active = [active[b] for b in keep]
            mask, last_pos, logits = mask[sel], last_pos[sel], logits[sel]

        while active:
            if control is not None:
                retract = False
                while True:  # held while paused; aborts are served meanwhile
                    retract |= self._checkpoint(control) == "retract"
                    keep = []
                    for b, r in enumerate(active):
                        if control.aborted(requests[prompt_of[r]].key):
                            finish(r, "abort")
                        else:
                            keep.append(b)
                    if keep:
                        keep_only(keep)
                    else:
                        active = []
                    if not active or control.pause_mode() is None:
                        break
                if not active:
                    break
                if retract:  # recompute the KV cache of the running rows with the current weights
                    logits, mask, last_pos, cache = self._prefill(
                        [requests[prompt_of[r]].prompt + tokens[r] for r in active])
                    if recording:  # routed again, with the current weights
                        for b, r in enumerate(active):
                            routes[r] = [self.last_routing[b]]
            uniforms = streams.next(torch.tensor(active, dtype=torch.long))
            groups = {}
            for b, r in enumerate(active):
                groups.setdefault(sampling[prompt_of[r]], []).append(b)
            tok, lp = [0] * len(active), [0.0] * len(active)
            for (t, k, p), members in groups.items():
                idx = torch.tensor(members, dtype=torch.long)
                g_tok, g_lp = sample_tokens(logits[idx.to(logits.device)], t, k, p, uniforms[idx])
                for b, a, c in zip(members, g_tok.tolist(), g_lp.tolist()):
                    tok[b], lp[b] = a, c
            keep = []
            for b, (r, t, l) in enumerate(zip(active, tok, lp)):
                tokens[r].append(t)
                logprobs[r].append(l)
                if t in stops[prompt_of[r]]:
                    finish(r, "stop")
                elif len(tokens[r]) >= requests[prompt_of[r]].max_new_tokens:
                    finish(r, "length")
                else:
                    keep.append(b)
            if not keep:
                break
            keep_only(keep)
            fed = torch.tensor([tok[b] for b in keep], dtype=torch.long, device=dev).unsqueeze(1)
            mask = torch.cat([mask, mask.new_ones(len(keep), 1)], dim=1)
            last_pos = last_pos + 1
            logits = self._forward(fed, mask, last_pos, cache)
            if recording:
                for b, r in enumerate(active):
                    routes[r].append(self.last_routing[b])

    # ---------------------------------------------------------------- weights
    def update_weights(self, named_tensors, *, version: int | None = None) -> None:
        """Copy ``(HF name, tensor)`` pairs into the model, converting dtype and device.

        Every parameter must arrive exactly once; with tied embeddings ``lm_head.weight`` may be
        left out (if sent, it must equal ``model.embed_tokens.weight``). A list, tuple or dict is
        checked whole before the first copy, so a bad one leaves the weights untouched. A stream (a
        generator) is copied as it comes: an unknown name, a duplicate or a shape mismatch raises at
        once, missing names at the end, and a failure after some tensors were copied leaves the
        engine refusing to generate until a complete update.
        """
        if isinstance(named_tensors, dict):
            named_tensors = list(named_tensors.items())
        with self._lock, torch.no_grad():
            if isinstance(named_tensors, (list, tuple)):
                self._apply_weights(named_tensors, copy=False)  # all checks, nothing copied
            self._apply_weights(named_tensors, copy=True)
            self.weight_version = version

    def load_named_weights(self, named_tensors, *, version=None, adopt: bool = False) -> list:
        """Copy some or all parameters, all or nothing: every ``(HF name, tensor)`` is checked (known
        name, given once, shape; a tied ``lm_head.weight`` must equal the embedding) before the first
        copy, so a failure leaves the weights and the version as they were. Parameters not given keep
        their values (SGLang's ``load_weights`` semantics; the HTTP server commits a weight-update
        session with it). ``adopt``: the tensors become the parameters' storage where their dtype,
        device and layout allow (no copy; the caller hands them over and must not touch them).
        Returns the storages replaced by adoption (no longer used by the model: reusable buffers)."""
        named_tensors = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
        replaced = []
        with self._lock, torch.no_grad():
            self._apply_weights(named_tensors, copy=False, require_all=False)
            if not adopt:
                self._apply_weights(named_tensors, copy=True, require_all=False)
            else:
                params = dict(self.model.named_parameters())  # a tied lm_head is the embedding: absent
                slices = self._weight_targets()
                for name, tensor in named_tensors:
                    param = params.get(name)
                    if param is None:
                        if name in slices:  # an expert's slice of a fused parameter: copied into
                            slices[name].copy_(tensor)
                        continue
                    tensor = tensor.to(device=param.device, dtype=param.dtype)
                    if tensor.is_contiguous() and tensor.shape == param.shape:
                        replaced.append(param.data)
                        param.data = tensor
                    else:
                        param.copy_(tensor)
                if not set(slices) - {n for n, _ in named_tensors}:  # every weight loaded
                    self._broken = None
            self.weight_version = version
        return replaced

    # ---------------------------------------------------------------- memory (colocated servers)
    def release_weights(self) -> int:
        """Free every parameter's storage (SGLang's ``release_memory_occupation`` of ``weights`` under
        ``--enable-memory-saver``); returns the bytes freed. Buffers (rotary frequencies) stay, as
        SGLang stashes and restores a model's static state. Generating or loading is refused until
        :meth:`resume_weights`."""
        with self._lock:
            if self._released is not None:
                return 0
            released, freed = {}, 0
            for p in self.model.parameters():  # a tied lm_head is the embedding: once
                released[p] = tuple(p.shape)
                freed += p.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._released = released
            return freed

    def resume_weights(self) -> None:
        """Give the parameters their storage back. Their content is lost, as with SGLang's memory
        saver: floats are NaN (integers 0) and the engine refuses to generate until an update loads
        every weight (the colocated loop reloads them from disk next)."""
        with self._lock:
            released, self._released = self._released, None
            if released is None:
                return
            for p, shape in released.items():
                fill = float("nan") if p.dtype.is_floating_point else 0
                p.data = torch.full(shape, fill, dtype=p.dtype, device=p.device)
            self._broken = "since their memory was released and resumed (their content is lost)"

    @property
    def weights_released(self) -> bool:
        return self._released is not None

    def check_named_weights(self, named_tensors) -> None:
        """The checks of :meth:`load_named_weights` without copying (raises :class:`WeightUpdateError`)."""
        with torch.no_grad():
            self._apply_weights(list(named_tensors), copy=False, require_all=False)

    def checksums(self, skip=()) -> dict:
        """{parameter name: sha256 of its bytes (16 hex digits)} (SGLang's ``/weights_checker``)."""
        import hashlib

        out = {}
        with self._lock, torch.no_grad():
            for name, p in self.model.named_parameters():
                if any(s in name for s in skip):
                    continue
                data = p.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
                out[name] = hashlib.sha256(data).hexdigest()[:16]
        return out

    def _weight_targets(self) -> dict:
        """{HF checkpoint name: the parameter, or the slice of one, that it loads into}. transformers
        keeps a MoE layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H] with gate rows
        then up rows, ``mlp.experts.down_proj`` [E, H, I]); checkpoints, SGLang and the trainer's
        weight sync name them one tensor per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``).
        Call under ``torch.no_grad()`` (the slices are views that are copied into)."""
        out = {}
        for name, p in self.model.named_parameters():
            prefix, _, kind = name.rpartition(".experts.")
            if prefix and kind in ("gate_up_proj", "down_proj") and p.dim() == 3:
                half = p.shape[1] // 2
                for e in range(p.shape[0]):
                    base = f"{prefix}.experts.{e}."
                    if kind == "gate_up_proj":
                        out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = p[e, :half], p[e, half:]
                    else:
                        out[base + "down_proj.weight"] = p[e]
            else:
                out[name] = p
        return out

    def _apply_weights(self, named_tensors, *, copy: bool, require_all: bool = True) -> None:
        if self._released is not None:
            raise WeightUpdateError("rollout.embedded: the weights are released (release_memory_occupation): "
                                    "resume them (resume_memory_occupation) before loading new ones")
        params = self._weight_targets()
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False)) and "lm_head.weight" not in params
        seen, tied_head, copied = set(), None, False
        try:
            for name, tensor in named_tensors:
                if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"rollout.embedded: update_weights expects (str, torch.Tensor) pairs, got "
                                    f"({type(name).__name__}, {type(tensor).__name__})")
                if name in seen:
                    raise WeightUpdateError(f"rollout.embedded: update_weights: tensor '{name}' given twice")
                seen.add(name)
                if tied and name == "lm_head.weight":
                    tied_head = tensor
                    continue
                if name not in params:
                    raise WeightUpdateError(f"rollout.embedded: update_weights: unknown tensor '{name}' (the model has "
                                            f"{len(params)} parameters, e.g. '{next(iter(params))}')")
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise WeightUpdateError(f"rollout.embedded: update_weights: tensor '{name}' has shape "
                                            f"{tuple(tensor.shape)}, the model expects {tuple(params[name].shape)}")
                if copy:
                    params[name].copy_(tensor)
                    copied = True
            missing = sorted(set(params) - seen) if require_all else []
            if missing:
                raise WeightUpdateError(f"rollout.embedded: update_weights: {len(missing)} parameter(s) not given: "
                                        f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
            if tied_head is not None:
                embed = self.model.get_input_embeddings().weight
                # after copying, the model's embedding is the new one; before, compare with the one given
                new_embed = embed if copy else next((t for n, t in named_tensors if n == "model.embed_tokens.weight"), embed)
                if tuple(tied_head.shape) != tuple(embed.shape) or not torch.equal(tied_head.to(embed), new_embed.to(embed)):
                    raise WeightUpdateError("rollout.embedded: update_weights: 'lm_head.weight' differs from the embedding "
                                            "of this tied-embedding model (tie_word_embeddings=true)")
        except BaseException as e:
            if copied:
                self._broken = f"after a failed update ({e})"
            raise
        if copy and not set(params) - seen:  # a complete update repairs a broken state; a partial one does not
            self._broken = None

    def load_weights_from_dir(self, path: str, *, version=None) -> None:
        """Load every weight from an HF safetensors checkpoint directory through :meth:`update_weights`
        (same checks; the architecture must match). All or nothing: every tensor is read and checked
        before the first copy, so a failure leaves the current weights (and version) in place."""
        from megatron_klear.checkpoint.hf_io import HFReader

        reader = HFReader(path)
        try:
            tensors = [(key, reader.get(key)) for _, keys in reader.files() for key in sorted(keys)]
            try:
                self.update_weights(tensors, version=version)
            except WeightUpdateError as e:
                raise WeightUpdateError(f"{e} [checkpoint {path}]") from None
        finally:
            reader.close()
        self.model_path = os.path.abspath(path)

    def model_info(self) -> dict:
        cfg = self.model.config
        return {
            "model_path": self.model_path,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
            "vocab_size": self.vocab_size,
            "eos_token_ids": self.eos_token_ids,
            "context_length": self.context_length,
            "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
            "weight_version": self.weight_version,
        }


def load_tokenizer(path: str):
    """The model directory's tokenizer, or None when it has none."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) and not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def __getattr__(name):  # the HTTP face lives in embedded_http (stdlib server + client)
    if name in ("EmbeddedHTTPEngine", "make_server", "main"):
        from megatron_klear.rollout import embedded_http

        return getattr(embedded_http, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

