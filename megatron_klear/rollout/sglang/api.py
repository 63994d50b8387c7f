"""SGLang 0.5.23's native HTTP API (:class:`SGLangAPI`, a
:class:`~megatron_klear.rollout.servers.dialect.ServerDialect`): ``/generate`` with token ids in and
``return_logprob``, ``/model_info``'s ``weight_version``, ``/pause_generation`` and
``/continue_generation``, ``/abort_request``, and the distributed weight update's calls. Bodies
follow the request structs of SGLang 0.5.23's ``io_struct.py`` (the tests check them)."""

from __future__ import annotations

from megatron_klear.rollout.base import Completion, EngineError, SamplingParams
from megatron_klear.rollout.in_server.sglang_delta import LOADER, failed_load, request_body
from megatron_klear.rollout.servers.dialect import AbortedByServer, ServerDialect
from megatron_klear.rollout.servers.versions import token_versions
from megatron_klear.rollout.sglang.compat import env_bool, own_env_vars
from megatron_klear.rollout.sglang.routed_experts import decode_routed_experts

#: SGLang 0.5.23 variables under which a loaded weight is permuted in place after loading, so that
#: a delta written in the checkpoint's layout lands in the wrong elements
PERMUTING_ENV = {
    "SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED": "SGLang interleaves the MoE gate/up rows after loading "
    "(layers/quantization/unquant.py _maybe_interleave_w13_for_fused_swiglu; 'not compatible with runtime "
    "weight updates', srt/environ.py)",
    "SGLANG_USE_AITER": "on ROCm SGLang shuffles the MoE weights after loading (unquant.py "
    "process_weights_after_loading, aiter's shuffle_weight)",
}


def checkpoint_quantization(model_path) -> str | None:
    """The ``quantization_config`` of the checkpoint at ``model_path`` (its ``quant_method``, or the
    whole entry), where this process can read its ``config.json``; None otherwise."""
    import json
    import os

    if not model_path:
        return None
    try:
        with open(os.path.join(str(model_path), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if not quant:
        return None
    return str(quant.get("quant_method") or quant) if isinstance(quant, dict) else str(quant)


class SGLangAPI(ServerDialect):
    """``send_seed``: send ``sampling_seed`` (SGLang honours it only with
    ``--enable-deterministic-inference``, and then one seed for a request's ``n`` samples makes them
    identical: off by default, see :class:`~.engine.SGLangEngine`)."""

    name = "SGLang"
    generate_path = "/generate"
    abort_all = ("/abort_request", {"rid": "", "abort_all": True})
    continue_call = ("/continue_generation", {})
    begin_call = ("/begin_weight_update", {})
    end_call = ("/end_weight_update", {})
    session_open_text = "already open"
    tensor_route = True  # /update_weights_from_tensor (rollout.weight_sync=memory)
    # no body: SGLang's route reads only an optional ``timeout`` query parameter; 0.5.23 flushes only
    # a fully idle scheduler (``Scheduler.flush_cache``) and otherwise answers HTTP 400
    flush_call = ("/flush_cache", None)
    flush_refused_text = "HTTP 400"

    def __init__(self, send_seed: bool = False):
        self.send_seed = bool(send_seed)

    def generate_body(self, input_ids: list, params: SamplingParams, n: int, seed, *, routing: bool) -> dict:
        sp = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "max_new_tokens": params.max_new_tokens,
            "n": int(n),
            "stop_token_ids": list(params.stop_token_ids),
            "skip_special_tokens": False,
        }
        if params.repetition_penalty != 1.0:  # SGLang's rule: the response's tokens only (docs/data.md)
            sp["repetition_penalty"] = float(params.repetition_penalty)
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

    def probe_body(self, prompt_ids: list, max_new_tokens: int) -> dict:
        return {
            "input_ids": [int(t) for t in prompt_ids],
            "return_logprob": True,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": int(max_new_tokens),
                "ignore_eos": True,
                "skip_special_tokens": False,
            },
        }

    def read_probe(self, payload, where: str) -> Completion:
        url = where[: -len(self.generate_path)] if where.endswith(self.generate_path) else where
        return parse_completion(payload[0] if isinstance(payload, list) else payload, url=url, allow_abort=True)

    def pause_call(self, mode: str) -> tuple:
        """The engine's pause modes are SGLang's own: ``abort`` ends the requests in flight (the
        client sends them again); ``retract`` keeps them (SGLang 0.5.23 ``Scheduler.pause_generation``
        moves them back to the waiting queue, a paused server's ``/flush_cache`` ignores that queue,
        and after ``/continue_generation`` their KV cache is recomputed with the new weights).
        SGLang's third mode, ``in_place``, leaves the running batch in place, which ``/flush_cache``
        refuses: the config does not offer it."""
        return "/pause_generation", {"mode": mode}

    def version_call(self, version: str) -> tuple:
        return "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}

    def group_ranks(self, transport, worker: str) -> int:
        """One rank per TP rank of the worker's model (SGLang: ``rank_offset + tp_rank``); refuses
        ``dp_size`` > 1 and pipeline parallelism, which SGLang's update cannot cover."""
        info = transport.server_info(worker) or {}
        tp, pp, dp = (int(info.get(k) or 1) for k in ("tp_size", "pp_size", "dp_size"))
        if dp > 1:  # SGLang 0.5.23: assert dp_size == 1, answered as a bare HTTP 500
            raise EngineError(
                f"rollout: {worker} runs {dp} data-parallel replicas (dp_size={dp}); SGLang refuses weight "
                "update groups unless dp_size is 1 (data-parallel attention, attn_dp_size, is fine): "
                "start one server per replica (behind the router), or use rollout.weight_sync=disk"
            )
        if pp > 1:
            raise EngineError(
                f"rollout: {worker} runs pipeline parallelism (pp_size={pp}), which SGLang's "
                "update_weights_from_distributed does not cover: use rollout.weight_sync=disk"
            )
        return tp

    def tensor_gpus(self, transport, worker: str) -> list:
        """TP rank ``i`` runs on local GPU ``base_gpu_id + i * gpu_id_step`` (SGLang 0.5.23
        ``compute_local_gpu_id``, one node), counted over the GPUs the server sees; SGLang does not
        report ``CUDA_VISIBLE_DEVICES``, so a colocated server must see every GPU of its node (as
        the trainer does) for that count to be the physical one (docs/sglang.md)."""
        from megatron_klear.platform.gpus import server_rank_gpu

        info = transport.server_info(worker) or {}
        tp = int(info.get("tp_size") or 1)
        base, step = int(info.get("base_gpu_id") or 0), int(info.get("gpu_id_step") or 1)
        return [server_rank_gpu(i, base, step) for i in range(tp)]

    def tensor_call(self, handles: list, transport, worker: str):
        """SGLang 0.5.23's ``/update_weights_from_tensor`` (``UpdateWeightsFromTensorReqInput``): one
        entry of ``serialized_named_tensors`` per TP rank of the server, entry ``i`` read by TP rank
        ``i`` alone (``managers/tp_worker.py`` ``deserialize_own_rank``) with
        ``MultiprocessingSerializer.deserialize`` (``SafeUnpickler``: torch's tensor and storage
        rebuild functions of ``torch.multiprocessing.reductions`` are allowed; the device is a GPU
        UUID, ``srt/utils/patch_torch.py``), then loaded through the model's own ``load_weights``
        (``load_format`` None: fused qkv / gate_up, vocab padding and TP sharding as from a
        checkpoint). The cache is flushed before the first bucket (the session)."""
        body = {"serialized_named_tensors": list(handles), "flush_cache": False, "abort_all_requests": False}
        return "/update_weights_from_tensor", body

    def join_calls(self, group: dict, timeout: float) -> list:
        """A stale group of the same name (left by a trainer that died) is dropped first."""
        return [
            ("/destroy_weights_update_group", {"group_name": group["group_name"]}, "does not exist"),
            ("/init_weights_update_group", dict(group), ""),
        ]

    def leave_call(self, group_name: str) -> tuple:
        return "/destroy_weights_update_group", {"group_name": group_name}

    def delta_refusal(self, transport, workers: list) -> str | None:
        """Delta buckets reach SGLang 0.5.23 through the project's custom weight loader
        (:mod:`megatron_klear.rollout.in_server.sglang_delta`): every server must list it in
        ``--custom-weight-loader``. Refused by name: a quantized server (``quantization`` set by the
        flag, or a ``quantization_config`` in the checkpoint's ``config.json`` where the trainer can
        read it: its parameters are packed or rescaled, and a NaN-masked copy of HF-shaped changes
        cannot be written into them), a server that permutes weights after loading them
        (:data:`PERMUTING_ENV`, where it lists its variables: the masked copy would land in the
        permuted layout), and speculative decoding (the loader updates
        the target model; a draft that shares or copies its weights is refreshed only by the
        family's own full update)."""
        reasons = []
        for w in workers:
            info = transport.server_info(w) or {}
            if LOADER not in (info.get("custom_weight_loader") or []):
                reasons.append(f"{w} was started without --custom-weight-loader {LOADER}")
            if info.get("quantization"):
                reasons.append(f"{w} serves quantized weights (quantization={info['quantization']})")
            else:
                declared = checkpoint_quantization(info.get("model_path"))
                if declared:
                    reasons.append(
                        f"{w} serves quantized weights (its checkpoint's config.json declares quantization_config "
                        f"{declared}; SGLang's /server_info reports only the --quantization flag)"
                    )
            env = own_env_vars(info) or {}
            for var, what in PERMUTING_ENV.items():
                if env_bool(env.get(var), False):
                    reasons.append(f"{w} runs with {var}={env[var]}: {what}")
            if info.get("speculative_algorithm"):
                reasons.append(
                    f"{w} runs speculative decoding (speculative_algorithm={info['speculative_algorithm']}: "
                    "its draft is refreshed only by full syncs)"
                )
        if not reasons:
            return None
        return (
            "; ".join(reasons) + " (SGLang 0.5.23 takes delta buckets only through that loader, into "
            "unquantized target weights; docs/sglang.md, 'Delta syncs')"
        )

    def group_check_call(self, group_name: str) -> tuple:
        """An empty ``/update_weights_from_distributed`` (no tensor, no flush, no version): SGLang
        0.5.23 answers ``Group <name> not in [<its groups>]`` when the group is not in its table (a
        server restarted since it joined, or one whose delta loader failed on it and marked it:
        :func:`megatron_klear.rollout.in_server.sglang_delta.failed_load`), success otherwise."""
        return self.bucket_call([], [], [], group_name=group_name, load_format=None)

    def failed_load(self, message: str, group_name: str) -> str | None:
        return failed_load(message, group_name)

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
        """``flush_cache`` False: the cache is flushed once before the first bucket (SGLang 0.5.23
        fails a bucket whose flush finds a request still queued); the version is set at the end.
        A delta bucket (``counts``) goes to ``/update_weights_from_tensor`` for the project's custom
        loader (:mod:`megatron_klear.rollout.in_server.sglang_delta`):
        ``update_weights_from_distributed`` loads whole tensors only."""
        if counts is not None:
            return "/update_weights_from_tensor", request_body(
                names,
                dtypes,
                shapes,
                counts,
                group_name=group_name,
                load_format=load_format,
                ranks=ranks,
                timeout=timeout,
            )
        body = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": False,
            "abort_all_requests": False,
        }
        if load_format is not None:
            body["load_format"] = load_format
        return "/update_weights_from_distributed", body


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
