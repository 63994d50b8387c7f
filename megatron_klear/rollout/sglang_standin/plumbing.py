"""What the routers share: the error gate every route runs behind, bodies read and decoded here
(FastAPI never validates them: its 422 would replace SGLang's 400 messages), answers, and running
blocking work off the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

from fastapi import Request, Response
from fastapi.routing import APIRoute

from megatron_klear.rollout.sglang_standin.contract import BadRequest, ContractError

MAX_BODY_BYTES = 1 << 30
#: the routes SGLang answers through its scheduler: their answer moves the tokenizer manager's
#: last_receive_tstamp, which a health probe counts as a sign of life (SGLang 0.5.23 tokenizer_manager.py
#: handle_loop); so does every decode step
SCHEDULER_ROUTES = frozenset(
    {
        "/server_info",
        "/get_server_info",
        "/flush_cache",
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_distributed",
        "/update_weight_version",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/weights_checker",
        "/continue_generation",
    }
)


def reply(status: int = 200, payload=None, *, text: str | None = None) -> Response:
    """``payload`` as ``json.dumps`` writes it (empty when None; NaN written as Python does, which
    Starlette's JSONResponse refuses), or ``text``."""
    if text is not None:
        return Response(text.encode(), status_code=status, media_type="text/plain; charset=utf-8")
    data = b"" if payload is None else json.dumps(payload).encode()
    return Response(data, status_code=status, media_type="application/json")


def error(status: int, message: str) -> Response:
    return reply(status, {"error": {"message": message}})


class StandinRoute(APIRoute):
    """Every route runs behind this gate: a body SGLang's contract refuses answers 400
    ``{"error": "..."}``, a request SGLang (or this engine) refuses 400 ``{"error": {"message"}}``,
    any other failure 500 ``{"error": {"message": "<type>: <text>"}}``, all on the same connection
    (an exception left to Starlette would close it)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def gated(request: Request) -> Response:
            try:
                response = await handler(request)
                if request.url.path in SCHEDULER_ROUTES:
                    server_state(request).last_receive = time.monotonic()
                return response
            except ContractError as e:
                return reply(400, {"error": str(e)})
            except BadRequest as e:
                return error(400, str(e))
            except Exception as e:  # noqa: BLE001 -- answered, not swallowed: the client raises it
                return error(500, f"{type(e).__name__}: {e}")

        return gated


def server_state(request: Request):
    """The :class:`~megatron_klear.rollout.sglang_standin.state.ServerState` of the app serving ``request``."""
    return request.app.state.standin


async def read_body(request: Request) -> bytes:
    length = int(request.headers.get("content-length") or 0)
    if length > MAX_BODY_BYTES:
        raise BadRequest(f"request body of {length} bytes is over the {MAX_BODY_BYTES}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"request body of more than {MAX_BODY_BYTES} bytes is over the limit")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(raw: bytes):
    """An empty body is ``{}``."""
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON ({e})") from None


async def read_json(request: Request):
    return decode_json(await read_body(request))


async def off_loop(fn, *args):
    """``fn(*args)`` in a thread of its own, awaited: weight and pause calls block for seconds (or
    until a peer joins a group) while the event loop goes on answering. A daemon thread per call,
    like the connection threads of the stdlib server before: one still blocked at exit does not hold
    the process, and calls never wait for each other's threads."""
    future = concurrent.futures.Future()

    def run():
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 -- re-raised in the awaiting route
            future.set_exception(e)

    threading.Thread(target=run, name="standin-call", daemon=True).start()
    return await asyncio.wrap_future(future)
