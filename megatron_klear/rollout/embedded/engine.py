"""The embedded rollout engine: KV-cache generation with a transformers causal LM in plain torch,
for CPU runs, tests and small experiments (SGLang is the production engine).

The engine decodes all the sequences of a call together with its own loop over the model's forward
(``DynamicCache``, a left-padded attention mask, explicit position ids) instead of
``model.generate``, so that sampling and log-probs are the ones the trainer expects
(:mod:`.sampling`) and stop ids and context length are SGLang's (:mod:`.rules`).

- Each prompt is prefilled once and its KV cache repeated for its samples; a row that finishes is
  dropped from the batch (and its cache) at that step. ``max_batch_size`` bounds the rows decoded
  together (whole prompts at a time, at least one).
- Prompts of one batch may have different sampling parameters: the forward is shared and each group
  of equal ``(temperature, top_k, top_p)`` is sampled on its own.
- A ``control`` object (the stand-in server's scheduler) may pause decoding between steps (the
  engine lock is released meanwhile, so weights can change; after a ``"retract"`` pause the running
  rows' KV cache is recomputed with the current weights, after ``"in_place"`` it is kept) and abort
  requests (their rows end with finish_reason ``"abort"``, keeping the tokens sampled so far).
- Every Completion carries ``versions``: per token, the engine's ``weight_version`` when the logits it
  was sampled from were computed (the weights that produced it). A request that runs across a weight
  update made while paused holds tokens of both versions: after ``"retract"`` the KV cache and the
  next logits are recomputed with the new weights; after ``"in_place"`` the first token after the
  pause still comes from logits of the old weights (as in SGLang, where a step samples what its own
  forward computed) and the following ones from the new weights over the old KV cache.
- Limits, acceptable at CPU scale: ``DynamicCache`` grows by concatenation (a copy per step), and a
  batch's left padding stays until the batch ends.

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
from megatron_klear.rollout.base import Completion, RolloutEngine, SamplingParams
from megatron_klear.rollout.embedded.requests import PromptRequest, check_prompts, check_requests
from megatron_klear.rollout.embedded.rules import (
    GREEDY_TEMPERATURE_EPS,
    eos_token_ids_of,
    resolve_context_length,
    token_id_list,
)
from megatron_klear.rollout.embedded.sampling import SampleStreams, request_seeds, sample_tokens
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
        max_batch_size: int | None = None,
        model_path: str | None = None,
        context_length: int | None = None,
        tokenizer=None,
        record_routing: bool = False,
    ):
        if max_batch_size is not None and int(max_batch_size) < 1:
            raise ValueError(f"rollout.embedded: max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.eos_token_ids = (
            token_id_list(eos_token_ids, "eos_token_ids")
            if eos_token_ids is not None
            else eos_token_ids_of(model, tokenizer)
        )
        self.max_batch_size = None if max_batch_size is None else int(max_batch_size)
        self.model_path = model_path
        self.context_length = resolve_context_length(model.config, context_length)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.pad_token_id = 0  # any valid id: left-padding positions are masked out
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._lock = threading.RLock()
        self.weights = ModelWeights(self.model, self._lock)  # loading by HF name, release/resume, checksums
        self.decode_steps = 0  # forwards run so far (the HTTP server's /health_generate watches it)
        # MoE models: record the experts each token was routed to (Completion.routed_experts, for
        # rollout.router_replay); the routers' top-k indices, one [tokens, top_k] per MoE layer
        self.record_routing = bool(record_routing)
        self._routed = None  # the current forward's indices while recording
        routers = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]
        self._routers = [m for _, m in routers]
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
        max_batch_size: int | None = None,
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
            max_batch_size=max_batch_size,
            model_path=os.path.abspath(path),
            context_length=context_length,
            tokenizer=tokenizer,
            record_routing=record_routing,
        )

    @classmethod
    def from_config(
        cls,
        config,
        *,
        dtype="float32",
        device="cpu",
        attn_implementation: str = "sdpa",
        seed: int = 0,
        max_batch_size: int | None = None,
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
            max_batch_size=max_batch_size,
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

    def generate_requests(self, requests: list, *, control=None, on_prompt_done=None) -> list:
        """Per :class:`PromptRequest`, its Completions (one per seed), all decoded together (in chunks
        of at most ``max_batch_size`` rows). ``on_prompt_done(i, completions)`` is called as soon as
        every sample of request ``i`` has finished. ``control`` (optional) has ``pause_mode()`` (None,
        "in_place" or "retract"), ``wait_while_paused()`` and ``aborted(key)``, checked between steps."""
        requests = check_requests(requests, self.vocab_size, self.context_length)
        results = [None] * len(requests)

        def done(i, completions):
            results[i] = completions
            if on_prompt_done is not None:
                on_prompt_done(i, completions)

        with self._lock:
            self.weights.check_usable()
            todo = []
            for i, r in enumerate(requests):
                if r.max_new_tokens == 0 or (control is not None and control.aborted(r.key)):
                    reason = "length" if r.max_new_tokens == 0 else "abort"
                    done(i, [Completion(token_ids=[], logprobs=[], finish_reason=reason, versions=[]) for _ in r.seeds])
                else:
                    todo.append(i)
            with torch.inference_mode():
                for chunk in self._chunks(todo, requests):
                    self._generate_chunk([requests[i] for i in chunk], chunk, control, done)
        return results

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

    def _prefill(self, seqs: list):
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
        logits = self._forward(ids, mask, positions, cache, logits_to_keep=1)
        if self.record_routing and self._routers:
            self.last_routing = [self.last_routing[i, width - len(p) :] for i, p in enumerate(seqs)]
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
        self.weights.check_usable()
        return mode

    def _generate_chunk(self, requests: list, indices: list, control, done) -> None:
        dev = self.device
        counts = [len(r.seeds) for r in requests]
        prompt_of = [p for p, c in enumerate(counts) for _ in range(c)]  # row -> request (rows prompt-major)
        logits, mask, last_pos, cache = self._prefill([r.prompt for r in requests])
        logits_version = self.weights.version  # the weights that computed ``logits``
        recording = self.record_routing and bool(self._routers)
        # per row: the experts of each token fed to the model so far ([tokens, MoE layers, top_k] pieces)
        routes = [[self.last_routing[p]] for p in prompt_of] if recording else None
        if any(c != 1 for c in counts):  # repeat each prompt's cache for its samples
            sel = torch.tensor(prompt_of, dtype=torch.long, device=dev)
            cache.batch_select_indices(sel)
            logits, mask, last_pos = logits[sel], mask[sel], last_pos[sel]

        rows = len(prompt_of)
        streams = SampleStreams([s for r in requests for s in r.seeds])
        stops = [
            frozenset() if r.ignore_eos else frozenset(self.eos_token_ids) | frozenset(r.params.stop_token_ids)
            for r in requests
        ]
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
        versions = [[] for _ in range(rows)]  # per token: the weight version that produced it
        reasons = [None] * rows

        def finish(r, reason):
            reasons[r] = reason
            p = prompt_of[r]
            remaining[p] -= 1
            if remaining[p] == 0:
                done(
                    indices[p],
                    [
                        Completion(
                            token_ids=tokens[q],
                            logprobs=logprobs[q],
                            finish_reason=reasons[q],
                            routed_experts=torch.cat(routes[q]).to(torch.int16) if recording else None,
                            versions=versions[q],
                        )
                        for q in range(first_row[p], first_row[p] + counts[p])
                    ],
                )

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
                        [requests[prompt_of[r]].prompt + tokens[r] for r in active]
                    )
                    logits_version = self.weights.version
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
            for b, (r, t, logprob) in enumerate(zip(active, tok, lp)):
                tokens[r].append(t)
                logprobs[r].append(logprob)
                versions[r].append(logits_version)
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
            logits_version = self.weights.version
            if recording:
                for b, r in enumerate(active):
                    routes[r].append(self.last_routing[b])

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
