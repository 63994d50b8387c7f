"""Run metrics: JSONL always; TensorBoard events and an offline wandb run when enabled; a console
line with step, loss, lr, tokens/s and ETA."""

import contextlib
import io
import json
import os
import sys

import pytest


@pytest.fixture(autouse=True)
def _own_wandb_service(monkeypatch):
    """wandb keeps one service per process and writes its address into os.environ: each test
    starts its own and leaves neither behind for the tests that run after it in this worker."""
    monkeypatch.setitem(os.environ, "WANDB_SERVICE", "")
    yield
    if "wandb" in sys.modules:
        with contextlib.suppress(Exception):  # the service a test killed cannot answer its teardown
            sys.modules["wandb"].teardown()


def test_jsonl_console_tensorboard_and_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from megatron_klear.training.metrics import MetricsLogger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)  # the run's directory, not the working directory
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    console = io.StringIO()
    log = MetricsLogger(
        jsonl_path=str(tmp_path / "m.jsonl"),
        total_steps=4,
        config={"x": 1},
        wandb=True,
        run_name="t",
        tensorboard_dir=str(tmp_path / "tb"),
        wandb_dir=str(tmp_path / "run"),
        stream=console,
    )
    for step in (1, 2):
        log.log(step, {"loss": 3.0 / step, "lr": 1e-4, "tokens_per_s": 1000.0, "step_time_s": 0.5, "nan": float("nan")})
    log.close()
    rows = [json.loads(x) for x in open(tmp_path / "m.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] == 1.5 and "nan" not in rows[0]
    lines = console.getvalue().splitlines()
    assert lines[0].startswith("step 1/4 | loss 3 | lr 0.0001 | 1000 tokens/s | ETA")
    events = [f for _, _, fs in os.walk(tmp_path / "tb") for f in fs if f.startswith("events.out.tfevents")]
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [round(e.value, 3) for e in acc.Scalars("loss")] == [3.0, 1.5]
    runs = [d for d in os.listdir(tmp_path / "run" / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1  # offline: nothing leaves the machine without a key
    assert not os.path.exists(tmp_path / "wandb")  # nothing in the working directory


def test_missing_extras_are_named(tmp_path, monkeypatch):
    import builtins

    from megatron_klear.training.metrics import MetricsLogger

    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match=r"the \[logging\] extra: pip install -e '\.\[logging\]'"):
        MetricsLogger(jsonl_path=str(tmp_path / "m.jsonl"), total_steps=1, wandb=True)


def test_a_terminated_wandb_service_stops_wandb_not_the_run(tmp_path, monkeypatch):
    """Slurm (and container runtimes) send SIGTERM to every process of the step, wandb's service
    process too: the next wandb call raises. The logger warns once and goes on with the JSONL file,
    so a trainer told to save and stop still reaches its save (tests/slurm: it crashed before).
    A process started afterwards inherits the dead service's address in WANDB_SERVICE (as a run
    launched from a notebook or a launcher that used wandb does): it starts a service of its own."""
    pytest.importorskip("wandb")
    import signal
    import subprocess
    import time

    import psutil

    from megatron_klear.training.metrics import MetricsLogger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    console = io.StringIO()
    log = MetricsLogger(jsonl_path=str(tmp_path / "m.jsonl"), total_steps=4, wandb=True, stream=console)
    assert os.environ["WANDB_SERVICE"]  # the address a child process inherits
    log.log(1, {"loss": 1.0})
    service = [p for p in psutil.Process().children(recursive=True) if "wandb" in " ".join(p.cmdline())]
    assert service, [p.cmdline() for p in psutil.Process().children(recursive=True)]
    for p in service:
        p.send_signal(signal.SIGTERM)
    psutil.wait_procs(service, timeout=20)
    time.sleep(0.5)
    for step in (2, 3, 4):
        log.log(step, {"loss": 1.0 / step})
    log.close()
    assert [json.loads(x)["step"] for x in open(tmp_path / "m.jsonl")] == [1, 2, 3, 4]
    assert console.getvalue().count("warning: wandb stopped working") == 1, console.getvalue()

    child = (
        "import sys; from megatron_klear.training.metrics import MetricsLogger\n"
        f"log = MetricsLogger(jsonl_path={str(tmp_path / 'c.jsonl')!r}, total_steps=1, wandb=True, stream=sys.stdout)\n"
        "log.log(1, {'loss': 0.5}); log.close()\n"
    )
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "names a wandb service that is gone" in proc.stdout, proc.stdout
    assert "wandb stopped working" not in proc.stdout, proc.stdout
    assert len([d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]) == 2
