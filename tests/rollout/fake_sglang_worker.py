"""A scriptable stand-in for one SGLang worker, for fault injection only (stdlib, starts in ~50 ms).

Run as its own process so that the faults are real (SIGKILL, SIGSTOP); every request it receives
is recorded (one JSON line: method, path, body, the client's address) so the tests can validate what the client sent
against SGLang's contract. Generation answers in SGLang's response shape: each sample is
``[7, 8, 9]`` (or a prefix of it for a smaller max_new_tokens) with log-prob -0.5 per token.

    python tests/rollout/fake_sglang_worker.py --port-file F [--port P] --record R.jsonl [--generate-delay S]
        [--fail-first K] [--status CODE] [--abort-first K] [--non-json] [--context-length C]
        [--tp-size N] [--hang-init] [--fail-post PATH,PATH...] [--refuse-flush K]

The routes of SGLang's distributed weight update answer ``{"success": true}`` without joining any
process group (``/update_weight_version`` sets the version); with ``--hang-init``,
``/init_weights_update_group`` never answers (a server that never joins the group). With
``--fail-post``, each POST to one of those paths answers 400 ``{"success": false, "message":
"injected failure of PATH"}`` (SGLang's shape for a failed control call). ``/flush_cache`` answers
SGLang's text; with ``--refuse-flush K`` its first K calls answer 400 ``Flush cache failed.`` (SGLang
0.5.23 while a request is still running or queued).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKENS = [7, 8, 9]


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.generate_calls = 0
        self.weight_version = "0"
        self.paused = False
        self.flushes = 0

    def record(self, method, path, body, client=None):
        if self.args.record:
            with self.lock, open(self.args.record, "a") as f:
                f.write(json.dumps({"method": method, "path": path, "body": body, "client": client}) + "\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, status, payload=None, raw=None, ctype="application/json"):
        data = raw if raw is not None else (b"" if payload is None else json.dumps(payload).encode())
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw.strip() else None

    def do_GET(self):
        st, a = self.server.state, self.server.state.args
        st.record("GET", self.path, None, self.client_address)
        if self.path == "/health":
            self._send(200)
        elif self.path == "/v1/models":
            if a.non_json:
                self._send(200, raw=b"<html>502 Bad Gateway</html>", ctype="text/html")
            else:
                self._send(
                    200,
                    {"object": "list", "data": [{"id": "fake", "object": "model", "max_model_len": a.context_length}]},
                )
        elif self.path in ("/server_info", "/get_server_info"):
            self._send(
                200,
                {
                    "context_length": a.context_length,
                    "generate_calls": st.generate_calls,
                    "tp_size": a.tp_size,
                    "dtype": "bfloat16",
                    **json.loads(a.server_info or "{}"),
                },
            )
        elif self.path in ("/model_info", "/get_model_info"):
            self._send(200, {"model_path": "fake", "is_generation": True, "weight_version": st.weight_version})
        else:
            self._send(404, {"error": {"message": f"no GET {self.path}"}})

    def do_POST(self):
        st, a = self.server.state, self.server.state.args
        body = self._body()
        st.record("POST", self.path, body, self.client_address)
        if self.path in a.fail_post:
            return self._send(400, {"success": False, "message": f"injected failure of {self.path}"})
        if self.path == "/generate":
            with st.lock:
                st.generate_calls += 1
                call = st.generate_calls
            if a.generate_delay:
                time.sleep(a.generate_delay)
            if a.non_json:
                return self._send(200, raw=b"<html>502 Bad Gateway</html>", ctype="text/html")
            if a.status:
                return self._send(a.status, {"error": {"message": f"injected HTTP {a.status}"}})
            if call <= a.fail_first:
                return self._send(500, {"error": {"message": f"injected failure {call}"}})
            sp = body.get("sampling_params") or {}
            n, k = int(sp.get("n", 1)), min(len(TOKENS), int(sp.get("max_new_tokens", 128)))
            ids = TOKENS[:k]
            reason = {"type": "stop", "matched": ids[-1]} if k == len(TOKENS) else {"type": "length", "length": k}
            if call <= a.abort_first:  # as SGLang answers a request aborted before its first token
                ids, k, reason = [], 0, {"type": "abort", "message": "injected abort"}
            outs = [
                {
                    "text": "",
                    "output_ids": ids,
                    "meta_info": {
                        "id": f"r{call}-{j}",
                        "finish_reason": reason,
                        "prompt_tokens": len(body["input_ids"]),
                        "completion_tokens": k,
                        "cached_tokens": 0,
                        "weight_version": st.weight_version,
                        "output_token_logprobs": [[-0.5, t, None] for t in ids],
                    },
                }
                for j in range(n)
            ]
            return self._send(200, outs[0] if n == 1 else outs)
        if self.path == "/flush_cache":
            with st.lock:
                st.flushes += 1
                refuse = st.flushes <= a.refuse_flush
            if refuse:
                return self._send(400, raw=b"Flush cache failed.\n", ctype="text/plain")
            return self._send(200, raw=b"Cache flushed.\n", ctype="text/plain")
        if self.path == "/pause_generation":
            st.paused = True
            return self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
        if self.path == "/continue_generation":
            st.paused = False
            return self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
        if self.path == "/init_weights_update_group" and a.hang_init:
            time.sleep(3600)
        if self.path == "/update_weight_version":
            st.weight_version = str(body["new_version"])
            return self._send(200, {"success": True, "message": "ok", "new_version": st.weight_version})
        if self.path in (
            "/init_weights_update_group",
            "/destroy_weights_update_group",
            "/begin_weight_update",
            "/end_weight_update",
            "/update_weights_from_distributed",
        ):
            return self._send(200, {"success": True, "message": "ok"})
        if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
            return self._send(200, raw=b"null")  # SGLang's handlers return None: FastAPI answers null
        if self.path == "/update_weights_from_disk":
            st.weight_version = str(body.get("weight_version", st.weight_version))
            return self._send(200, {"success": True, "message": "ok", "num_paused_requests": 0})
        self._send(404, {"error": {"message": f"no POST {self.path}"}})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--port", type=int, default=0, help="0: any free port (a restart at a known URL names one)")
    ap.add_argument("--record", default="")
    ap.add_argument("--generate-delay", type=float, default=0.0)
    ap.add_argument("--fail-first", type=int, default=0)
    ap.add_argument("--abort-first", type=int, default=0)
    ap.add_argument("--status", type=int, default=0)
    ap.add_argument("--non-json", action="store_true")
    ap.add_argument("--context-length", type=int, default=40960)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--server-info", default="", help="JSON fields added to /server_info")
    ap.add_argument("--hang-init", action="store_true")
    ap.add_argument("--fail-post", type=lambda v: v.split(","), default=[])
    ap.add_argument("--refuse-flush", type=int, default=0)
    args = ap.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    server.state = State(args)
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
