"""Health, info, pause/continue/abort and memory routes, as SGLang 0.5.23's
``http_server.py`` names them (``/generate`` is :mod:`.generate_route`'s). Blocking work never runs
on the event loop: pause and memory calls run in threads of their own, so /health answers at once
during a long generation."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid

from fastapi import APIRouter, Request, Response

from megatron_klear.rollout.base import SamplingParams
from megatron_klear.rollout.embedded import PromptRequest
from megatron_klear.rollout.sglang import MEMORY_TAGS
from megatron_klear.rollout.sglang_standin import sglang_env
from megatron_klear.rollout.sglang_standin.contract import (
    SGLANG_API_VERSION,
    SGLANG_PAUSE_MODES,
    BadRequest,
    control_fields,
    expect_bool,
    expect_str,
    expect_str_list,
)
from megatron_klear.rollout.sglang_standin.plumbing import (
    StandinRoute,
    error,
    off_loop,
    read_json,
    reply,
    server_state,
)
from megatron_klear.rollout.sglang_standin.scheduler import Job

router = APIRouter(route_class=StandinRoute)


# -- health and info -----------------------------------------------------------------------------
@router.get("/health")
async def health(request: Request):
    """SGLang 0.5.23: a one-token generation, as /health_generate, unless
    ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is false (then 200 at once, even while paused)."""
    if not sglang_env.env_bool(sglang_env.HEALTH_GENERATION, True):
        return reply(200)
    return await _health_generate(server_state(request))


@router.get("/health_generate")
async def health_generate(request: Request):
    return await _health_generate(server_state(request))


async def _health_generate(state):
    """SGLang's health generation: 200 once the scheduler shows a sign of life after the probe came
    (a decode step, a control call answered, the probe's own token), 503 after
    ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds. A busy scheduler does not run the probe (its running
    requests answer for it); a paused server holds it (no sign of life: 503). An idle server runs it
    -- on memory the memory saver has unmapped, too, which kills SGLang's scheduler: the server
    answers 503 naming the fault and exits."""
    tic = time.monotonic()
    steps = state.engine.decode_steps
    stats = state.scheduler.stats()
    job = None
    if not stats["paused"] and not stats["num_running_reqs"] and not stats["num_waiting_reqs"]:
        freed = state.freed_memory_tags()
        if freed:
            return _fault(
                state,
                f"a health-check generation ran while {', '.join(sorted(freed))} memory was "
                "released (release_memory_occupation): SGLang's scheduler reads unmapped memory "
                "and dies; start colocated servers with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION="
                "false",
            )
        probe = PromptRequest(prompt=[0], params=SamplingParams(top_k=1, max_new_tokens=1), seeds=[0], max_new_tokens=1)
        job = Job([probe], ids=[f"HEALTH_CHECK_{uuid.uuid4().hex}"])
        probe.key = job
        state.scheduler.submit(job)
    done = asyncio.wrap_future(job.future) if job is not None else None
    deadline = tic + state.health_check_timeout
    healthy = False
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        if done is not None and done.done():
            healthy = job.error is None
            break
        now = state.scheduler.stats()
        # a sign of life: a decode step, a control call answered, a batch started, or the batch that
        # ran when the probe came finished (its answers went out)
        if (
            state.engine.decode_steps > steps
            or state.last_receive > tic
            or now["num_batches"] > stats["num_batches"]
            or (stats["num_running_reqs"] and not now["num_running_reqs"] and not now["paused"])
        ):
            healthy = True
            break
    if job is not None:
        state.scheduler.abort(job.ids[0], message="health check")
    return reply(200 if healthy else 503)


def _fault(state, message: str) -> Response:
    """The server dies of a generation on released memory: this answer, then ``state.on_fault``."""
    state.fault = message
    print(f"sglang stand-in: fatal: {message}", file=sys.stderr, flush=True)
    if state.on_fault is not None:
        asyncio.get_running_loop().call_later(0.1, state.on_fault)
    return error(503, message)


@router.get("/ready")
async def ready(request: Request):
    return reply(503 if server_state(request).scheduler.paused else 200)


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request):
    state = server_state(request)
    return reply(
        200,
        {
            **state.engine.model_info(),
            "model_path": state.model_path,
            "served_model_name": state.model_name,
            "tokenizer_path": state.tokenizer_path or state.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        },
    )


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request):
    state = server_state(request)
    engine, sched = state.engine, state.scheduler
    c = engine.context_length
    internal = sched.stats()
    if sglang_env.env_bool(sglang_env.EXPOSE_ENV_VARS, False):  # SGLang's SGLANG_EXPOSE_OWN_ENV_VARS
        internal["env_vars"] = sglang_env.own_env_vars()
    return reply(
        200,
        {
            "model_path": state.model_path,
            "served_model_name": state.model_name,
            "tokenizer_path": state.tokenizer_path or state.model_path,
            "context_length": c,
            "max_context_length": c,
            "max_total_num_tokens": sched.max_total_tokens,
            "max_req_input_len": c - 1,
            "max_running_requests": sched.max_running_requests,
            "dtype": engine.model_info().get("dtype"),
            "device": str(engine.device),
            "host": state.host,
            "port": state.port,
            **state.gpus.info(),
            "pp_size": 1,
            "dp_size": 1,
            "version": SGLANG_API_VERSION,
            "frontend": "megatron-klear-embedded",
            "weight_version": state.weight_version,
            "num_generate_requests": state.num_generate_requests,
            "internal_states": [internal],
            "incremental_streaming_output": False,
            "disaggregation_mode": "null",
            "enable_memory_saver": state.enable_memory_saver,
            "custom_weight_loader": list(state.custom_weight_loader),
            # not SGLang's: what is released now, and how often memory was released (tests, operators)
            "released_memory_tags": sorted(state.offload_tags),
            "memory_releases": state.memory_releases,
            # not SGLang's: the weight-update calls that succeeded, by route
            "weight_updates": dict(state.weight_updates),
            # not SGLang's: the shared-memory managers whose storages /update_weights_from_tensor
            # read (torch starts one per sharing process: which trainer process shared the buckets)
            "tensor_sharers": sorted(state.tensor_sharers),
            # not SGLang's: the released tags whose memory is really free (cuda_graph only with
            # SGLANG_MEMORY_SAVER_CUDA_GRAPH; none without --enable-memory-saver)
            "freed_memory_tags": sorted(state.freed_memory_tags()),
        },
    )


def _card(state, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": name,
        "parent": None,
        "max_model_len": state.engine.context_length,
    }


@router.get("/v1/models")
async def models(request: Request):
    state = server_state(request)
    return reply(200, {"object": "list", "data": [_card(state, state.model_name)]})


@router.get("/v1/models/{name:path}")
async def model_card(name: str, request: Request):
    state = server_state(request)
    if name != state.model_name:
        return reply(
            404,
            {
                "error": {
                    "message": f"The model '{name}' does not exist",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            },
        )
    return reply(200, _card(state, name))


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    """SGLang 0.5.23: flushes only an idle server (running requests, or waiting ones while not paused,
    refuse it: 400 ``Flush cache failed.``); ``?timeout=S`` waits up to S seconds for idle (then 400
    ``Timed out waiting for idle state.``). Nothing is cached between requests here."""
    if request.method != "GET":
        await read_json(request)  # a body that is not JSON is refused, as on every POST route
    raw = request.query_params.get("timeout", "0")
    try:
        timeout = float(raw)
    except ValueError:
        timeout = -1.0
    if not timeout >= 0:
        raise BadRequest(f"timeout must be a number >= 0, got {raw!r}")
    sched = server_state(request).scheduler
    deadline = time.monotonic() + timeout
    while not sched.idle_for_flush():
        if time.monotonic() >= deadline:
            return reply(400, text="Timed out waiting for idle state." if timeout > 0 else "Flush cache failed.\n")
        await asyncio.sleep(0.02)
    return reply(
        200,
        text="Cache flushed.\nPlease check backend logs for more details. (When there are running or "
        "waiting requests, the operation will not be performed.)\n",
    )


# -- pause / continue / abort --------------------------------------------------------------------
@router.post("/pause_generation")
async def pause_generation(request: Request):
    """Answers once nothing decodes: mode abort ends the running requests, in_place and retract hold
    them between two decode steps."""
    f = control_fields(await read_json(request), {"mode": (expect_str, "abort")})
    if f["mode"] not in SGLANG_PAUSE_MODES:
        raise BadRequest(f"mode must be one of {', '.join(SGLANG_PAUSE_MODES)}, got {f['mode']!r}")
    await off_loop(server_state(request).scheduler.pause, f["mode"])
    return reply(200, {"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request):
    control_fields(await read_json(request), {"torch_empty_cache": (expect_bool, True)})
    server_state(request).scheduler.resume()
    return reply(200, {"message": "Generation continued successfully.", "status": "ok"})


@router.post("/abort_request")
async def abort_request(request: Request):
    """SGLang 0.5.23: 200 always; an empty rid without abort_all, or a rid no live request has, is
    ignored; else every request whose id starts with rid ends (:meth:`Scheduler.abort_request`)."""
    f = control_fields(await read_json(request), {"rid": (expect_str, ""), "abort_all": (expect_bool, False)})
    server_state(request).scheduler.abort_request(f["rid"], f["abort_all"])
    return reply(200)


# -- memory of a server colocated with the trainer (SGLang's --enable-memory-saver) ---------------
def _memory_tags(body) -> list:
    f = control_fields(body or {}, {"tags": (expect_str_list, None)})
    tags = f["tags"] or list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise BadRequest(f"tags: unknown memory type(s) {unknown}; expected some of {list(MEMORY_TAGS)}")
    return tags


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request):
    """Needs an idle server (SGLang asserts it); with --enable-memory-saver releasing ``weights``
    frees the parameters, else the tags are only recorded (SGLang's no-op saver)."""
    tags = _memory_tags(await read_json(request))
    state = server_state(request)
    stats = state.scheduler.stats()
    # SGLang: is_fully_idle(ignore_waiting=paused); a request waiting on a paused SGLang server has not
    # reached its scheduler (the tokenizer manager holds it), as a queued job here waits for continue
    if stats["num_running_reqs"] or (stats["num_waiting_reqs"] and not stats["paused"]):
        raise BadRequest("release_memory_occupation should be called only when server is idle.")
    await off_loop(_release, state, tags)
    return reply(200)


def _release(state, tags) -> None:
    with state.weight_lock:
        state.offload_tags.update(tags)
        state.memory_releases += 1
        if "weights" in tags and state.enable_memory_saver:
            state.scheduler.run_update(state.engine.weights.release_weights)


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request):
    """Resumed weights come back with their content lost (a weight update must follow); resuming a
    tag that is not released is refused."""
    tags = _memory_tags(await read_json(request))
    await off_loop(_resume, server_state(request), tags)
    return reply(200)


def _resume(state, tags) -> None:
    with state.weight_lock:
        not_released = [t for t in tags if t not in state.offload_tags]
        if not_released:
            raise BadRequest(
                f"resume_memory_occupation: {not_released} not released (released: {sorted(state.offload_tags)})"
            )
        state.offload_tags.difference_update(tags)
        if "weights" in tags and state.enable_memory_saver:
            state.engine.weights.resume_weights()
