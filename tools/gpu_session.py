#!/usr/bin/env python3
"""The lent GPU's one run: a preflight, the GPU check, the in-memory push again under expandable
segments, the GPU tests -- each step under its own timeout, the whole under one budget, and ONE
table written to ``$OUT/gpu-session.md`` (and ``.jsonl``) after every step, so a run cut short
leaves what it found. ``tools/gpu_session.sh`` installs the carried wheels and runs this.

    python3 tools/gpu_session.py run --out "$OUT"              # on the lent GPU (cuda, 8b-layers)
    python3 tools/gpu_session.py run --dry-run --out /tmp/o    # the same control flow on a CPU (tiny)
    python3 tools/gpu_session.py preflight --device cuda       # the first step alone (JSON rows)

Steps, in order (the riskiest questions first; a step starts only while the budget lasts):

1. ``preflight`` (<= 90 s): the driver (``nvidia-smi``), torch's CUDA, what Triton needs to build
   kernels (a C compiler, ``Python.h``, writable caches: ``platform/compile_check.py``), one
   ``torch.compile`` on the device as Megatron-Core's fusions are compiled, and the imports of the
   carried stack (megatron-core, the stand-in server's fastapi/uvicorn, math-verify).
2. ``checks``: ``tools/gpu_checks.py`` (each check in its own process, ``--timeout`` each; its own
   order puts packed THD, log-prob precision, the pushes and the resume first).
3. ``expandable``: the in-memory push alone (``weight_sync`` with ``--sync-paths memory``) under
   ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, the launchers' setting for trainers.
4. ``tests``: ``pytest -m gpu tests/gpu`` with spawned rank processes (CUDA cannot start in a child
   of the test helper's fork server), one row per test from its JUnit XML.

Results: PASS, FAIL, SKIP, TIMEOUT, NOT RUN. A SKIP whose reason is a module that the session
carries and failed to import (anything but Transformer Engine, SGLang, vLLM, apex, flash-attn, which
the GPU image does not have) is counted as a FAIL: it hides a missing dependency. Exit status 0 only
when every row is PASS or an allowed SKIP.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

#: modules a GPU image lacks and the session does not carry: a SKIP naming one is expected
NOT_CARRIED = ("transformer_engine", "sglang", "vllm", "apex", "flash_attn")
#: the modules the checks import, carried as wheels when the image lacks them (requirements/gpu-session.txt)
CARRIED_IMPORTS = ("megatron.core", "transformers", "safetensors", "fastapi", "uvicorn", "httpx", "math_verify")
OK = ("PASS", "SKIP")
MIN_START_S = 20.0  # a step needs at least this much of the budget left to start
PER_CHECK_S = {"cuda": 120.0, "cpu": 120.0}


def row(check: str, result: str, figure: str = "", seconds: float = 0.0) -> dict:
    return {"check": check, "result": result, "figure": figure, "seconds": float(seconds)}


# -- the preflight (step 1) ---------------------------------------------------------------------------
def preflight(device: str) -> list:
    """The preflight's rows: whether this machine can run the rest at all."""
    rows = []

    def timed(name, fn):
        t0 = time.monotonic()
        try:
            result, figure = fn()
        except Exception as e:  # noqa: BLE001 -- a preflight failure is its row
            result, figure = (
                "FAIL",
                f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400] if str(e).strip() else ''}",
            )
        rows.append(row(f"preflight: {name}", result, figure, time.monotonic() - t0))

    def driver():
        if device != "cuda":
            return "SKIP", "no GPU on this machine (dry run)"
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode:
            return "FAIL", f"nvidia-smi exit {out.returncode}: {out.stderr.strip()[:300]}"
        return "PASS", out.stdout.strip().replace("\n", "; ")

    def torch_cuda():
        import torch

        said = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
        if device == "cuda" and not torch.cuda.is_available():
            return "FAIL", said + ": torch sees no CUDA device"
        if device == "cuda":
            said += f", {torch.cuda.get_device_name(0)}"
        return "PASS", said

    def compiler():
        from megatron_klear.platform.compile_check import compile_gaps

        gaps = compile_gaps()
        return ("FAIL", "missing: " + "; ".join(gaps)) if gaps else ("PASS", "C compiler, Python.h, writable caches")

    def compiles():
        from megatron_klear.platform.compile_check import check_fusions_compile

        t0 = time.monotonic()
        check_fusions_compile(device)
        return "PASS", f"torch.compile of a SwiGLU on {device} in {time.monotonic() - t0:.1f} s"

    def imports():
        import importlib

        missing = []
        for name in CARRIED_IMPORTS:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 -- any failure to import is the finding
                missing.append(f"{name} ({type(e).__name__}: {e})")
        return ("FAIL", "cannot import: " + "; ".join(missing)) if missing else ("PASS", ", ".join(CARRIED_IMPORTS))

    timed("driver", driver)
    timed("torch", torch_cuda)
    timed("imports", imports)
    timed("compiler", compiler)
    timed("compile", compiles)
    return rows


# -- steps and their rows -------------------------------------------------------------------------------
@dataclass
class Step:
    """One command of the session: ``rows(step, returncode, log_text)`` turns what it left into rows."""

    name: str
    argv: list
    timeout: float
    rows: object
    env: dict = field(default_factory=dict)
    out: str = ""  # where the step writes its own results (read back by ``rows``)


def json_rows(step, returncode, log):
    """Rows printed as JSON objects, one a line (the preflight's)."""
    out = []
    for line in log.splitlines():
        line = line.strip()
        if line.startswith("{") and '"check"' in line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def checks_rows(prefix: str = ""):
    """Rows of tools/gpu_checks.py from the JSON it rewrites after each check (a cut run's too)."""

    def rows(step, returncode, log):
        try:
            with open(os.path.join(step.out, "gpu-checks.json"), encoding="utf-8") as f:
                checks = json.load(f)["checks"]
        except (OSError, ValueError, KeyError):
            return []
        return [row(prefix + c["check"], c["result"], c.get("figure", ""), c.get("seconds", 0.0)) for c in checks]

    return rows


def junit_rows(step, returncode, log):
    """One row per test case of pytest's JUnit XML (``--junitxml``)."""
    path = os.path.join(step.out, "gpu-tests.xml")
    try:
        tree = ET.parse(path)
    except (OSError, ET.ParseError):
        return []
    out = []
    for case in tree.iter("testcase"):
        name = f"test: {case.get('name')}"
        seconds = float(case.get("time") or 0.0)
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            out.append(
                row(
                    name,
                    "FAIL",
                    (failed.get("message") or "").splitlines()[0][:400] if failed.get("message") else "",
                    seconds,
                )
            )
        elif skipped is not None:
            out.append(row(name, "SKIP", (skipped.get("message") or "")[:400], seconds))
        else:
            out.append(row(name, "PASS", "", seconds))
    return out


_MISSING = re.compile(
    r"No module named '([\w.]+)'|could not import '([\w.]+)'|cannot be imported[^(]*\((?:No module named )?'?([\w.]+)"
)


def judge(r: dict) -> dict:
    """A SKIP that hides a missing dependency the session carries becomes a FAIL (said in its figure)."""
    if r["result"] != "SKIP":
        return r
    text = r["figure"]
    hit = _MISSING.search(text)
    module = next((g for g in hit.groups() if g), "") if hit else ""
    hides = bool(hit) and module.split(".")[0] not in NOT_CARRIED
    if hides:
        return {**r, "result": "FAIL", "figure": f"SKIP hides a missing dependency ({module}): {text}"}
    return r


# -- the session ---------------------------------------------------------------------------------------
def table(rows) -> str:
    lines = ["| step | check | result | figure | seconds |", "|---|---|---|---|---|"]
    for r in rows:
        figure = str(r.get("figure", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.get('step', '')} | {r['check']} | {r['result']} | {figure} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def write_table(out: str, header: str, rows: list) -> None:
    """``gpu-session.md`` and ``gpu-session.jsonl`` in ``out``, each replaced whole."""
    from megatron_klear.utils import atomic

    atomic.write_text(os.path.join(out, "gpu-session.md"), header + "\n\n" + table(rows) + "\n")
    atomic.write_text(os.path.join(out, "gpu-session.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))


def _run_step(step: Step, timeout: float, log_path: str) -> tuple:
    """``(returncode or None when cut at the timeout, seconds)``; the step's output goes to ``log_path``
    and its whole process group is killed at the timeout."""
    env = {**os.environ, **step.env}
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            step.argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
    return code, time.monotonic() - t0


def run_session(steps: list, out: str, budget: float, title: str, clock=time.monotonic) -> int:
    """Run ``steps`` in order within ``budget`` seconds; the table is rewritten after every step.
    Returns the exit status (0: every row PASS or an allowed SKIP)."""
    os.makedirs(out, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0, rows = clock(), []

    def header(state):
        return f"{title}; {started}; {clock() - t0:.0f} s of a {budget:.0f} s budget; {state}"

    for k, step in enumerate(steps):
        left = budget - (clock() - t0)
        if left < MIN_START_S:
            rows.append({**row(step.name, "NOT RUN", f"{left:.0f} s of the budget left"), "step": step.name})
            continue
        write_table(out, header(f"running {step.name} (step {k + 1} of {len(steps)})"), rows)
        timeout = min(step.timeout, left)
        print(f"== {step.name}: {' '.join(step.argv)} (timeout {timeout:.0f} s)", file=sys.stderr, flush=True)
        log_path = os.path.join(out, f"{step.name}.log")
        code, seconds = _run_step(step, timeout, log_path)
        with open(log_path, encoding="utf-8", errors="replace") as f:
            log = f.read()
        got = [judge(r) for r in step.rows(step, code, log)]
        if code is None:
            got.append(row(step.name, "TIMEOUT", f"cut at {timeout:.0f} s; the rows above it stand", seconds))
        elif code != 0 and all(r["result"] in OK for r in got):
            tail = " / ".join(line for line in log.strip().splitlines()[-3:])[-400:]
            got.append(row(step.name, "FAIL", f"exit {code}: {tail}", seconds))
        elif not got:
            got.append(row(step.name, "PASS", f"exit 0 in {seconds:.0f} s", seconds))
        rows.extend({**r, "step": step.name} for r in got)
        for r in got:
            print(f"{step.name}: {r['check']}: {r['result']} {r['figure']}", file=sys.stderr, flush=True)
    bad = [r for r in rows if r["result"] not in OK]
    write_table(out, header(f"done: {len(bad)} row(s) not PASS or an allowed SKIP"), rows)
    return 1 if bad else 0


def session_steps(device: str, shape: str, out: str, workdir: str, python: str = sys.executable) -> list:
    """The four steps of a session on ``device`` at ``shape``."""
    per = PER_CHECK_S[device]
    here = os.path.join(REPO, "tools")
    checks, expandable, tests = (os.path.join(out, d) for d in ("checks", "checks-expandable", "tests"))
    for d in (checks, expandable, tests):
        os.makedirs(d, exist_ok=True)
    common = ["--device", device, "--shape", shape, "--workdir", workdir, "--timeout", str(per)]
    return [
        Step(
            "preflight", [python, os.path.join(here, "gpu_session.py"), "preflight", "--device", device], 90, json_rows
        ),
        Step(
            "checks",
            [python, os.path.join(here, "gpu_checks.py"), *common, "--out", checks],
            9 * per,
            checks_rows(),
            out=checks,
        ),
        Step(
            "expandable",
            [
                python,
                os.path.join(here, "gpu_checks.py"),
                *common,
                "--out",
                expandable,
                "--only",
                "weight_sync",
                "--sync-paths",
                "memory",
            ],
            per + 60,
            checks_rows("expandable_segments: "),
            env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
            out=expandable,
        ),
        Step(
            "tests",
            [
                python,
                "-m",
                "pytest",
                "-q",
                "-rs",
                "-m",
                "gpu",
                "tests/gpu",
                "-p",
                "no:cacheprovider",
                "--junitxml",
                os.path.join(tests, "gpu-tests.xml"),
            ],
            240,
            junit_rows,
            env={"KLEAR_TEST_START_METHOD": "spawn"},
            out=tests,
        ),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("preflight", help="the first step alone: one JSON row a line")
    pre.add_argument("--device", choices=("cuda", "cpu"), required=True)
    run = sub.add_parser("run", help="the whole session")
    run.add_argument("--out", required=True)
    run.add_argument("--dry-run", action="store_true", help="on this CPU: --device cpu, the tiny shape")
    run.add_argument("--budget", type=float, default=float(os.environ.get("GPU_SESSION_BUDGET", 480)))
    run.add_argument(
        "--workdir", default="", help="the checkpoints (default: a temporary directory, removed at the end)"
    )
    run.add_argument(
        "--steps",
        default=os.environ.get("GPU_SESSION_STEPS", ""),
        help="comma-separated steps to run (default all: preflight, checks, expandable, tests)",
    )
    args = ap.parse_args(argv)
    import megatron_klear  # noqa: F401 -- its warning filter first

    if args.command == "preflight":
        for r in preflight(args.device):
            print(json.dumps(r), flush=True)
        return 0
    device, shape = ("cpu", "tiny") if args.dry_run else ("cuda", "8b-layers")
    # (not under --out: what the device tool finds there comes back, and the checkpoints are GBs)
    workdir = args.workdir or tempfile.mkdtemp(prefix="klear-gpu-session-")
    try:
        steps = session_steps(device, shape, args.out, workdir)
        wanted = [x.strip() for x in args.steps.split(",") if x.strip()]
        unknown = sorted(set(wanted) - {step.name for step in steps})
        if unknown:
            ap.error(f"--steps: unknown step(s) {unknown}; known: {', '.join(step.name for step in steps)}")
        steps = [step for step in steps if not wanted or step.name in wanted]
        title = f"tools/gpu_session.py{' --dry-run' if args.dry_run else ''} ({device}, {shape})"
        return run_session(steps, args.out, args.budget, title)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
