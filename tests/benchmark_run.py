"""Running a benchmark script as a user does, for the benchmarks' ``--quick`` tests."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_benchmark(script: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python benchmarks/<script> <args>`` from the repository root; fails the test with the end of
    its output unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, os.path.join("benchmarks", script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
