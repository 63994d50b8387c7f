"""tools/gpu_session.py / gpu_session.sh, the lent GPU's one run, on the CPU: its control flow
(each step's timeout, the budget, the table rewritten after every step so a cut run leaves its rows,
a SKIP that hides a missing dependency counted as a failure) with steps made for the test, and the
whole script in its dry-run mode (every step of a real session at the tiny shape, within its budget)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tools import gpu_session
from tools.gpu_checks import CHECKS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _py_step(name, code, timeout=30.0):
    """A step that runs ``code`` (which may print rows as JSON lines) in a fresh interpreter."""
    return gpu_session.Step(name, [sys.executable, "-c", textwrap.dedent(code)], timeout, gpu_session.json_rows)


def _row_line(check, result, figure=""):
    return f"print({json.dumps(json.dumps(gpu_session.row(check, result, figure)))}, flush=True)"


def test_timeouts_missing_dependencies_and_the_table_after_every_step(tmp_path):
    out = str(tmp_path)
    table = os.path.join(out, "gpu-session.md")
    steps = [
        _py_step("ok", _row_line("first", "PASS", "fine")),
        _py_step(
            "skips",
            "\n".join(
                [
                    _row_line(
                        "te", "SKIP", "could not import 'transformer_engine': No module named 'transformer_engine'"
                    ),
                    _row_line("gpus", "SKIP", "needs 2 GPUs"),
                    _row_line(
                        "server",
                        "SKIP",
                        "the SGLang stand-in server cannot be imported here (No module named 'fastapi')",
                    ),
                ]
            ),
        ),
        # while a step runs, the table already holds the rows before it and says which step runs
        _py_step(
            "hang",
            f"""
            import json, time
            text = open({table!r}).read()
            seen = "| ok | first | PASS |" in text and "running hang (step 3 of 5)" in text
            print(json.dumps({{"check": "sees the table so far", "result": "PASS" if seen else "FAIL",
                              "figure": text[-300:], "seconds": 0.0}}), flush=True)
            time.sleep(120)
            """,
            timeout=3.0,
        ),
        _py_step("crash", "import sys; print('boom', flush=True); sys.exit(3)"),
        _py_step("quiet", "pass"),
    ]
    t0 = time.monotonic()
    code = gpu_session.run_session(steps, out, budget=300, title="test session")
    assert time.monotonic() - t0 < 60  # the hung step was cut at its 3 s
    rows = [json.loads(line) for line in open(os.path.join(out, "gpu-session.jsonl"))]
    got = {(r["step"], r["check"]): (r["result"], r["figure"]) for r in rows}
    assert got[("ok", "first")] == ("PASS", "fine")
    assert got[("skips", "te")][0] == "SKIP" and got[("skips", "gpus")][0] == "SKIP"  # not carried / no second GPU
    result, figure = got[("skips", "server")]
    assert result == "FAIL" and figure.startswith("SKIP hides a missing dependency (fastapi)"), figure
    assert got[("hang", "sees the table so far")][0] == "PASS", got[("hang", "sees the table so far")]
    assert got[("hang", "hang")][0] == "TIMEOUT"
    assert got[("crash", "crash")][0] == "FAIL" and "exit 3: boom" in got[("crash", "crash")][1]
    assert got[("quiet", "quiet")][0] == "PASS"
    assert code == 1
    text = open(table).read()
    assert "done: 3 row(s) not PASS or an allowed SKIP" in text and "| hang | hang | TIMEOUT |" in text


def test_a_step_past_the_budget_is_not_run_and_all_allowed_rows_exit_0(tmp_path):
    first = _py_step("first", "import time; time.sleep(1)\n" + _row_line("a", "PASS"))
    steps = [first, _py_step("second", _row_line("b", "PASS"))]
    code = gpu_session.run_session(steps, str(tmp_path), budget=gpu_session.MIN_START_S + 0.5, title="t")
    rows = [json.loads(line) for line in open(tmp_path / "gpu-session.jsonl")]
    assert [(r["check"], r["result"]) for r in rows] == [("a", "PASS"), ("second", "NOT RUN")] and code == 1
    assert gpu_session.run_session(steps[:1], str(tmp_path / "again"), budget=300, title="t") == 0


def test_a_session_killed_mid_step_leaves_the_rows_before_it(tmp_path):
    out = str(tmp_path)
    driver = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {REPO!r})
        from tools import gpu_session
        steps = [
            gpu_session.Step("ok", [sys.executable, "-c", {_row_line("first", "PASS")!r}], 30, gpu_session.json_rows),
            gpu_session.Step(
                "sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], 100, gpu_session.json_rows
            ),
        ]
        gpu_session.run_session(steps, {out!r}, budget=300, title="killed")
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=REPO, start_new_session=True)
    table = os.path.join(out, "gpu-session.md")
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if os.path.exists(table) and "running sleeper" in open(table).read():
                break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # as the device tool ends a command at its limit
        proc.wait()
    text = open(table).read()
    assert "running sleeper (step 2 of 2)" in text and "| ok | first | PASS |" in text, text


@pytest.mark.slow
def test_the_dry_run_runs_every_step_of_a_session_within_its_budget(tmp_path):
    """``bash tools/gpu_session.sh --dry-run``: the preflight (a real torch.compile), every check of
    tools/gpu_checks.py at the tiny shape, the in-memory push again under expandable segments (in
    memory, not through disk), and pytest -m gpu (every test SKIP here: no CUDA) -- exit 0, within
    the budget a lent GPU gets: the script starts no step past its budget (``NOT RUN``), so every
    step's result above is that bound (a wall-clock assertion here would race the busy machine)."""
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(
        ["bash", "tools/gpu_session.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=400
    )
    failure = f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, failure
    rows = [json.loads(line) for line in open(tmp_path / "gpu-session.jsonl")]
    by = {(r["step"], r["check"]): r["result"] for r in rows}
    preflight = {c: v for (s, c), v in by.items() if s == "preflight"}
    assert preflight == {
        "preflight: driver": "SKIP",
        "preflight: torch": "PASS",
        "preflight: imports": "PASS",
        "preflight: compiler": "PASS",
        "preflight: compile": "PASS",
    }, failure
    assert [c for (s, c) in by if s == "checks"] == list(CHECKS)  # every check, in the session's order
    assert all(v == "PASS" for (s, c), v in by.items() if s == "checks"), by
    assert by[("expandable", "expandable_segments: weight_sync")] == "PASS"
    tests = [v for (s, c), v in by.items() if s == "tests"]
    assert tests and set(tests) == {"SKIP"}
    checks = json.loads((tmp_path / "checks" / "gpu-checks.json").read_text())
    assert checks["failed"] == [] and checks["device"] == "cpu"
