"""SGLang 0.5.23's ``/generate`` on the stand-in: the body checked against SGLang's contract, one
:class:`~megatron_klear.rollout.sglang_standin.scheduler.Job` for the scheduler, SGLang's answer
shape. Its router is the app's first (FastAPI tries routes in order, and this is the one every
sample of a partial rollout calls)."""

from __future__ import annotations

import asyncio
import os
import time

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from megatron_klear.rollout.base import SamplingParams
from megatron_klear.rollout.embedded import PromptRequest, context_length_error
from megatron_klear.rollout.embedded.sampling import sample_seed
from megatron_klear.rollout.sglang_standin.contract import (
    TOP_K_ALL,
    BadRequest,
    assign_ids,
    completion_to_sglang,
    parse_generate_request,
)
from megatron_klear.rollout.sglang_standin.plumbing import (
    StandinRoute,
    decode_json,
    error,
    read_body,
    reply,
    server_state,
)
from megatron_klear.rollout.sglang_standin.scheduler import Job

router = APIRouter(route_class=StandinRoute)

# Up to these sizes a request's body is read, and its answer written, on the event loop (measured on
# 2 cores, benchmarks/RESULTS.md: a worker-thread hop costs more than a one-sample request's work)
INLINE_BODY_BYTES = 64 * 1024
INLINE_ANSWER_TOKENS = 4096
# SGLang 0.5.23 (managers/tokenizer_manager.py, _stream_one_response) waits on a request's state in
# slices of SGLANG_REQUEST_STATE_WAIT_TIMEOUT seconds (4) and, between two, aborts a non-streaming
# request whose client has disconnected, waiting or running: a client that gives up on a
# generation (a stop signal) frees the server within that time
DISCONNECT_POLL_S = float(os.environ.get("SGLANG_REQUEST_STATE_WAIT_TIMEOUT", "4"))


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request):
    """Token ids in, SGLang's answer shape out; the request waits on its job (the scheduler thread
    decodes). Reading a body and writing an answer run on the event loop when they are small (one
    sample's request: a thread hop would cost more than the work) and in a worker thread when they
    are large (a batch's: CPU work that would hold up /health)."""
    state = server_state(request)
    raw = await read_body(request)
    t0 = time.monotonic()
    if len(raw) <= INLINE_BODY_BYTES:
        prepared = _prepare(state, raw)
    else:
        prepared = await run_in_threadpool(_prepare, state, raw)
    if isinstance(prepared, Response):
        return prepared  # 503: the memory is released
    call, job, limits, routing = prepared
    state.scheduler.submit(job)
    waiting = asyncio.wrap_future(job.future)
    while True:
        try:
            await asyncio.wait_for(asyncio.shield(waiting), timeout=DISCONNECT_POLL_S)
            break
        except asyncio.TimeoutError:
            if await request.is_disconnected():  # SGLang's abort of a disconnected request
                state.scheduler.abort(job.ids[0], message="the client disconnected")
                await waiting
                return Response(status_code=499)  # (nobody reads it)
    if job.error is not None:
        if isinstance(job.error, ValueError):
            raise BadRequest(str(job.error))
        raise job.error
    latency = time.monotonic() - t0
    tokens = sum(len(c.token_ids) for completions in job.results for c in completions)
    if tokens <= INLINE_ANSWER_TOKENS:
        return _answer(state, call, job, limits, routing, latency)
    return await run_in_threadpool(_answer, state, call, job, limits, routing, latency)


def _prepare(state, raw: bytes):
    """The body -> (call, job, per-prompt token limits, routing), or the 503 of released memory."""
    engine = state.engine
    call = parse_generate_request(decode_json(raw))
    released = sorted(state.offload_tags & {"weights", "kv_cache"})
    if released:
        return error(
            503,
            f"the server's memory is released ({', '.join(released)}: release_memory_occupation); "
            "resume_memory_occupation and load weights before generating",
        )
    if call.return_text_in_logprobs and state.tokenizer is None:
        raise BadRequest("field 'return_text_in_logprobs'=True needs a tokenizer; this server has none")
    c = engine.context_length
    requests, limits = [], []
    for i, (prompt, params) in enumerate(zip(call.prompts, call.params)):
        bad = next((t for t in prompt if not 0 <= t < engine.vocab_size), None)
        if bad is not None:
            raise BadRequest(
                f"input_ids{'' if call.single else f'[{i}]'} holds {bad}, not a token id of the "
                f"model's vocabulary [0, {engine.vocab_size})"
            )
        err = context_length_error(len(prompt), params.max_new_tokens, c)
        if err is not None:
            raise BadRequest(err)
        limit = (
            params.max_new_tokens if params.max_new_tokens is not None else max(0, min(TOP_K_ALL, c - 1 - len(prompt)))
        )
        limits.append(limit)
        base = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        requests.append(
            PromptRequest(
                prompt=list(prompt),
                params=SamplingParams(
                    temperature=params.temperature if params.temperature > 0 else 1.0,
                    top_p=params.top_p,
                    top_k=params.top_k if params.temperature > 0 else 1,
                    max_new_tokens=max(1, limit),
                    stop_token_ids=params.stop_token_ids,
                    repetition_penalty=params.repetition_penalty,
                ),
                seeds=[sample_seed(base, i, j) for j in range(call.n)],
                max_new_tokens=limit,
                ignore_eos=bool(call.sampling[i]["ignore_eos"]),
            )
        )
    routing = None
    if call.return_routed_experts:
        start = call.routed_experts_start_len  # SGLang's scheduler checks (its texts)
        for prompt in call.prompts:
            if start < 0:
                raise BadRequest(
                    f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a "
                    "non-negative routed_experts_start_len."
                )
            if start > len(prompt):
                raise BadRequest(
                    f"recv_req.routed_experts_start_len={start} is higher than the number of input "
                    f"tokens len(req.origin_input_ids)={len(prompt)}. Please use a smaller "
                    "routed_experts_start_len."
                )
        if state.return_routed_experts:  # else not captured: SGLang then leaves the field out
            routing = (start, engine.num_layers, engine.routed_layers)
    job = Job(requests, assign_ids(call), rid=call.rid)
    for r in requests:
        r.key = job
    with state.lock:
        state.num_generate_requests += 1
    return call, job, limits, routing


def _answer(state, call, job, limits, routing, latency):
    # aborted in SGLang's waiting queue (before it ran, or retracted by a pause): the tokens SGLang's
    # tokenizer manager received, whole multiples of SGLANG_FORCE_STREAM_INTERVAL for a request that
    # does not stream
    waiting_interval = state.force_stream_interval if job.abort_where == "waiting" else None
    outs = []
    for i, completions in enumerate(job.results):
        for j, comp in enumerate(completions):
            outs.append(
                completion_to_sglang(
                    comp,
                    prompt=call.prompts[i],
                    max_new_tokens=limits[i],
                    return_logprob=call.return_logprob,
                    rid=job.ids[i * call.n + j],
                    weight_version=state.engine.weight_version,
                    tokenizer=state.tokenizer,
                    sampling=call.sampling[i],
                    e2e_latency=latency,
                    return_text_in_logprobs=call.return_text_in_logprobs,
                    return_prompt_token_ids=call.return_prompt_token_ids,
                    abort_message=job.abort_message,
                    routing=routing,
                    waiting_interval=waiting_interval,
                )
            )
    return reply(200, outs[0] if call.single and call.n == 1 else outs)
