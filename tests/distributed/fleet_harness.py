"""What the fleet tests (test_fleet_runs.py) drive an RL run with: stand-in servers that a test can
kill, freeze and restart at the same URL, the real sglang-router in front of them, and a director
thread that acts on them while the run goes on in the test's main thread.

The director acts on what it observes, not on sleeps: the run's metrics JSONL (one line per
finished step, written after the step's weight push), and each server's request log
(:mod:`tests.distributed.fleet_server` ``--events``), which says which requests it has received and
which it has not answered yet. "Mid-rollout of step k" is: after step k-1's line, a ``/generate``
that the server has not answered; "mid-sync" is a weight-update call it has not answered (the
server holds such calls for a moment, ``--route-delay``, so that the sync is under way for sure).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYNC_ROUTES = ("/update_weights_from_disk", "/update_weights_from_distributed", "/init_weights_update_group")


def fixed_port(rng: random.Random | None = None) -> int:
    """A port below the kernel's ephemeral range (32768 and up), free now: a server restarted on it
    later does not find it taken by some process's outgoing connection."""
    rng = rng or random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


class Zygote:
    """The process that forks the stand-in servers (:mod:`tests.distributed.fleet_server`): started
    once per model, warm in 10-30 s; each :class:`Server` start then takes a fraction of a second."""

    def __init__(self, model: str, workdir: str):
        self.model, self.control = model, os.path.join(workdir, "zygote")
        os.makedirs(self.control, exist_ok=True)
        self.log_path = os.path.join(workdir, "zygote.log")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.distributed.fleet_server", self.control, model],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=ROOT,
            )
        self._tokens = itertools.count()

    def wait_ready(self, timeout: float = 180.0) -> "Zygote":
        deadline = time.monotonic() + timeout
        while not os.path.exists(os.path.join(self.control, "ready")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the server zygote is not ready (exit code {self.proc.poll()}):\n{_tail(self.log_path)}"
                )
            time.sleep(0.05)
        return self

    def fork(self, spec: dict) -> int:
        """A new server process for ``spec`` (see fleet_server); returns its pid."""
        token = f"{os.getpid()}-{next(self._tokens)}"
        req = os.path.join(self.control, f"req-{token}.json")
        with open(req + ".tmp", "w") as f:
            json.dump(spec, f)
        os.replace(req + ".tmp", req)
        answer = os.path.join(self.control, f"pid-{token}")
        deadline = time.monotonic() + 30
        while not os.path.exists(answer):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the server zygote did not fork (exit code {self.proc.poll()}):\n{_tail(self.log_path)}"
                )
            time.sleep(0.01)
        with open(answer) as f:
            return int(f.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            open(os.path.join(self.control, "stop"), "w").close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _alive(pid: int | None) -> bool:
    """``pid`` runs (or is stopped); False once it exited, also before its parent reaped it."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Server:
    """One stand-in server at a fixed port (its URL never changes), forked by ``zygote``:
    :meth:`kill` (SIGKILL), :meth:`freeze` / :meth:`thaw` (SIGSTOP / SIGCONT), :meth:`start` again
    at the same URL (a new process with the checkpoint's weights)."""

    def __init__(
        self,
        zygote: Zygote,
        workdir: str,
        name: str,
        *,
        token_delay: float = 0.0,
        route_delays=None,
        port: int | None = None,
    ):
        self.zygote, self.name = zygote, name
        self.port = port or fixed_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events_path = os.path.join(workdir, f"{name}.events.jsonl")
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.token_delay, self.route_delays = token_delay, dict(route_delays or {})
        self.pid = None
        self.starts = 0

    def start(self) -> "Server":
        """Start a new server process (returns at once; :meth:`wait_healthy` waits for it)."""
        if self.running():
            raise RuntimeError(f"{self.name} ({self.url}) is already running")
        self.pid = self.zygote.fork(
            {
                "port": self.port,
                "events": self.events_path,
                "log": self.log_path,
                "token_delay": self.token_delay,
                "route_delays": self.route_delays,
            }
        )
        self.starts += 1
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout: float = 60.0) -> "Server":
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if not self.running():
                raise RuntimeError(f"server {self.name} ({self.url}) exited; log {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"server {self.name} ({self.url}) not healthy within {timeout:g} s:\n{self.log_tail()}"
                )
            time.sleep(0.05)
        return self

    def running(self) -> bool:
        return _alive(self.pid)

    def _signal(self, sig) -> None:
        if not self.running():
            raise RuntimeError(f"server {self.name} ({self.url}) is not running")
        os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL: the process ends at once, mid-request, its connections reset."""
        self._signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.01)

    def freeze(self) -> None:
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)

    def close(self) -> None:
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.02)
            if self.running():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)

    # -- what it did --------------------------------------------------------------------------------
    def events(self) -> list:
        if not os.path.isfile(self.events_path):
            return []
        out = []
        with open(self.events_path) as f:
            for line in f:
                if line.endswith("\n"):
                    out.append(json.loads(line))
        return out

    def unanswered(self, paths, since: float = 0.0) -> list:
        """Requests to any of ``paths`` received after ``since`` (time.time()) by the running process
        and not answered yet."""
        pid = self.pid
        evs = [e for e in self.events() if e["pid"] == pid]
        answered = {e["id"] for e in evs if e["ev"] == "answer"}
        return [
            e for e in evs if e["ev"] == "start" and e["path"] in paths and e["t"] > since and e["id"] not in answered
        ]

    def received(self, path: str, since: float = 0.0) -> int:
        return sum(1 for e in self.events() if e["ev"] == "start" and e["path"] == path and e["t"] > since)

    def weight_version(self):
        return get_json(self.url + "/model_info")["weight_version"]

    def log_tail(self) -> str:
        return _tail(self.log_path)


from megatron_klear.rollout.sglang_standin.launcher import _tail  # noqa: E402 -- the servers' log tail


def router_flags() -> list:
    """sglang-router 0.3.2 as docs/sglang.md starts it: no health checks of its own (the trainer keeps
    the membership) and a request timeout above the runs' rollout.generate_timeout_s."""
    return ["--disable-health-check", "--request-timeout-secs", "600"]


def read_metrics(path: str) -> list:
    """The complete lines of a metrics JSONL (a line being written is left out)."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


class Director(threading.Thread):
    """Runs ``script(director)`` in a thread while the RL run goes on in the caller's; records what
    it did (``actions``: (seconds since start, text)) and the first error, raised by :meth:`finish`
    (as is a script the run ended before). ``stop`` is set when the run has ended: every wait gives
    up then (:class:`RunEnded`)."""

    def __init__(self, script, metrics_path: str, poll_s: float = 0.02):
        super().__init__(name="fleet-director", daemon=True)
        self.script, self.metrics_path, self.poll_s = script, metrics_path, poll_s
        self.actions, self.error, self.done = [], None, False
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        try:
            self.script(self)
            self.done = True
        except RunEnded as e:
            self.error = f"the run ended while the director waited for: {e}"
        except BaseException:  # noqa: BLE001 -- raised in the test's thread by finish()
            self.error = traceback.format_exc()

    def note(self, text: str) -> None:
        self.actions.append((round(time.monotonic() - self.t0, 2), text))

    def wait(self, condition, timeout: float, what: str, poll_s: float | None = None):
        """Poll ``condition()`` (every ``poll_s``, default the director's) until it returns something
        truthy (returned)."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if self.stop.is_set():
                raise RunEnded(what)
            if time.monotonic() > deadline:
                raise TimeoutError(f"director: {what}: not seen within {timeout:g} s")
            time.sleep(self.poll_s if poll_s is None else poll_s)

    def steps(self) -> list:
        return read_metrics(self.metrics_path)

    def wait_step(self, k: int, timeout: float = 120.0) -> float:
        """Wait for step ``k``'s metrics line; returns when the file was last written (time.time())."""
        self.wait(lambda: len(self.steps()) >= k, timeout, f"metrics line of step {k}")
        return os.stat(self.metrics_path).st_mtime

    @contextlib.contextmanager
    def holding(self):
        """The run starts no new step while inside (:func:`run_rl` waits at each step's start while
        the hold file exists): a server restarted meanwhile is healthy before the next step, so it
        rejoins at that step's push whatever the machine's load (a slow restart on a busy machine
        once cost the script the steps it needed)."""
        path = hold_file(os.path.dirname(self.metrics_path))
        open(path, "w").close()  # an empty file: its existence is the hold
        try:
            yield
        finally:
            os.remove(path)

    def mid_rollout(self, server: Server, after: float, timeout: float = 120.0) -> None:
        """Wait until ``server`` holds an unanswered ``/generate`` received after ``after``."""
        self.wait(
            lambda: server.unanswered(("/generate",), since=after),
            timeout,
            f"a /generate in flight on {server.name} ({server.url})",
        )

    def mid_sync(self, server: Server, after: float, timeout: float = 120.0, routes=SYNC_ROUTES) -> str:
        """Wait until ``server`` holds an unanswered weight-update call received after ``after``;
        returns its path."""
        found = self.wait(
            lambda: server.unanswered(routes, since=after),
            timeout,
            f"a weight update in flight on {server.name} ({server.url})",
        )
        return found[0]["path"]

    def finish(self, run_error: BaseException | None = None, timeout: float = 60.0) -> None:
        """The run has ended (``run_error``: how it failed, if it did): the script must have done all
        it had to, else AssertionError with what it did, what it was waiting for and the end of the
        run's error."""
        self.stop.set()
        self.join(timeout)
        if self.error or not self.done:
            tail = f"\nthe run's error (end):\n{str(run_error)[-4000:]}" if run_error is not None else ""
            raise AssertionError(
                f"the director's script did not finish; its actions: {self.actions}\n"
                f"{self.error or 'still running'}{tail}"
            )

    def during(self, run, *args, **kwargs):
        """``run(*args, **kwargs)`` with this director acting meanwhile; returns what ``run`` returns,
        or raises its error (after :meth:`finish`, which fails first if the script did not finish)."""
        self.start()
        try:
            result = run(*args, **kwargs)
        except BaseException as e:
            self.finish(e)
            raise
        self.finish()
        return result


class RunEnded(Exception):
    """The run ended while the director was still waiting for something."""


def hold_file(save_dir: str) -> str:
    """While this file exists, :func:`run_rl` starts no new step (:meth:`Director.holding`)."""
    return os.path.join(save_dir, "director.hold")


def run_rl(rank, world, overrides):
    """One RL run (in :func:`tests.distributed.helper.run_distributed`'s ranks): the last step's
    metrics and the trainer's final weights (HF names). Each step waits to start while the
    director holds the run (every rank waits: the step is collective)."""
    from megatron_klear.config import load_config
    from megatron_klear.rl.loop import RLLoop
    from megatron_klear.rollout.weight_sync import iter_model_hf_weights

    loop = RLLoop(load_config(None, overrides))
    hold, step = hold_file(loop.cfg.train.save_dir), loop.step

    def held_step():
        deadline = time.monotonic() + 180
        while os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.05)
        return step()

    loop.step = held_step
    metrics = loop.run()
    return metrics, {k: v.clone() for k, v in iter_model_hf_weights(loop.state.model)}


def probe_logprobs(model_dir: str, weights, prompt, response):
    """float64 log-probs of ``response`` after ``prompt`` under ``weights`` (HF names; None: the
    checkpoint's own), in an HF model built from the checkpoint's config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if weights is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64).eval()
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).double().eval()
        missing, unexpected = model.load_state_dict({k: v.double() for k, v in weights.items()}, strict=False)
        assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    return [float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(response)]


def greedy_probe(url: str, prompt, max_new_tokens: int = 6):
    """The server's greedy tokens and their log-probs for ``prompt`` (sent to the server directly).
    An answer that a weight push's pause aborted part-way (``finish_reason`` abort: the loop goes on
    while the test probes) is asked again, so that the probe is always a whole continuation."""
    body = {
        "input_ids": list(prompt),
        "return_logprob": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
    }
    for _ in range(50):
        req = urllib.request.Request(
            url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            out = json.loads(r.read())
        if (out["meta_info"].get("finish_reason") or {}).get("type") != "abort":
            break
        time.sleep(0.1)
    lps = out["meta_info"]["output_token_logprobs"]
    return [t for _, t, _ in lps], [lp for lp, _, _ in lps]
