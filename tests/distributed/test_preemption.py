"""Preemption under torchrun (issue 20, item 1): a signal after the first interval save ends with a
complete checkpoint of the step at which the run stopped, and the run resumes from it exactly.

Megatron's checkpoint writer collected its results through a ``multiprocessing`` manager process
(started at the first save) that sat in the rank's process group, where torchrun's
``killpg(SIGTERM)`` killed it: the final save then failed with ``BrokenPipeError`` and left a
``.tmp-iter_*``. Saves now start no such process (checkpoint/dist_ckpt.py ``save``). See
docs/checkpoints.md#preemption.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.launch import TORCHRUN, start_torchrun
from tests.tiny_sft import sft_data

SAVE_INTERVAL = 2

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc are Linux's")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("preempt")
    model = make_tiny_qwen3(str(root / "model"), seed=5)
    sft_data(root, model, 64, seed=2)
    return {"model": model, "data": str(root / "data"), "root": root}


def _sft(setup, save, steps, *torchrun_args, launcher=TORCHRUN, env=None):
    """The SFT command at 2 ranks under ``launcher``, started (its output: one pipe) in a session
    of its own, as Slurm starts a job step; ``env``: variables added."""
    return start_torchrun(
        *torchrun_args,
        "-m",
        "megatron_klear",
        "sft",
        f"model.path={setup['model']}",
        f"data.prefix={setup['data']}",
        "data.seq_length=128",
        "data.micro_batches_per_step=1",
        "optim.lr=2e-3",
        "optim.min_lr=2e-4",
        "optim.warmup_steps=1",
        "optim.decay_steps=100",  # the schedule does not depend on train.steps
        f"train.steps={steps}",
        f"train.save_interval={SAVE_INTERVAL}",
        "train.keep_last=2",
        f"train.save_dir={save}",
        launcher=launcher,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _descendants(pid):
    """``pid``'s processes below it (the ranks, the checkpoint writer's manager, ...)."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _logged_steps(save):
    try:
        with open(os.path.join(save, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _signal_when(proc, ready, send, timeout=240):
    """Wait until ``ready()``, then ``send(proc)``; returns the output and the exit status."""
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "the run did not get there in time"
            time.sleep(0.05)
        send(proc)
        out = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out, proc.returncode


def _check_stopped_with_checkpoint(save, out, returncode, expected_returncode):
    """The documented outcome: each rank saved the step it stopped at and exited 0; plain torchrun
    re-raises the signal it got (SignalException) and exits 1, megatron_klear.platform.launch ends
    with one line and 128 + the signal's number."""
    latest = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    logged = [m["step"] for m in _logged_steps(save)]
    assert latest > SAVE_INTERVAL and latest == logged[-1], (latest, logged, out[-4000:])
    ckpt = os.path.join(save, f"iter_{latest:07d}")
    for name in ("manifest.json", "metadata.json", "common.pt"):
        assert os.path.isfile(os.path.join(ckpt, name)), (name, out[-4000:])
    assert not [n for n in os.listdir(save) if n.startswith(".tmp")], (os.listdir(save), out[-4000:])
    assert "BrokenPipeError" not in out and "]: Traceback" not in out, out[-4000:]  # no rank failed
    assert f"checkpoint of step {latest} saved" in out, out[-4000:]
    assert returncode == expected_returncode, (returncode, out[-4000:])
    return latest


def _save_twice(rank, world, root):
    import multiprocessing

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_klear.checkpoint import dist_ckpt
    from megatron_klear.platform import cpu_compat

    cpu_compat.activate()  # Megatron's writer synchronises CUDA
    loaded = []
    for i in range(2):
        path = os.path.join(root, str(i))
        os.makedirs(path)
        dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(i)), replica_id=0)}, path)
        template = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4), replica_id=0)}
        loaded.append(dist_checkpointing.load(template, path)["w"].tolist())
    return {
        "children": [c.name for c in multiprocessing.active_children()],
        "queue": type(filesystem_async._results_queue).__module__,
        "loaded": loaded,
    }


def test_a_save_starts_no_writer_process_that_a_stop_signal_could_kill():
    """The cause, removed: two torch_dist saves in one rank leave no child process behind (Megatron's
    writer would have started a Manager server at the first, outside anything the rank controls:
    torchrun's killpg and Slurm's --signal killed it, a killed rank left it running), Megatron's
    results queue is an in-process one, and both checkpoints read back."""
    import tempfile

    from tests.distributed.helper import run_distributed

    with tempfile.TemporaryDirectory() as root:
        (out,) = run_distributed(_save_twice, 1, root)
    assert out == {"children": [], "queue": "queue", "loaded": [[0.0] * 4, [1.0] * 4]}, out


def _latest(save):
    try:
        return int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    except (FileNotFoundError, ValueError):
        return 0


def test_sigterm_then_sigusr1_save_the_current_step_and_the_run_resumes_from_it(setup):
    """Two runs on one save_dir (each torchrun launch costs ~15 s on 2 cores): SIGTERM to torchrun
    after the first interval save; then the resumed run gets SIGUSR1 as Slurm's ``--signal`` sends
    it (to every process of the job step: torchrun, the ranks, their helpers), with torchrun told to
    handle it. That a checkpoint resumes exactly is tests/distributed/test_sft.py's
    test_resume_continues_exactly; here the records continue without a gap or a repeat."""
    save = str(setup["root"] / "run")
    proc = _sft(setup, save, 1000)
    out, rc = _signal_when(proc, lambda: _latest(save) >= SAVE_INTERVAL, lambda p: p.send_signal(signal.SIGTERM))
    stopped = _check_stopped_with_checkpoint(save, out, rc, 1)
    assert "stopped on SIGTERM" in out
    # the line says what the launcher's grace must cover: the save, and the time since the signal
    import re

    took = re.search(r"stopped on SIGTERM after step \d+/\d+: .*\(the save took ([\d.]+) s\); ([\d.]+) s after", out)
    assert took and 0 < float(took.group(1)) <= float(took.group(2)) < 120, out[-2000:]
    before = _logged_steps(save)

    # the resumed run through the project's launcher (the example scripts' way)
    proc = _sft(
        setup,
        save,
        1000,
        "--signals-to-handle",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        launcher="megatron_klear.platform.launch",
        env={"SHUTDOWN_TIMEOUT": "0.001"},  # a grace no save fits: the trainer says so at its first save
    )

    def usr1_everywhere(p):
        for pid in [p.pid, *_descendants(p.pid)]:
            with contextlib.suppress(ProcessLookupError):  # a helper process that exited meanwhile
                os.kill(pid, signal.SIGUSR1)

    # after an interval save of the resumed run: its checkpoint writer is running
    out, rc = _signal_when(proc, lambda: _latest(save) > stopped, usr1_everywhere)
    assert f"resumed from {os.path.join(save, f'iter_{stopped:07d}')} at step {stopped}" in out, out[-4000:]
    again = _check_stopped_with_checkpoint(save, out, rc, 128 + signal.SIGUSR1)
    assert "stopped on SIGUSR1" in out and "SignalException" not in out, out[-4000:]
    warned = [line for line in out.splitlines() if line.startswith("warning: a stop signal can now cost")]
    assert len(warned) == 1 and "more than the SHUTDOWN_TIMEOUT=0.001 s" in warned[0], out[-4000:]
    assert out.rstrip().splitlines()[-1].startswith("stopped on SIGUSR1: the ranks were asked"), out[-2000:]
    after = _logged_steps(save)
    assert [m["step"] for m in after] == list(range(1, again + 1))
    assert after[:stopped] == before
