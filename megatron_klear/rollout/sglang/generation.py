"""Generation through SGLang's ``/generate`` (token ids in, ``return_logprob``).

A call is sent as many concurrent requests, at most ``max_concurrent_requests`` in flight, one per
prompt (``n`` samples each, ``request_granularity="prompt"``) or one per sample (``"sample"``), so
that a router can spread them over its workers and no request carries a whole batch towards a
timeout. With several URLs each request goes to the one with the fewest requests in flight.
Results are handed back as each prompt completes (:meth:`Generation.generate_iter`), so grading
overlaps generation.

Failures: a request that fails in transport, answers 5xx or is aborted by the server is retried up
to ``max_retries`` times (on another URL when there are several), then the call fails naming the
URL and the server's message; a 4xx (a bad request: too long for the context, an unknown field) is
not retried. While requests run, every worker's ``/health`` is probed each
``health_check_interval`` seconds; a worker that misses ``health_failure_threshold`` probes in a
row (dead, or frozen: a stopped process still accepts TCP connections but never answers) fails the
call naming it, instead of waiting out the generation timeout.

:class:`Generation` is a mixin of :class:`~megatron_klear.rollout.sglang.SGLangEngine` (its
settings, ``record_routing`` / ``routing_layers`` / ``routing_topk``, and :class:`.transport.Transport`).
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time

import httpx

from megatron_klear.rollout.base import Completion, SamplingParams
from megatron_klear.rollout.sglang.routed_experts import decode_routed_experts
from megatron_klear.rollout.sglang.transport import EngineError, _message_of, _Retryable

GRANULARITIES = ("prompt", "sample")


class Generation:
    def generation_urls(self) -> list:
        """Where /generate requests go: ``urls`` (a router, or the servers themselves), each request
        to the one with the fewest in flight. With ``record_routing`` the workers themselves: the
        real sglang-router (0.3.2) rebuilds each request from its own struct, which has no
        ``return_routed_experts`` / ``routed_experts_start_len``, so the servers would never be
        asked for the experts (tests/rollout/test_routed_experts.py sends one through it)."""
        return self.workers() if self.record_routing else list(self.urls)

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
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=self._auth_headers()) as client:
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
