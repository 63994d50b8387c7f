"""SGLang servers as the rollout engine, over SGLang's native HTTP API.

Attach to running servers (``python -m sglang.launch_server --model-path ... --port ...``), or to
an ``sglang-router`` in front of several, by URL. Prompts go as token ids (no re-tokenisation);
each prompt's ``n`` samples are sent as one batch request; prompts are spread over the URLs.
Weights are updated from disk: the trainer writes an HF checkpoint directory on a filesystem the
servers can read (``rollout.sync_dir``) and each server reloads it (``/update_weights_from_disk``).
Our embedded engine's HTTP server speaks the same subset of the API, which is how this client is
tested on a CPU machine.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from megatron_klear.rollout.base import Completion, RolloutEngine, SamplingParams


class EngineError(RuntimeError):
    pass


def _post(url: str, payload: dict, timeout: float):
    data = json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")[:500]
        raise EngineError(f"POST {url}: HTTP {e.code}: {body}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise EngineError(f"POST {url}: {e} (is the server up? timeout {timeout:.0f}s)") from None


def _get(url: str, timeout: float):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read()
            return json.loads(body) if body.strip() else {}
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise EngineError(f"GET {url}: {e}") from None


def parse_generate_output(item: dict) -> Completion:
    """One element of SGLang's /generate response -> Completion."""
    meta = item.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise EngineError("response has no meta_info.output_token_logprobs (was return_logprob sent?)")
    ids = item.get("output_ids")
    if ids is None:
        ids = [int(p[1]) for p in pairs]
    logprobs = [float(p[0]) for p in pairs]
    if len(ids) != len(logprobs):
        raise EngineError(f"{len(ids)} output ids but {len(logprobs)} log-probs")
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind not in ("stop", "length", "abort"):
        raise EngineError(f"unknown finish_reason {reason!r}")
    if kind == "abort":
        raise EngineError(f"the server aborted a request: {reason}")
    return Completion(token_ids=[int(t) for t in ids], logprobs=logprobs, finish_reason=kind)


class SGLangEngine(RolloutEngine):
    loads_from_disk = True

    def __init__(self, urls: list, *, timeout: float = 3600.0, check: bool = True):
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        if check:
            for u in self.urls:
                _get(f"{u}/health", timeout=30)

    def _request(self, url: str, prompt: list, params: SamplingParams, n: int) -> list:
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "max_new_tokens": params.max_new_tokens,
            "skip_special_tokens": False,
        }
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        out = _post(f"{url}/generate", {"input_ids": [list(prompt)] * n, "sampling_params": sampling,
                                        "return_logprob": True}, self.timeout)
        if isinstance(out, dict):
            out = [out]
        if len(out) != n:
            raise EngineError(f"{url}: asked for {n} samples, got {len(out)}")
        return [parse_generate_output(o) for o in out]

    def generate(self, prompts: list, params: SamplingParams, n: int = 1) -> list:
        params.validate()
        with ThreadPoolExecutor(max_workers=min(len(prompts), 64) or 1) as pool:
            futures = [pool.submit(self._request, self.urls[i % len(self.urls)], p, params, n)
                       for i, p in enumerate(prompts)]
            return [f.result() for f in futures]

    def load_from_disk(self, model_dir: str) -> None:
        for u in self.urls:
            res = _post(f"{u}/update_weights_from_disk", {"model_path": model_dir}, self.timeout)
            if isinstance(res, dict) and res.get("success") is False:
                raise EngineError(f"{u}: update_weights_from_disk failed: {res.get('message')}")

    def update_weights(self, named_tensors, *, version=None) -> None:
        raise EngineError("SGLangEngine loads weights from disk: use weight_sync.export_hf_for_engine + load_from_disk")

    def release_memory(self) -> None:
        for u in self.urls:
            _post(f"{u}/release_memory_occupation", {}, self.timeout)

    def resume_memory(self) -> None:
        for u in self.urls:
            _post(f"{u}/resume_memory_occupation", {}, self.timeout)
