"""The embedded engine over HTTP: a small server speaking a subset of SGLang's native API, and a client.

Server (standard library only, bound to 127.0.0.1)::

    python -m megatron_klear.rollout.embedded --model DIR --port P [--dtype float32] [--max-batch-size N]
        [--context-length C] [--served-model-name NAME] [--batch-window-ms MS] [--weight-sync-timeout S]

It stands in for SGLang 0.5.23 in the tests (SGLang needs CUDA), so it answers like SGLang wherever a
client relies on it: request validation (``sglang/api/v1/api_types.py``, the contract SGLang's
``/generate`` enforces, and ``sampling_params.py``), context length (``tokenizer_manager.py``
``_validate_one_request``), EOS (``schedule_batch.py`` ``_check_token_based_finish``), response and
error shapes, and the control routes (``http_server.py``).

Generation
----------
``POST /generate`` (also PUT) with token ids: ``{"input_ids": [...] | [[...], ...], "sampling_params":
{...} | [{...} per prompt], "return_logprob": bool, "rid": str | [str per prompt], ...}``.

- Answers, per sample, ``{"text"?, "output_ids": [...], "meta_info": {"id", "finish_reason":
  {"type": "stop", "matched": id} | {"type": "length", "length": max_new_tokens} | {"type": "abort",
  "message", "status_code": null, "err_type": null}, "prompt_tokens", "completion_tokens",
  "cached_tokens": 0, "weight_version", "e2e_latency", "output_token_logprobs"?: [[logprob, id,
  text|null], ...]}, "prompt_token_ids"?}``: one object for a single (flat) ``input_ids`` with
  ``n == 1``, else a list ordered prompt by prompt (sample ``j`` of prompt ``i`` at ``i * n + j``,
  as SGLang's ``_handle_batch_request`` expands parallel samples). ``text`` (decoded with
  ``skip_special_tokens``, the matched stop token trimmed unless ``no_stop_trim``, as SGLang's
  detokenizer does) is present when the server has a tokenizer. ``meta_info.id``: the ``rid`` for a
  single request, ``{rid}_{k}`` for sample ``k`` of a batch or ``n > 1`` (SGLang gives those fresh
  uuids), a uuid when no rid is sent. ``weight_version`` is ``"default"`` until weights are updated
  with a version (SGLang's default).
- Sampling: ``temperature`` (below 1e-6: greedy, SGLang's rule), ``top_p``, ``top_k`` (-1 or
  2^30: off), ``max_new_tokens`` (default 128; 0 gives an empty response; null: up to the context,
  as SGLang), ``n``, ``stop_token_ids``, ``ignore_eos``, ``sampling_seed``; ``skip_special_tokens``
  and ``no_stop_trim`` shape the text; ``spaces_between_special_tokens`` and ``stream_interval`` are
  accepted and have no effect.
  The log-probs are the engine's: ``log_softmax(logits / temperature)``, unfiltered (see
  :mod:`megatron_klear.rollout.embedded.sampling`). Stop ids: the checkpoint's EOS ids (config.json,
  generation_config.json, the tokenizer's EOS: see :mod:`.embedded`) plus ``stop_token_ids``.
- Seeds: sample ``j`` of prompt ``i`` of a request draws from ``sample_seed(s, i, j)`` with ``s``
  that prompt's ``sampling_seed`` (a random one when absent), whatever else is being decoded: the
  tokens do not depend on the requests it happens to be batched with. (SGLang honours
  ``sampling_seed`` only with deterministic inference, and then gives the ``n`` samples one seed.)
- Batching: requests waiting when the engine becomes free are decoded together in one engine call
  (at most ``--max-batch-size`` sequences, whole prompts, in arrival order), each prompt with its own
  sampling parameters; a request answers as soon as its own samples have finished. A running batch
  admits no newcomers (no continuous batching), so an idle engine first lets concurrent arrivals
  gather (until none came for 5 ms, at most ``--batch-window-ms``, default 50).
- Validation, as SGLang: the body is checked against SGLang's contract types for the fields this
  server reads (a violation answers 400 ``{"error": "<serde-style message>"}``, the shape of SGLang's
  contract gate; e.g. an unknown ``sampling_params`` key gets ``unknown field `x`, expected one of
  ...``); top-level keys SGLang does not know are ignored (sglang-router adds ``model``, ``stream``,
  ``log_metrics``, ``return_hidden_states``, ``background``, ``no_logs``, ``return_bytes``,
  ``return_entropy``, ``return_text_in_logprobs``). Values SGLang would refuse (``top_p`` outside
  (0, 1], ...) and requests over the context length (SGLang's two messages: ``The input (N tokens)
  is longer than the model's context length (C tokens).`` and ``Requested token count exceeds the
  model's maximum context length of C tokens. ...``) answer 400 ``{"error": {"message"}}``, as do
  options this server cannot honour, naming the field rather than ignoring it: text prompts,
  ``stream: true``, images/audio/video, input embeddings, ``logprob_start_len`` other than -1, top
  log-probs, ``token_ids_logprob``, hidden states, LoRA, sessions, custom logit processors,
  penalties, ``min_p``, ``min_new_tokens``, string/regex stops, grammars, ``logit_bias``, beam search,
  ``return_entropy`` and the like.

Other routes (SGLang's shapes)
------------------------------
- ``GET /health`` (200, empty body; answers at once, also during a long generation),
  ``GET /health_generate`` (200 once the engine makes progress or a 1-token generation completes,
  503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds, default 20, e.g. while paused), ``GET /ready``
  (200, 503 while paused).
- ``GET /model_info`` and ``/get_model_info``: ``model_path``, ``served_model_name``,
  ``tokenizer_path``, ``is_generation``, ``weight_version``, ``model_type``, ``architectures`` ...
  plus ``vocab_size``, ``eos_token_ids``, ``context_length``, ``dtype``.
- ``GET /server_info`` and ``/get_server_info``: ``context_length`` and ``max_context_length`` (the
  effective context length), ``max_total_num_tokens`` (null: no KV pool bound), ``max_req_input_len``,
  ``max_running_requests`` (``--max-batch-size``), ``version`` (the SGLang API version mimicked),
  ``internal_states`` and ``num_generate_requests`` (the /generate requests accepted so far).
- ``GET /v1/models`` (``{"object": "list", "data": [{"id", "object": "model", "created", "owned_by",
  "root", "parent", "max_model_len"}]}``) and ``GET /v1/models/{name}`` (404 for another name).
- ``POST /pause_generation`` ``{"mode": "abort" | "retract" | "in_place"}`` (default abort) and
  ``POST /continue_generation``: while paused, new /generate requests wait until continue; ``abort``
  ends the queued and running requests (finish_reason abort, the tokens so far) and answers once
  none runs; ``in_place`` holds the running ones between two decode steps with their KV cache,
  ``retract`` also recomputes their KV cache with the current weights on continue; both answer once
  the engine holds. Weights may be updated while paused.
- ``POST /update_weights_from_disk`` ``{"model_path", "weight_version"?, "abort_all_requests"?,
  "flush_cache"?, "load_format"? (auto | safetensors), ...}`` (SGLang's UpdateWeightFromDiskReqInput
  fields; the rest are accepted and have no effect here): not paused, it waits for the running
  requests to finish and holds new ones meanwhile (SGLang's writer lock); paused, it applies at once.
  Every tensor is read and checked before the first copy, so the weights are either all new or all
  old. Answers ``{"success", "message", "num_paused_requests"}``, 400 with ``success: false`` on
  failure.
- Weights over a process group, SGLang's ``update_weights_from_distributed`` protocol (the trainer
  side is :class:`megatron_klear.rollout.weight_sync.DistributedWeightSync`; the group and bucket
  layout are :mod:`megatron_klear.rollout.weight_sync.update_group`):
  ``POST /init_weights_update_group`` ``{"master_address", "master_port", "rank_offset",
  "world_size", "group_name" (default "weight_update_group"), "backend"}`` joins the group as rank
  ``rank_offset`` (this server is one TP rank) through the sender's TCP store and answers once the
  whole group has formed (gloo; nccl needs a CUDA engine), or fails after ``--weight-sync-timeout``
  seconds; ``POST /destroy_weights_update_group`` ``{"group_name"}`` leaves it;
  ``POST /begin_weight_update`` / ``POST /end_weight_update`` open and close a session (SGLang
  0.5.23 refuses updates outside one, and a second begin);
  ``POST /update_weights_from_distributed`` ``{"names", "dtypes", "shapes", "group_name",
  "load_format"?, "flush_cache", "weight_version"?, "abort_all_requests"}`` receives the tensors
  broadcast by group rank 0: one broadcast per tensor in order, or one ``uint8`` broadcast for
  ``load_format="flattened_bucket"``. All or nothing, unlike SGLang (which loads each call as it
  arrives): the tensors are checked and staged, and ``/end_weight_update`` makes every staged
  tensor a parameter at once (the received buffers become the parameters' storage, no copy; between
  two decode steps, as a disk update) with the last ``weight_version`` given; a session with any failed call (a broadcast cut by a dead peer or a timeout, an unknown
  tensor, a refused flush) applies nothing, its end answers 400 naming the version still served,
  and destroying a group discards what its sender staged. ``flush_cache`` fails the call as SGLang
  does while requests hold KV cache of the old weights (running, or paused ``in_place``; paused
  with ``retract`` they recompute it). A broadcast that fails drops the group.
  ``GET``/``POST /weights_checker`` ``{"action": "checksum"}``: per-parameter sha256 prefixes in
  SGLang's answer shape (``ranks``, ``per_engine_checksum``); other actions answer 400.
  ``/server_info`` reports ``tp_size``, ``pp_size``, ``dp_size`` (1) for the trainer's rank layout.
- ``POST /update_weight_version`` ``{"new_version", "abort_all_requests" (default true)}``. (SGLang
  0.5.23 has no route reading the version alone: it is ``weight_version`` in ``/model_info``.)
- ``POST /abort_request`` ``{"rid" | "abort_all"}`` (200, empty body): aborts the requests whose id
  or a sample's id starts with ``rid`` (the whole request), queued or running.
- ``POST``/``GET /flush_cache``: 200 (nothing is cached between requests here).
- ``POST /release_memory_occupation`` / ``POST /resume_memory_occupation`` ``{"tags"?}`` (``weights``,
  ``kv_cache``, ``cuda_graph``; none or empty: all), for servers colocated with the trainer
  (``rollout.colocate``). Release needs an idle server (SGLang asserts it). With
  ``--enable-memory-saver`` releasing ``weights`` frees the parameters and resuming gives them back
  with their content lost (NaN), as SGLang's memory saver does, so a weight update must follow;
  without it the tags are only recorded (SGLang's no-op saver). Stricter than SGLang, which would
  run them on freed memory: while ``weights`` or ``kv_cache`` is released ``/generate`` answers 503
  and weight updates 400, and resuming a tag that is not released answers 400 (SGLang's scheduler
  fails on it). ``/server_info`` reports ``enable_memory_saver``.

Unknown routes answer 404 ``{"detail": "Not Found"}``; failures inside the engine 500 ``{"error":
{"message"}}``.

Client: :class:`EmbeddedHTTPEngine` implements :class:`~megatron_klear.rollout.base.RolloutEngine`
over that API (the SGLang client); :meth:`EmbeddedHTTPEngine.launch` starts a server subprocess.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_klear.rollout.base import Completion, SamplingParams
from megatron_klear.rollout.sglang import MEMORY_TAGS, SGLangEngine

HOST = "127.0.0.1"
MAX_BODY_BYTES = 1 << 30
SGLANG_API_VERSION = "0.5.23"  # the SGLang release whose API this server mimics
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k
DEFAULT_WEIGHT_VERSION = "default"  # SGLang's --weight-version default
DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name for weight updates
PAUSE_MODES = ("abort", "retract", "in_place")
_RELEASED_WEIGHTS = ("the weights are released (release_memory_occupation): resume_memory_occupation with tag "
                     "'weights' before updating them")


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


def _bool(v, where, expected="a boolean"):
    if not isinstance(v, bool):
        raise _invalid(where, v, expected)
    return v


def _int(v, where, expected="i64"):
    if not _is_int(v):
        raise _invalid(where, v, expected)
    return v


def _uint(v, where, expected="u64"):
    _int(v, where, expected)
    if v < 0:
        raise ContractError(f"{where}: invalid value: integer `{v}`, expected {expected}")
    return v


def _float(v, where, expected="f64"):
    if not (isinstance(v, (int, float)) and not isinstance(v, bool)):
        raise _invalid(where, v, expected)
    return float(v)


def _str(v, where, expected="a string"):
    if not isinstance(v, str):
        raise _invalid(where, v, expected)
    return v


def _seq(v, where, expected="a sequence"):
    if not isinstance(v, list):
        raise _invalid(where, v, expected)
    return v


def _map(v, where, expected="a map"):
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


def _token_ids(v, where):
    return [_int(e, f"{where}[{k}]") for k, e in enumerate(_seq(v, where))]


def _str_list(v, where):
    return [_str(e, f"{where}[{k}]") for k, e in enumerate(_seq(v, where))]


def _token_ids_or_list(v, where):
    if not isinstance(v, list):
        raise _invalid(where, v, "a value or an array of values for TokenIdsOrList")
    if not v or (isinstance(v[0], (int, float)) and not isinstance(v[0], bool)):
        return _token_ids(v, where)
    return [_token_ids(e, f"{where}[{k}]") for k, e in enumerate(v)]


def _optional_str(v, where, expected="a string"):
    return None if v is None else _str(v, where, expected)


_str_or_list = _or_list(_str)
_bool_or_list = _or_list(_bool)
_int_or_list = _or_list(_int)
_optional_str_or_list = _or_list(_optional_str)

# SamplingParams, in the contract's order (its unknown-field message lists them so); (kind, default).
SAMPLING_FIELDS = {
    "max_new_tokens": ("int", 128), "stop": ("str_or_list", None), "stop_token_ids": ("int_list", None),
    "stop_regex": ("str_or_list", None), "temperature": ("float", 1.0), "top_p": ("float", 1.0),
    "top_k": ("int", TOP_K_ALL), "min_p": ("float", 0.0), "frequency_penalty": ("float", 0.0),
    "presence_penalty": ("float", 0.0), "repetition_penalty": ("float", 1.0), "min_new_tokens": ("int", 0),
    "n": ("int", 1), "json_schema": ("str", None), "regex": ("str", None), "ebnf": ("str", None),
    "structural_tag": ("str", None), "ignore_eos": ("bool", False), "skip_special_tokens": ("bool", True),
    "spaces_between_special_tokens": ("bool", True), "no_stop_trim": ("bool", False),
    "stream_interval": ("int", None), "logit_bias": ("map_float", {}), "sampling_seed": ("int", None),
    "custom_params": ("any", None), "beam_width": ("int", None), "watermark": ("watermark", None),
    "choice": ("str_list", []),
}
_WATERMARK_FIELDS = {"enabled": _bool, "key": _str, "context_window": _int}


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
    _map(sp, where, "struct SamplingParams")
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
            out[key] = _int(x, at)
        elif kind == "float":
            out[key] = _float(x, at)
        elif kind == "bool":
            out[key] = _bool(x, at)
        elif kind == "str":
            out[key] = _str(x, at)
        elif kind == "str_or_list":
            out[key] = _str_or_list(x, at, "StringOrList")
        elif kind == "int_list":
            out[key] = _token_ids(x, at)
        elif kind == "map_float":
            out[key] = {k: _float(e, f"{at}.{k}") for k, e in _map(x, at).items()}
        elif kind == "str_list":
            out[key] = [_str(e, f"{at}[{k}]") for k, e in enumerate(_seq(x, at))]
        elif kind == "watermark":
            for wk, wx in _map(x, at, "struct WatermarkRequestConfig").items():
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
    "image_data": (_default_or(None), ""), "video_data": (_default_or(None), ""), "audio_data": (_default_or(None), ""),
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
    "lora_path": (_default_or(None), ""), "lora_id": (_default_or(None), ""),
    "session_params": (_default_or(None), ""), "custom_logit_processor": (_default_or(None), ""),
    "positional_embed_overrides": (_default_or(None), ""), "max_thinking_tokens": (_default_or(None), ""),
    "require_reasoning": (_default_or(None, False), ""),
    "multi_item_delimiter_indices": (_default_or(None), ""), "token_indices_to_pool": (_default_or(None), ""),
    "use_audio_in_video": (_default_or(None, False), ""),
}
# Contract types of the top-level fields read or refused here (others are ignored, as SGLang's
# GenerateRequest ignores unknown keys).
_TOP_LEVEL_TYPES = {
    "rid": lambda v, w: _str_or_list(v, w, "StringOrList"),
    "text": lambda v, w: _str_or_list(v, w, "StringOrList"),
    "stream": _bool,
    "return_logprob": lambda v, w: _bool_or_list(v, w, "BoolOrList"),
    "logprob_start_len": lambda v, w: _int_or_list(v, w, "Int64OrList"),
    "top_logprobs_num": lambda v, w: _int_or_list(v, w, "Int64OrList"),
    "token_ids_logprob": _token_ids_or_list,
    "return_hidden_states": lambda v, w: _bool_or_list(v, w, "BoolOrList"),
    "return_text_in_logprobs": _bool,
    "require_reasoning": _bool,
    "lora_path": lambda v, w: _optional_str_or_list(v, w, "OptionalStringOrList"),
    "custom_logit_processor": lambda v, w: _optional_str_or_list(v, w, "OptionalStringOrList"),
    "max_thinking_tokens": _uint,
    "return_sampling_mask": lambda v, w: _bool_or_list(v, w, "BoolOrList"),
    "return_routed_experts": _bool,  # (GenerateReqInput's bool; the v1 contract ignores it)
}
_NOT_NULL = {"return_prompt_token_ids": _bool, "routed_experts_start_len": _int}  # contract: no null


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
    if s["max_new_tokens"] is not None and s["max_new_tokens"] < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {s['max_new_tokens']}.")
    if s["n"] < 1:
        raise BadRequest(f"{where}.n must be at least 1, got {s['n']}.")
    seed = s["sampling_seed"]
    if seed is not None and not -(2 ** 63) <= seed <= 2 ** 63 - 1:
        raise BadRequest(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    unsupported = {
        "stop": lambda v: not v, "stop_regex": lambda v: not v, "min_p": lambda v: v == 0,
        "frequency_penalty": lambda v: v == 0, "presence_penalty": lambda v: v == 0,
        "repetition_penalty": lambda v: v == 1, "min_new_tokens": lambda v: v == 0,
        "json_schema": lambda v: not v, "regex": lambda v: not v, "ebnf": lambda v: not v,
        "structural_tag": lambda v: not v, "logit_bias": lambda v: not v, "custom_params": lambda v: not v,
        "beam_width": lambda v: v in (None, 1), "choice": lambda v: not v,
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
        decoded_sp = [decode_sampling_params(e, f"sampling_params[{k}]") for k, e in enumerate(_seq(raw_sp, "sampling_params"))]
    elif raw_sp is not None:
        _map(raw_sp, "sampling_params", "a value or an array of values for SamplingParamsOrList")
        decoded_sp = decode_sampling_params(raw_sp)
    else:
        decoded_sp = decode_sampling_params({})

    for key, (ok, hint) in _UNSUPPORTED.items():
        if key in body and not ok(body[key]):
            raise BadRequest(f"field '{key}'={body[key]!r:.200} is not supported by the embedded engine"
                             + (f": {hint}" if hint else ""))
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
        params.append(SamplingParams(temperature=temperature if temperature > 0 else 0.0, top_p=s["top_p"], top_k=top_k,
                                     max_new_tokens=s["max_new_tokens"], stop_token_ids=list(s["stop_token_ids"] or []),
                                     seed=s["sampling_seed"]))

    rid = body.get("rid")
    if isinstance(rid, list):
        if len(rid) != len(prompts) or single:
            raise BadRequest("The specified rids length mismatch with the batch_size for batch processing.")
        if len(set(rid)) != len(rid):
            raise BadRequest(f"Duplicate request IDs detected within the request: "
                             f"{sorted(r for r, c in collections.Counter(rid).items() if c > 1)}")
        rids, single_rid = list(rid), None
    else:
        rids, single_rid = [rid] * len(prompts), rid
    return_logprob = body.get("return_logprob")
    if isinstance(return_logprob, list):
        if len(set(return_logprob)) > 1:
            raise BadRequest("field 'return_logprob' as a per-prompt list of different values is not supported by the "
                             "embedded engine")
        return_logprob = bool(return_logprob and return_logprob[0])
    return GenerateCall(prompts=prompts, single=single, n=n, sampling=per_prompt, params=params,
                        return_logprob=bool(return_logprob), rids=rids, rid=single_rid,
                        return_text_in_logprobs=bool(body.get("return_text_in_logprobs")),
                        return_prompt_token_ids=bool(body.get("return_prompt_token_ids", False)),
                        return_routed_experts=bool(body.get("return_routed_experts")),
                        routed_experts_start_len=int(body.get("routed_experts_start_len", 0)))


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
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.token_ids[-1]}
    if c.finish_reason == "abort":
        return {"type": "abort", "message": abort_message or "Aborted", "status_code": None, "err_type": None}
    return {"type": "length", "length": max_new_tokens}


def completion_to_sglang(c: Completion, *, prompt: list, max_new_tokens: int, return_logprob: bool, rid: str,
                         weight_version, tokenizer=None, sampling: dict | None = None, e2e_latency: float | None = None,
                         return_text_in_logprobs: bool = False, return_prompt_token_ids: bool = False,
                         abort_message: str | None = None, routing: tuple | None = None) -> dict:
    """One sample in SGLang's /generate response shape. ``routing`` = (start, the model's layer count,
    the layer index of each recorded MoE layer): ``meta_info["routed_experts"]`` as SGLang 0.5.23
    returns it (``--enable-return-routed-experts``): int32 [tokens, layers, top_k] for the positions
    ``[start, prompt + response - 1)``, base64; a dense layer's rows are zeros, as in SGLang's
    zero-initialised capture buffer."""
    sampling = sampling or {}
    reason = finish_reason_json(c, max_new_tokens, abort_message)
    meta = {"id": rid, "finish_reason": reason, "prompt_tokens": len(prompt), "completion_tokens": len(c.token_ids),
            "cached_tokens": 0, "weight_version": DEFAULT_WEIGHT_VERSION if weight_version is None else str(weight_version)}
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


# ------------------------------------------------------------------------------------------------
# The scheduler: batches waiting requests into one engine call; pause / abort / weight updates
# ------------------------------------------------------------------------------------------------
class _Job:
    """One /generate request: its prompts (PromptRequests keyed by this job) and what comes back."""

    def __init__(self, requests: list, ids: list, rid=None):
        self.requests, self.ids, self.rid = requests, ids, rid
        self.rows = sum(len(r.seeds) for r in requests)
        self.results = [None] * len(requests)
        self.pending = len(requests)
        self.done = threading.Event()
        self.error = None
        self.aborted = False
        self.abort_message = None

    def matches(self, rid: str) -> bool:
        return any(isinstance(i, str) and i.startswith(rid) for i in [self.rid, *self.ids])

    def finish_aborted(self, message: str) -> None:
        self.aborted, self.abort_message = True, message
        for k, r in enumerate(self.requests):
            if self.results[k] is None:
                self.results[k] = [Completion(token_ids=[], logprobs=[], finish_reason="abort") for _ in r.seeds]
        self.done.set()


class Scheduler:
    """The engine's only caller: a thread that takes the requests waiting when the engine is free
    (in arrival order, at most ``max_batch_size`` sequences, at least one request) and decodes them
    in one :meth:`EmbeddedEngine.generate_requests` call. It is also the engine's ``control``
    (pause between steps, aborts).

    A batch does not admit requests that arrive while it decodes, so when the engine is idle and
    requests start arriving the scheduler lets them gather first: it takes them once no new one has
    come for ``settle`` seconds, or after ``window`` seconds (a client sending hundreds of requests
    at once then fills one batch instead of having its first request decoded alone)."""

    def __init__(self, engine, max_batch_size: int | None = None, *, window: float = 0.05, settle: float = 0.005):
        self.engine = engine
        self.max_batch_size = max_batch_size if max_batch_size is not None else getattr(engine, "max_batch_size", None)
        self.window, self.settle = float(window), float(settle)
        self.cond = threading.Condition()
        self.queue = collections.deque()
        self.running = []
        self.paused = None  # None | "abort" | "retract" | "in_place"
        self.parked = False  # the engine waits between two steps for continue
        self.updates = 0  # weight updates waiting for the running requests to finish
        self.abort_epoch = 0  # bumped by every abort of a running request (wakes a held engine)
        self.closed = False
        self.batches = 0
        self.history = collections.deque(maxlen=1024)  # (requests, sequences) of the recent engine calls
        self._thread = threading.Thread(target=self._loop, name="embedded-scheduler", daemon=True)
        self._thread.start()

    # -- the engine's control ----------------------------------------------------------------------
    def pause_mode(self):
        with self.cond:
            return self.paused if self.paused in ("in_place", "retract") and not self.closed else None

    def wait_while_paused(self) -> None:
        """Hold the engine until continue, or until an abort is to be served (the engine then ends
        the aborted rows and comes back while still paused)."""
        with self.cond:
            self.parked = True
            self.cond.notify_all()
            epoch = self.abort_epoch
            while self.paused in ("in_place", "retract") and not self.closed and self.abort_epoch == epoch:
                self.cond.wait()
            self.parked = False

    def aborted(self, job) -> bool:
        return job is not None and (job.aborted or self.closed)

    # -- requests -----------------------------------------------------------------------------------
    def submit(self, job: _Job, timeout: float | None = None) -> _Job:
        with self.cond:
            if self.closed:
                raise RuntimeError("the server is shutting down")
            self.queue.append(job)
            self.cond.notify_all()
        job.done.wait(timeout)
        return job

    def _gather(self) -> None:
        """(Holding the lock, the engine idle.) Let concurrent arrivals join before a batch starts."""
        end = time.monotonic() + self.window
        seen = len(self.queue)
        while not self.closed and not self.paused and not self.updates:
            if self.max_batch_size is not None and sum(job.rows for job in self.queue) >= self.max_batch_size:
                return
            left = end - time.monotonic()
            if left <= 0:
                return
            self.cond.wait(min(self.settle, left))
            if len(self.queue) == seen:
                return
            seen = len(self.queue)

    def _take(self) -> list:
        batch, rows = [], 0
        while self.queue:
            job = self.queue[0]
            if batch and self.max_batch_size is not None and rows + job.rows > self.max_batch_size:
                break
            batch.append(self.queue.popleft())
            rows += job.rows
        return batch

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.closed and (not self.queue or self.paused or self.updates):
                    self.cond.wait()
                if self.closed:
                    return
                self._gather()
                if self.closed:
                    return
                if not self.queue or self.paused or self.updates:
                    continue
                batch = self._take()
                self.running = batch
                self.batches += 1
                self.history.append((len(batch), sum(job.rows for job in batch)))
            owners = [(job, k) for job in batch for k in range(len(job.requests))]

            def on_done(i, completions, owners=owners):
                job, k = owners[i]
                job.results[k] = completions
                job.pending -= 1
                if job.pending == 0:
                    job.done.set()

            try:
                self.engine.generate_requests([job.requests[k] for job, k in owners], control=self, on_prompt_done=on_done)
            except Exception as e:  # noqa: BLE001 -- handed to the requests, answered by their handlers
                for job in batch:
                    if not job.done.is_set():
                        job.error = e
                        job.done.set()
            finally:
                with self.cond:
                    self.running = []
                    self.cond.notify_all()

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "Aborted") -> int:
        """Abort the queued and running requests matching ``rid`` (a prefix of their ids) or all."""
        count = 0
        with self.cond:
            for job in list(self.queue):
                if abort_all or job.matches(rid):
                    self.queue.remove(job)
                    job.finish_aborted(message)
                    count += 1
            for job in self.running:
                if abort_all or job.matches(rid):
                    job.aborted, job.abort_message = True, message
                    count += 1
                    self.abort_epoch += 1
            self.cond.notify_all()
        return count

    def pause(self, mode: str) -> None:
        with self.cond:
            self.paused = mode
            if mode == "abort":  # what runs or waits now ends; later requests wait for continue
                self.abort(abort_all=True, message="Aborted by /pause_generation (mode abort)")
            self.cond.notify_all()
        with self.cond:  # answer once nothing decodes: the running requests ended, or the engine holds
            while self.running and not self.closed and not (mode != "abort" and self.parked):
                self.cond.wait()

    def resume(self) -> None:
        with self.cond:
            self.paused = None
            self.cond.notify_all()

    def run_update(self, fn):
        """Run ``fn`` (a weight update) with no decoding under way: paused, at once (the held
        requests continue with the new weights); else after the running requests, holding new ones.
        Returns ``(fn(), number of requests held paused)``."""
        with self.cond:
            paused = self.paused is not None
            held = sum(1 for _ in self.running) if paused else 0
            if not paused:
                self.updates += 1
                while self.running and not self.closed:
                    self.cond.wait()
        try:
            return fn(), held
        finally:
            if not paused:
                with self.cond:
                    self.updates -= 1
                    self.cond.notify_all()

    def cache_flushable(self) -> bool:
        """SGLang's condition for flushing the cache after a weight update (``Scheduler.flush_cache``:
        fully idle, the waiting requests ignored while paused), asked during :meth:`run_update`: no
        request holds KV cache computed with the old weights. Paused with ``retract``, the held
        requests recompute theirs on continue; paused ``in_place``, they keep it (not flushable)."""
        with self.cond:
            return not self.running or self.paused == "retract"

    def stats(self) -> dict:
        with self.cond:
            return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.queue),
                    "paused": self.paused, "num_batches": self.batches}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            pending = list(self.queue)
            self.queue.clear()
            self.cond.notify_all()
        for job in pending:
            job.error = RuntimeError("the server shut down")
            job.done.set()


# ------------------------------------------------------------------------------------------------
# HTTP
# ------------------------------------------------------------------------------------------------
class _ServerState:
    def __init__(self, engine, tokenizer, tokenizer_path, served_model_name, max_batch_size, batch_window,
                 weight_sync_timeout: float = 600.0, return_routed_experts: bool = False,
                 enable_memory_saver: bool = False):
        self.engine, self.tokenizer = engine, tokenizer
        # --enable-memory-saver: releasing "weights" frees them (rollout.colocate); the tags released
        self.enable_memory_saver = bool(enable_memory_saver)
        self.offload_tags = set()
        self.memory_releases = 0
        # --enable-return-routed-experts: the engine records every token's experts (MoE models)
        self.return_routed_experts = bool(return_routed_experts) and bool(getattr(engine, "routed_layers", None))
        if self.return_routed_experts:
            engine.record_routing = True
        self.tokenizer_path = tokenizer_path
        self.served_model_name = served_model_name
        self.scheduler = Scheduler(engine, max_batch_size, window=batch_window)
        self.num_generate_requests = 0
        self.lock = threading.Lock()
        self.health_check_timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
        self.host, self.port = HOST, 0
        # weights over a process group (SGLang's update_weights_from_distributed): the groups joined,
        # the open begin/end session, and a lock that runs these calls one at a time, as SGLang's
        # scheduler does
        self.weight_sync_timeout = float(weight_sync_timeout)
        self.update_groups = {}
        self.weight_session = None
        self.receive_buffers = {}  # the storages the last commit replaced: the next update lands there
        self.adopted = set()  # data pointers of the received buffers the model holds
        self.weight_lock = threading.Lock()

    @property
    def model_path(self) -> str:
        return self.engine.model_path or ""

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def weight_version(self) -> str:
        v = self.engine.weight_version
        return DEFAULT_WEIGHT_VERSION if v is None else str(v)


class _Handler(BaseHTTPRequestHandler):
    server_version = "megatron-klear-embedded"
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY: an answer is written as headers then body; with Nagle's algorithm the body
    # waits for the client's delayed ACK of the headers, ~40 ms per request on Linux
    disable_nagle_algorithm = True

    def log_message(self, fmt, *args):  # no access log; errors are answered to the client
        pass

    # -- plumbing -----------------------------------------------------------------------------------
    def _send(self, status: int, payload=None, *, text: str | None = None) -> None:
        if text is not None:
            data, ctype = text.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = (b"" if payload is None else json.dumps(payload).encode()), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": message}})

    def _body(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise BadRequest(f"request body of {length} bytes is over the {MAX_BODY_BYTES}-byte limit")
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON ({e})") from None

    def _dispatch(self, method: str) -> None:
        path = urllib.parse.urlsplit(self.path).path
        gets = {"/health": self._health, "/health_generate": self._health_generate, "/ready": self._ready,
                "/model_info": self._model_info, "/get_model_info": self._model_info,
                "/server_info": self._server_info, "/get_server_info": self._server_info,
                "/v1/models": self._models, "/flush_cache": self._flush_cache,
                "/weights_checker": self._weights_checker}
        posts = {"/generate": self._generate, "/update_weights_from_disk": self._update_from_disk,
                 "/init_weights_update_group": self._init_group, "/destroy_weights_update_group": self._destroy_group,
                 "/begin_weight_update": self._begin_update, "/end_weight_update": self._end_update,
                 "/update_weights_from_distributed": self._update_from_distributed,
                 "/weights_checker": self._weights_checker,
                 "/update_weight_version": self._update_weight_version, "/pause_generation": self._pause,
                 "/continue_generation": self._continue, "/abort_request": self._abort,
                 "/flush_cache": self._flush_cache, "/release_memory_occupation": self._release_memory,
                 "/resume_memory_occupation": self._resume_memory}
        puts = {"/generate": self._generate}
        table = {"GET": gets, "POST": posts, "PUT": puts}[method]
        route = table.get(path)
        if route is None and method == "GET" and path.startswith("/v1/models/"):
            route = lambda body: self._model_card(urllib.parse.unquote(path[len("/v1/models/"):]))  # noqa: E731
        if route is None:
            known = any(path in t for t in (gets, posts, puts))
            self._send(405 if known else 404, {"detail": "Method Not Allowed" if known else "Not Found"})
            return
        try:
            route(self._body() if method != "GET" else None)
        except ContractError as e:
            self._send(400, {"error": str(e)})
        except BadRequest as e:
            self._error(400, str(e))
        except Exception as e:  # noqa: BLE001 -- answered, not swallowed: the client raises it
            self._error(500, f"{type(e).__name__}: {e}")

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    # -- health and info ----------------------------------------------------------------------------
    def _health(self, body) -> None:
        self._send(200)

    def _ready(self, body) -> None:
        self._send(503 if self.server.state.scheduler.paused else 200)

    def _health_generate(self, body) -> None:
        from megatron_klear.rollout.embedded import PromptRequest

        state = self.server.state
        steps = state.engine.decode_steps
        probe = PromptRequest(prompt=[0], params=SamplingParams(top_k=1, max_new_tokens=1), seeds=[0], max_new_tokens=1)
        job = _Job([probe], ids=[f"HEALTH_CHECK_{uuid.uuid4().hex}"])
        probe.key = job
        state.scheduler.submit(job, timeout=0)
        deadline = time.monotonic() + state.health_check_timeout
        while time.monotonic() < deadline:
            if job.done.wait(0.05) or state.engine.decode_steps > steps:
                if job.error is None:
                    state.scheduler.abort(job.ids[0], message="health check")
                    self._send(200)
                    return
                break
        state.scheduler.abort(job.ids[0], message="health check")
        self._send(503)

    def _model_info(self, body) -> None:
        state = self.server.state
        info = state.engine.model_info()
        self._send(200, {**info,
                         "model_path": state.model_path, "served_model_name": state.model_name,
                         "tokenizer_path": state.tokenizer_path or state.model_path, "is_generation": True,
                         "preferred_sampling_params": None, "weight_version": state.weight_version,
                         "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
                         "disaggregation_mode": "null", "has_image_understanding": False,
                         "has_audio_understanding": False})

    def _server_info(self, body) -> None:
        state = self.server.state
        engine, sched = state.engine, state.scheduler
        c = engine.context_length
        self._send(200, {
            "model_path": state.model_path, "served_model_name": state.model_name,
            "tokenizer_path": state.tokenizer_path or state.model_path,
            "context_length": c, "max_context_length": c, "max_total_num_tokens": None,
            "max_req_input_len": c - 1, "max_running_requests": sched.max_batch_size,
            "max_batch_size": sched.max_batch_size, "dtype": engine.model_info().get("dtype"),
            "device": str(engine.device), "host": state.host, "port": state.port,
            "tp_size": 1, "pp_size": 1, "dp_size": 1,
            "version": SGLANG_API_VERSION, "frontend": "megatron-klear-embedded",
            "weight_version": state.weight_version, "num_generate_requests": state.num_generate_requests,
            "internal_states": [sched.stats()], "incremental_streaming_output": False, "disaggregation_mode": "null",
            "enable_memory_saver": state.enable_memory_saver,
            # not SGLang's: what is released now, and how often memory was released (tests, operators)
            "released_memory_tags": sorted(state.offload_tags), "memory_releases": state.memory_releases,
        })

    def _card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
                "parent": None, "max_model_len": self.server.state.engine.context_length}

    def _models(self, body) -> None:
        self._send(200, {"object": "list", "data": [self._card(self.server.state.model_name)]})

    def _model_card(self, name: str) -> None:
        if name != self.server.state.model_name:
            self._send(404, {"error": {"message": f"The model '{name}' does not exist", "type": "invalid_request_error",
                                       "param": "model", "code": "model_not_found"}})
            return
        self._send(200, self._card(name))

    def _flush_cache(self, body) -> None:
        self._send(200, text="Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                             "waiting requests, the operation will not be performed.)\n")

    # -- generation ---------------------------------------------------------------------------------
    def _generate(self, body) -> None:
        from megatron_klear.rollout.embedded import PromptRequest, context_length_error
        from megatron_klear.rollout.embedded.sampling import sample_seed

        state = self.server.state
        engine = state.engine
        t0 = time.monotonic()
        call = parse_generate_request(body)
        released = sorted(state.offload_tags & {"weights", "kv_cache"})
        if released:
            self._error(503, f"the server's memory is released ({', '.join(released)}: release_memory_occupation); "
                             "resume_memory_occupation and load weights before generating")
            return
        if call.return_text_in_logprobs and state.tokenizer is None:
            raise BadRequest("field 'return_text_in_logprobs'=True needs a tokenizer; this server has none")
        c = engine.context_length
        requests, limits = [], []
        for i, (prompt, params) in enumerate(zip(call.prompts, call.params)):
            bad = next((t for t in prompt if not 0 <= t < engine.vocab_size), None)
            if bad is not None:
                raise BadRequest(f"input_ids{'' if call.single else f'[{i}]'} holds {bad}, not a token id of the "
                                 f"model's vocabulary [0, {engine.vocab_size})")
            err = context_length_error(len(prompt), params.max_new_tokens, c)
            if err is not None:
                raise BadRequest(err)
            limit = params.max_new_tokens if params.max_new_tokens is not None else max(0, min(TOP_K_ALL, c - 1 - len(prompt)))
            limits.append(limit)
            base = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            requests.append(PromptRequest(prompt=list(prompt), params=SamplingParams(
                temperature=params.temperature if params.temperature > 0 else 1.0,
                top_p=params.top_p, top_k=params.top_k if params.temperature > 0 else 1, max_new_tokens=max(1, limit),
                stop_token_ids=params.stop_token_ids), seeds=[sample_seed(base, i, j) for j in range(call.n)],
                max_new_tokens=limit, ignore_eos=bool(call.sampling[i]["ignore_eos"])))
        routing = None
        if call.return_routed_experts:
            start = call.routed_experts_start_len  # SGLang's scheduler checks (its texts)
            for prompt in call.prompts:
                if start < 0:
                    raise BadRequest(f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a "
                                     "non-negative routed_experts_start_len.")
                if start > len(prompt):
                    raise BadRequest(f"recv_req.routed_experts_start_len={start} is higher than the number of input "
                                     f"tokens len(req.origin_input_ids)={len(prompt)}. Please use a smaller "
                                     "routed_experts_start_len.")
            if state.return_routed_experts:  # else not captured: SGLang then leaves the field out
                routing = (start, engine.num_layers, engine.routed_layers)
        ids = assign_ids(call)
        job = _Job(requests, ids, rid=call.rid)
        for r in requests:
            r.key = job
        with state.lock:
            state.num_generate_requests += 1
        state.scheduler.submit(job)
        if job.error is not None:
            if isinstance(job.error, ValueError):
                raise BadRequest(str(job.error))
            raise job.error
        latency = time.monotonic() - t0
        outs = []
        for i, completions in enumerate(job.results):
            for j, comp in enumerate(completions):
                outs.append(completion_to_sglang(
                    comp, prompt=call.prompts[i], max_new_tokens=limits[i], return_logprob=call.return_logprob,
                    rid=ids[i * call.n + j], weight_version=engine.weight_version, tokenizer=state.tokenizer,
                    sampling=call.sampling[i], e2e_latency=latency, return_text_in_logprobs=call.return_text_in_logprobs,
                    return_prompt_token_ids=call.return_prompt_token_ids, abort_message=job.abort_message,
                    routing=routing))
        self._send(200, outs[0] if call.single and call.n == 1 else outs)

    # -- control ------------------------------------------------------------------------------------
    def _fields(self, body, spec: dict, required=()) -> dict:
        """Type-check a control body (unknown keys ignored, as SGLang's request structs do)."""
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

    def _pause(self, body) -> None:
        f = self._fields(body, {"mode": (_str, "abort")})
        if f["mode"] not in PAUSE_MODES:
            raise BadRequest(f"mode must be one of {', '.join(PAUSE_MODES)}, got {f['mode']!r}")
        self.server.state.scheduler.pause(f["mode"])
        self._send(200, {"message": "Generation paused successfully.", "status": "ok"})

    def _continue(self, body) -> None:
        self._fields(body, {"torch_empty_cache": (_bool, True)})
        self.server.state.scheduler.resume()
        self._send(200, {"message": "Generation continued successfully.", "status": "ok"})

    def _abort(self, body) -> None:
        f = self._fields(body, {"rid": (_str, ""), "abort_all": (_bool, False)})
        if f["abort_all"] or f["rid"]:  # an empty rid without abort_all is ignored, as in SGLang
            self.server.state.scheduler.abort(f["rid"], f["abort_all"], message="Aborted by /abort_request")
        self._send(200)

    def _update_weight_version(self, body) -> None:
        f = self._fields(body, {"new_version": (_str, None), "abort_all_requests": (_bool, True)}, required=("new_version",))
        state = self.server.state
        if f["abort_all_requests"]:
            state.scheduler.abort(abort_all=True, message="Aborted by /update_weight_version")
        state.engine.weight_version = f["new_version"]
        self._send(200, {"success": True, "message": f"Weight version updated to {f['new_version']}",
                         "new_version": f["new_version"]})

    def _update_from_disk(self, body) -> None:
        f = self._fields(body, {
            "model_path": (_str, None), "load_format": (_optional_str, None), "abort_all_requests": (_bool, False),
            "weight_version": (_str, None), "is_async": (_bool, False), "torch_empty_cache": (_bool, False),
            "keep_pause": (_bool, False), "recapture_cuda_graph": (_bool, False), "token_step": (_int, 0),
            "flush_cache": (_bool, True), "manifest": (_map, None)}, required=("model_path",))
        state = self.server.state
        if f["load_format"] not in (None, "auto", "safetensors"):
            self._send(400, {"success": False, "num_paused_requests": 0,
                             "message": f"load_format {f['load_format']!r} is not supported by the embedded engine "
                                        "(auto | safetensors)"})
            return
        if "weights" in state.offload_tags:
            self._send(400, {"success": False, "num_paused_requests": 0, "message": _RELEASED_WEIGHTS})
            return
        if f["abort_all_requests"]:
            state.scheduler.abort(abort_all=True, message="Aborted by /update_weights_from_disk")
        version = f["weight_version"] if f["weight_version"] is not None else state.engine.weight_version
        try:
            _, held = state.scheduler.run_update(lambda: state.engine.load_weights_from_dir(f["model_path"], version=version))
        except (OSError, ValueError) as e:
            self._send(400, {"success": False, "num_paused_requests": 0,
                             "message": f"Failed to update weights: {e}.\nRolling back to original weights."})
            return
        message = "Succeeded to update model weights."
        if f["weight_version"] is not None:
            message += f" Weight version updated to {f['weight_version']}."
        self._send(200, {"success": True, "message": message, "num_paused_requests": held})


    # -- memory of a server colocated with the trainer (SGLang's --enable-memory-saver) ---------------
    def _memory_tags(self, body) -> list:
        f = self._fields(body or {}, {"tags": (_str_list, None)})
        tags = f["tags"] or list(MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise BadRequest(f"tags: unknown memory type(s) {unknown}; expected some of {list(MEMORY_TAGS)}")
        return tags

    def _release_memory(self, body) -> None:
        tags = self._memory_tags(body)
        state = self.server.state
        stats = state.scheduler.stats()
        if stats["num_running_reqs"] or stats["num_waiting_reqs"]:
            raise BadRequest("release_memory_occupation should be called only when server is idle.")
        with state.weight_lock:
            state.offload_tags.update(tags)
            state.memory_releases += 1
            if "weights" in tags and state.enable_memory_saver:
                state.scheduler.run_update(state.engine.release_weights)
        self._send(200)

    def _resume_memory(self, body) -> None:
        tags = self._memory_tags(body)
        state = self.server.state
        with state.weight_lock:
            not_released = [t for t in tags if t not in state.offload_tags]
            if not_released:
                raise BadRequest(f"resume_memory_occupation: {not_released} not released (released: "
                                 f"{sorted(state.offload_tags)})")
            state.offload_tags.difference_update(tags)
            if "weights" in tags and state.enable_memory_saver:
                state.engine.resume_weights()
        self._send(200)

    # -- weights over a process group (SGLang's update_weights_from_distributed) ----------------------
    def _weights_reply(self, ok: bool, message: str, **extra) -> None:
        self._send(200 if ok else 400, {"success": ok, "message": message, **extra})

    def _init_group(self, body) -> None:
        f = self._fields(body, {"master_address": (_str, None), "master_port": (_int, None), "rank_offset": (_int, None),
                                "world_size": (_int, None), "group_name": (_str, DEFAULT_GROUP_NAME),
                                "backend": (_str, "nccl")},
                         required=("master_address", "master_port", "rank_offset", "world_size"))
        from megatron_klear.rollout.weight_sync.update_group import join_update_group, set_group_timeout

        state = self.server.state
        prefix = "Failed to initialize custom process group: "
        name, backend, rank = f["group_name"], f["backend"], f["rank_offset"]  # this server is TP rank 0 of 1
        if backend not in ("gloo", "nccl"):
            return self._weights_reply(False, f"{prefix}backend {backend!r} is not supported (gloo | nccl).")
        if backend == "nccl" and state.engine.device.type != "cuda":
            return self._weights_reply(False, f"{prefix}backend nccl needs CUDA; this embedded engine runs on "
                                              f"{state.engine.device.type}: use backend gloo.")
        if not 0 < rank < f["world_size"]:
            return self._weights_reply(False, f"{prefix}rank_offset {rank} is not a receiver rank of a group of "
                                              f"world_size {f['world_size']} (rank 0 is the sender).")
        with state.weight_lock:
            if name in state.update_groups:
                return self._weights_reply(False, f"{prefix}The specified group name has already been created, "
                                                  "please use a different group name.")
            try:
                pg = join_update_group(backend=backend, master_address=f["master_address"],
                                       master_port=f["master_port"], rank=rank, world_size=f["world_size"],
                                       group_name=name, timeout=state.weight_sync_timeout)
                set_group_timeout(pg, state.weight_sync_timeout)
            except Exception as e:  # noqa: BLE001 -- answered
                return self._weights_reply(False, f"{prefix}{type(e).__name__}: {e}.")
            state.update_groups[name] = pg
        self._weights_reply(True, "Succeeded to initialize custom process group.")

    def _destroy_group(self, body) -> None:
        f = self._fields(body, {"group_name": (_str, DEFAULT_GROUP_NAME)})
        from megatron_klear.rollout.weight_sync.update_group import destroy_update_group

        state = self.server.state
        with state.weight_lock:
            pg = state.update_groups.pop(f["group_name"], None)
            if pg is None:
                return self._weights_reply(False, "The group to be destroyed does not exist.")
            session = state.weight_session
            if session is not None and f["group_name"] in session.groups:
                state.weight_session = None  # what a gone sender staged is never applied
            destroy_update_group(pg)
        self._weights_reply(True, "Succeeded to destroy custom process group.")

    def _begin_update(self, body) -> None:
        f = self._fields(body, {"selector": (_str, "all")})
        if f["selector"] not in ("target", "draft", "all"):
            raise BadRequest(f"invalid selector {f['selector']!r}; expected 'target', 'draft', or 'all'")
        state = self.server.state
        if "weights" in state.offload_tags:
            return self._weights_reply(False, _RELEASED_WEIGHTS)
        with state.weight_lock:
            if state.weight_session is not None:
                return self._weights_reply(False, "a weight-update session is already open; call end_weight_update() "
                                                  "first")
            state.weight_session = _WeightSession()
        self._weights_reply(True, "Success")

    def _update_from_distributed(self, body) -> None:
        f = self._fields(body, {
            "names": (_str_list, None),
            "dtypes": (_str_list, None),
            "shapes": (lambda v, w: [_token_ids(x, f"{w}[{k}]") for k, x in enumerate(_seq(v, w))], None),
            "group_name": (_str, DEFAULT_GROUP_NAME), "flush_cache": (_bool, True), "abort_all_requests": (_bool, False),
            "weight_version": (_str, None), "load_format": (_optional_str, None), "selector": (_str, "all"),
            "torch_empty_cache": (_bool, False)}, required=("names", "dtypes", "shapes"))
        from megatron_klear.rollout.weight_sync.update_group import destroy_update_group

        state = self.server.state
        if f["abort_all_requests"]:
            state.scheduler.abort(abort_all=True, message="Aborted by /update_weights_from_distributed")
        with state.weight_lock:
            session = state.weight_session
            if session is None:
                return self._weights_reply(False, "update_weights_from_distributed must run between "
                                                  "begin_weight_update() and end_weight_update()")
            name = f["group_name"]
            pg = state.update_groups.get(name)
            if pg is None:
                session.error = (f"Failed to receive weights: Group {name} not in {sorted(state.update_groups)}. "
                                 "Please call `init_weights_update_group` first.")
                return self._weights_reply(False, session.error)
            session.groups.add(name)

            def receive():  # with no decoding under way (SGLang: paused, or behind the model-update lock)
                try:
                    tensors = _receive_weights(pg, f["names"], f["dtypes"], f["shapes"], f["load_format"],
                                               state.engine.device, state.receive_buffers)
                except Exception as e:  # noqa: BLE001 -- a broken group (sender or a peer gone, a timeout) is dropped
                    if not isinstance(e, ValueError):
                        state.update_groups.pop(name, None)
                        destroy_update_group(pg)
                    return None, f"Failed to receive weights: {type(e).__name__}: {e}"
                try:
                    state.engine.check_named_weights(tensors)
                except (TypeError, ValueError) as e:
                    return None, f"Failed to update parameter online: {e}. Nothing was applied."
                if f["flush_cache"] and not state.scheduler.cache_flushable():
                    # SGLang's answer when requests hold KV cache computed with the old weights
                    return None, ("Weights were updated, but the cache was not flushed because requests are still "
                                  "running or queued. Retract or finish them, then call /flush_cache. (Nothing "
                                  "was applied: the embedded engine commits a session whole.)")
                return tensors, None

            (tensors, error), _ = state.scheduler.run_update(receive)
            if error is not None:
                session.error = error
                return self._weights_reply(False, error)
            session.staged.update(tensors)
            if f["weight_version"] is not None:
                session.version = f["weight_version"]
        message = f"Succeeded to update parameter online ({len(tensors)} tensors staged; applied by end_weight_update)."
        if f["weight_version"] is not None:
            message += f" Weight version updated to {f['weight_version']}."
        self._weights_reply(True, message)

    def _end_update(self, body) -> None:
        self._fields(body, {})
        state = self.server.state
        with state.weight_lock:
            session, state.weight_session = state.weight_session, None
            if session is None:
                return self._weights_reply(False, "no weight-update session is open; call begin_weight_update() first")
            if session.error is not None:
                return self._weights_reply(False, f"the weight update failed ({session.error}); nothing was applied: "
                                                  f"weight version {state.weight_version} is still served")
            if session.staged:
                version = session.version if session.version is not None else state.engine.weight_version
                try:
                    # the received buffers become the parameters (no copy): the swap is the commit;
                    # the storages they replace receive the next update (no fresh allocation)
                    replaced, _ = state.scheduler.run_update(
                        lambda: state.engine.load_named_weights(session.staged, version=version, adopt=True))
                    state.receive_buffers = {}
                    for t in replaced:  # only buffers this server received into (not the loaded checkpoint's)
                        if t.data_ptr() in state.adopted and t.storage_offset() == 0 and \
                                t.untyped_storage().nbytes() == t.numel() * t.element_size():
                            state.receive_buffers.setdefault((tuple(t.shape), t.dtype), []).append(t)
                    state.adopted = {t.data_ptr() for t in session.staged.values()}
                except (TypeError, ValueError) as e:
                    return self._weights_reply(False, f"Failed to update parameter online: {e}. Nothing was applied.")
        self._weights_reply(True, "Success")

    def _weights_checker(self, body) -> None:
        f = self._fields(body or {}, {"action": (_str, "checksum"), "allow_quant_error": (_bool, False),
                                      "skip_tensor_list": (lambda v, w: [_str(x, w) for x in _seq(v, w)], None),
                                      "selector": (_str, "all")})
        if f["action"] != "checksum":
            return self._weights_reply(False, f"action {f['action']!r} is not supported by the embedded engine "
                                              "(checksum)")
        import hashlib

        checksums = self.server.state.engine.checksums(skip=f["skip_tensor_list"] or ())
        overall = hashlib.sha256()
        for name in sorted(checksums):
            overall.update(name.encode())
            overall.update(checksums[name].encode())
        per_gpu = overall.hexdigest()
        info = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                "rank": 0, "size": 1}
        self._weights_reply(True, "Success", ranks=[{"checksums": checksums, "per_gpu_checksum": per_gpu,
                                                     "parallelism_info": [info]}],
                            per_engine_checksum=hashlib.sha256(per_gpu.encode()).hexdigest())


class _WeightSession:
    """A begin/end weight-update session: what was received (applied at end, whole), the version
    to report with it, the groups it came from, and the first failure (nothing is applied then)."""

    def __init__(self):
        self.staged, self.version, self.groups, self.error = {}, None, set(), None


def _receive_weights(pg, names, dtypes, shapes, load_format, device, buffers=None) -> list:
    """(name, tensor) received from group rank 0: one broadcast per tensor in order, or one
    ``uint8`` broadcast for ``load_format="flattened_bucket"`` (SGLang's two receive paths).
    ``buffers``: {(shape, dtype): [free tensors]} to receive into before allocating."""
    import torch
    import torch.distributed as dist

    from megatron_klear.rollout.weight_sync.update_group import FLATTENED_BUCKET, bucket_layout, dtype_of, unflatten_bucket

    if load_format == FLATTENED_BUCKET:
        layout = bucket_layout(names, dtypes, shapes)
        flat = torch.empty(layout[-1][4], dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=pg)
        return unflatten_bucket(flat, layout)
    if load_format not in (None, "auto"):
        raise ValueError(f"load_format {load_format!r} is not supported by the embedded engine "
                         f"(auto | {FLATTENED_BUCKET})")
    out, works = [], []
    for name, dt, shape in zip(names, dtypes, shapes):
        shape, dt = tuple(int(d) for d in shape), dtype_of(dt)
        free = (buffers or {}).get((shape, dt))
        t = free.pop() if free else torch.empty(shape, dtype=dt, device=device)
        works.append(dist.broadcast(t, src=0, group=pg, async_op=True))
        out.append((name, t))
    for w in works:
        w.wait()
    return out


class EmbeddedHTTPServer(ThreadingHTTPServer):
    """A thread per connection. Closing the server also ends its kept-alive connections and waits
    for their threads: a handler thread still blocked on a client's idle connection when the
    interpreter exits is killed mid-call, which aborts the process ("terminate called without an
    active exception")."""

    daemon_threads = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._connections = {}  # socket -> the thread serving it
        self._connections_lock = threading.Lock()

    def process_request_thread(self, request, client_address):
        with self._connections_lock:
            self._connections[request] = threading.current_thread()
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._connections_lock:
                self._connections.pop(request, None)

    def server_close(self):
        import socket

        self.state.scheduler.close()
        super().server_close()
        with self._connections_lock:
            open_connections = list(self._connections.items())
        for sock, _ in open_connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # a handler waiting for the next request reads EOF
            except OSError:
                pass  # already closed by the client
        for _, thread in open_connections:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)


def make_server(engine, port: int = 0, *, tokenizer=None, tokenizer_path: str | None = None,
                served_model_name: str | None = None, max_batch_size: int | None = None,
                batch_window: float = 0.05, weight_sync_timeout: float = 600.0,
                return_routed_experts: bool = False, enable_memory_saver: bool = False) -> EmbeddedHTTPServer:
    """A server for ``engine`` on 127.0.0.1:``port`` (0: a free port, see ``server.server_address``).
    Call ``serve_forever()`` (e.g. in a thread), then ``shutdown()`` and ``server_close()``.
    ``max_batch_size``: most sequences per engine call (default: the engine's); ``batch_window``:
    the longest an idle engine waits for concurrent requests to gather (:class:`Scheduler`);
    ``weight_sync_timeout``: seconds for joining a weight-update group and for each broadcast;
    ``return_routed_experts``: SGLang's ``--enable-return-routed-experts`` (MoE models);
    ``enable_memory_saver``: SGLang's ``--enable-memory-saver`` (releasing weights frees them)."""
    server = EmbeddedHTTPServer((HOST, int(port)), _Handler)
    server.state = _ServerState(engine, tokenizer, tokenizer_path, served_model_name, max_batch_size, batch_window,
                                weight_sync_timeout, return_routed_experts, enable_memory_saver)
    server.state.port = server.server_address[1]
    return server


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_klear.rollout.embedded",
                                 description="Serve an HF checkpoint with the embedded rollout engine on 127.0.0.1 "
                                             "(a subset of SGLang's native HTTP API).")
    ap.add_argument("--model", required=True, help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("--port", type=int, default=30000, help="port on 127.0.0.1 (0: any free port)")
    ap.add_argument("--dtype", default="float32", help="float32 (default) | bfloat16 | float16 | float64")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-batch-size", type=int, default=None, help="most sequences decoded together")
    ap.add_argument("--context-length", type=int, default=None,
                    help="longest prompt + response (default: the config's, as SGLang's --context-length)")
    ap.add_argument("--served-model-name", default=None, help="the model name in /v1/models (default: the path)")
    ap.add_argument("--batch-window-ms", type=float, default=50.0,
                    help="longest an idle engine waits for concurrent requests to gather into one batch")
    ap.add_argument("--weight-sync-timeout", type=float, default=600.0,
                    help="seconds for joining a weight-update group and for each broadcast received in it")
    ap.add_argument("--port-file", default=None, help="write the bound port here (atomically) once serving")
    ap.add_argument("--enable-return-routed-experts", action="store_true",
                    help="record each token's experts (MoE models) and return them to requests with "
                         "return_routed_experts (SGLang's flag of the same name)")
    ap.add_argument("--enable-memory-saver", action="store_true",
                    help="release_memory_occupation of 'weights' frees them (a server sharing the trainer's "
                         "machine; SGLang's flag of the same name)")
    args = ap.parse_args(argv)

    from megatron_klear.rollout.embedded import EmbeddedEngine, load_tokenizer

    tokenizer = load_tokenizer(args.model)
    engine = EmbeddedEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device,
                                            max_batch_size=args.max_batch_size, context_length=args.context_length,
                                            tokenizer=tokenizer)
    server = make_server(engine, args.port, tokenizer=tokenizer, tokenizer_path=args.model if tokenizer else None,
                         served_model_name=args.served_model_name, batch_window=args.batch_window_ms / 1000.0,
                         weight_sync_timeout=args.weight_sync_timeout,
                         return_routed_experts=args.enable_return_routed_experts,
                         enable_memory_saver=args.enable_memory_saver)
    port = server.server_address[1]
    if args.port_file:
        tmp = f"{args.port_file}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    print(f"embedded rollout engine serving {args.model} on http://{HOST}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


class EmbeddedHTTPEngine(SGLangEngine):
    """The SGLang-API client (:class:`megatron_klear.rollout.sglang.SGLangEngine`) pointed at an
    embedded-engine server, plus :meth:`launch` to start one. Every request has a timeout:
    ``timeout`` seconds, or ``generate_timeout`` for /generate."""

    send_seed = True  # the embedded server derives one seed per (prompt, sample) from it

    def __init__(self, url: str, *, timeout: float = 60.0, generate_timeout: float = 3600.0):
        super().__init__([url], timeout=timeout, generate_timeout=generate_timeout)
        self._process = None
        self._workdir = None

    # ---------------------------------------------------------------- server process
    @classmethod
    def launch(cls, model_dir: str, *, port: int = 0, dtype: str = "float32", max_batch_size: int | None = None,
               context_length: int | None = None, served_model_name: str | None = None,
               weight_sync_timeout: float | None = None, startup_timeout: float = 300.0,
               return_routed_experts: bool = False, enable_memory_saver: bool = False,
               **kwargs) -> "EmbeddedHTTPEngine":
        """Start ``python -m megatron_klear.rollout.embedded`` for ``model_dir`` and wait until it is
        healthy; :meth:`close` stops it. The server's output goes to a log file named in errors.
        ``context_length`` / ``served_model_name`` / ``weight_sync_timeout`` /
        ``return_routed_experts`` / ``enable_memory_saver``: the server's flags of those names."""
        workdir = tempfile.mkdtemp(prefix="klear-embedded-server-")
        port_file, log_path = os.path.join(workdir, "port"), os.path.join(workdir, "server.log")
        cmd = [sys.executable, "-m", "megatron_klear.rollout.embedded", "--model", model_dir, "--port", str(port),
               "--dtype", dtype, "--port-file", port_file]
        if max_batch_size is not None:
            cmd += ["--max-batch-size", str(max_batch_size)]
        if context_length is not None:
            cmd += ["--context-length", str(context_length)]
        if served_model_name is not None:
            cmd += ["--served-model-name", served_model_name]
        if weight_sync_timeout is not None:
            cmd += ["--weight-sync-timeout", str(weight_sync_timeout)]
        if return_routed_experts:
            cmd += ["--enable-return-routed-experts"]
        if enable_memory_saver:
            cmd += ["--enable-memory-saver"]
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        engine = None
        deadline = time.monotonic() + startup_timeout
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"rollout.embedded_http: the server exited with code {proc.returncode} before "
                                       f"serving; log {log_path}:\n{_tail(log_path)}")
                if os.path.isfile(port_file):
                    if engine is None:
                        with open(port_file) as f:
                            engine = cls(f"http://{HOST}:{int(f.read())}", **kwargs)
                    if engine.health():
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rollout.embedded_http: the server was not healthy within {startup_timeout:g} s; "
                                       f"log {log_path}:\n{_tail(log_path)}")
                time.sleep(0.1)
        except BaseException:
            stop_process(proc)
            raise
        engine._process, engine._workdir = proc, workdir
        return engine

    def close(self) -> None:
        """Stop the server if :meth:`launch` started it."""
        super().close()
        if self._process is not None:
            stop_process(self._process)
            self._process = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


def stop_process(proc, timeout: float = 10.0) -> None:
    """Terminate ``proc`` (SIGCONT first: a stopped process ignores SIGTERM until continued), then
    kill it if it has not exited within ``timeout`` seconds."""
    if proc.poll() is None:
        import signal

        try:
            os.kill(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no log)"


def serve_in_thread(engine, port: int = 0, **kwargs):
    """Start :func:`make_server` in a daemon thread; returns ``(server, url)``. Stop with
    ``server.shutdown(); server.server_close()``."""
    server = make_server(engine, port, **kwargs)
    threading.Thread(target=server.serve_forever, name="embedded-http", daemon=True).start()
    return server, f"http://{HOST}:{server.server_address[1]}"
