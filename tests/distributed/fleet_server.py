"""Stand-in SGLang servers as the fleet tests run them, started by a *zygote*: one process imports
torch, transformers and the stand-in and loads the checkpoint once (10-30 s on a busy 2-core
machine), then forks a fresh server process on request in a fraction of a second. Each server is a
process of its own (its own pid, memory and weights, loaded again from the checkpoint), so a test
kills, freezes and restarts it as it would a real server, only without paying the start-up again.

A server is the stand-in of ``python -m megatron_klear.rollout.sglang_standin`` (the same
``make_server`` with the CLI's defaults) with three test-only additions, so that a test can act on a
server *during* a rollout or a weight sync by watching what it does rather than by sleeping:

- ``events``: one JSON line per request as it arrives (``{"ev": "start", "id", "method", "path",
  "t", "pid"}``) and one as its answer starts (``{"ev": "answer", "id", "path", "status", "t",
  "pid"}``); a restarted server appends to the same file (with its own ``pid``);
- ``token_delay``: every forward pass of the engine (the prefill and each decode step) first sleeps
  this many seconds, so that a rollout lasts long enough to be interrupted;
- ``route_delays``: ``{path: seconds}``, a request to ``path`` waits that long before it is
  handled (e.g. ``/update_weights_from_disk``: the weight sync is under way when the test kills it).

Protocol (files in the control directory): the zygote writes ``ready`` once warm; a request
``req-<token>.json`` (``{"port", "events", "log", "token_delay", "route_delays"}``) is answered by
``pid-<token>`` (the new server's pid); ``stop`` ends the zygote and its servers. The zygote reaps
its servers and ends when its parent does.

    python -m tests.distributed.fleet_server CONTROL_DIR MODEL_DIR
"""

from __future__ import annotations

import asyncio
import glob
import itertools
import json
import os
import signal
import sys
import threading
import time
import traceback

from tests.rollout.standin_zygote import stop_children


class _Events:
    """Appends one JSON line per event to ``path`` (thread-safe, flushed at once)."""

    def __init__(self, path: str | None):
        self._file = open(path, "a", buffering=1) if path else None
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def next_id(self) -> int:
        return next(self._ids)

    def write(self, **event) -> None:
        if self._file is None:
            return
        event.update(t=time.time(), pid=os.getpid())
        with self._lock:
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()


def _recorded(app, events: _Events, delays: dict):
    """An ASGI wrapper of ``app``: records each HTTP request and its answer, and holds the requests
    to the paths in ``delays``."""

    async def wrapped(scope, receive, send):
        if scope.get("type") != "http":
            return await app(scope, receive, send)
        rid, path = events.next_id(), scope.get("path", "")
        events.write(ev="start", id=rid, method=scope.get("method", ""), path=path)

        async def send_recorded(message):
            if message.get("type") == "http.response.start":
                events.write(ev="answer", id=rid, path=path, status=message.get("status"))
            await send(message)

        if delays.get(path):
            await asyncio.sleep(delays[path])
        return await app(scope, receive, send_recorded)

    return wrapped


def _load(model: str):
    from megatron_klear.rollout.embedded import EmbeddedEngine, load_tokenizer

    tokenizer = load_tokenizer(model)
    return tokenizer, EmbeddedEngine.from_pretrained(model, dtype="float32", device="cpu", tokenizer=tokenizer)


def _serve(model: str, spec: dict) -> None:
    """(In a forked server process.) Load the checkpoint and serve it at ``spec['port']``, as the
    stand-in's CLI does with its defaults."""
    fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from megatron_klear.rollout.embedded.engine import EmbeddedEngine
    from megatron_klear.rollout.sglang_standin import app as app_module
    from megatron_klear.rollout.sglang_standin import launcher

    events, delays = _Events(spec.get("events")), dict(spec.get("route_delays") or {})
    build_app = app_module.build_app
    app_module.build_app = lambda state: _recorded(build_app(state), events, delays)  # read when the server is built
    delay = float(spec.get("token_delay") or 0.0)
    if delay > 0:
        forward = EmbeddedEngine.forward

        def slow_forward(self, *a, **kw):
            time.sleep(delay)
            return forward(self, *a, **kw)

        EmbeddedEngine.forward = slow_forward
    tokenizer, engine = _load(model)
    kwargs = {"weight_sync_timeout": float(spec["weight_sync_timeout"])} if spec.get("weight_sync_timeout") else {}
    server = launcher.make_server(
        engine, int(spec["port"]), tokenizer=tokenizer, tokenizer_path=model if tokenizer else None, **kwargs
    )
    print(f"fleet server pid {os.getpid()} serving {model} on http://127.0.0.1:{spec['port']}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def zygote(control: str, model: str) -> int:
    import torch

    torch.set_num_threads(1)  # no OpenMP pool in the zygote: its forks run torch safely (one thread each)
    from megatron_klear.rollout.base import SamplingParams

    _, engine = _load(model)  # warms every lazy import and the first forward
    engine.generate([[1, 2, 3]], SamplingParams(top_k=1, max_new_tokens=2))
    del engine
    parent, children = os.getppid(), set()
    _write(os.path.join(control, "ready"), str(os.getpid()))
    while True:
        for req in sorted(glob.glob(os.path.join(control, "req-*.json"))):
            token = os.path.basename(req)[len("req-") : -len(".json")]
            with open(req) as f:
                spec = json.load(f)
            os.remove(req)
            pid = os.fork()
            if pid == 0:  # the server process
                status = 0
                try:
                    _serve(model, spec)
                except BaseException:  # noqa: BLE001 -- into the server's log; the process ends either way
                    traceback.print_exc()
                    status = 1
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(status)
            children.add(pid)
            _write(os.path.join(control, f"pid-{token}"), str(pid))
        while children:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
        if os.path.exists(os.path.join(control, "stop")) or os.getppid() != parent:
            stop_children(children)
            return 0
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(zygote(sys.argv[1], sys.argv[2]))
