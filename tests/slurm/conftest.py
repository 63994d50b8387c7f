"""A failed Slurm test keeps its job's logs: the test's directory (the job's output, every role's
log, the run directory) and the local Slurm's daemon logs are copied to
``test-artifacts/slurm/<test>/`` in the repository (ignored by git, kept by CI's workspace), and the
failure report ends with the tail of each log (the job's output and the trainer's first), so that a
failure on a machine nobody can log into still says what the job printed."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.slurm.cluster import LocalSlurm, missing_binaries

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARTIFACTS = os.path.join(ROOT, "test-artifacts", "slurm")
TAIL_LINES = 40
PY = sys.executable


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    missing = missing_binaries()
    if missing:
        why = f"Slurm is not installed ({', '.join(missing)} missing): `make slurm` installs slurm-wlm and munge"
        if os.environ.get("KLEAR_REQUIRE_SLURM"):  # `make test-slurm` asked for these tests: no silent skip
            pytest.fail(why)
        pytest.skip(why)
    c = LocalSlurm(str(tmp_path_factory.mktemp("slurm"))).start()
    yield c
    c.stop()


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl, write_sft_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3

    d = tmp_path_factory.mktemp("slurm-files")
    hf = make_tiny_qwen3(str(d / "hf"), flavor="base", num_layers=2, seed=0)
    # the servers start from other weights: a probe after a push that never landed cannot pass
    other = make_tiny_qwen3(str(d / "hf-other"), flavor="base", num_layers=2, seed=1)
    write_rl_prompts_jsonl(str(d / "rl.jsonl"), 64, seed=1)
    write_sft_jsonl(str(d / "sft.jsonl"), 64, seed=0)
    subprocess.run(
        [PY, "tools/preprocess_sft.py", "--input", str(d / "sft.jsonl"), "--tokenizer", hf]
        + ["--output-prefix", str(d / "sft-data"), "--max-length", "256"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return {"dir": d, "hf": hf, "hf_other": other, "rl": str(d / "rl.jsonl"), "sft": str(d / "sft-data")}


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-TAIL_LINES:])
    except OSError as e:
        return f"(unreadable: {e})"


def _shown_first(path: str) -> tuple:
    """The order of the report's tails: the job's output, then the trainer's logs, the other roles'
    and Slurm's daemons' last (CI shows the start of a long report: what explains a failure first)."""
    name = os.path.basename(path)
    rank = 0 if name.endswith(".out") else 1 if name.startswith("trainer") else 3 if "slurm-log" in path else 2
    return rank, path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    tmp = item.funcargs.get("tmp_path")
    cluster = item.funcargs.get("cluster")
    dest = os.path.join(ARTIFACTS, item.name.replace("/", "_"))
    shutil.rmtree(dest, ignore_errors=True)
    if tmp is not None and os.path.isdir(tmp):
        # logs and small files only: checkpoints are not what explains a failure
        shutil.copytree(
            tmp, os.path.join(dest, "test"), ignore=shutil.ignore_patterns("iter_*", ".tmp-*", "weights", "wandb")
        )
    if cluster is not None:
        shutil.copytree(os.path.join(cluster.root, "log"), os.path.join(dest, "slurm-log"), dirs_exist_ok=True)
    logs = sorted(
        (os.path.join(d, n) for d, _, names in os.walk(dest) for n in names if n.endswith((".log", ".out"))),
        key=_shown_first,
    )
    text = [f"the job's logs are kept in {dest}"]
    text += [f"--- {os.path.relpath(p, dest)} (last {TAIL_LINES} lines)\n{_tail(p)}" for p in logs]
    report.sections.append(("Slurm job logs", "\n".join(text)))
