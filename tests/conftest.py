import os
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")


# Modules whose tests race a deadline or a server's timing (watchdog thresholds, kills and freezes
# mid-request, abort quotas, wall-clock limits, "within N s" bounds): `make test` runs them in a
# pass of their own, three at a time, after the CPU-heavy tests (two at a time: pytest-xdist), so
# that no CPU-heavy test's load moves their timings (they mostly wait: three of them keep the two
# cores ~80% busy). A new module of that kind goes here.
# (the longest first, as measured: the pass hands modules out in this order, see HEAVY_MODULES)
TIMING_MODULES = [
    "tests/distributed/test_fleet_runs.py",
    "tests/distributed/test_weight_sync_distributed.py",
    "tests/distributed/test_distributed_sync_fleet.py",
    "tests/distributed/test_rl_loop.py",
    "tests/rollout/test_fleet.py",
    "tests/rollout/test_vllm_probe_abort.py",
    "tests/rollout/test_sglang_client.py",
    "tests/rollout/test_streams.py",
    "tests/distributed/test_preemption.py",
    "tests/rollout/test_sglang_divergences.py",
    "tests/distributed/test_async_rl_loop.py",
    "tests/rewards/test_pool.py",
    "tests/rewards/test_sandbox.py",
    "tests/rollout/test_received_check.py",
    # (in-process, its fakes sleep: the time a batch generated past its quota is measured). Two
    # heavy modules keep bounds of their own in the heavy pass, as hang detectors with room: a stop
    # saved "at once" (< 10 s, against >= 15 s of responses left) and a failure raised on every rank
    # (< 60 s, against ~5 s): moved here, their processes slowed this pass from 209 s to 505 s.
    "tests/rl/rollout/test_dynamic_sampling.py",
]
# Modules that start torchrun, the CLIs or server processes, tens of seconds each on 2 cores, the
# longest first: the parallel pass hands them out first (the Makefile's --no-loadscope-reorder keeps
# this order: xdist's default hands out the modules with the most tests first, which put the
# 4-minute journey last, ending the pass with one worker running it while the other idled), and
# `make test-fast` leaves them out, with tests/distributed and TIMING_MODULES.
#: the journey at Qwen3-0.6B's real width (~4 minutes on 2 cores): `make test-width`, apart from
#: `make test`'s 20-minute budget (CI runs both: .ci/run)
WIDTH_MODULES = ["tests/test_journey_at_width.py"]

HEAVY_MODULES = [
    "tests/test_journey_at_width.py",
    "tests/rollout/test_vllm_server.py",
    "tests/test_demo.py",
    "tests/rollout/test_colocate.py",
    "tests/test_shipped_configs.py",
    "tests/test_journey.py",
    "tests/distributed/test_rl_weight_sync.py",
    "tests/test_bench_async_rl.py",
    "tests/distributed/test_bad_lines_and_foreign_runs.py",
    "tests/distributed/test_stop_mid_generation.py",
    "tests/test_gpu_checks.py",
    "tests/test_cli_errors.py",
    "tests/test_bench_vs_trl.py",
    "tests/test_bench_weight_sync.py",
    "tests/test_bench_rl_step.py",
    "tests/rollout/test_routed_experts.py",
    "tests/rewards/test_sandbox_hostile.py",
    "tests/test_bench_moe.py",
    "tests/rollout/test_embedded_http.py",
    "tests/rollout/test_weight_update_protocol.py",
    "tests/rollout/test_standin_versions.py",
    "tests/rollout/test_sglang_delta.py",  # (stand-in servers and delta syncs: ~15 s; out of make test-fast)
]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU machines)")
    config.addinivalue_line("markers", "slow: takes more than ~20 s on 2 CPU cores")
    config.addinivalue_line("markers", "timing: races a deadline or a server's timing (TIMING_MODULES)")
    config.addinivalue_line("markers", "processes: starts ranks, CLIs or servers (tests/distributed, HEAVY_MODULES)")
    config.addinivalue_line("markers", "slurm: needs Slurm and munge (tests/slurm; `make test-slurm`)")
    config.addinivalue_line("markers", "width: the journey at a real model's width (WIDTH_MODULES; `make test-width`)")


def _module(item) -> str:
    return os.path.relpath(str(item.path), ROOT).replace(os.sep, "/")


def pytest_collection_modifyitems(config, items):
    import torch

    missing = [m for m in (*TIMING_MODULES, *HEAVY_MODULES) if not os.path.isfile(os.path.join(ROOT, m))]
    if missing:  # a renamed test module would silently leave its pass
        raise pytest.UsageError(f"tests/conftest.py names test modules that do not exist: {missing}")
    rank = {m: i for i, m in enumerate(HEAVY_MODULES)}
    first = {m: i for i, m in enumerate([*HEAVY_MODULES, *TIMING_MODULES])}
    for item in items:
        module = _module(item)
        if module in TIMING_MODULES:
            item.add_marker(pytest.mark.timing)
        if module in WIDTH_MODULES:
            item.add_marker(pytest.mark.width)
        if module in rank or module.startswith("tests/distributed/"):
            item.add_marker(pytest.mark.processes)
    items.sort(key=lambda item: first.get(_module(item), len(first)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """Two tiny Qwen3 HF checkpoints: {'untied': dir, 'tied': dir}."""
    from megatron_klear.models.tiny import make_tiny_qwen3

    base = tmp_path_factory.mktemp("tiny_hf")
    return {
        "untied": make_tiny_qwen3(str(base / "untied"), tied=False, seed=1),
        "tied": make_tiny_qwen3(str(base / "tied"), tied=True, seed=2),
    }


@pytest.fixture(scope="session", autouse=True)
def standin_fork_server():
    """The stand-in servers the tests launch (EmbeddedHTTPEngine.launch) are forked from one warm
    process (tests/rollout/standin_zygote.py): each would otherwise import torch and transformers
    again, 5-10 s of CPU, dozens of times a run. ``KLEAR_TEST_EXEC_STANDIN=1``: every launch starts a
    new interpreter, as the package does outside the tests."""
    if os.environ.get("KLEAR_TEST_EXEC_STANDIN") == "1":
        yield None
        return
    from megatron_klear.rollout.sglang_standin import EmbeddedHTTPEngine
    from tests.rollout.standin_zygote import StandinZygote

    zygote = StandinZygote()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EmbeddedHTTPEngine, "start_process", staticmethod(zygote.start))
        try:
            yield zygote
        finally:
            zygote.close()


@pytest.fixture
def exec_standin_launch(monkeypatch):
    """EmbeddedHTTPEngine.launch starts a new interpreter in this test (the launch users run)."""
    from megatron_klear.rollout.sglang_standin import launcher

    monkeypatch.setattr(launcher.EmbeddedHTTPEngine, "start_process", staticmethod(launcher.start_server_process))
