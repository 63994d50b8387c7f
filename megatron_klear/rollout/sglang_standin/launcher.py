"""Running the stand-in: :func:`make_server` and :func:`serve_in_thread` (uvicorn on 127.0.0.1),
:func:`main` (``python -m megatron_klear.rollout.sglang_standin``), and the client
:class:`EmbeddedHTTPEngine`, which can launch a server subprocess."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import uvicorn

import megatron_klear
from megatron_klear.rollout.sglang import SGLangEngine
from megatron_klear.rollout.sglang_standin import sglang_env
from megatron_klear.rollout.sglang_standin.state import HOST, ServerState
from megatron_klear.utils import atomic

SERVER_HEADER = "megatron-klear-embedded"
SHUTDOWN_GRACE_S = 5  # a call still running this long after shutdown is cancelled


class _Uvicorn(uvicorn.Server):
    """uvicorn with a server process's signals kept: SIGTERM ends it at once (uvicorn would first
    wait for the running requests), SIGINT (Ctrl-C) calls ``on_interrupt`` in the event loop."""

    def __init__(self, config, on_interrupt):
        super().__init__(config)
        self.on_interrupt = on_interrupt

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self.on_interrupt)
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGINT)


class StandinServer:
    """One stand-in server: its :class:`ServerState` (``state``), ``uvicorn`` (a ``uvicorn.Server``)
    and the socket bound at construction (``server_address``). Call :meth:`serve_forever` (e.g. in
    a thread), then :meth:`shutdown` and :meth:`server_close`."""

    def __init__(self, state: ServerState, port: int = 0, *, exit_on_fault: bool = False, host: str = HOST):
        from megatron_klear.rollout.sglang_standin.app import build_app  # (the routes import the engine: torch)

        self.state = state
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on connections accepted from such a socket
        # (without it an answer's body waits for the client's delayed ACK of its headers, ~40 ms)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, int(port)))  # 127.0.0.1; 0.0.0.0 for other nodes (--host)
        state.host = host
        self.socket.listen(2048)
        self.server_address = self.socket.getsockname()[:2]
        state.port = self.server_address[1]
        config = uvicorn.Config(
            build_app(state),
            # uvloop and httptools when installed (dependencies of the package), as SGLang's server runs
            # uvloop (http_server.py) and uvicorn picks httptools: about a third less CPU per request
            # than asyncio + h11 (benchmarks/RESULTS.md)
            loop="auto",
            http="auto",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            server_header=False,
            headers=[("server", SERVER_HEADER)],
            timeout_keep_alive=sglang_env.timeout_keep_alive(),
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
        self.uvicorn = _Uvicorn(config, on_interrupt=self._stop)
        self._serving = False
        self._stopped = threading.Event()
        # a generation on released memory kills SGLang's server: a server process exits (status 1),
        # an in-process one stops serving
        self.exit_on_fault = exit_on_fault
        state.on_fault = self._die

    def _die(self) -> None:
        if self.exit_on_fault:
            os._exit(1)
        self._stop()

    def serve_forever(self) -> None:
        self._serving = True
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def _stop(self) -> None:
        self.state.scheduler.close()
        self.uvicorn.should_exit = True

    def shutdown(self) -> None:
        """Stop serving; returns once :meth:`serve_forever` has. Running requests end (finish_reason
        abort), queued ones answer 500, idle kept-alive connections are closed at once and the others
        after their answer; a call still running after ``SHUTDOWN_GRACE_S`` is cancelled."""
        self._stop()
        if self._serving:
            self._stopped.wait()

    def server_close(self) -> None:
        """:meth:`shutdown`, then close the socket and wait (at most ``SHUTDOWN_GRACE_S``) for the
        engine to stop."""
        self.shutdown()
        self.socket.close()
        self.state.scheduler.join(SHUTDOWN_GRACE_S)


def make_server(
    engine,
    port: int = 0,
    *,
    tokenizer=None,
    tokenizer_path: str | None = None,
    served_model_name: str | None = None,
    max_running_requests: int | None = None,
    max_total_tokens: int | None = None,
    batch_window: float = 0.05,
    weight_sync_timeout: float = 600.0,
    return_routed_experts: bool = False,
    enable_memory_saver: bool = False,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    custom_weight_loader=(),
    host: str = HOST,
    gpus=None,
) -> StandinServer:
    """A server for ``engine`` on ``host``:``port`` (127.0.0.1 by default; 0: a free port, see
    ``server.server_address``).
    ``max_running_requests`` / ``max_total_tokens``: the running batch's bounds, in sequences and KV
    tokens (SGLang's flags; default: the engine's); ``batch_window``: the longest an idle engine waits
    for concurrent requests to gather (the scheduler);
    ``weight_sync_timeout``: seconds for joining a weight-update group and for each broadcast;
    ``return_routed_experts``: SGLang's ``--enable-return-routed-experts`` (MoE models);
    ``enable_memory_saver``: SGLang's ``--enable-memory-saver`` (releasing weights frees them);
    ``api_key`` / ``admin_api_key``: SGLang's ``--api-key`` / ``--admin-api-key``;
    ``custom_weight_loader``: SGLang's ``--custom-weight-loader`` (import paths of loaders
    ``update_weights_from_tensor`` may call); ``gpus``: its TP ranks' GPUs
    (:class:`~.gpus.ServerGPUs`; default one rank on local GPU 0 of this process's)."""
    state = ServerState(
        engine,
        tokenizer,
        tokenizer_path,
        served_model_name,
        max_running_requests,
        max_total_tokens,
        batch_window,
        weight_sync_timeout,
        return_routed_experts,
        enable_memory_saver,
        api_key,
        admin_api_key,
        custom_weight_loader,
        gpus,
    )
    return StandinServer(state, port, host=host)


def serve_in_thread(engine, port: int = 0, **kwargs):
    """:func:`make_server` served by a daemon thread; returns ``(server, url)``. Stop with
    ``server.shutdown(); server.server_close()``."""
    server = make_server(engine, port, **kwargs)
    server._serving = True  # (a shutdown right away waits for the thread)
    threading.Thread(target=server.serve_forever, name="standin-http", daemon=True).start()
    return server, f"http://{HOST}:{server.server_address[1]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_klear.rollout.embedded",
        description="Serve an HF checkpoint with the embedded rollout engine on 127.0.0.1 "
        "(a subset of SGLang's native HTTP API).",
    )
    ap.add_argument(
        "--model",
        "--model-path",
        required=True,
        help="HF checkpoint directory (config.json + safetensors; SGLang: --model-path)",
    )
    ap.add_argument("--port", type=int, default=30000, help="port (0: any free port)")
    ap.add_argument(
        "--host", default=HOST, help="address to bind (default 127.0.0.1; 0.0.0.0 to be reached from other nodes)"
    )
    ap.add_argument("--dtype", default="float32", help="float32 (default) | bfloat16 | float16 | float64")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--max-running-requests", type=int, default=None, help="most sequences in the running batch (SGLang's flag)"
    )
    ap.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="most KV-cache tokens the running sequences hold; beyond it requests wait or are retracted "
        "(SGLang's flag; default: unbounded)",
    )
    ap.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="longest prompt + response (default: the config's, as SGLang's --context-length)",
    )
    ap.add_argument("--served-model-name", default=None, help="the model name in /v1/models (default: the path)")
    ap.add_argument(
        "--batch-window-ms",
        type=float,
        default=50.0,
        help="longest an idle engine waits for concurrent requests to gather into one prefill",
    )
    ap.add_argument(
        "--weight-sync-timeout",
        type=float,
        default=600.0,
        help="seconds for joining a weight-update group and for each broadcast received in it",
    )
    ap.add_argument("--port-file", default=None, help="write the bound port here (atomically) once serving")
    ap.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="record each token's experts (MoE models) and return them to requests with "
        "return_routed_experts (SGLang's flag of the same name)",
    )
    ap.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="release_memory_occupation of 'weights' frees them (a server sharing the trainer's "
        "machine; SGLang's flag of the same name)",
    )
    ap.add_argument(
        "--api-key",
        default=None,
        help="refuse requests without 'Authorization: Bearer <key>' (SGLang's flag and rules; /health stays open)",
    )
    ap.add_argument(
        "--admin-api-key",
        default=None,
        help="the key of the admin routes (weights, memory, pause; SGLang's flag and rules)",
    )
    ap.add_argument(
        "--custom-weight-loader",
        nargs="*",
        default=[],
        help="import paths of weight loaders update_weights_from_tensor may name as its load_format "
        "(SGLang's flag; the project's delta loader: megatron_klear.rollout.in_server.sglang_delta.apply_delta)",
    )
    ap.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks: one model here, but each rank opens its own handles of an in-memory "
        "push on its own GPU, as SGLang's do (rollout/sglang_standin/gpus.py)",
    )
    ap.add_argument("--base-gpu-id", type=int, default=0, help="the local GPU of TP rank 0 (SGLang's flag)")
    ap.add_argument("--gpu-id-step", type=int, default=1, help="local GPUs between TP ranks (SGLang's flag)")
    args = ap.parse_args(argv)

    from megatron_klear.rollout.embedded import EmbeddedEngine, load_tokenizer
    from megatron_klear.rollout.sglang_standin.gpus import ServerGPUs

    gpus = ServerGPUs(args.tp_size, args.base_gpu_id, args.gpu_id_step)  # (CUDA's error for a GPU it cannot see)

    tokenizer = load_tokenizer(args.model)
    engine = EmbeddedEngine.from_pretrained(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_running_requests=args.max_running_requests,
        max_total_tokens=args.max_total_tokens,
        context_length=args.context_length,
        tokenizer=tokenizer,
    )
    server = make_server(
        engine,
        args.port,
        tokenizer=tokenizer,
        tokenizer_path=args.model if tokenizer else None,
        served_model_name=args.served_model_name,
        batch_window=args.batch_window_ms / 1000.0,
        weight_sync_timeout=args.weight_sync_timeout,
        return_routed_experts=args.enable_return_routed_experts,
        enable_memory_saver=args.enable_memory_saver,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        custom_weight_loader=args.custom_weight_loader,
        host=args.host,
        gpus=gpus,
    )
    server.exit_on_fault = True
    port = server.server_address[1]
    if args.port_file:
        atomic.write_text(args.port_file, str(port))
    print(f"embedded rollout engine serving {args.model} on http://{args.host}:{port}", flush=True)
    try:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: a clean stop
            server.serve_forever()
    finally:
        server.server_close()
    return 0


def start_server_process(cmd: list, log_path: str, env: dict) -> subprocess.Popen:
    """``cmd`` (a server's command line) in a new interpreter, its output to ``log_path``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


class EmbeddedHTTPEngine(SGLangEngine):
    """The SGLang-API client (:class:`megatron_klear.rollout.sglang.SGLangEngine`) pointed at a
    stand-in server, plus :meth:`launch` to start one. Every request has a timeout: ``timeout``
    seconds, or ``generate_timeout`` for /generate."""

    def __init__(
        self, url: str, *, timeout: float = 60.0, generate_timeout: float = 3600.0, api_key: str | None = None
    ):
        from megatron_klear.rollout.config import RolloutConfig

        # send_seed: the stand-in derives one seed per (prompt, sample) from it
        config = RolloutConfig(
            engine="sglang",
            urls=[url],
            control_timeout_s=timeout,
            generate_timeout_s=generate_timeout,
            api_key=api_key or "",
            send_seed=True,
        )
        config.validate()
        super().__init__(config)
        self._process = None
        self._workdir = None

    #: how :meth:`launch` starts a server: ``(cmd, log_path, env) -> process`` with
    #: :class:`subprocess.Popen`'s ``pid``, ``returncode``, ``poll``, ``wait``, ``terminate`` and
    #: ``kill``. The tests, which start dozens of servers, swap in a fork server that runs the same
    #: :func:`main` from warm imports (tests/rollout/standin_zygote.py).
    start_process = staticmethod(start_server_process)

    @classmethod
    def launch(
        cls,
        model_dir: str,
        *,
        port: int = 0,
        host: str = HOST,
        dtype: str = "float32",
        max_running_requests: int | None = None,
        max_total_tokens: int | None = None,
        context_length: int | None = None,
        served_model_name: str | None = None,
        weight_sync_timeout: float | None = None,
        startup_timeout: float = 300.0,
        return_routed_experts: bool = False,
        enable_memory_saver: bool = False,
        api_key: str | None = None,
        custom_weight_loader=(),
        env: dict | None = None,
        tp_size: int = 1,
        base_gpu_id: int = 0,
        **kwargs,
    ) -> "EmbeddedHTTPEngine":
        """Start ``python -m megatron_klear.rollout.sglang_standin`` for ``model_dir`` and wait until
        it is healthy at ``host`` (the address it binds); :meth:`close` stops it. The server's output
        goes to a log file named in errors.
        ``context_length`` / ``served_model_name`` / ``weight_sync_timeout`` /
        ``return_routed_experts`` / ``enable_memory_saver`` / ``api_key`` / ``custom_weight_loader``:
        the server's flags of those names (the client sends ``api_key`` too); ``tp_size`` /
        ``base_gpu_id``: ``--tp-size`` / ``--base-gpu-id`` (its ranks' GPUs); ``env``: variables
        added to the server's environment (e.g. ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``,
        ``CUDA_VISIBLE_DEVICES``)."""
        workdir = tempfile.mkdtemp(prefix="klear-embedded-server-")
        port_file, log_path = os.path.join(workdir, "port"), os.path.join(workdir, "server.log")
        cmd = [
            sys.executable,
            "-m",
            "megatron_klear.rollout.sglang_standin",
            "--model",
            model_dir,
            "--port",
            str(port),
            "--host",
            host,
            "--dtype",
            dtype,
            "--port-file",
            port_file,
        ]
        if max_running_requests is not None:
            cmd += ["--max-running-requests", str(max_running_requests)]
        if max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(max_total_tokens)]
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
        if api_key:
            cmd += ["--api-key", api_key]
        if custom_weight_loader:
            cmd += ["--custom-weight-loader", *custom_weight_loader]
        if tp_size != 1 or base_gpu_id:
            cmd += ["--tp-size", str(tp_size), "--base-gpu-id", str(base_gpu_id)]
        root = os.path.dirname(os.path.dirname(os.path.abspath(megatron_klear.__file__)))
        env = dict(
            os.environ, **(env or {}), PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        )
        proc = cls.start_process(cmd, log_path, env)
        engine = None
        deadline = time.monotonic() + startup_timeout
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"rollout.sglang_standin: the server exited with code {proc.returncode} "
                        f"before serving; log {log_path}:\n{_tail(log_path)}"
                    )
                if os.path.isfile(port_file):
                    if engine is None:
                        with open(port_file) as f:
                            engine = cls(f"http://{host}:{int(f.read())}", api_key=api_key, **kwargs)
                    if engine.health():
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"rollout.sglang_standin: the server was not healthy within "
                        f"{startup_timeout:g} s; log {log_path}:\n{_tail(log_path)}"
                    )
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
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(proc.pid, signal.SIGCONT)
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
