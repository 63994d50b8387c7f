"""The embedded rollout engine: KV-cache generation with an HF causal LM in plain torch.

The engine for CPU runs, tests and small experiments (SGLang is the production engine). It runs the
transformers model of a Qwen3 / Qwen2 / Llama checkpoint in eval mode without autograd, and decodes
all ``len(prompts) * n`` sequences of a call together with its own loop over the model's forward
(``DynamicCache``, a left-padded attention mask and explicit position ids) instead of
``model.generate``, so that sampling and log-probs are exactly the ones the trainer expects:

- sampling: ``logits / temperature``, then top-k and top-p, then a seeded draw
  (:mod:`megatron_klear.rollout.sampling` spells out the rules);
- returned log-prob of each token: ``log_softmax(logits / temperature)`` over the model's FULL
  vocabulary, BEFORE top-k/top-p -- what :mod:`megatron_klear.training.logprobs` recomputes;
- stop: at an EOS id of the checkpoint (``eos_token_id`` of config.json and generation_config.json,
  an int or a list) or one of ``params.stop_token_ids`` (finish_reason "stop", the stop token is
  kept in the response with its log-prob), else after ``max_new_tokens`` ("length");
- seeds: sample ``j`` of prompt ``i`` uses a generator seeded with
  ``sampling.sample_seed(params.seed, i, j)`` (a random base seed when ``params.seed`` is None), so a
  sample does not depend on what else is in the batch; :meth:`EmbeddedEngine.generate_with_seeds`
  takes the per-sample seeds directly.

Each prompt is prefilled once and its KV cache repeated for its ``n`` samples; rows that finish are
dropped from the batch (and their cache) at the step they finish, so finished sequences cost nothing.
``max_batch_size`` bounds the rows decoded together (whole prompts at a time, at least one).

Limits, acceptable at CPU scale: transformers' ``DynamicCache`` grows by concatenation (one copy of
the cache per step), and the left padding of a batch stays until the batch ends. Prompts plus
``max_new_tokens`` are not checked against ``max_position_embeddings``.

Weights arrive by HF name (:meth:`EmbeddedEngine.update_weights`, every parameter exactly once) or
from an HF checkpoint directory (:meth:`EmbeddedEngine.load_weights_from_dir`).

``python -m megatron_klear.rollout.embedded --model DIR --port P`` serves the engine over a subset of
SGLang's native HTTP API (:mod:`.embedded_http`, which also holds the client
:class:`~megatron_klear.rollout.embedded_http.EmbeddedHTTPEngine`).
"""
from __future__ import annotations

import inspect
import json
import numbers
import os
import secrets
import threading

import torch

from megatron_klear.rollout.base import Completion, RolloutEngine, SamplingParams
from megatron_klear.rollout.sampling import SampleStreams, sample_seed, sample_tokens

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"rollout.embedded: dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")


def _dtype_kwarg() -> str:
    """transformers >= 4.56 takes ``dtype=``; older releases ``torch_dtype=``."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _id_list(value, where: str) -> list:
    if value is None:
        return []
    values = [value] if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    if not isinstance(values, (list, tuple)) or not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values
    ):
        raise ValueError(f"rollout.embedded: {where} must be a token id or a list of token ids, got {value!r}")
    return [int(v) for v in values]


def eos_token_ids_of(model) -> list:
    """EOS ids of an HF model: its config's ``eos_token_id`` plus its generation config's (Qwen
    instruct checkpoints list ``<|im_end|>`` and ``<|endoftext|>`` there)."""
    ids = _id_list(getattr(model.config, "eos_token_id", None), "config.json eos_token_id")
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        ids += _id_list(getattr(gen, "eos_token_id", None), "generation_config.json eos_token_id")
    return sorted(set(ids))


class WeightUpdateError(ValueError):
    """A weight update that does not fit the model; the message names the tensor."""


class EmbeddedEngine(RolloutEngine):
    """In-process :class:`RolloutEngine` over a transformers causal LM (see the module docstring)."""

    def __init__(self, model, *, eos_token_ids=None, max_batch_size: int | None = None, model_path: str | None = None):
        if max_batch_size is not None and int(max_batch_size) < 1:
            raise ValueError(f"rollout.embedded: max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.eos_token_ids = _id_list(eos_token_ids, "eos_token_ids") if eos_token_ids is not None else eos_token_ids_of(model)
        self.max_batch_size = None if max_batch_size is None else int(max_batch_size)
        self.model_path = model_path
        self.weight_version = None
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.pad_token_id = 0  # any valid id: left-padding positions are masked out
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._lock = threading.RLock()
        self._broken = None  # why the weights are inconsistent (a failed update), else None

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, path: str, *, dtype="float32", device="cpu", attn_implementation: str = "sdpa",
                        max_batch_size: int | None = None, config=None) -> "EmbeddedEngine":
        """Load an HF checkpoint directory (config.json + safetensors); ``config`` overrides its
        config.json (e.g. YaRN RoPE scaling for long-context evaluation)."""
        from transformers import AutoModelForCausalLM

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"rollout.embedded: {path}: no config.json (not an HF checkpoint directory)")
        extra = {"config": config} if config is not None else {}
        model = AutoModelForCausalLM.from_pretrained(
            path, **{_dtype_kwarg(): resolve_dtype(dtype)}, attn_implementation=attn_implementation, **extra
        ).to(device)
        return cls(model, max_batch_size=max_batch_size, model_path=os.path.abspath(path))

    @classmethod
    def from_config(cls, config, *, dtype="float32", device="cpu", attn_implementation: str = "sdpa",
                    seed: int = 0, max_batch_size: int | None = None) -> "EmbeddedEngine":
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
        return cls(model.to(device=device, dtype=resolve_dtype(dtype)), max_batch_size=max_batch_size)

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
        seeds = [[sample_seed(base, i, j) for j in range(int(n))] for i in range(count)]
        return self.generate_with_seeds(prompts, params, seeds)

    def generate_with_seeds(self, prompts: list, params: SamplingParams, seeds: list) -> list:
        """Like :meth:`generate` with explicit per-sample seeds: ``seeds[i]`` lists one seed per sample
        of prompt ``i`` (all prompts the same count). ``params.seed`` is not used."""
        params.validate()
        prompts = self._check_prompts(prompts)
        if not isinstance(seeds, (list, tuple)) or len(seeds) != len(prompts):
            raise ValueError(f"rollout.embedded: seeds must hold one list per prompt ({len(prompts)}), got {seeds!r:.200}")
        n = len(seeds[0]) if seeds else 1
        for i, s in enumerate(seeds):
            if not isinstance(s, (list, tuple)) or len(s) != n or n < 1:
                raise ValueError(f"rollout.embedded: seeds[{i}] must list {n} seeds (one per sample), got {s!r:.200}")
        stop = set(self.eos_token_ids) | set(_id_list(params.stop_token_ids, "stop_token_ids"))
        per_chunk = len(prompts) if self.max_batch_size is None else max(1, self.max_batch_size // n)
        with self._lock:
            if self._broken:
                raise RuntimeError(f"rollout.embedded: the weights are inconsistent after a failed update ({self._broken}); "
                                   "call update_weights again with every tensor before generating")
            results = []
            with torch.inference_mode():
                for start in range(0, len(prompts), per_chunk):
                    chunk = slice(start, start + per_chunk)
                    results += self._generate_chunk(prompts[chunk], params, list(seeds[chunk]), stop)
        return results

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

    def _forward(self, ids, mask, positions, cache, logits_to_keep: int = 0) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=logits_to_keep, **{self._cache_kwarg: cache})
        return out.logits[:, -1]

    def _generate_chunk(self, prompts: list, params: SamplingParams, seeds: list, stop: set) -> list:
        dev, n = self.device, len(seeds[0])
        # Prefill each prompt once, left-padded, then repeat its cache for its n samples.
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(1) - 1).clamp_(min=0)
        cache = self._new_cache()
        logits = self._forward(ids, mask, positions, cache, logits_to_keep=1)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits, mask = logits.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
            positions = positions.repeat_interleave(n, 0)
        last_pos = positions[:, -1:]

        rows = len(prompts) * n  # row r is sample r % n of prompt r // n
        streams = SampleStreams([s for per_prompt in seeds for s in per_prompt])
        active = torch.arange(rows)  # which row each batch entry holds
        tokens = [[] for _ in range(rows)]
        logprobs = [[] for _ in range(rows)]
        reasons = [None] * rows
        for step in range(params.max_new_tokens):
            tok, lp = sample_tokens(logits, params.temperature, params.top_k, params.top_p, streams.next(active))
            keep = []
            for b, (r, t, l) in enumerate(zip(active.tolist(), tok.tolist(), lp.tolist())):
                tokens[r].append(t)
                logprobs[r].append(l)
                if t in stop:
                    reasons[r] = "stop"
                elif step + 1 == params.max_new_tokens:
                    reasons[r] = "length"
                else:
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(active):  # drop finished rows from the batch and the cache
                sel = torch.tensor(keep, dtype=torch.long)
                cache.batch_select_indices(sel.to(dev))
                active, tok = active[sel], tok[sel.to(tok.device)]
                mask, last_pos = mask[sel.to(dev)], last_pos[sel.to(dev)]
            mask = torch.cat([mask, mask.new_ones(len(keep), 1)], dim=1)
            last_pos = last_pos + 1
            logits = self._forward(tok.to(dev).unsqueeze(1), mask, last_pos, cache)

        completions = [Completion(token_ids=tokens[r], logprobs=logprobs[r], finish_reason=reasons[r]) for r in range(rows)]
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    # ---------------------------------------------------------------- weights
    def update_weights(self, named_tensors, *, version: int | None = None) -> None:
        """Copy ``(HF name, tensor)`` pairs into the model, converting dtype and device.

        Every parameter must arrive exactly once; with tied embeddings ``lm_head.weight`` may be
        left out (if sent, it must equal ``model.embed_tokens.weight``). An unknown name, a
        duplicate or a shape mismatch raises at once; missing names raise at the end. A failure after
        some tensors were copied leaves the engine refusing to generate until a complete update.
        """
        with self._lock, torch.no_grad():
            params = dict(self.model.named_parameters())
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
                        raise WeightUpdateError(f"rollout.embedded: update_weights: tensor '{name}' has shape {tuple(tensor.shape)}, "
                                         f"the model expects {tuple(params[name].shape)}")
                    params[name].copy_(tensor)
                    copied = True
                missing = sorted(set(params) - seen)
                if missing:
                    raise WeightUpdateError(f"rollout.embedded: update_weights: {len(missing)} parameter(s) not given: "
                                     f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
                if tied_head is not None:
                    embed = self.model.get_input_embeddings().weight
                    if tuple(tied_head.shape) != tuple(embed.shape) or not torch.equal(tied_head.to(embed), embed):
                        raise WeightUpdateError("rollout.embedded: update_weights: 'lm_head.weight' differs from the embedding "
                                         "of this tied-embedding model (tie_word_embeddings=true)")
            except BaseException as e:
                if copied:
                    self._broken = str(e)
                raise
            self._broken = None
            self.weight_version = version

    def load_weights_from_dir(self, path: str, *, version=None) -> None:
        """Load every weight from an HF safetensors checkpoint directory through :meth:`update_weights`
        (same checks); the architecture must match."""
        from megatron_klear.checkpoint.hf_io import HFReader

        reader = HFReader(path)
        try:
            def tensors():
                for _, keys in reader.files():
                    for key in sorted(keys):
                        yield key, reader.get(key)

            try:
                self.update_weights(tensors(), version=version)
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
            "vocab_size": self.vocab_size,
            "eos_token_ids": self.eos_token_ids,
            "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
            "weight_version": self.weight_version,
        }


def __getattr__(name):  # the HTTP face lives in embedded_http (stdlib server + client)
    if name in ("EmbeddedHTTPEngine", "make_server", "main"):
        from megatron_klear.rollout import embedded_http

        return getattr(embedded_http, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    from megatron_klear.rollout.embedded_http import main

    raise SystemExit(main())
