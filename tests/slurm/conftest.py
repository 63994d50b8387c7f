"""A failed Slurm test keeps its job's logs: the test's directory (the job's output, every role's
log, the run directory) and the local Slurm's daemon logs are copied to
``test-artifacts/slurm/<test>/`` in the repository (ignored by git, kept by CI's workspace), and the
failure report ends with the tail of each log (the job's output and the trainer's first), so that a
failure on a machine nobody can log into still says what the job printed."""

import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARTIFACTS = os.path.join(ROOT, "test-artifacts", "slurm")
TAIL_LINES = 40


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
