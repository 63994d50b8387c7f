"""The client of SGLang's native HTTP API: SGLang servers, directly or behind ``sglang-router``, as
the rollout engine (our embedded engine's server speaks the same API).

Generation (``/generate`` with token ids, ``return_logprob``) goes to ``urls``: one router, or the
servers themselves. It is sent as many concurrent requests, at most ``max_concurrent_requests`` in
flight, one per prompt (``n`` samples each, ``request_granularity="prompt"``) or one per sample
(``"sample"``), so that a router can spread them over its workers and no request carries a whole
batch towards a timeout. With several URLs each request goes to the one with the fewest requests
in flight. Results are handed back as each prompt completes (:meth:`SGLangEngine.generate_iter`),
so grading overlaps generation.

Failures: a request that fails in transport, answers 5xx or is aborted by the server is retried up
to ``max_retries`` times (on another URL when there are several), then the call fails naming the
URL and the server's message; a 4xx (a bad request: too long for the context, an unknown field) is
not retried. While requests run, every worker's ``/health`` is probed each
``health_check_interval`` seconds; a worker that misses ``health_failure_threshold`` probes in a
row (dead, or frozen: a stopped process still accepts TCP connections but never answers) fails the
call naming it, instead of waiting out the generation timeout.

Control calls (weights, pause/continue, versions, context length) go to every *worker*, never to
the router (``sglang-router`` has no weight-update routes): workers are listed explicitly or
discovered from the router (``GET /workers``). A weight update from disk runs on all workers in
parallel as SGLang's sequence ``/pause_generation`` -> ``/update_weights_from_disk`` (with
``weight_version``) -> ``/continue_generation``, then checks that each worker reports the new
version (``/model_info``). The calls of SGLang's distributed weight update
(``/init_weights_update_group``, ``/begin_weight_update``, ``/update_weights_from_distributed``,
``/end_weight_update``, ``/update_weight_version``, ``/destroy_weights_update_group``) are here
too, each on every worker in parallel; :class:`megatron_klear.rollout.weight_sync.DistributedWeightSync`
drives them while the trainer broadcasts the tensors. :meth:`SGLangEngine.probe` asks one worker
for a greedy continuation with log-probs (the weight check of :mod:`megatron_klear.rl.verify`).

API checked against SGLang 0.5.23 (``sglang/srt/entrypoints/http_server.py``,
``sglang/srt/managers/io_struct.py``, ``sglang/api/v1/api_types.py``) and the real sglang-router
0.3.2 (which answers ``/health`` with the text ``OK`` and has no weight routes); the tests validate
every ``/generate`` body against that contract file and every control body against the request
structs of ``io_struct.py``.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time

import httpx

from megatron_klear.rollout.base import Completion, RolloutEngine, SamplingParams


#: SGLang's memory types (``GPU_MEMORY_ALL_TYPES``) for /release_memory_occupation and /resume_memory_occupation
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class EngineError(RuntimeError):
    pass


GRANULARITIES = ("prompt", "sample")


def _message_of(resp: httpx.Response) -> str:
    """What a server said in an error response (SGLang: ``{"error": {"message"}}`` or ``{"message"}``)."""
    text = resp.text
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:500] or "(empty body)"
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if payload.get("message"):
            return str(payload["message"])
        if payload.get("detail"):
            return str(payload["detail"])
    return text.strip()[:500]


class _Retryable(Exception):
    """A failure worth another attempt (transport, 5xx, abort)."""

    def __init__(self, url: str, message: str):
        super().__init__(message)
        self.url, self.message = url, message


class SGLangEngine(RolloutEngine):
    """See the module docstring.

    ``timeout``: seconds for control calls (health, info, pause/continue); ``generate_timeout``: for
    one ``/generate`` request; ``weight_update_timeout``: for one worker's weight load.
    ``send_seed``: SGLang honours ``sampling_seed`` only with ``--enable-deterministic-inference``,
    and then one seed for a request's ``n`` samples makes them identical, so no seed is sent by
    default; with ``send_seed`` each request carries its own seed derived from ``params.seed``
    (our embedded server derives one per sample from it: runs are reproducible).
    """

    loads_from_disk = True
    send_seed = False
    # rollout.router_replay (MoE): ask each server for the experts every token was routed to
    # (``return_routed_experts``); the model's MoE layer indices and top_k to read them
    record_routing = False
    routing_layers: list = []
    routing_topk: int = 0

    def __init__(self, urls, *, workers=None, timeout: float = 60.0, generate_timeout: float = 3600.0,
                 weight_update_timeout: float = 1800.0, max_concurrent_requests: int = 256,
                 request_granularity: str = "prompt", max_retries: int = 2, retry_backoff: float = 1.0,
                 health_check_interval: float = 10.0, health_check_timeout: float = 10.0,
                 health_failure_threshold: int = 3, send_seed: bool | None = None, check: bool = False):
        urls = [urls] if isinstance(urls, str) else list(urls or [])
        if not urls:
            raise ValueError("rollout: at least one server URL is needed")
        if request_granularity not in GRANULARITIES:
            raise ValueError(f"rollout.request_granularity must be one of {GRANULARITIES}, got {request_granularity!r}")
        if int(max_concurrent_requests) < 1 or int(max_retries) < 0 or int(health_failure_threshold) < 1:
            raise ValueError("rollout: max_concurrent_requests and health_failure_threshold must be >= 1, max_retries >= 0")
        self.urls = [u.rstrip("/") for u in urls]
        self.url = self.urls[0]
        self._explicit_workers = [w.rstrip("/") for w in workers] if workers else None
        self._workers = None
        self.timeout, self.generate_timeout = float(timeout), float(generate_timeout)
        self.weight_update_timeout = float(weight_update_timeout)
        self.max_concurrent_requests = int(max_concurrent_requests)
        self.request_granularity = request_granularity
        self.max_retries, self.retry_backoff = int(max_retries), float(retry_backoff)
        self.health_check_interval = float(health_check_interval)
        self.health_check_timeout = float(health_check_timeout)
        self.health_failure_threshold = int(health_failure_threshold)
        if send_seed is not None:
            self.send_seed = bool(send_seed)
        self.requests_sent = 0  # /generate requests, retries included
        self.retries = 0
        self._control = None  # the keep-alive client of the control calls (made on first use)
        self._control_lock = threading.Lock()
        if check:
            for u in self.urls:
                if not self.health(u):
                    raise EngineError(f"rollout: {u}/health does not answer (is the server or router running?)")

    # -- control transport (synchronous) ----------------------------------------------------------
    def _client(self) -> httpx.Client:
        """One keep-alive client for every control call (thread-safe): a fresh client per call costs
        ~20 ms (its TLS context) and a TCP handshake, paid several times per weight sync."""
        with self._control_lock:
            if self._control is None:
                self._control = httpx.Client(limits=httpx.Limits(max_connections=64, max_keepalive_connections=32))
            return self._control

    def close(self) -> None:
        with self._control_lock:
            client, self._control = self._control, None
        if client is not None:
            client.close()

    def _request(self, method: str, path: str, body=None, timeout: float | None = None, url: str | None = None,
                 expect_json: bool = True):
        url = (url or self.url) + path
        timeout = self.timeout if timeout is None else float(timeout)
        try:
            resp = self._client().request(method, url, json=body, timeout=timeout)
        except httpx.TimeoutException:
            raise EngineError(f"rollout: {method} {url} did not answer within {timeout:g} s") from None
        except httpx.HTTPError as e:
            raise EngineError(f"rollout: {method} {url} failed: {type(e).__name__}: {e}") from None
        if resp.status_code >= 400:
            raise EngineError(f"rollout: {method} {url} failed with HTTP {resp.status_code}: {_message_of(resp)}")
        if not expect_json:
            return resp.text
        if not resp.content.strip():
            return None
        try:
            return resp.json()
        except json.JSONDecodeError:
            raise EngineError(f"rollout: {method} {url} answered HTTP {resp.status_code} with a body that is not JSON: "
                              f"{resp.text[:200]!r}") from None

    def health(self, url: str | None = None) -> bool:
        """``GET /health`` answers 2xx (SGLang: empty body; sglang-router: the text ``OK``)."""
        try:
            self._request("GET", "/health", timeout=min(self.timeout, self.health_check_timeout), url=url,
                          expect_json=False)
            return True
        except EngineError:
            return False

    def model_info(self, url: str | None = None) -> dict:
        return self._request("GET", "/model_info", url=url)

    def server_info(self, url: str | None = None) -> dict:
        return self._request("GET", "/server_info", url=url)

    # -- workers -----------------------------------------------------------------------------------
    def workers(self, refresh: bool = False) -> list:
        """The SGLang servers behind ``urls``: listed explicitly, or asked from each URL that is a
        router (``GET /workers``); a URL without that route is a server itself."""
        if self._explicit_workers is not None:
            return list(self._explicit_workers)
        if self._workers is not None and not refresh:
            return list(self._workers)
        found = []
        for u in self.urls:
            try:
                resp = self._client().get(u + "/workers", timeout=self.timeout)
            except httpx.TimeoutException:
                raise EngineError(f"rollout: {u} did not answer GET /workers within {self.timeout:g} s "
                                  "(rollout.control_timeout_s): is it hung?") from None
            except httpx.HTTPError as e:
                raise EngineError(f"rollout: cannot reach {u} ({type(e).__name__}: {e}); is the server or router "
                                  "running, and is rollout.urls right?") from None
            listed = None
            if resp.status_code == 200:
                try:
                    listed = resp.json().get("workers")
                except (json.JSONDecodeError, AttributeError):
                    listed = None
            if isinstance(listed, list):
                urls = [w.get("url") for w in listed if isinstance(w, dict) and w.get("url")]
                if not urls:
                    raise EngineError(f"rollout: the router {u} has no workers registered ({u}/workers)")
                found += [w.rstrip("/") for w in urls]
            else:
                found.append(u)
        self._workers = list(dict.fromkeys(found))
        return list(self._workers)

    def _on_workers(self, fn, timeout_hint: str = "") -> list:
        """Run ``fn(worker_url)`` on every worker in parallel; the first failure is raised after all finish."""
        workers = self.workers()
        results, errors = [None] * len(workers), []

        def run(i, w):
            try:
                results[i] = fn(w)
            except Exception as e:  # noqa: BLE001 -- collected and re-raised below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i, w), daemon=True) for i, w in enumerate(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def generation_urls(self) -> list:
        """Where /generate requests go: ``urls`` (a router, or the servers themselves), each request
        to the one with the fewest in flight. With ``record_routing`` the workers themselves: the
        real sglang-router (0.3.2) rebuilds each request from its own struct, which has no
        ``return_routed_experts`` / ``routed_experts_start_len``, so the servers would never be
        asked for the experts (tests/rollout/test_routed_experts.py sends one through it)."""
        return self.workers() if self.record_routing else list(self.urls)

    # -- context length ----------------------------------------------------------------------------
    def context_length(self, url: str) -> int | None:
        """The longest prompt + response a worker accepts: ``/v1/models``' ``max_model_len``
        (SGLang's model_config.context_len), else ``/server_info``'s context length."""
        try:
            models = self._request("GET", "/v1/models", url=url)
            cards = models.get("data") if isinstance(models, dict) else None
            if cards and isinstance(cards[0], dict) and cards[0].get("max_model_len"):
                return int(cards[0]["max_model_len"])
        except EngineError as e:
            if "HTTP 404" not in str(e):  # a server without the route falls back; anything else is an error
                raise
        info = self._request("GET", "/server_info", url=url)
        for key in ("max_context_length", "context_length"):
            if isinstance(info, dict) and isinstance(info.get(key), int) and info[key] > 0:
                return int(info[key])
        return None

    def check_context_length(self, needed: int, what: str = "") -> dict:
        """Fail unless every worker's context holds ``needed`` tokens (prompt + max_new_tokens);
        returns {worker: context length}."""
        lengths = dict(zip(self.workers(), self._on_workers(self.context_length)))
        short = {w: c for w, c in lengths.items() if c is not None and c < needed}
        if short:
            w, c = next(iter(short.items()))
            raise EngineError(
                f"rollout: the server {w} has a context length of {c} tokens, but {what or 'a request'} needs "
                f"{needed} (SGLang answers every such request with HTTP 400). Start the servers with "
                f"`--context-length {needed}` (beyond the model's max_position_embeddings also set "
                "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, or choose a RoPE scaling such as YaRN with "
                "--json-model-override-args), or lower rl.max_prompt_length / rollout.max_new_tokens")
        return lengths

    # -- generation --------------------------------------------------------------------------------
    def _sampling_params(self, params: SamplingParams, n: int, seed) -> dict:
        sp = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
              "max_new_tokens": params.max_new_tokens, "n": int(n), "stop_token_ids": list(params.stop_token_ids),
              "skip_special_tokens": False}
        if seed is not None and self.send_seed:
            sp["sampling_seed"] = int(seed)
        return sp

    def generate(self, prompts: list, params: SamplingParams, n: int = 1) -> list:
        out = [None] * len(prompts)
        for i, completions in self.generate_iter(prompts, params, n):
            out[i] = completions
        return out

    def generate_iter(self, prompts: list, params: SamplingParams, n: int = 1, *, chunk_size: int | None = None):
        """Yield ``(prompt index, [n Completions])`` in the order prompts complete. The requests run
        on an event loop in a helper thread; closing the iterator early cancels them. (``chunk_size``
        is for in-process engines; requests here are already one per prompt or per sample.)"""
        params.validate()
        if not prompts:
            return
        results: queue.Queue = queue.Queue()
        stop = threading.Event()
        thread = threading.Thread(target=self._run_loop, args=(prompts, params, int(n), results, stop),
                                  name="sglang-client", daemon=True)
        thread.start()
        done = 0
        try:
            while done < len(prompts):
                kind, a, b = results.get()
                if kind == "error":
                    raise a
                done += 1
                yield a, b
        finally:
            stop.set()
            thread.join()

    def _run_loop(self, prompts, params, n, results, stop):
        try:
            asyncio.run(self._generate_all(prompts, params, n, results, stop))
        except BaseException as e:  # noqa: BLE001 -- handed to the consumer
            results.put(("error", e if isinstance(e, EngineError) else EngineError(f"rollout: {type(e).__name__}: {e}"), None))

    async def _generate_all(self, prompts, params, n, results, stop):
        base_seed = params.seed
        per_sample = self.request_granularity == "sample" and n > 1
        units = [(i, j) for i in range(len(prompts)) for j in range(n)] if per_sample else [(i, None) for i in range(len(prompts))]
        in_flight = {u: 0 for u in self.generation_urls()}
        sem = asyncio.Semaphore(self.max_concurrent_requests)
        partial = {i: [None] * n for i in range(len(prompts))} if per_sample else None
        limits = httpx.Limits(max_connections=self.max_concurrent_requests + 8,
                              max_keepalive_connections=self.max_concurrent_requests + 8)
        timeout = httpx.Timeout(self.generate_timeout, connect=self.timeout)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            async def run(unit):
                i, j = unit
                if base_seed is None:
                    seed = None
                elif j is None:
                    seed = (base_seed * 1_000_003 + i) % (1 << 63)
                else:
                    seed = ((base_seed * 1_000_003 + i) * 1_000_033 + j) % (1 << 63)
                body = {"input_ids": [int(t) for t in prompts[i]], "return_logprob": True,
                        "sampling_params": self._sampling_params(params, 1 if per_sample else n, seed)}
                if self.record_routing:  # SGLang >= 0.5.x with --enable-return-routed-experts
                    body["return_routed_experts"] = True
                async with sem:
                    return unit, await self._post_generate(client, body, 1 if per_sample else n, in_flight)

            tasks = [asyncio.ensure_future(run(u)) for u in units]
            watchdog = asyncio.ensure_future(self._watch_workers(client, stop))
            pending = set(tasks) | {watchdog}
            try:
                while True:
                    done, pending = await asyncio.wait(pending, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                    if stop.is_set():
                        return
                    failed = [t.exception() for t in done if t.exception() is not None]  # (retrieves them all)
                    if failed:  # a request that exhausted its retries, or the watchdog
                        raise next((e for e in failed if "stopped answering" in str(e)), failed[0])
                    for t in done:
                        if t is watchdog:
                            continue
                        (i, j), completions = t.result()
                        if not per_sample:
                            results.put(("ok", i, completions))
                        else:
                            partial[i][j] = completions[0]
                            if all(c is not None for c in partial[i]):
                                results.put(("ok", i, partial.pop(i)))
                    if pending == {watchdog}:
                        return
            finally:
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    async def _post_generate(self, client: httpx.AsyncClient, body: dict, n: int, in_flight: dict) -> list:
        last = None
        for attempt in range(self.max_retries + 1):
            urls = list(in_flight)
            url = min(urls, key=lambda u: in_flight[u]) if last is None or len(urls) == 1 else \
                min((u for u in urls if u != last.url), key=lambda u: in_flight[u])
            in_flight[url] += 1
            self.requests_sent += 1
            try:
                return await self._post_once(client, url, body, n)
            except _Retryable as e:
                last = e
                if attempt < self.max_retries:
                    self.retries += 1
                    await asyncio.sleep(self.retry_backoff * (2 ** attempt))
            finally:
                in_flight[url] -= 1
        raise EngineError(f"rollout: POST {last.url}/generate failed {self.max_retries + 1} times; last: {last.message}")

    async def _post_once(self, client: httpx.AsyncClient, url: str, body: dict, n: int) -> list:
        try:
            resp = await client.post(url + "/generate", json=body)
        except httpx.TimeoutException:
            raise EngineError(f"rollout: POST {url}/generate did not answer within rollout.generate_timeout_s = "
                              f"{self.generate_timeout:g} s") from None
        except httpx.HTTPError as e:
            raise _Retryable(url, f"{type(e).__name__}: {e}") from None
        if resp.status_code >= 500:
            raise _Retryable(url, f"HTTP {resp.status_code}: {_message_of(resp)}")
        if resp.status_code >= 400:
            raise EngineError(f"rollout: POST {url}/generate failed with HTTP {resp.status_code}: {_message_of(resp)}")
        try:
            outs = resp.json()
        except json.JSONDecodeError:
            raise EngineError(f"rollout: POST {url}/generate answered a body that is not JSON: {resp.text[:200]!r}") from None
        if isinstance(outs, dict):
            outs = [outs]
        if not isinstance(outs, list) or len(outs) != n:
            got = len(outs) if isinstance(outs, list) else type(outs).__name__
            raise EngineError(f"rollout: {url}/generate answered {got} samples, expected {n}")
        for k, o in enumerate(outs):
            reason = (o.get("meta_info") or {}).get("finish_reason") if isinstance(o, dict) else None
            if isinstance(reason, dict) and reason.get("type") == "abort":
                raise _Retryable(url, f"sample {k} aborted by the server: {reason.get('message') or reason}")
        routing = (len(body["input_ids"]), self.routing_layers, self.routing_topk) if self.record_routing else None
        return [parse_completion(o, k, url=url, routing=routing) for k, o in enumerate(outs)]

    async def _watch_workers(self, client: httpx.AsyncClient, stop: threading.Event):
        """Probe every worker's /health while requests run; raise when one misses too many in a row."""
        workers = self.workers()
        misses = {w: 0 for w in workers}
        first_miss = {}
        while not stop.is_set():
            await asyncio.sleep(self.health_check_interval)

            async def probe(w):
                try:
                    r = await client.get(w + "/health", timeout=self.health_check_timeout)
                    return w, (r.status_code < 400, f"HTTP {r.status_code}")
                except httpx.TimeoutException:
                    return w, (False, f"no answer within {self.health_check_timeout:g} s")
                except httpx.HTTPError as e:
                    return w, (False, f"{type(e).__name__}: {e}")

            for w, (ok, why) in await asyncio.gather(*(probe(w) for w in workers)):
                if ok:
                    misses[w] = 0
                    first_miss.pop(w, None)
                    continue
                misses[w] += 1
                first_miss.setdefault(w, time.monotonic())
                if misses[w] >= self.health_failure_threshold:
                    raise EngineError(
                        f"rollout: the worker {w} stopped answering /health during generation ({misses[w]} probes in a "
                        f"row over {time.monotonic() - first_miss[w]:.0f} s; last: {why}): is it dead or hung? "
                        "The step is abandoned; restart the server and the run resumes from its last checkpoint")

    # -- weights -----------------------------------------------------------------------------------
    def load_from_disk(self, model_dir: str, *, version=None) -> None:
        """Every worker loads the HF checkpoint ``model_dir`` (a path the servers can read), in
        parallel: pause -> update_weights_from_disk -> continue; then each must report ``version``."""
        version = None if version is None else str(version)

        def update(w):
            self._request("POST", "/pause_generation", {"mode": "abort"}, url=w)
            try:
                body = {"model_path": model_dir, "flush_cache": True}
                if version is not None:
                    body["weight_version"] = version
                result = self._request("POST", "/update_weights_from_disk", body, timeout=self.weight_update_timeout, url=w)
                if not isinstance(result, dict) or not result.get("success", False):
                    raise EngineError(f"rollout: {w}/update_weights_from_disk failed: {(result or {}).get('message')}")
            finally:
                self._request("POST", "/continue_generation", {}, url=w)
            if version is not None:
                reported = (self.model_info(w) or {}).get("weight_version")
                if str(reported) != version:
                    raise EngineError(f"rollout: {w} reports weight_version {reported!r} after loading {model_dir}, "
                                      f"expected {version!r}")

        self._on_workers(update)

    def weight_versions(self) -> dict:
        return {w: (self.model_info(w) or {}).get("weight_version") for w in self.workers()}

    # -- weights over a process group (SGLang's update_weights_from_distributed) ---------------------
    # The trainer side (megatron_klear.rollout.weight_sync.DistributedWeightSync) drives these; each
    # runs on every worker in parallel and raises EngineError naming the first worker that failed.
    def _post_weights(self, worker: str, path: str, body: dict, timeout: float | None = None) -> dict:
        """POST a weight-control call; SGLang answers ``{"success", "message"}`` (400 on failure)."""
        result = self._request("POST", path, body, timeout=timeout, url=worker)
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineError(f"rollout: POST {worker}{path} failed: {result.get('message')}")
        return result if isinstance(result, dict) else {}

    def update_group_layout(self) -> list:
        """``[(worker, ranks)]``: each worker joins an update group with one rank per TP rank of its
        model (SGLang: ``rank_offset + tp_rank``). Refuses layouts SGLang cannot update this way."""
        def ask(w):
            info = self.server_info(w) or {}
            tp, pp, dp = (int(info.get(k) or 1) for k in ("tp_size", "pp_size", "dp_size"))
            if dp > 1 and not info.get("enable_dp_attention"):
                raise EngineError(f"rollout: {w} runs {dp} data-parallel replicas (dp_size); SGLang updates weights "
                                  "from a process group only with dp_size 1: start one server per replica "
                                  "(behind the router), or use rollout.weight_sync=disk")
            if pp > 1:
                raise EngineError(f"rollout: {w} runs pipeline parallelism (pp_size={pp}), which SGLang's "
                                  "update_weights_from_distributed does not cover: use rollout.weight_sync=disk")
            return tp

        return list(zip(self.workers(), self._on_workers(ask)))

    def init_weights_update_group_async(self, *, master_address: str, master_port: int, world_size: int,
                                        rank_offsets: dict, group_name: str, backend: str, timeout: float) -> dict:
        """Start ``/init_weights_update_group`` on every worker (each first drops a stale group of that
        name, left by a trainer that died); returns ``{worker: concurrent.futures.Future}`` (the
        call blocks on the server until the whole group has joined)."""
        import concurrent.futures

        def join(w):
            try:
                self._post_weights(w, "/destroy_weights_update_group", {"group_name": group_name})
            except EngineError as e:
                if "does not exist" not in str(e):
                    raise
            return self._post_weights(w, "/init_weights_update_group", {
                "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offsets[w]),
                "world_size": int(world_size), "group_name": group_name, "backend": backend}, timeout=timeout)

        pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(rank_offsets), thread_name_prefix="weights-init")
        futures = {w: pool.submit(join, w) for w in rank_offsets}
        pool.shutdown(wait=False)
        return futures

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Drop the group on every worker (best effort: a worker without it, or gone, is skipped)."""
        def drop(w):
            try:
                self._post_weights(w, "/destroy_weights_update_group", {"group_name": group_name})
            except EngineError:
                pass

        self._on_workers(drop)

    def pause_generation(self, mode: str = "abort") -> None:
        self._on_workers(lambda w: self._request("POST", "/pause_generation", {"mode": mode}, url=w))

    def continue_generation(self) -> None:
        self._on_workers(lambda w: self._request("POST", "/continue_generation", {}, url=w))

    def begin_weight_update(self) -> None:
        """Open a weight-update session on every worker (SGLang 0.5.23 refuses updates outside one).
        A session left open by a trainer that died is closed first."""
        def begin(w):
            try:
                self._post_weights(w, "/begin_weight_update", {})
            except EngineError as e:
                if "already open" not in str(e):
                    raise
                try:
                    self._post_weights(w, "/end_weight_update", {})
                except EngineError:
                    pass  # a failed stale session (ours: nothing applied) still closes
                self._post_weights(w, "/begin_weight_update", {})

        self._on_workers(begin)

    def update_weights_from_distributed(self, names: list, dtypes: list, shapes: list, *, group_name: str,
                                        load_format: str | None = None, flush_cache: bool = True,
                                        weight_version: str | None = None, timeout: float | None = None) -> None:
        """Every worker receives one bucket (the sender broadcasts it meanwhile)."""
        body = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                "group_name": group_name, "flush_cache": bool(flush_cache), "abort_all_requests": False}
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        timeout = self.weight_update_timeout if timeout is None else timeout
        workers = self.workers()
        errors = [None] * len(workers)

        def post(i, w):
            try:
                self._post_weights(w, "/update_weights_from_distributed", body, timeout=timeout)
            except Exception as e:  # noqa: BLE001 -- collected below
                errors[i] = e

        threads = [threading.Thread(target=post, args=(i, w), daemon=True) for i, w in enumerate(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [(w, e) for w, e in zip(workers, errors) if e is not None]
        if failed:
            # a server that cannot be reached (dead) first: the others' failures follow from it
            failed.sort(key=lambda we: "failed with HTTP" in str(we[1]))
            raise EngineError("; ".join(str(e) for _, e in failed))

    def end_weight_update(self) -> None:
        self._on_workers(lambda w: self._post_weights(w, "/end_weight_update", {}, timeout=self.weight_update_timeout))

    def set_weight_version(self, version) -> None:
        """``/update_weight_version`` on every worker, aborting nothing (generation is paused)."""
        body = {"new_version": str(version), "abort_all_requests": False}
        self._on_workers(lambda w: self._post_weights(w, "/update_weight_version", body))

    def check_weight_versions(self, version) -> None:
        """Every worker must report ``version`` (``/model_info``'s ``weight_version``)."""
        for w, reported in self.weight_versions().items():
            if str(reported) != str(version):
                raise EngineError(f"rollout: {w} reports weight_version {reported!r} after the update, expected "
                                  f"{str(version)!r}")

    # -- verification ------------------------------------------------------------------------------
    def probe(self, worker: str, prompt_ids: list, max_new_tokens: int) -> Completion:
        """Greedy continuation of ``prompt_ids`` by one worker (not through the router), exactly
        ``max_new_tokens`` tokens (``ignore_eos``), with the log-prob of each token (greedy:
        ``log_softmax`` of the logits at temperature 1, in SGLang and in the embedded engine)."""
        body = {"input_ids": [int(t) for t in prompt_ids], "return_logprob": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": int(max_new_tokens), "ignore_eos": True,
                                    "skip_special_tokens": False}}
        out = self._request("POST", "/generate", body, timeout=self.generate_timeout, url=worker)
        return parse_completion(out[0] if isinstance(out, list) else out, url=worker)

    def worker_dtypes(self) -> dict:
        """{worker: the dtype its model runs in} from ``/server_info`` (``dtype``; SGLang's ``auto``
        is reported as is)."""
        return {w: str((self.server_info(w) or {}).get("dtype") or "auto") for w in self.workers()}

    def update_weights(self, named_tensors, *, version: int | None = None) -> None:
        """Write the tensors to a temporary HF directory and have every worker load it. Only for
        servers on this machine; on a cluster the RL loop writes to ``rollout.sync_dir`` (a
        filesystem the servers share) and calls :meth:`load_from_disk`."""
        import os
        import shutil
        import tempfile

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

    # -- servers colocated with the trainer (rollout.colocate) ------------------------------------------
    def check_memory_saver(self) -> None:
        """Every worker must run with ``--enable-memory-saver``: without it SGLang's
        ``/release_memory_occupation`` frees nothing (a no-op saver), and the trainer would meet the
        server's weights and KV cache on its GPU."""
        def ask(w):
            if not (self.server_info(w) or {}).get("enable_memory_saver"):
                raise EngineError(f"rollout.colocate: {w} was not started with --enable-memory-saver, so releasing its "
                                  "memory would free nothing: restart it with that flag (pip install "
                                  "torch-memory-saver), or give the servers their own GPUs (rollout.colocate=false)")

        self._on_workers(ask)

    def release_memory(self, tags=None) -> None:
        """SGLang's ``/release_memory_occupation`` on every worker (they must be idle): ``tags`` of
        ``weights``, ``kv_cache``, ``cuda_graph`` (None: all). Released weights lose their content:
        resume them, then load weights, before generating."""
        body = {"tags": list(tags)} if tags else {}
        self._on_workers(lambda w: self._request("POST", "/release_memory_occupation", body, url=w))

    def resume_memory(self, tags=None) -> None:
        """SGLang's ``/resume_memory_occupation`` on every worker, for ``tags`` released before (None:
        all; resuming a tag that is not released fails SGLang's scheduler)."""
        body = {"tags": list(tags)} if tags else {}
        self._on_workers(lambda w: self._request("POST", "/resume_memory_occupation", body, url=w))


def encode_routed_experts(routes) -> str:
    """SGLang's ``meta_info["routed_experts"]``: the base64 of an int32 array [tokens, layers, top_k]
    (``detokenizer_manager._b64_encode_per_request`` of 0.5.23)."""
    import base64

    import numpy as np

    return base64.b64encode(np.ascontiguousarray(np.asarray(routes, dtype=np.int32)).tobytes()).decode("ascii")


def decode_routed_experts(text, *, rows: int, layers: list, top_k: int, where: str = "/generate"):
    """``meta_info["routed_experts"]`` -> int16 tensor [rows, len(layers), top_k]: the experts of the
    MoE layers ``layers`` (indices among the model's layers; SGLang reports every layer, a dense
    one as zeros) for each of the ``rows`` = prompt + response - 1 tokens the model was fed (SGLang:
    positions ``[routed_experts_start_len, seqlen - 1)``, start 0)."""
    import base64
    import binascii

    import numpy as np
    import torch

    if not isinstance(text, str):
        raise EngineError(f"rollout: {where} did not return meta_info.routed_experts (rollout.router_replay needs "
                          "SGLang started with --enable-return-routed-experts)")
    try:
        flat = np.frombuffer(base64.b64decode(text, validate=True), dtype=np.int32)
    except (binascii.Error, ValueError) as e:
        raise EngineError(f"rollout: {where}: meta_info.routed_experts is not base64 int32 ({e})") from None
    per_token = flat.size // rows if rows else 0
    if rows <= 0 or flat.size != rows * per_token or per_token % top_k or per_token // top_k <= max(layers, default=-1):
        raise EngineError(f"rollout: {where}: meta_info.routed_experts holds {flat.size} ids, not {rows} tokens x "
                          f"layers x top_k={top_k} covering MoE layers {list(layers)} (prompt + response - 1 = {rows})")
    routes = torch.from_numpy(flat.reshape(rows, per_token // top_k, top_k)[:, list(layers)].astype(np.int16))
    return routes


def parse_completion(out: dict, k: int = 0, url: str = "", routing: tuple | None = None) -> Completion:
    """One element of a /generate response -> Completion (validated). ``routing``: (prompt length,
    MoE layer indices, top_k) to read the routed experts too (rollout.router_replay)."""
    where = f"{url}/generate" if url else "/generate"
    try:
        meta = out["meta_info"]
        pairs = meta["output_token_logprobs"]
        reason = meta["finish_reason"]
        reason = reason["type"] if isinstance(reason, dict) else reason
    except (KeyError, TypeError) as e:
        raise EngineError(f"rollout: {where} sample {k} lacks {e} (meta_info.output_token_logprobs and "
                          "meta_info.finish_reason are required; was return_logprob sent?)") from None
    try:
        ids = [int(t) for t in out.get("output_ids", [p[1] for p in pairs])]
        logprobs = [float(p[0]) for p in pairs]
        pair_ids = [int(p[1]) for p in pairs]
    except (TypeError, ValueError, IndexError) as e:
        raise EngineError(f"rollout: {where} sample {k}: malformed output_ids / output_token_logprobs ({e})") from None
    if pair_ids != ids:
        raise EngineError(f"rollout: {where} sample {k}: output_token_logprobs do not match output_ids")
    if reason not in ("stop", "length"):
        raise EngineError(f"rollout: {where} sample {k} finished with {reason!r}")
    routes = None
    if routing is not None:
        prompt_len, layers, top_k = routing
        routes = decode_routed_experts(meta.get("routed_experts"), rows=prompt_len + len(ids) - 1, layers=layers,
                                       top_k=top_k, where=f"{where} sample {k}")
    return Completion(token_ids=ids, logprobs=logprobs, finish_reason=reason, routed_experts=routes)
