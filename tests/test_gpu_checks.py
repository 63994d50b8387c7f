"""tools/gpu_checks.py, the GPU check, on the CPU path (``--device cpu --shape tiny``): a check over
its tolerance (``--tolerance-scale 0``) is reported FAIL with exit status 1, in the printed table and
in the JSON. (Every check passing at the tiny shape, in the order a session runs them, is
tests/test_gpu_session.py's dry run.)"""

import json
import os
import subprocess
import sys

import pytest

from tools.gpu_checks import CHECKS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(REPO, ".venv", "bin", "python")

pytestmark = pytest.mark.slow


def _run(out_dir, *args):
    """(the process, {check: [check, result, figure, seconds]} from the printed table)."""
    python = PYTHON if os.path.isfile(PYTHON) else sys.executable
    proc = subprocess.run(
        [python, "tools/gpu_checks.py", "--device", "cpu", "--shape", "tiny", "--out", str(out_dir), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in CHECKS:
            rows[cells[0]] = cells
    return proc, rows


def test_a_check_over_its_tolerance_is_reported_fail_with_a_non_zero_exit_status(tmp_path):
    # (logprob_precision: one of the cheapest checks, and its errors are never exactly 0)
    proc, rows = _run(tmp_path, "--only", "logprob_precision", "--tolerance-scale", "0")
    failure = f"stdout:\n{proc.stdout}\nstderr (end):\n{proc.stderr[-4000:]}"
    assert list(rows) == ["logprob_precision"] and rows["logprob_precision"][1] == "FAIL", failure
    assert "(tol 0.00e+00)" in rows["logprob_precision"][2], failure
    assert proc.returncode == 1, failure
    assert json.loads((tmp_path / "gpu-checks.json").read_text())["failed"] == ["logprob_precision"]
