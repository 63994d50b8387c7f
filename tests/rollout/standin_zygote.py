"""A fork server for the stand-in servers the tests start (dozens a run): one process imports torch,
transformers' Qwen3 models, uvicorn and FastAPI once (5-10 s of CPU on a busy 2-core machine, what
every ``python -m megatron_klear.rollout.sglang_standin`` pays again), then forks a server on
request in a fraction of a second.

A forked server is what :meth:`EmbeddedHTTPEngine.launch` would have started: its own process (pid,
memory, log file), the caller's working directory and environment, and the stand-in's ``main`` run
with the same arguments (only its command line, as ``ps`` shows it, stays the fork server's: a
test that finds servers by their command line starts them itself). The fork server imports no
module of this package (a module that reads an
environment variable when imported reads the server's own), and runs no tensor operation (torch's
thread pool starts in the server, as it does in a new interpreter). tests/conftest.py installs it as
:attr:`EmbeddedHTTPEngine.start_process` for the whole session; the tests of the launch itself
(tests/rollout/test_embedded_http.py) ask for a new interpreter (``exec_standin_launch``).

Protocol: a UNIX socket in the control directory; one JSON request a connection
(``{"argv", "env", "cwd", "log"}`` -> the new pid; ``{"op": "stop"}``); the fork server reaps its
servers and writes each one's exit status to ``exit-<pid>`` (:class:`subprocess.Popen`'s
``returncode``: minus the signal that ended it). It stops its servers and ends when its parent does.

    python -m tests.rollout.standin_zygote CONTROL_DIR
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULE = "megatron_klear.rollout.sglang_standin"
SOCKET = "zygote.sock"


# -- the fork server ------------------------------------------------------------------------------
def _warm_imports() -> None:
    """What a stand-in server imports besides this package (not run: no thread pool starts here)."""
    import fastapi  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers
    import transformers.models.qwen3.modeling_qwen3
    import transformers.models.qwen3_moe.modeling_qwen3_moe
    import uvicorn  # noqa: F401

    transformers.AutoTokenizer, transformers.AutoModelForCausalLM  # noqa: B018 (lazy attributes)


def _server(request: dict) -> None:
    """(In the forked process.) Become ``python -m megatron_klear.rollout.sglang_standin ARGV``."""
    status = 1
    try:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [MODULE, *request["argv"]]
        from megatron_klear.rollout.sglang_standin.launcher import main

        status = main(request["argv"]) or 0
    except SystemExit as e:  # argparse's errors and --help, as the interpreter ends them
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- as the interpreter prints an uncaught exception
        traceback.print_exc()
        status = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _reap(children: set, control: str) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        tmp = os.path.join(control, f".exit-{pid}")
        with open(tmp, "w") as f:
            f.write(str(_returncode(status)))
        os.replace(tmp, os.path.join(control, f"exit-{pid}"))


def stop_children(children: set, grace: float = 10.0, reap=None) -> None:
    """SIGTERM each of ``children`` (SIGCONT first: a frozen one would not act on it), SIGKILL
    those still there after ``grace`` seconds; ``reap(children)`` removes the ones that ended
    (default: waitpid)."""
    reap = reap or _forget_ended
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for pid in children:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.kill(pid, sig)
    deadline = time.monotonic() + grace
    while children:
        reap(children)
        if children and time.monotonic() > deadline:
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.02)


def _forget_ended(children: set) -> None:
    with contextlib.suppress(ChildProcessError):
        pid, _ = os.waitpid(-1, os.WNOHANG)
        children.discard(pid)


def zygote(control: str) -> int:
    _warm_imports()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(control, SOCKET))
    listener.listen(16)
    listener.settimeout(0.1)
    parent, children = os.getppid(), set()
    while True:
        _reap(children, control)
        if os.getppid() != parent:
            break
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(30)
            request = json.loads(conn.makefile("r").readline())
            if request.get("op") == "stop":
                break
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                _server(request)
            children.add(pid)
            conn.sendall(f"{pid}\n".encode())
    listener.close()
    stop_children(children, reap=lambda c: _reap(c, control))
    return 0


# -- the tests' side ------------------------------------------------------------------------------
class ForkedProcess:
    """A server the fork server started, with the :class:`subprocess.Popen` calls the launcher and
    the tests make (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``,
    ``kill``)."""

    def __init__(self, pid: int, exit_path: str, args: list):
        self.pid, self.args, self._exit_path = pid, args, exit_path
        self.returncode = None

    def poll(self):
        if self.returncode is None and os.path.exists(self._exit_path):
            with open(self._exit_path) as f:
                self.returncode = int(f.read())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig) -> None:
        if self.poll() is None:  # (a pid the fork server reaped may be another process's by now)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class StandinZygote:
    """The fork server of this test process, started at the first :meth:`start` (a launch whose
    command is not the stand-in's starts a new interpreter, as without it). :meth:`close` stops it
    and every server it started."""

    def __init__(self, startup_timeout: float = 300.0):
        self.startup_timeout = startup_timeout
        self.control = self.proc = None
        self._lock = threading.Lock()

    def _ensure_started(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.control = tempfile.mkdtemp(prefix="klear-standin-zygote-")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        with open(os.path.join(self.control, "zygote.log"), "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.rollout.standin_zygote", self.control],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=ROOT,
            )

    def _ask(self, request: dict) -> str:
        deadline = time.monotonic() + self.startup_timeout
        path = os.path.join(self.control, SOCKET)
        while True:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(path)
                except (FileNotFoundError, ConnectionRefusedError):
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        from megatron_klear.rollout.sglang_standin.launcher import _tail

                        raise RuntimeError(
                            f"the stand-in fork server is not serving (exit code {self.proc.poll()}); "
                            f"log {self.control}/zygote.log:\n{_tail(os.path.join(self.control, 'zygote.log'))}"
                        ) from None
                    time.sleep(0.05)
                    continue
                s.settimeout(60)
                s.sendall((json.dumps(request) + "\n").encode())
                return s.makefile("r").readline().strip()

    def start(self, cmd: list, log_path: str, env: dict):
        """:attr:`EmbeddedHTTPEngine.start_process`: the stand-in's ``cmd`` forked, any other
        command in a new interpreter."""
        from megatron_klear.rollout.sglang_standin.launcher import start_server_process

        if list(cmd[1:3]) != ["-m", MODULE]:
            return start_server_process(cmd, log_path, env)
        request = {"argv": list(cmd[3:]), "env": dict(env), "cwd": os.getcwd(), "log": log_path}
        with self._lock:
            self._ensure_started()
            pid = int(self._ask(request))
        return ForkedProcess(pid, os.path.join(self.control, f"exit-{pid}"), cmd)

    def close(self) -> None:
        with self._lock:
            if self.proc is None:
                return
            if self.proc.poll() is None:
                with contextlib.suppress(OSError, RuntimeError):
                    self._ask({"op": "stop"})
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
            shutil.rmtree(self.control, ignore_errors=True)
            self.proc = self.control = None


if __name__ == "__main__":
    sys.exit(zygote(sys.argv[1]))
