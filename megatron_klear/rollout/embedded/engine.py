"""The embedded rollout engine: KV-cache generation with a transformers causal LM in plain torch,
for CPU runs, tests and small experiments (SGLang is the production engine).

The engine runs its own loop over the model's forward (``DynamicCache``, a left-padded attention
mask, explicit position ids) instead of ``model.generate``, so that sampling and log-probs are the
ones the trainer expects (:mod:`.sampling`) and stop ids and context length are SGLang's
(:mod:`.rules`). The rows are scheduled continuously (:mod:`.batcher`): requests join the running
batch between decode steps and leave it as soon as they finish, within ``max_running_requests``
rows and ``max_total_tokens`` KV tokens (SGLang's ``--max-running-requests`` and
``--max-total-tokens``), retracting when the tokens run short.

- Prompts of one batch may have different sampling parameters: the forward is shared and each group
  of equal ``(temperature, top_k, top_p)`` is sampled on its own.
- Every Completion carries ``versions``: per token, the engine's ``weight_version`` when the logits it
  was sampled from were computed (the weights that produced it). A request that runs across a weight
  update made while paused holds tokens of both versions (the stand-in server's scheduler pauses
  between steps): after a ``retract`` pause the KV cache and the next logits are recomputed with the
  new weights; after ``in_place`` the first token after the pause still comes from logits of the old
  weights (as in SGLang, where a step samples what its own forward computed) and the following ones
  from the new weights over the old KV cache.
- Limit, acceptable at CPU scale: ``DynamicCache`` grows by concatenation (a copy per step), and the
  samples of one prompt hold copies of its KV cache (SGLang's radix cache shares them).

Weight loading (by HF name, from a directory, memory release) is :mod:`.weights`.
"""

from __future__ import annotations

import inspect
import json
import numbers
import os
import re
import secrets
import threading

import torch

from megatron_klear.platform.dtypes import torch_dtype
from megatron_klear.rollout.base import RolloutEngine, SamplingParams, keyed_seed
from megatron_klear.rollout.embedded.batcher import ContinuousBatcher
from megatron_klear.rollout.embedded.requests import PromptRequest, check_prompts, check_requests
from megatron_klear.rollout.embedded.rules import eos_token_ids_of, resolve_context_length, token_id_list
from megatron_klear.rollout.embedded.sampling import request_seeds
from megatron_klear.rollout.embedded.weights import ModelWeights


def resolve_dtype(dtype) -> torch.dtype:
    return torch_dtype(dtype, what="rollout.embedded: dtype")


def _dtype_kwarg() -> str:
    """transformers >= 4.56 takes ``dtype=``; older releases ``torch_dtype=``."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_tokenizer(path: str):
    """The model directory's tokenizer, or None when it has none."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) and not os.path.isfile(
        os.path.join(path, "tokenizer_config.json")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class EmbeddedEngine(RolloutEngine):
    """In-process :class:`RolloutEngine` over a transformers causal LM (see the module docstring).

    ``record_routing`` (MoE models, ``rollout.router_replay``): each Completion carries the experts
    every token was routed to (``routed_experts``); the attribute may also be set later."""

    def __init__(
        self,
        model,
        *,
        eos_token_ids=None,
        max_running_requests: int | None = None,
        max_total_tokens: int | None = None,
        model_path: str | None = None,
        context_length: int | None = None,
        tokenizer=None,
        record_routing: bool = False,
    ):
        for name, value in (("max_running_requests", max_running_requests), ("max_total_tokens", max_total_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
                raise ValueError(f"rollout.embedded: {name} must be an integer >= 1, got {value!r}")
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.eos_token_ids = (
            token_id_list(eos_token_ids, "eos_token_ids")
            if eos_token_ids is not None
            else eos_token_ids_of(model, tokenizer)
        )
        self.max_running_requests = None if max_running_requests is None else int(max_running_requests)
        self.max_total_tokens = None if max_total_tokens is None else int(max_total_tokens)
        self.model_path = model_path
        self.context_length = resolve_context_length(model.config, context_length)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.pad_token_id = 0  # any valid id: left-padding positions are masked out
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.lock = threading.RLock()  # forwards and weight changes
        self.weights = ModelWeights(self.model, self.lock)  # loading by HF name, release/resume, checksums
        self.decode_steps = 0  # forwards run so far (the HTTP server's /health_generate watches it)
        # MoE models: record the experts each token was routed to (Completion.routed_experts, for
        # rollout.router_replay); the routers' top-k indices, one [tokens, top_k] per MoE layer
        self.record_routing = bool(record_routing)
        self._routed = None  # the current forward's indices while recording
        routers = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]
        self._routers = [m for _, m in routers]
        self.has_routers = bool(self._routers)
        # the model's layer index of each router (Completion.routed_experts' second axis, in order)
        self.routed_layers = [int(re.search(r"layers\.(\d+)\.", n).group(1)) for n, _ in routers]
        self.num_layers = int(
            getattr(getattr(model.config, "get_text_config", lambda: model.config)(), "num_hidden_layers", 0) or 0
        )
        for router in self._routers:
            router.register_forward_hook(self._record_route)

    @property
    def weight_version(self):
        """The version of the weights serving now (None: the checkpoint's own)."""
        return self.weights.version

    @weight_version.setter
    def weight_version(self, version) -> None:  # SGLang's /update_weight_version: a new tag, same weights
        self.weights.version = version

    def update_weights(self, named_tensors, *, version: int | None = None) -> None:
        self.weights.update_weights(named_tensors, version=version)

    def load_weights_from_dir(self, path: str, *, version=None) -> None:
        """Every weight from the HF checkpoint directory ``path`` (:meth:`ModelWeights.load_weights_from_dir`),
        which becomes the engine's ``model_path``."""
        self.weights.load_weights_from_dir(path, version=version)
        self.model_path = os.path.abspath(path)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype="float32",
        device="cpu",
        attn_implementation: str = "sdpa",
        max_running_requests: int | None = None,
        max_total_tokens: int | None = None,
        config=None,
        context_length: int | None = None,
        tokenizer="auto",
        record_routing: bool = False,
    ) -> "EmbeddedEngine":
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
        return cls(
            model,
            max_running_requests=max_running_requests,
            max_total_tokens=max_total_tokens,
            model_path=os.path.abspath(path),
            context_length=context_length,
            tokenizer=tokenizer,
            record_routing=record_routing,
        )

    @classmethod
    def from_rollout_config(cls, r, *, model_dir: str, device: str = "cpu", hf_config=None, **_) -> "EmbeddedEngine":
        """The engine of a job's ``rollout`` section (the engine registry's builder): the HF
        directory ``model_dir`` on ``device`` in ``rollout.dtype``, recording the experts of every
        token with ``rollout.router_replay``; ``hf_config`` overrides the directory's config."""
        extra = {"config": hf_config} if hf_config is not None else {}
        return cls.from_pretrained(model_dir, dtype=r.dtype, device=device, record_routing=r.router_replay, **extra)

    @classmethod
    def from_config(
        cls,
        config,
        *,
        dtype="float32",
        device="cpu",
        attn_implementation: str = "sdpa",
        seed: int = 0,
        max_running_requests: int | None = None,
        max_total_tokens: int | None = None,
        context_length: int | None = None,
        record_routing: bool = False,
    ) -> "EmbeddedEngine":
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
        return cls(
            model.to(device=device, dtype=resolve_dtype(dtype)),
            max_running_requests=max_running_requests,
            max_total_tokens=max_total_tokens,
            context_length=context_length,
            record_routing=record_routing,
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---------------------------------------------------------------- generation
    def generate(self, prompts: list, params: SamplingParams, n: int = 1) -> list:
        """Per prompt, ``n`` Completions. Sample ``j`` of prompt ``i`` draws from its own generator seeded
        ``sampling.sample_seed(params.seed, i, j)`` (a random base seed when ``params.seed`` is None), so a
        sample does not depend on the rest of the batch."""
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
            raise ValueError(f"rollout.embedded: n must be an integer >= 1, got {n!r}")
        base = params.seed if params.seed is not None else secrets.randbits(63)
        count = len(prompts) if isinstance(prompts, (list, tuple)) else 0
        return self.generate_with_seeds(prompts, params, request_seeds(base, count, n))

    def generate_keyed(self, prompts: list, params: SamplingParams, n: int, keys: list) -> list:
        """One batch, prompt ``i``'s samples seeded ``sample_seed(keyed_seed(params.seed, keys[i]), 0, j)``:
        each prompt as if it were alone in a call seeded by its key (``RolloutEngine.generate_keyed``)."""
        if params.seed is None:
            return self.generate(prompts, params, n)
        seeds = [request_seeds(keyed_seed(params.seed, key), 1, n)[0] for key in keys]
        return self.generate_with_seeds(prompts, params, seeds)

    def generate_with_seeds(self, prompts: list, params: SamplingParams, seeds: list) -> list:
        """Like :meth:`generate` with explicit per-sample seeds: ``seeds[i]`` lists one seed per sample
        of prompt ``i``. ``params.seed`` is not used."""
        params.validate()
        prompts = check_prompts(prompts, self.vocab_size)
        if not isinstance(seeds, (list, tuple)) or len(seeds) != len(prompts):
            raise ValueError(
                f"rollout.embedded: seeds must hold one list per prompt ({len(prompts)}), got {seeds!r:.200}"
            )
        return self.generate_requests([PromptRequest(p, params, s) for p, s in zip(prompts, seeds)])

    def generate_requests(self, requests: list, *, aborted=None, on_prompt_done=None) -> list:
        """Per :class:`PromptRequest`, its Completions (one per seed), decoded with continuous batching
        (:mod:`.batcher`). ``on_prompt_done(i, completions)`` is called as soon as every sample of
        request ``i`` has finished; ``aborted(key)`` (optional) is asked at each step whether the
        request with that ``key`` was aborted (it then ends with finish_reason ``"abort"``)."""
        requests = self.checked(requests)
        results = [None] * len(requests)

        def done(i, completions):
            results[i] = completions
            if on_prompt_done is not None:
                on_prompt_done(i, completions)

        batcher = self.batcher(aborted=aborted)
        with self.lock:
            self.weights.check_usable()
            for i, r in enumerate(requests):
                batcher.submit(r, lambda completions, i=i: done(i, completions))
            while batcher.busy:
                batcher.step()
        return results

    def checked(self, requests: list) -> list:
        """``requests`` checked and normalised for this engine (:func:`.requests.check_requests`), as
        :meth:`ContinuousBatcher.submit` takes them."""
        return check_requests(requests, self.vocab_size, self.context_length)

    def batcher(self, aborted=None) -> ContinuousBatcher:
        """A :class:`ContinuousBatcher` over this engine with its bounds (the stand-in server holds one)."""
        return ContinuousBatcher(
            self,
            max_running_requests=self.max_running_requests,
            max_total_tokens=self.max_total_tokens,
            aborted=aborted,
        )

    def _new_cache(self):
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            return DynamicCache()

    def _record_route(self, module, inputs, output) -> None:
        if self._routed is not None:
            self._routed.append(output[2].detach())  # transformers' router: (logits, weights, indices)

    def forward(self, ids, mask, positions, cache, logits_to_keep: int = 0) -> torch.Tensor:
        """Logits of the last position; with ``record_routing``, ``self.last_routing`` = the experts
        of every position, ``[batch, positions, MoE layers, top_k]``."""
        self.decode_steps += 1
        self._routed = [] if self.record_routing and self._routers else None
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self._cache_kwarg: cache},
            )
            if self._routed is not None:
                self.last_routing = torch.stack(self._routed, dim=1).reshape(*ids.shape, len(self._routed), -1).cpu()
        finally:
            self._routed = None
        return out.logits[:, -1]

    def prefill(self, seqs: list):
        """Left-padded forward of ``seqs``: ``(logits of the last position, mask, last position, cache)``."""
        dev = self.device
        width = max(len(p) for p in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, p in enumerate(seqs):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(1) - 1).clamp_(min=0)
        cache = self._new_cache()
        logits = self.forward(ids, mask, positions, cache, logits_to_keep=1)
        if self.record_routing and self._routers:
            self.last_routing = [self.last_routing[i, width - len(p) :] for i, p in enumerate(seqs)]
        return logits, mask, positions[:, -1:], cache

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
            "weight_version": self.weights.version,
        }
