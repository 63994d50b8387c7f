"""SGLang's request contract, as the stand-in enforces it: /generate bodies decoded and checked
against ``sglang/api/v1/api_types.py`` (serde-style messages) and ``sampling_params.py``, control
bodies type-checked, and samples written in SGLang's /generate answer shape."""

from __future__ import annotations

import collections
import math
import uuid
from dataclasses import dataclass, field

from megatron_klear.rollout.base import Completion, SamplingParams

SGLANG_API_VERSION = "0.5.23"  # the SGLang release whose API this server mimics
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k
DEFAULT_WEIGHT_VERSION = "default"  # SGLang's --weight-version default
DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name for weight updates
SGLANG_PAUSE_MODES = ("abort", "retract", "in_place")


class BadRequest(ValueError):
    """A request this server cannot serve: status 400, ``{"error": {"message": ...}}``."""


class ContractError(BadRequest):
    """A body that violates SGLang's contract types: status 400, ``{"error": "<message>"}`` (SGLang's
    ``generate_contract_error`` gate answers that shape)."""


# ------------------------------------------------------------------------------------------------
# SGLang's contract types (sglang/api/v1/api_types.py), with its serde-style messages
# ------------------------------------------------------------------------------------------------
def _unexpected(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _invalid(where: str, v, expected: str) -> ContractError:
    return ContractError(f"{where}: invalid type: {_unexpected(v)}, expected {expected}")


def expect_bool(v, where, expected="a boolean"):
    if not isinstance(v, bool):
        raise _invalid(where, v, expected)
    return v


def expect_int(v, where, expected="i64"):
    if not _is_int(v):
        raise _invalid(where, v, expected)
    return v


def _uint(v, where, expected="u64"):
    expect_int(v, where, expected)
    if v < 0:
        raise ContractError(f"{where}: invalid value: integer `{v}`, expected {expected}")
    return v


def _float(v, where, expected="f64"):
    if not (isinstance(v, (int, float)) and not isinstance(v, bool)):
        raise _invalid(where, v, expected)
    return float(v)


def expect_str(v, where, expected="a string"):
    if not isinstance(v, str):
        raise _invalid(where, v, expected)
    return v


def expect_seq(v, where, expected="a sequence"):
    if not isinstance(v, list):
        raise _invalid(where, v, expected)
    return v


def expect_map(v, where, expected="a map"):
    if not isinstance(v, dict):
        raise _invalid(where, v, expected)
    return v


def _or_list(scalar):
    """A contract ``XOrList``: one value or an array of values."""

    def check(v, where, name):
        if isinstance(v, list):
            return [scalar(e, f"{where}[{k}]") for k, e in enumerate(v)]
        return scalar(v, where, f"a value or an array of values for {name}")

    return check


def expect_token_ids(v, where):
    v = expect_seq(v, where)
    if set(map(type, v)) <= {int}:  # every element a plain int (bool is not): checked at C speed
        return v
    return [expect_int(e, f"{where}[{k}]") for k, e in enumerate(v)]


def expect_str_list(v, where):
    return [expect_str(e, f"{where}[{k}]") for k, e in enumerate(expect_seq(v, where))]


def _token_ids_or_list(v, where):
    if not isinstance(v, list):
        raise _invalid(where, v, "a value or an array of values for TokenIdsOrList")
    if not v or (isinstance(v[0], (int, float)) and not isinstance(v[0], bool)):
        return expect_token_ids(v, where)
    return [expect_token_ids(e, f"{where}[{k}]") for k, e in enumerate(v)]


def expect_optional_str(v, where, expected="a string"):
    return None if v is None else expect_str(v, where, expected)


_str_or_list = _or_list(expect_str)
_bool_or_list = _or_list(expect_bool)
_int_or_list = _or_list(expect_int)
_optional_str_or_list = _or_list(expect_optional_str)

# SamplingParams, in the contract's order (its unknown-field message lists them so); (kind, default).
SAMPLING_FIELDS = {
    "max_new_tokens": ("int", 128),
    "stop": ("str_or_list", None),
    "stop_token_ids": ("int_list", None),
    "stop_regex": ("str_or_list", None),
    "temperature": ("float", 1.0),
    "top_p": ("float", 1.0),
    "top_k": ("int", TOP_K_ALL),
    "min_p": ("float", 0.0),
    "frequency_penalty": ("float", 0.0),
    "presence_penalty": ("float", 0.0),
    "repetition_penalty": ("float", 1.0),
    "min_new_tokens": ("int", 0),
    "n": ("int", 1),
    "json_schema": ("str", None),
    "regex": ("str", None),
    "ebnf": ("str", None),
    "structural_tag": ("str", None),
    "ignore_eos": ("bool", False),
    "skip_special_tokens": ("bool", True),
    "spaces_between_special_tokens": ("bool", True),
    "no_stop_trim": ("bool", False),
    "stream_interval": ("int", None),
    "logit_bias": ("map_float", {}),
    "sampling_seed": ("int", None),
    "custom_params": ("any", None),
    "beam_width": ("int", None),
    "watermark": ("watermark", None),
    "choice": ("str_list", []),
}
_WATERMARK_FIELDS = {"enabled": expect_bool, "key": expect_str, "context_window": expect_int}


def _unknown_field(key: str, fields) -> ContractError:
    """serde's ``unknown_field`` text (the contract's DENY policy)."""
    fields = tuple(fields)
    if not fields:
        return ContractError(f"unknown field `{key}`, there are no fields")
    if len(fields) == 1:
        return ContractError(f"unknown field `{key}`, expected `{fields[0]}`")
    if len(fields) == 2:
        return ContractError(f"unknown field `{key}`, expected `{fields[0]}` or `{fields[1]}`")
    listed = ", ".join(f"`{f}`" for f in fields)
    return ContractError(f"unknown field `{key}`, expected one of {listed}")


def decode_sampling_params(sp, where: str = "sampling_params") -> dict:
    """SGLang's SamplingParams decoding (unknown keys rejected, types checked, null -> default);
    returns every field with its value."""
    expect_map(sp, where, "struct SamplingParams")
    out = {name: default for name, (_, default) in SAMPLING_FIELDS.items()}
    for key, x in sp.items():
        if key not in SAMPLING_FIELDS:
            raise _unknown_field(key, SAMPLING_FIELDS)
        kind, default = SAMPLING_FIELDS[key]
        at = f"{where}.{key}"
        if x is None:
            # the contract keeps null for the Optional fields without a default; SGLang's
            # SamplingParams.__post_init__ then applies its defaults
            out[key] = None if key in ("max_new_tokens",) else default
            continue
        if kind == "int":
            out[key] = expect_int(x, at)
        elif kind == "float":
            out[key] = _float(x, at)
        elif kind == "bool":
            out[key] = expect_bool(x, at)
        elif kind == "str":
            out[key] = expect_str(x, at)
        elif kind == "str_or_list":
            out[key] = _str_or_list(x, at, "StringOrList")
        elif kind == "int_list":
            out[key] = expect_token_ids(x, at)
        elif kind == "map_float":
            out[key] = {k: _float(e, f"{at}.{k}") for k, e in expect_map(x, at).items()}
        elif kind == "str_list":
            out[key] = [expect_str(e, f"{at}[{k}]") for k, e in enumerate(expect_seq(x, at))]
        elif kind == "watermark":
            for wk, wx in expect_map(x, at, "struct WatermarkRequestConfig").items():
                if wk not in _WATERMARK_FIELDS:
                    raise _unknown_field(wk, _WATERMARK_FIELDS)
                if wx is not None:
                    _WATERMARK_FIELDS[wk](wx, f"{at}.{wk}")
            out[key] = x
        else:  # any
            out[key] = x
    return out


# Top-level /generate fields that change what is computed: the value(s) this server can honour.
def _default_or(*allowed):
    def ok(v):
        values = v if isinstance(v, list) else [v]
        return all(any(x is a or (x == a and type(x) is type(a)) for a in allowed) for x in values)

    return ok


_UNSUPPORTED = {
    "text": (_default_or(None), "send token ids in input_ids"),
    "input_embeds": (_default_or(None), ""),
    "image_data": (_default_or(None), ""),
    "video_data": (_default_or(None), ""),
    "audio_data": (_default_or(None), ""),
    "stream": (_default_or(None, False), "only whole responses are served"),
    "logprob_start_len": (_default_or(None, -1), "only output-token log-probs are served"),
    "top_logprobs_num": (_default_or(None, 0), ""),
    "token_ids_logprob": (lambda v: v is None or v == [], ""),
    "return_hidden_states": (_default_or(None, False), ""),
    "return_indexer_topk": (_default_or(None, False), ""),
    "return_entropy": (_default_or(None, False), ""),
    "return_bytes": (_default_or(None, False), ""),
    "return_sampling_mask": (_default_or(None, False), ""),
    "sampling_logprobs_mode": (_default_or(None), ""),
    "return_flat_raw_top_logprobs": (_default_or(None, False), ""),
    "return_flat_raw_output_top_logprobs": (_default_or(None, False), ""),
    "return_flat_raw_top_logprobs_b64": (_default_or(None, False), ""),
    "lora_path": (_default_or(None), ""),
    "lora_id": (_default_or(None), ""),
    "session_params": (_default_or(None), ""),
    "custom_logit_processor": (_default_or(None), ""),
    "positional_embed_overrides": (_default_or(None), ""),
    "max_thinking_tokens": (_default_or(None), ""),
    "require_reasoning": (_default_or(None, False), ""),
    "multi_item_delimiter_indices": (_default_or(None), ""),
    "token_indices_to_pool": (_default_or(None), ""),
    "use_audio_in_video": (_default_or(None, False), ""),
}
# Contract types of the top-level fields read or refused here (others are ignored, as SGLang's
# GenerateRequest ignores unknown keys).
_TOP_LEVEL_TYPES = {
    "rid": lambda v, w: _str_or_list(v, w, "StringOrList"),
    "text": lambda v, w: _str_or_list(v, w, "StringOrList"),
    "stream": expect_bool,
    "return_logprob": lambda v, w: _bool_or_list(v, w, "BoolOrList"),
    "logprob_start_len": lambda v, w: _int_or_list(v, w, "Int64OrList"),
    "top_logprobs_num": lambda v, w: _int_or_list(v, w, "Int64OrList"),
    "token_ids_logprob": _token_ids_or_list,
    "return_hidden_states": lambda v, w: _bool_or_list(v, w, "BoolOrList"),
    "return_text_in_logprobs": expect_bool,
    "require_reasoning": expect_bool,
    "lora_path": lambda v, w: _optional_str_or_list(v, w, "OptionalStringOrList"),
    "custom_logit_processor": lambda v, w: _optional_str_or_list(v, w, "OptionalStringOrList"),
    "max_thinking_tokens": _uint,
    "return_sampling_mask": lambda v, w: _bool_or_list(v, w, "BoolOrList"),
    "return_routed_experts": expect_bool,  # (GenerateReqInput's bool; the v1 contract ignores it)
}
_NOT_NULL = {"return_prompt_token_ids": expect_bool, "routed_experts_start_len": expect_int}  # contract: no null


@dataclass
class GenerateCall:
    """A parsed /generate body."""

    prompts: list  # token-id lists
    single: bool  # a flat input_ids (answered with one object when n == 1)
    n: int
    sampling: list  # per prompt: the decoded SamplingParams fields (dict)
    params: list  # per prompt: SamplingParams (seed = the prompt's sampling_seed or None)
    return_logprob: bool
    rids: list  # per prompt: the rid sent for it, or None
    rid: str | None  # the request's rid when a single string was sent
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    ids: list = field(default_factory=list)  # meta_info.id per sample, filled by assign_ids


def _check_values(s: dict, where: str) -> None:
    """SGLang's SamplingParams.verify (same texts), then what this engine cannot honour."""
    t = s["temperature"]
    if not math.isfinite(t) or t < 0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {t}.")
    if not 0.0 < s["top_p"] <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {s['top_p']}.")
    if not 0.0 <= s["min_p"] <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {s['min_p']}.")
    if s["top_k"] < 1 and s["top_k"] != -1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {s['top_k']}.")
    if not 0.0 < s["repetition_penalty"] <= 2.0:
        raise BadRequest(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {s['repetition_penalty']}.")
    if s["max_new_tokens"] is not None and s["max_new_tokens"] < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {s['max_new_tokens']}.")
    if s["n"] < 1:
        raise BadRequest(f"{where}.n must be at least 1, got {s['n']}.")
    seed = s["sampling_seed"]
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        raise BadRequest(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    unsupported = {
        "stop": lambda v: not v,
        "stop_regex": lambda v: not v,
        "min_p": lambda v: v == 0,
        "frequency_penalty": lambda v: v == 0,
        "presence_penalty": lambda v: v == 0,
        "min_new_tokens": lambda v: v == 0,
        "json_schema": lambda v: not v,
        "regex": lambda v: not v,
        "ebnf": lambda v: not v,
        "structural_tag": lambda v: not v,
        "logit_bias": lambda v: not v,
        "custom_params": lambda v: not v,
        "beam_width": lambda v: v in (None, 1),
        "choice": lambda v: not v,
        "watermark": lambda v: not v or not v.get("enabled"),
    }
    for key, ok in unsupported.items():
        if not ok(s[key]):
            raise BadRequest(f"{where}.{key}={s[key]!r} is not supported by the embedded engine")


def parse_generate_request(body) -> GenerateCall:
    """A /generate JSON body -> :class:`GenerateCall`; raises :class:`ContractError` (SGLang's contract
    refuses it) or :class:`BadRequest` (SGLang refuses the values, or this engine cannot honour them)."""
    if not isinstance(body, dict):
        raise ContractError(f"invalid type: {_unexpected(body)}, expected struct GenerateRequest")
    for key, check in _TOP_LEVEL_TYPES.items():
        if body.get(key) is not None:
            check(body[key], key)
    for key, check in _NOT_NULL.items():
        if key in body:
            check(body[key], key)
    if body.get("input_ids") is not None:
        _token_ids_or_list(body["input_ids"], "input_ids")
    raw_sp = body.get("sampling_params")
    if raw_sp is not None and isinstance(raw_sp, list):
        decoded_sp = [
            decode_sampling_params(e, f"sampling_params[{k}]")
            for k, e in enumerate(expect_seq(raw_sp, "sampling_params"))
        ]
    elif raw_sp is not None:
        expect_map(raw_sp, "sampling_params", "a value or an array of values for SamplingParamsOrList")
        decoded_sp = decode_sampling_params(raw_sp)
    else:
        decoded_sp = decode_sampling_params({})

    for key, (ok, hint) in _UNSUPPORTED.items():
        if key in body and not ok(body[key]):
            raise BadRequest(
                f"field '{key}'={body[key]!r:.200} is not supported by the embedded engine"
                + (f": {hint}" if hint else "")
            )
    ids = body.get("input_ids")
    if ids is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if not ids:
        raise BadRequest("input_ids must not be empty")
    single = not isinstance(ids[0], list)
    prompts = [ids] if single else ids
    for i, p in enumerate(prompts):
        if not p:
            raise BadRequest(f"input_ids[{i}] must be a non-empty list of token ids")

    per_prompt = decoded_sp if isinstance(decoded_sp, list) else [decoded_sp] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise BadRequest(f"sampling_params lists {len(per_prompt)} entries for {len(prompts)} prompts")
    n = per_prompt[0]["n"]
    if any(s["n"] != n for s in per_prompt):
        raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
    params = []
    for i, s in enumerate(per_prompt):
        where = "sampling_params" if not isinstance(decoded_sp, list) else f"sampling_params[{i}]"
        _check_values(s, where)
        temperature, top_k = s["temperature"], s["top_k"]
        if top_k == -1 or top_k >= TOP_K_ALL:
            top_k = -1
        params.append(
            SamplingParams(
                temperature=temperature if temperature > 0 else 0.0,
                top_p=s["top_p"],
                top_k=top_k,
                max_new_tokens=s["max_new_tokens"],
                stop_token_ids=list(s["stop_token_ids"] or []),
                seed=s["sampling_seed"],
                repetition_penalty=s["repetition_penalty"],
            )
        )

    rid = body.get("rid")
    if isinstance(rid, list):
        if len(rid) != len(prompts) or single:
            raise BadRequest("The specified rids length mismatch with the batch_size for batch processing.")
        if len(set(rid)) != len(rid):
            raise BadRequest(
                f"Duplicate request IDs detected within the request: "
                f"{sorted(r for r, c in collections.Counter(rid).items() if c > 1)}"
            )
        rids, single_rid = list(rid), None
    else:
        rids, single_rid = [rid] * len(prompts), rid
    return_logprob = body.get("return_logprob")
    if isinstance(return_logprob, list):
        if len(set(return_logprob)) > 1:
            raise BadRequest(
                "field 'return_logprob' as a per-prompt list of different values is not supported by the "
                "embedded engine"
            )
        return_logprob = bool(return_logprob and return_logprob[0])
    return GenerateCall(
        prompts=prompts,
        single=single,
        n=n,
        sampling=per_prompt,
        params=params,
        return_logprob=bool(return_logprob),
        rids=rids,
        rid=single_rid,
        return_text_in_logprobs=bool(body.get("return_text_in_logprobs")),
        return_prompt_token_ids=bool(body.get("return_prompt_token_ids", False)),
        return_routed_experts=bool(body.get("return_routed_experts")),
        routed_experts_start_len=int(body.get("routed_experts_start_len", 0)),
    )


def assign_ids(call: GenerateCall) -> list:
    """``meta_info.id`` of each sample (prompt-major), SGLang's naming where it is deterministic."""
    n, count = call.n, len(call.prompts) * call.n
    if call.single and n == 1:
        ids = [call.rid if call.rid is not None else uuid.uuid4().hex]
    elif call.rid is not None:
        ids = [f"{call.rid}_{k}" for k in range(count)]
    elif any(r is not None for r in call.rids):
        ids = [r if n == 1 else f"{r}_{j}" for r in call.rids for j in range(n)]
    else:
        ids = [uuid.uuid4().hex for _ in range(count)]
    call.ids = ids
    return ids


def finish_reason_json(c: Completion, max_new_tokens: int, abort_message: str | None = None) -> dict:
    """SGLang's ``finish_reason`` of a finished sample: ``FINISH_MATCHED_TOKEN``, ``FINISH_LENGTH`` or,
    aborted while running, ``FINISH_ABORT().to_json()`` (SGLang 0.5.23 ``schedule_batch.py``; every
    abort the HTTP API sends carries no message: "Aborted")."""
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.token_ids[-1]}
    if c.finish_reason == "abort":
        return {"type": "abort", "message": abort_message or "Aborted", "status_code": None, "err_type": None}
    return {"type": "length", "length": max_new_tokens}


def visible_spans(spans: list, num_tokens: int) -> list:
    """SGLang 0.5.23's ``add_weight_versions_to_meta_info``: the spans cut to the ``num_tokens``
    output tokens the answer holds (an empty first span stays)."""
    return [{**s, "end": min(s["end"], num_tokens)} for s in spans if s["start"] < num_tokens or s["start"] == 0]


def waiting_abort_to_sglang(
    c: Completion,
    *,
    prompt: list,
    rid: str,
    weight_version,
    interval: int,
    return_logprob: bool,
    tokenizer=None,
    e2e_latency: float | None = None,
    return_text_in_logprobs: bool = False,
    return_prompt_token_ids: bool = False,
    abort_message: str | None = None,
) -> dict:
    """A sample aborted in SGLang's waiting queue -- before it ran, or retracted by a pause --, in
    the shape SGLang 0.5.23's ``TokenizerManager._handle_abort_req`` answers: finish_reason
    ``{"type": "abort", "message": "Abort in waiting queue"}``, no ``prompt_tokens``/``cached_tokens``,
    and only the output the tokenizer manager had received: a request that does not stream is sent
    its tokens every ``SGLANG_FORCE_STREAM_INTERVAL`` (``interval``) tokens, so the answer holds the
    first ``interval * (len // interval)`` tokens, their log-probs, and the scheduler's spans
    (``_make_abort_req``: over every token) cut to them."""
    kept = interval * (len(c.token_ids) // interval) if interval > 0 else 0
    spans = visible_spans(weight_version_spans(c.versions, weight_version, len(c.token_ids)), kept)
    meta = {
        "id": rid,
        "finish_reason": {"type": "abort", "message": abort_message or "Abort in waiting queue"},
        "weight_version": spans[-1]["version"],
        "weight_versions": spans,
    }
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    tokens = list(c.token_ids[:kept])
    if return_logprob:
        texts = [None] * kept
        if return_text_in_logprobs and tokenizer is not None:
            texts = [tokenizer.decode([t]) for t in tokens]
        meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(c.logprobs[:kept], tokens, texts)]
    meta["completion_tokens"] = kept
    out = {"output_ids": tokens, "meta_info": meta}
    if tokenizer is not None:
        out = {"text": tokenizer.decode(tokens), **out}
    if return_prompt_token_ids:
        out["prompt_token_ids"] = list(prompt)
    return out


def version_name(version) -> str:
    """A weight version as SGLang reports it: its string, ``"default"`` before any was set."""
    return DEFAULT_WEIGHT_VERSION if version is None else str(version)


def weight_version_spans(versions, current, num_tokens: int) -> list:
    """``meta_info["weight_versions"]`` as SGLang 0.5.23 reports it (``srt/utils/weight_versions.py``:
    ``compute_weight_version_spans`` in the scheduler, then ``add_weight_versions_to_meta_info``):
    the output tokens as spans ``{"version", "start", "end"}`` of consecutive tokens of one version.
    SGLang records, at each version change, how many tokens each live request holds, so its spans
    are the runs of the per-token versions; an output with no token is one empty span of the current
    version. ``versions``: one per token (engine values; None = SGLang's default name), or None when
    unknown (every token then counts as ``current``)."""
    if versions is None:
        versions = [current] * num_tokens
    if len(versions) != num_tokens:
        raise ValueError(f"weight_version_spans: {len(versions)} versions for {num_tokens} tokens")
    spans = []
    for k, v in enumerate(versions):
        name = version_name(v)
        if spans and spans[-1]["version"] == name:
            spans[-1]["end"] = k + 1
        else:
            spans.append({"version": name, "start": k, "end": k + 1})
    return spans or [{"version": version_name(current), "start": 0, "end": 0}]


def completion_to_sglang(
    c: Completion,
    *,
    prompt: list,
    max_new_tokens: int,
    return_logprob: bool,
    rid: str,
    weight_version,
    tokenizer=None,
    sampling: dict | None = None,
    e2e_latency: float | None = None,
    return_text_in_logprobs: bool = False,
    return_prompt_token_ids: bool = False,
    abort_message: str | None = None,
    routing: tuple | None = None,
    waiting_interval: int | None = None,
) -> dict:
    """One sample in SGLang's /generate response shape. ``routing`` = (start, the model's layer count,
    the layer index of each recorded MoE layer): ``meta_info["routed_experts"]`` as SGLang 0.5.23
    returns it (``--enable-return-routed-experts``): int32 [tokens, layers, top_k] for the positions
    ``[start, prompt + response - 1)``, base64; a dense layer's rows are zeros, as in SGLang's
    zero-initialised capture buffer. ``weight_version``: the engine's version now (the version of an
    output with no token); ``meta_info["weight_versions"]`` holds the spans of ``c.versions``
    (:func:`weight_version_spans`) and ``meta_info["weight_version"]`` the last span's version.
    ``waiting_interval`` (an aborted sample SGLang would find in its waiting queue): the answer is
    :func:`waiting_abort_to_sglang`'s with that stream interval."""
    if waiting_interval is not None and c.finish_reason == "abort":
        return waiting_abort_to_sglang(
            c,
            prompt=prompt,
            rid=rid,
            weight_version=weight_version,
            interval=waiting_interval,
            return_logprob=return_logprob,
            tokenizer=tokenizer,
            e2e_latency=e2e_latency,
            return_text_in_logprobs=return_text_in_logprobs,
            return_prompt_token_ids=return_prompt_token_ids,
            abort_message=abort_message,
        )
    sampling = sampling or {}
    reason = finish_reason_json(c, max_new_tokens, abort_message)
    spans = weight_version_spans(c.versions, weight_version, len(c.token_ids))
    meta = {
        "id": rid,
        "finish_reason": reason,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(c.token_ids),
        "cached_tokens": 0,
        "weight_version": spans[-1]["version"],
        "weight_versions": spans,
    }
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    if return_logprob:
        texts = [None] * len(c.token_ids)
        if return_text_in_logprobs and tokenizer is not None:
            texts = [tokenizer.decode([t]) for t in c.token_ids]
        meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(c.logprobs, c.token_ids, texts)]
    out = {"output_ids": list(c.token_ids), "meta_info": meta}
    if tokenizer is not None:
        shown = c.token_ids
        if reason["type"] == "stop" and shown and not sampling.get("no_stop_trim", False):
            shown = shown[:-1]  # SGLang's detokenizer trims the matched stop token
        kwargs = {"skip_special_tokens": sampling.get("skip_special_tokens", True)}
        out = {"text": tokenizer.decode(shown, **kwargs), **out}
    if return_prompt_token_ids:
        out["prompt_token_ids"] = list(prompt)
    if routing is not None and c.routed_experts is not None:
        import torch

        from megatron_klear.rollout.sglang import encode_routed_experts

        start, num_layers, layers = routing
        rec = torch.as_tensor(c.routed_experts)[start:]
        full = torch.zeros((rec.shape[0], num_layers, rec.shape[2]), dtype=torch.int32)
        full[:, layers] = rec.to(torch.int32)
        meta["routed_experts"] = encode_routed_experts(full.numpy())
    return out


def control_fields(body, spec: dict, required=()) -> dict:
    """Type-check a control body: ``spec`` maps a key to (checker, default); unknown keys are
    ignored, as SGLang's request structs do."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {_unexpected(body)}")
    for key in required:
        if body.get(key) is None:
            raise BadRequest(f"field '{key}' is required")
    out = {}
    for key, (check, default) in spec.items():
        value = body.get(key)
        out[key] = default if value is None else check(value, key)
    return out
