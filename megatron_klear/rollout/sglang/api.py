"""SGLang 0.5.23's native HTTP API (:class:`SGLangAPI`, a :class:`~megatron_klear.rollout.server_api.ServerAPI`):
``/generate`` with token ids in and ``return_logprob``, ``/model_info``'s ``weight_version``,
``/continue_generation``, ``/abort_request``."""

from __future__ import annotations

from megatron_klear.rollout.base import Completion, EngineError, SamplingParams
from megatron_klear.rollout.server_api import AbortedByServer, ServerAPI
from megatron_klear.rollout.sglang.routed_experts import decode_routed_experts
from megatron_klear.rollout.sglang.versions import token_versions


class SGLangAPI(ServerAPI):
    """``send_seed``: send ``sampling_seed`` (SGLang honours it only with
    ``--enable-deterministic-inference``, and then one seed for a request's ``n`` samples makes them
    identical: off by default, see :class:`~.engine.SGLangEngine`)."""

    name = "SGLang"
    generate_path = "/generate"
    abort_all = ("/abort_request", {"rid": "", "abort_all": True})

    def __init__(self, send_seed: bool = False):
        self.send_seed = bool(send_seed)

    def generate_body(self, input_ids: list, params: SamplingParams, n: int, seed, *, routing: bool) -> dict:
        params.refuse_repetition_penalty("the SGLang client")
        sp = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "max_new_tokens": params.max_new_tokens,
            "n": int(n),
            "stop_token_ids": list(params.stop_token_ids),
            "skip_special_tokens": False,
        }
        if seed is not None and self.send_seed:
            sp["sampling_seed"] = int(seed)
        body = {"input_ids": [int(t) for t in input_ids], "return_logprob": True, "sampling_params": sp}
        if routing:  # SGLang >= 0.5.x with --enable-return-routed-experts
            body["return_routed_experts"] = True
        return body

    def read_generate(self, payload, n: int, *, where: str, routing: tuple | None, allow_abort: bool) -> tuple:
        outs = [payload] if isinstance(payload, dict) else payload
        if not isinstance(outs, list) or len(outs) != n:
            got = len(outs) if isinstance(outs, list) else type(outs).__name__
            raise EngineError(f"rollout: {where} answered {got} samples, expected {n}")
        for k, o in enumerate(outs):
            reason = (o.get("meta_info") or {}).get("finish_reason") if isinstance(o, dict) else None
            if isinstance(reason, dict) and reason.get("type") == "abort" and not allow_abort:
                raise AbortedByServer(f"sample {k} aborted by the server: {reason.get('message') or reason}")
        url = where[: -len(self.generate_path)] if where.endswith(self.generate_path) else where
        completions = [
            parse_completion(o, k, url=url, routing=routing, allow_abort=allow_abort) for k, o in enumerate(outs)
        ]
        return completions, [(o.get("meta_info") or {}).get("weight_version") for o in outs]

    def weight_version(self, transport, url: str, timeout: float | None = None):
        return (transport.request("GET", "/model_info", timeout=timeout, url=url) or {}).get("weight_version")

    def resume(self, transport, url: str, timeout: float | None = None) -> None:
        transport.request("POST", "/continue_generation", {}, timeout=timeout, url=url)


def parse_completion(
    out: dict, k: int = 0, url: str = "", routing: tuple | None = None, allow_abort: bool = False
) -> Completion:
    """One element of a /generate response -> Completion (validated), with each token's weight
    version (:func:`.versions.token_versions`). ``routing``: (prompt length, MoE layer indices,
    top_k) to read the routed experts too (rollout.router_replay). ``allow_abort``: an ``abort``
    finish reason is a partial result (the tokens and log-probs so far; a stream that was asked to
    abort) instead of an error."""
    where = f"{url}/generate" if url else "/generate"
    try:
        meta = out["meta_info"]
        pairs = meta["output_token_logprobs"]
        reason = meta["finish_reason"]
        reason = reason["type"] if isinstance(reason, dict) else reason
    except (KeyError, TypeError) as e:
        raise EngineError(
            f"rollout: {where} sample {k} lacks {e} (meta_info.output_token_logprobs and "
            "meta_info.finish_reason are required; was return_logprob sent?)"
        ) from None
    try:
        ids = [int(t) for t in out.get("output_ids", [p[1] for p in pairs])]
        logprobs = [float(p[0]) for p in pairs]
        pair_ids = [int(p[1]) for p in pairs]
    except (TypeError, ValueError, IndexError) as e:
        raise EngineError(f"rollout: {where} sample {k}: malformed output_ids / output_token_logprobs ({e})") from None
    if pair_ids != ids:
        raise EngineError(f"rollout: {where} sample {k}: output_token_logprobs do not match output_ids")
    if reason not in ("stop", "length") and not (allow_abort and reason == "abort"):
        raise EngineError(f"rollout: {where} sample {k} finished with {reason!r}")
    versions = token_versions(meta, len(ids), f"{where} sample {k}")
    routes = None
    if routing is not None:
        prompt_len, layers, top_k = routing
        routes = decode_routed_experts(
            meta.get("routed_experts"),
            rows=prompt_len + len(ids) - 1,
            layers=layers,
            top_k=top_k,
            where=f"{where} sample {k}",
        )
    return Completion(token_ids=ids, logprobs=logprobs, finish_reason=reason, routed_experts=routes, versions=versions)
