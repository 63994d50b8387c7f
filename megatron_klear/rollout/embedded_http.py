"""The embedded engine over HTTP: a small server speaking a subset of SGLang's native API, and a client.

Server (standard library only, bound to 127.0.0.1)::

    python -m megatron_klear.rollout.embedded --model DIR --port P [--dtype float32] [--max-batch-size N]

Endpoints, shaped like SGLang's (``python/sglang/srt/entrypoints/http_server.py``, ``GenerateReqInput``):

- ``POST /generate``: ``{"input_ids": [...] | [[...], ...], "sampling_params": {"temperature",
  "top_p", "top_k", "max_new_tokens", "n", "stop_token_ids", "sampling_seed"}, "return_logprob": true}``.
  One object per sample, ``{"text"?, "output_ids": [...], "meta_info": {"id", "finish_reason":
  {"type": "stop", "matched": id} | {"type": "length", "length": max_new_tokens}, "prompt_tokens",
  "completion_tokens", "cached_tokens", "weight_version", "output_token_logprobs":
  [[logprob, token_id, null], ...]}}``; a single (flat) ``input_ids`` with ``n == 1`` answers one
  object, anything else a list ordered prompt by prompt (sample ``j`` of prompt ``i`` at ``i * n + j``,
  as SGLang expands parallel samples). ``temperature == 0`` means greedy, as in SGLang (``top_k=1``,
  log-probs at temperature 1). ``text`` is present when the model directory has a tokenizer. The
  log-probs are the engine's: ``log_softmax(logits / temperature)``, unfiltered (see
  :mod:`megatron_klear.rollout.sampling`). Options SGLang has and this server does not (text prompts,
  streaming, string stops, penalties, per-prompt sampling params...) are refused with a 400 naming the
  field rather than ignored.
- ``GET /health`` (200, empty body), ``GET /get_model_info``, ``POST /flush_cache`` (no-op: nothing is
  cached between requests).
- ``POST /update_weights_from_disk`` ``{"model_path": DIR, "weight_version"?}``: load every weight of
  an HF safetensors checkpoint directory; answers ``{"success", "message", "num_paused_requests"}``.

Errors answer ``{"error": {"message": ...}}`` with status 400 (bad request) or 500.

Client: :class:`EmbeddedHTTPEngine` implements :class:`~megatron_klear.rollout.base.RolloutEngine`
over that API (weights go through a temporary safetensors directory and
``/update_weights_from_disk``); :meth:`EmbeddedHTTPEngine.launch` starts a server subprocess.
"""
from __future__ import annotations

import argparse
import json
import numbers
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


from megatron_klear.rollout.base import Completion, SamplingParams
from megatron_klear.rollout.sglang import SGLangEngine

HOST = "127.0.0.1"
MAX_BODY_BYTES = 1 << 30

# Request fields accepted besides the handled ones, when they hold these (default) values.
_TOP_LEVEL_DEFAULTS = {"stream": (False, None), "logprob_start_len": (-1, None), "top_logprobs_num": (0, None),
                       "return_text_in_logprobs": (False, True, None), "text": (None,)}
_SAMPLING_DEFAULTS = {"stop": (None, [], ""), "ignore_eos": (False, None), "min_new_tokens": (0, None),
                      "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None),
                      "repetition_penalty": (1, 1.0, None), "min_p": (0, 0.0, None),
                      "skip_special_tokens": (True, False, None), "spaces_between_special_tokens": (True, False, None),
                      "no_stop_trim": (False, True, None), "regex": (None,), "json_schema": (None,), "ebnf": (None,)}


class BadRequest(ValueError):
    """A request this server cannot serve; answered with status 400 and the message."""


def _int_field(value, name: str, minimum=None) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or (minimum is not None and value < minimum):
        raise BadRequest(f"{name} must be an integer{'' if minimum is None else f' >= {minimum}'}, got {value!r}")
    return int(value)


def _float_field(value, name: str) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise BadRequest(f"{name} must be a number, got {value!r}")
    return float(value)


def parse_generate_request(body) -> tuple:
    """``(prompts, single, SamplingParams, n, return_logprob, rid)`` from a /generate JSON body."""
    if not isinstance(body, dict):
        raise BadRequest("the /generate body must be a JSON object")
    handled = {"input_ids", "sampling_params", "return_logprob", "rid"}
    for key, value in body.items():
        if key in handled:
            continue
        if key not in _TOP_LEVEL_DEFAULTS:
            raise BadRequest(f"field '{key}' is not supported by the embedded engine")
        if value not in _TOP_LEVEL_DEFAULTS[key]:
            hint = ": send token ids in input_ids" if key == "text" else ""
            raise BadRequest(f"field '{key}'={value!r} is not supported by the embedded engine{hint}")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of token ids or a list of such lists")
    single = not isinstance(ids[0], list)
    prompts = [ids] if single else ids
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not p:
            raise BadRequest(f"input_ids[{i}] must be a non-empty list of token ids")
        for k, t in enumerate(p):
            if not isinstance(t, int) or isinstance(t, bool):
                where = f"input_ids[{k}]" if single else f"input_ids[{i}][{k}]"
                raise BadRequest(f"{where} must be an integer token id, got {t!r}")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be one JSON object (per-prompt sampling params are not supported)")
    for key, value in sp.items():
        if key in {"temperature", "top_p", "top_k", "max_new_tokens", "n", "stop_token_ids", "sampling_seed", "seed"}:
            continue
        if key not in _SAMPLING_DEFAULTS:
            raise BadRequest(f"sampling_params.{key} is not supported by the embedded engine")
        if value not in _SAMPLING_DEFAULTS[key]:
            raise BadRequest(f"sampling_params.{key}={value!r} is not supported by the embedded engine")
    temperature = _float_field(sp.get("temperature", 1.0), "sampling_params.temperature")
    top_k = _int_field(sp.get("top_k", -1), "sampling_params.top_k")
    if temperature < 0:
        raise BadRequest(f"sampling_params.temperature must be >= 0, got {temperature}")
    if temperature == 0:  # SGLang's greedy: top-1 at temperature 1
        temperature, top_k = 1.0, 1
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest(f"sampling_params.stop_token_ids must be a list of token ids, got {stop_ids!r}")
    seed = sp.get("sampling_seed", sp.get("seed"))
    params = SamplingParams(
        temperature=temperature,
        top_p=_float_field(sp.get("top_p", 1.0), "sampling_params.top_p"),
        top_k=top_k,
        max_new_tokens=_int_field(sp.get("max_new_tokens", 128), "sampling_params.max_new_tokens", 1),
        stop_token_ids=list(stop_ids),
        seed=None if seed is None else _int_field(seed, "sampling_params.sampling_seed"),
    )
    try:
        params.validate()
    except ValueError as e:
        raise BadRequest(f"sampling_params: {e}") from None
    n = _int_field(sp.get("n", 1), "sampling_params.n", 1)
    rid = body.get("rid")
    return prompts, single, params, n, bool(body.get("return_logprob", False)), rid


def completion_to_sglang(c: Completion, *, prompt_len: int, params: SamplingParams, return_logprob: bool,
                         rid: str, weight_version, tokenizer=None) -> dict:
    """One sample in SGLang's /generate response shape."""
    if c.finish_reason == "stop":
        reason = {"type": "stop", "matched": c.token_ids[-1]}
    else:
        reason = {"type": "length", "length": params.max_new_tokens}
    meta = {"id": rid, "finish_reason": reason, "prompt_tokens": prompt_len, "completion_tokens": len(c.token_ids),
            "cached_tokens": 0, "weight_version": None if weight_version is None else str(weight_version)}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)]
    out = {"output_ids": list(c.token_ids), "meta_info": meta}
    if tokenizer is not None:
        out = {"text": tokenizer.decode(c.token_ids, skip_special_tokens=True), **out}
    return out


class _Handler(BaseHTTPRequestHandler):
    server_version = "megatron-klear-embedded"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # no access log; errors are answered to the client
        pass

    def _send(self, status: int, payload=None) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
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
        try:
            return json.loads(raw or b"{}")
        except json.JSONDecodeError as e:
            raise BadRequest(f"the request body is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None

    def do_GET(self):
        state = self.server.state
        if self.path == "/health":
            self._send(200)
        elif self.path == "/get_model_info":
            info = state.engine.model_info()
            self._send(200, {**info, "tokenizer_path": state.tokenizer_path, "is_generation": True})
        else:
            self._error(404, f"no GET endpoint {self.path}")

    def do_POST(self):
        routes = {"/generate": self._generate, "/update_weights_from_disk": self._update_from_disk,
                  "/flush_cache": lambda body: self._send(200)}
        route = routes.get(self.path)
        if route is None:
            self._error(404, f"no POST endpoint {self.path}")
            return
        try:
            route(self._body())
        except BadRequest as e:
            self._error(400, str(e))
        except Exception as e:  # noqa: BLE001 -- answered, not swallowed: the client raises it
            self._error(500, f"{type(e).__name__}: {e}")

    def _generate(self, body) -> None:
        state = self.server.state
        prompts, single, params, n, return_logprob, rid = parse_generate_request(body)
        try:
            results = state.engine.generate(prompts, params, n)
        except ValueError as e:  # bad prompt ids and the like
            raise BadRequest(str(e)) from None
        base_id = rid if isinstance(rid, str) else uuid.uuid4().hex
        version = state.engine.weight_version
        outs = []
        for i, per_prompt in enumerate(results):
            for j, c in enumerate(per_prompt):
                sample_id = base_id if single and n == 1 else f"{base_id}-{i * n + j}"
                outs.append(completion_to_sglang(c, prompt_len=len(prompts[i]), params=params, return_logprob=return_logprob,
                                                 rid=sample_id, weight_version=version, tokenizer=state.tokenizer))
        self._send(200, outs[0] if single and n == 1 else outs)

    def _update_from_disk(self, body) -> None:
        path = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path must name an HF checkpoint directory")
        version = body.get("weight_version")
        try:
            self.server.state.engine.load_weights_from_dir(path, version=version)
        except (OSError, ValueError) as e:
            self._send(400, {"success": False, "message": str(e), "num_paused_requests": 0})
            return
        self._send(200, {"success": True, "message": f"loaded weights from {path}", "num_paused_requests": 0})


class _ServerState:
    def __init__(self, engine, tokenizer, tokenizer_path):
        self.engine, self.tokenizer, self.tokenizer_path = engine, tokenizer, tokenizer_path


def make_server(engine, port: int = 0, *, tokenizer=None, tokenizer_path: str | None = None) -> ThreadingHTTPServer:
    """A server for ``engine`` on 127.0.0.1:``port`` (0: a free port, see ``server.server_address``).
    Call ``serve_forever()`` (e.g. in a thread) and ``shutdown()``; the engine serialises requests."""
    server = ThreadingHTTPServer((HOST, int(port)), _Handler)
    server.daemon_threads = True
    server.state = _ServerState(engine, tokenizer, tokenizer_path)
    return server


def _load_tokenizer(path: str):
    """The model directory's tokenizer, or None when it has none (responses then carry no text)."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) and not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_klear.rollout.embedded",
                                 description="Serve an HF checkpoint with the embedded rollout engine on 127.0.0.1 "
                                             "(a subset of SGLang's native HTTP API).")
    ap.add_argument("--model", required=True, help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("--port", type=int, default=30000, help="port on 127.0.0.1 (0: any free port)")
    ap.add_argument("--dtype", default="float32", help="float32 (default) | bfloat16 | float16 | float64")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-batch-size", type=int, default=None, help="most sequences decoded together")
    ap.add_argument("--port-file", default=None, help="write the bound port here (atomically) once serving")
    args = ap.parse_args(argv)

    from megatron_klear.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device,
                                            max_batch_size=args.max_batch_size)
    tokenizer = _load_tokenizer(args.model)
    server = make_server(engine, args.port, tokenizer=tokenizer, tokenizer_path=args.model if tokenizer else None)
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
               startup_timeout: float = 300.0, **kwargs) -> "EmbeddedHTTPEngine":
        """Start ``python -m megatron_klear.rollout.embedded`` for ``model_dir`` and wait until it is
        healthy; :meth:`close` stops it. The server's output goes to a log file named in errors."""
        workdir = tempfile.mkdtemp(prefix="klear-embedded-server-")
        port_file, log_path = os.path.join(workdir, "port"), os.path.join(workdir, "server.log")
        cmd = [sys.executable, "-m", "megatron_klear.rollout.embedded", "--model", model_dir, "--port", str(port),
               "--dtype", dtype, "--port-file", port_file]
        if max_batch_size is not None:
            cmd += ["--max-batch-size", str(max_batch_size)]
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
            _stop(proc)
            raise
        engine._process, engine._workdir = proc, workdir
        return engine

    def close(self) -> None:
        """Stop the server if :meth:`launch` started it."""
        if self._process is not None:
            _stop(self._process)
            self._process = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


def _stop(proc, timeout: float = 10.0) -> None:
    if proc.poll() is None:
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
