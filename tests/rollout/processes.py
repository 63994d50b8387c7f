"""Processes the rollout tests run for real: the sglang-router (pinned, installed by ``make venv``)
and the scriptable fake worker used for fault injection. Ports are chosen by the OS; every
process is stopped by the context managers, whatever the test does."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from megatron_klear.platform.process import free_port
from megatron_klear.rollout.sglang_standin import stop_process as stop

HERE = os.path.dirname(os.path.abspath(__file__))
__all__ = ["free_port", "stop"]  # for the tests that start processes


def _get_json(url: str, timeout: float = 2.0, headers=None):
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
        return json.loads(r.read() or b"null")


@contextlib.contextmanager
def fake_worker(tmp_path, name: str = "w", **flags):
    """A fake SGLang worker process; yields (url, record_path, proc). ``flags``: see the script
    (``generate_delay=2.0``, ``fail_first=1``, ``non_json=True`` ...)."""
    port_file, record = str(tmp_path / f"{name}.port"), str(tmp_path / f"{name}.requests.jsonl")
    cmd = [sys.executable, os.path.join(HERE, "fake_sglang_worker.py"), "--port-file", port_file, "--record", record]
    for k, v in flags.items():
        opt = "--" + k.replace("_", "-")
        cmd += [opt] if v is True else [opt, str(v)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not os.path.isfile(port_file):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fake worker did not start (exit code {proc.poll()})")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{int(open(port_file).read())}", record, proc
    finally:
        stop(proc)


def recorded(record_path: str, path: str = "/generate") -> list:
    """Bodies of the requests a fake worker received on ``path``."""
    if not os.path.isfile(record_path):
        return []
    return [r["body"] for r in map(json.loads, open(record_path)) if r["path"] == path]


@contextlib.contextmanager
def router(
    worker_urls,
    *,
    policy: str = "round_robin",
    startup_timeout: float = 60.0,
    extra=(),
    api_key: str | None = None,
    tries: int = 3,
):
    """The real sglang-router in front of ``worker_urls``; yields its URL once every worker is
    registered and healthy (``GET /workers``). ``api_key``: the router's ``--api-key`` (it then
    refuses clients without it and sends it to the workers). Its two ports are found free, then
    bound by the router a moment later, so another process can take one meanwhile (the ephemeral
    range is shared with every outgoing connection): a router that exits at start-up is started
    again on new ports, up to ``tries`` times, and its output is kept for the error."""
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
    for attempt in range(tries):
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn"]
        cmd += ["--prometheus-port", str(free_port()), *extra, *(("--api-key", api_key) if api_key else ())]
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            if _registered(proc, url, worker_urls, auth, startup_timeout):
                yield url
                return
            log.seek(0)
            why = log.read().decode(errors="replace")[-2000:]
            if attempt + 1 == tries:
                raise RuntimeError(f"sglang-router exited with code {proc.returncode}: {' '.join(cmd)}\n{why}")
        finally:
            stop(proc)
            log.close()


def _registered(proc, url: str, worker_urls, auth, timeout: float) -> bool:
    """Whether the router at ``url`` lists every worker as healthy before ``timeout``; False when it
    exits first; RuntimeError when it is still up without them at the deadline."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        try:
            listed = _get_json(url + "/workers", headers=auth).get("workers", [])
        except (OSError, ValueError, AttributeError):
            listed = []  # not answering yet (still starting): asked again
        if listed and len(listed) == len(worker_urls) and all(w.get("is_healthy") for w in listed):
            return True
        if time.monotonic() > deadline:
            raise RuntimeError(f"sglang-router did not register {worker_urls} within {timeout:g} s")
        time.sleep(0.2)
    return False


@contextlib.contextmanager
def abort_storm(abort_url: str, body: dict, for_s: float = 60.0, until=None):
    """What a stream ending its batch sends to every server (an abort of every request: SGLang's
    ``/abort_request`` ``abort_all``, vLLM's ``/abort_requests``), posted to ``abort_url`` every 5 ms
    from a thread, for ``for_s`` seconds, until ``until()`` is true or the block ends; yields
    ``[posts sent]``."""
    import threading

    import httpx

    done, sent = threading.Event(), [0]
    http = httpx.Client(timeout=30)  # (built here: its SSL context takes a third of a second)
    http.post(abort_url, json=body).raise_for_status()  # the route answers: the storm is on
    end = time.monotonic() + for_s

    def storm():
        while not done.is_set() and time.monotonic() < end and not (until is not None and until()):
            http.post(abort_url, json=body)
            sent[0] += 1
            time.sleep(0.005)

    thread = threading.Thread(target=storm, daemon=True)
    thread.start()
    try:
        yield sent
    finally:
        done.set()
        thread.join()
        http.close()
