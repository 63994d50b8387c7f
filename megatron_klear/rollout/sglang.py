"""The client of SGLang's native HTTP API: SGLang servers (or an ``sglang-router``) as the rollout
engine, and also our embedded engine's server, which speaks the same subset.

Attach by URL to servers started with ``python -m sglang.launch_server --model-path ... --port ...``.
Prompts go as token ids (no re-tokenisation), ``n`` samples each (``sampling_params.n``); with
several URLs the prompts are split into contiguous chunks, one request per server, sent in
parallel. Samples come back in SGLang's order (sample ``j`` of prompt ``i`` at ``i*n+j``). Weights
are updated from disk: the trainer writes an HF checkpoint directory on a filesystem the servers can
read and each server reloads it (``/update_weights_from_disk``). Every request has a timeout, and
every failure names the URL and what the server said.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from megatron_klear.rollout.base import Completion, RolloutEngine, SamplingParams


class EngineError(RuntimeError):
    pass


class SGLangEngine(RolloutEngine):
    """``send_seed``: SGLang honours ``sampling_seed`` only with ``--enable-deterministic-inference``,
    and then one seed for a request's ``n`` samples would make them identical (every group would
    have zero reward spread). So by default no seed is sent to SGLang; our embedded server derives
    one seed per sample from it and its client turns this on."""

    loads_from_disk = True
    send_seed = False

    def __init__(self, urls, *, timeout: float = 60.0, generate_timeout: float = 3600.0, check: bool = False):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("rollout: at least one server URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self.url = self.urls[0]
        self.timeout, self.generate_timeout = float(timeout), float(generate_timeout)
        if check:
            for u in self.urls:
                if not self.health(u):
                    raise EngineError(f"rollout: {u}/health does not answer")

    # -- transport -----------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body=None, timeout: float | None = None, url: str | None = None):
        url = (url or self.url) + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        timeout = self.timeout if timeout is None else timeout
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                payload = json.loads(raw)
                message = payload.get("error", {}).get("message") or payload.get("message") or raw.decode()
            except (json.JSONDecodeError, AttributeError):
                message = raw.decode(errors="replace")
            raise EngineError(f"rollout: {method} {url} failed with HTTP {e.code}: {message}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise EngineError(f"rollout: {method} {url} failed (timeout {timeout:g} s): {reason}") from None
        return json.loads(raw) if raw.strip() else None

    def health(self, url: str | None = None) -> bool:
        try:
            self._request("GET", "/health", timeout=min(self.timeout, 10.0), url=url)
            return True
        except EngineError:
            return False

    def model_info(self) -> dict:
        return self._request("GET", "/get_model_info")

    # -- generation ------------------------------------------------------------------------------------
    def _generate_on(self, url: str, prompts: list, params: SamplingParams, n: int) -> list:
        sp = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
              "max_new_tokens": params.max_new_tokens, "n": int(n), "stop_token_ids": list(params.stop_token_ids),
              "skip_special_tokens": False}
        if params.seed is not None and self.send_seed:
            sp["sampling_seed"] = int(params.seed)
        body = {"input_ids": [list(map(int, p)) for p in prompts], "sampling_params": sp, "return_logprob": True}
        outs = self._request("POST", "/generate", body, timeout=self.generate_timeout, url=url)
        if isinstance(outs, dict):
            outs = [outs]
        if not isinstance(outs, list) or len(outs) != len(prompts) * n:
            got = len(outs) if isinstance(outs, list) else type(outs).__name__
            raise EngineError(f"rollout: {url}/generate answered {got} samples, expected {len(prompts) * n}")
        completions = [parse_completion(o, k) for k, o in enumerate(outs)]
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    def generate(self, prompts: list, params: SamplingParams, n: int = 1) -> list:
        params.validate()
        if not prompts:
            return []
        k = len(self.urls)
        size = -(-len(prompts) // k)
        chunks = [(u, prompts[i * size:(i + 1) * size]) for i, u in enumerate(self.urls) if prompts[i * size:(i + 1) * size]]
        if len(chunks) == 1:
            return self._generate_on(chunks[0][0], chunks[0][1], params, n)
        with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
            parts = list(pool.map(lambda c: self._generate_on(c[0], c[1], params, n), chunks))
        return [row for part in parts for row in part]

    # -- weights ---------------------------------------------------------------------------------------
    def load_from_disk(self, model_dir: str, *, version=None) -> None:
        body = {"model_path": model_dir}
        if version is not None:
            body["weight_version"] = str(version)
        for u in self.urls:
            result = self._request("POST", "/update_weights_from_disk", body, timeout=max(self.timeout, 600.0), url=u)
            if not result or not result.get("success", False):
                raise EngineError(f"rollout: {u}/update_weights_from_disk failed: {(result or {}).get('message')}")

    def update_weights(self, named_tensors, *, version: int | None = None) -> None:
        """Write the tensors to a temporary HF directory and have every server load it. Only for
        servers on this machine; on a cluster write to a shared directory and call
        :meth:`load_from_disk` (what the RL loop does, with ``rollout.sync_dir``)."""
        from megatron_klear.checkpoint.hf_io import HFWriter

        tmp_root = tempfile.mkdtemp(prefix="klear-engine-weights-")
        try:
            writer = HFWriter(os.path.join(tmp_root, "weights"), max_shard_bytes=1 << 30)
            try:
                for name, tensor in named_tensors:
                    writer.add(name, tensor)
                path = writer.finish(config={"note": "weights pushed by SGLangEngine.update_weights"})
            except BaseException:
                writer.abort()
                raise
            self.load_from_disk(path, version=version)
        finally:
            shutil.rmtree(tmp_root, ignore_errors=True)

    def release_memory(self) -> None:
        for u in self.urls:
            self._request("POST", "/release_memory_occupation", {}, url=u)

    def resume_memory(self) -> None:
        for u in self.urls:
            self._request("POST", "/resume_memory_occupation", {}, url=u)


def parse_completion(out: dict, k: int = 0) -> Completion:
    """One element of a /generate response -> Completion (validated)."""
    try:
        meta = out["meta_info"]
        pairs = meta["output_token_logprobs"]
        reason = meta["finish_reason"]
        reason = reason["type"] if isinstance(reason, dict) else reason
    except (KeyError, TypeError) as e:
        raise EngineError(f"rollout: /generate sample {k} lacks {e} (meta_info.output_token_logprobs and "
                          "meta_info.finish_reason are required; was return_logprob sent?)") from None
    ids = [int(t) for t in out.get("output_ids", [p[1] for p in pairs])]
    if [int(p[1]) for p in pairs] != ids:
        raise EngineError(f"rollout: /generate sample {k}: output_token_logprobs do not match output_ids")
    if reason not in ("stop", "length"):
        raise EngineError(f"rollout: /generate sample {k} finished with {reason!r}")
    return Completion(token_ids=ids, logprobs=[float(p[0]) for p in pairs], finish_reason=reason)
