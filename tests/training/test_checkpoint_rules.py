"""The rules of a save directory (issue 13): rotation never deletes this run's checkpoints, a fresh
run does not mix with an earlier one, partial checkpoints are cleaned at start-up, one run at a
time (lock file), metrics.jsonl follows the resumed step. Unit level: no model, no processes,
except the two end-to-end cases at the bottom (one spawned process each)."""

import json
import os
import socket
import subprocess
import sys
import types

import pytest

from megatron_klear.training.checkpointing import CheckpointManager
from megatron_klear.training.run_dir import LATEST
from megatron_klear.utils import atomic
from megatron_klear.utils.atomic import temporary_prefix
from tests.tiny_sft import sft_data

LOCK = "run.lock"


def _errors():
    """(RunDirError, RunLockedError), imported when used: the tests of behaviour that existed before
    issue 13 (rotation, the metrics file) run against that code too."""
    from megatron_klear.platform.process import RunLockedError
    from megatron_klear.training.run_dir import RunDirError

    return RunDirError, RunLockedError


def _fake_checkpoint(save_dir, step, note="old run"):
    d = os.path.join(save_dir, f"iter_{step:07d}")
    os.makedirs(d)
    with open(os.path.join(d, "note.txt"), "w") as f:
        f.write(note)
    return d


def _old_run(save_dir, steps=(30, 60)):
    os.makedirs(save_dir, exist_ok=True)
    for s in steps:
        _fake_checkpoint(save_dir, s)
    with open(os.path.join(save_dir, LATEST), "w") as f:
        f.write(str(steps[-1]))
    with open(os.path.join(save_dir, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps[-1] + 1)))
    with open(os.path.join(save_dir, "config.yaml"), "w") as f:
        f.write("old: run\n")


def _iters(save_dir):
    return sorted(n for n in os.listdir(save_dir) if n.startswith("iter_"))


@pytest.fixture
def no_torch_dist_save(monkeypatch, tmp_path):
    """CheckpointManager.save with Megatron's writer replaced by a marker file: the directory
    handling (temporary name, rename, pointer, rotation) is what runs."""

    import megatron.core.dist_checkpointing as mdc

    def fake_save(sharded, path, sharded_strategy=None):
        with open(os.path.join(path, "metadata.json"), "w") as f:
            json.dump({"step": sharded["common"]["step"]}, f)

    monkeypatch.setattr(mdc, "save", fake_save)
    monkeypatch.setattr(CheckpointManager, "_sharded_state", lambda self, state, **kw: {})
    monkeypatch.chdir(tmp_path)
    import torch

    return types.SimpleNamespace(
        model=[torch.nn.Linear(2, 2, dtype=torch.bfloat16)],  # (its dtype goes to the manifest)
        scheduler=types.SimpleNamespace(state_dict=lambda: {}),
        optimizer=types.SimpleNamespace(optimizer=types.SimpleNamespace(state={})),
        arch=types.SimpleNamespace(hf_config={"model_type": "qwen3"}),
    )


# -- item 1: rotation and fresh runs --------------------------------------------------------------
def test_rotation_never_deletes_what_this_run_wrote(tmp_path, no_torch_dist_save):
    """The data loss of issue 13: a save_dir holding higher steps of another run; each new
    checkpoint used to be deleted right after it was written (keep the highest keep_last)."""
    save = str(tmp_path / "run")
    _old_run(save)
    mgr = CheckpointManager(save, keep_last=2)
    for step in (10, 20, 25):
        final = mgr.save(no_torch_dist_save, step, {})
        assert os.path.isdir(final), f"iter_{step:07d} deleted right after it was written"
        assert open(os.path.join(save, LATEST)).read() == str(step)
        assert mgr.latest() == final
    # this run keeps its last two; the other run's checkpoints are not this run's to delete
    assert _iters(save) == ["iter_0000020", "iter_0000025", "iter_0000030", "iter_0000060"]


def test_rotation_keeps_the_last_of_a_run(tmp_path, no_torch_dist_save):
    save = str(tmp_path / "run")
    mgr = CheckpointManager(save, keep_last=2)
    for step in (1, 2, 3, 4):
        mgr.save(no_torch_dist_save, step, {})
    assert _iters(save) == ["iter_0000003", "iter_0000004"]
    assert not [n for n in os.listdir(save) if n.startswith(".tmp")]
    # the manifest records the parameters' precision: a resume in another one is refused by it
    assert json.load(open(os.path.join(save, "iter_0000004", "manifest.json")))["param_dtype"] == "bfloat16"


def test_a_fresh_run_into_an_earlier_run_refuses_naming_the_choices(tmp_path):
    RunDirError, _ = _errors()
    save = str(tmp_path / "run")
    _old_run(save)
    with pytest.raises(RunDirError) as e:
        CheckpointManager(save).start_run(resume=False)
    msg = str(e.value)
    assert "iter_0000030, iter_0000060" in msg and "train.resume=false" in msg
    for choice in ("train.resume=true", "train.save_dir=", "train.overwrite=true"):
        assert choice in msg, (choice, msg)
    assert _iters(save) == ["iter_0000030", "iter_0000060"]  # nothing touched
    assert not os.path.exists(os.path.join(save, LOCK))  # and the directory is not held
    # resume=true with checkpoints but no pointer: the same refusal, saying how to resume
    os.remove(os.path.join(save, LATEST))
    with pytest.raises(RunDirError, match=f"writing the step to resume from .e.g. 60. into .*{LATEST}"):
        CheckpointManager(save).start_run(resume=True)


def test_overwrite_moves_the_earlier_run_aside(tmp_path):
    save = str(tmp_path / "run")
    _old_run(save)
    with open(os.path.join(save, "notes.txt"), "w") as f:
        f.write("not the run's")
    said = []
    mgr = CheckpointManager(save)
    assert mgr.start_run(resume=True, overwrite=True, log=said.append) is None
    (moved,) = os.listdir(os.path.join(save, "replaced"))
    old = os.path.join(save, "replaced", moved)
    assert sorted(os.listdir(old)) == sorted(["iter_0000030", "iter_0000060", LATEST, "metrics.jsonl", "config.yaml"])
    assert sorted(os.listdir(save)) == sorted(["notes.txt", "replaced", LOCK])
    assert said == [f"train.overwrite=true: moved the earlier run in {save} to {old} (delete it when no longer needed)"]
    mgr.finish()
    assert not os.path.exists(os.path.join(save, LOCK))


def test_resume_starts_from_the_pointer_and_a_broken_pointer_is_explained(tmp_path):
    RunDirError, _ = _errors()
    save = str(tmp_path / "run")
    _old_run(save)
    mgr = CheckpointManager(save)
    assert mgr.start_run(resume=True) == os.path.join(save, "iter_0000060")
    mgr.finish()
    with open(os.path.join(save, LATEST), "w") as f:
        f.write("90")
    with pytest.raises(RunDirError, match="points at step 90 but .*iter_0000090 is missing.*train.overwrite=true"):
        CheckpointManager(save).start_run(resume=True)


def test_a_fresh_run_in_an_empty_or_checkpointless_dir_starts(tmp_path):
    save = str(tmp_path / "run")
    assert CheckpointManager(save).start_run(resume=False) is None
    with open(os.path.join(save, LATEST), "w") as f:
        f.write("5")  # pointing at nothing: removed, so that a crash before the first save cannot trip on it
    assert CheckpointManager(save).start_run(resume=False) is None
    assert not os.path.exists(os.path.join(save, LATEST))


# -- item 2: partial checkpoints --------------------------------------------------------------------
def test_partial_checkpoints_are_removed_at_start_up(tmp_path):
    save = str(tmp_path / "run")
    _old_run(save, steps=(4, 6))
    os.makedirs(os.path.join(save, ".tmp-iter_0000008", "model"))  # a save killed half-way
    os.rename(os.path.join(save, "iter_0000004"), os.path.join(save, "iter_0000004.old"))  # (older versions' name)
    _fake_checkpoint(save, 4, "new copy")  # the replacement arrived: the .old is garbage
    old6 = atomic.old_copy_name(os.path.join(save, "iter_0000006"), pid=4242)  # utils/atomic.py's finalize_dir's
    os.rename(os.path.join(save, "iter_0000006"), old6)  # the replacement did not arrive
    open(os.path.join(save, LATEST + ".tmp123"), "w").close()  # an older version's temporary name
    open(os.path.join(save, temporary_prefix(LATEST) + "123"), "w").close()  # utils/atomic.py's
    said = []
    got = CheckpointManager(save).start_run(resume=True, log=said.append)
    assert got == os.path.join(save, "iter_0000006")
    assert open(os.path.join(got, "note.txt")).read() == "old run"
    assert open(os.path.join(save, "iter_0000004", "note.txt")).read() == "new copy"
    assert sorted(os.listdir(save)) == sorted(
        ["iter_0000004", "iter_0000006", LATEST, "metrics.jsonl", "config.yaml", LOCK]
    )
    assert f"removed partial checkpoint {save}/.tmp-iter_0000008 (left by an interrupted save)" in said
    assert f"removed {save}/iter_0000004.old (left by an interrupted save)" in said
    assert f"restored {save}/iter_0000006 from {old6} (its replacement was interrupted)" in said


# -- item 8: one run per directory ------------------------------------------------------------------
def test_the_run_holds_a_lock_with_its_pid_and_host(tmp_path):
    save = str(tmp_path / "run")
    mgr = CheckpointManager(save)
    mgr.start_run()
    owner = json.load(open(os.path.join(save, LOCK)))
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    mgr.start_run()  # the same process again (tests train twice in one process)
    mgr.finish()
    assert not os.path.exists(os.path.join(save, LOCK))


def _write_lock(save, pid, host=None):
    from megatron_klear.platform.process import _start_time

    os.makedirs(save, exist_ok=True)
    with open(os.path.join(save, LOCK), "w") as f:
        json.dump(
            {
                "pid": pid,
                "host": host or socket.gethostname(),
                "start_time": _start_time(pid),
                "started": "2025-01-01 00:00:00",
            },
            f,
        )


def test_a_live_run_on_the_directory_is_refused(tmp_path):
    _, RunLockedError = _errors()
    save = str(tmp_path / "run")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(save, other.pid)
        with pytest.raises(
            RunLockedError,
            match=rf"in use by another run \(pid {other.pid} on host "
            rf"{socket.gethostname()}, started 2025-01-01 00:00:00",
        ):
            CheckpointManager(save).start_run()
        assert json.load(open(os.path.join(save, LOCK)))["pid"] == other.pid
    finally:
        other.kill()
        other.wait()


def test_a_lock_from_another_host_is_refused_and_says_how_to_clear_it(tmp_path):
    _, RunLockedError = _errors()
    save = str(tmp_path / "run")
    _write_lock(save, 1, host="node-elsewhere")
    with pytest.raises(
        RunLockedError, match=f"pid 1 on host node-elsewhere.*if that run is no longer running, delete {save}/{LOCK}"
    ):
        CheckpointManager(save).start_run()


def test_the_lock_of_a_dead_run_is_taken_over_with_a_message(tmp_path):
    save = str(tmp_path / "run")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(save, gone.pid)
    said = []
    mgr = CheckpointManager(save)
    mgr.start_run(log=said.append)
    assert json.load(open(os.path.join(save, LOCK)))["pid"] == os.getpid()
    assert said == [
        f"{save}/{LOCK}: taking over the lock of a run that is no longer running "
        f"(pid {gone.pid} on {socket.gethostname()} has exited)"
    ]
    mgr.finish()


# -- item 3: metrics.jsonl --------------------------------------------------------------------------
def _steps(path):
    return [json.loads(line)["step"] for line in open(path)]


def test_metrics_of_a_resumed_run_continue_from_the_resumed_step(tmp_path):
    from megatron_klear.training.metrics import MetricsLogger

    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as f:
        f.write("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)))
        f.write('{"step": 6, "lo')  # torn by the crash
    log = MetricsLogger(jsonl_path=path, total_steps=8, resume_step=3, stream=open(os.devnull, "w"))
    assert _steps(path) == [1, 2, 3]  # steps 4-5 are run again: not twice in the file
    for s in (4, 5):
        log.log(s, {"loss": 0.5})
    log.close()
    assert _steps(path) == [1, 2, 3, 4, 5]
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # rewritten through a temporary file, renamed


def test_metrics_of_a_fresh_run_start_a_new_file(tmp_path):
    from megatron_klear.training.metrics import MetricsLogger

    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as f:
        f.write("".join(json.dumps({"step": s}) + "\n" for s in range(1, 61)))
    log = MetricsLogger(jsonl_path=path, total_steps=2, stream=open(os.devnull, "w"))
    log.log(1, {"loss": 1.0})
    log.close()
    assert _steps(path) == [1]


# -- end to end: SFT and RL through their trainers (one spawned process each) ---------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("restart")
    model = make_tiny_qwen3(str(root / "model"), num_layers=2, seed=5)
    sft_data(root, model, 48, seed=1)
    prompts = write_rl_prompts_jsonl(str(root / "prompts.jsonl"), 12, seed=3)
    return {"model": model, "data": str(root / "data"), "prompts": prompts, "root": str(root)}


def _sft_restarts(rank, world, setup, save):
    import contextlib
    import io

    from megatron_klear.config import load_config
    from megatron_klear.sft.trainer import train

    def run(*extra, stop_after=None):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cfg = load_config(
                None,
                [
                    f"model.path={setup['model']}",
                    f"data.prefix={setup['data']}",
                    "data.seq_length=128",
                    "optim.lr=1e-3",
                    "optim.min_lr=1e-4",
                    f"train.save_dir={save}",
                    "train.keep_last=2",
                    *extra,
                ],
            )
            train(cfg, stop_after=stop_after)
        return out.getvalue()

    said = {}
    said["first"] = run("train.steps=4", "train.save_interval=2", stop_after=3)  # "crashes" after step 3
    os.makedirs(os.path.join(save, ".tmp-iter_0000003", "model"))  # a save cut short
    said["resumed"] = run("train.steps=4", "train.save_interval=2")
    said["steps_after_resume"] = _steps(os.path.join(save, "metrics.jsonl"))
    said["iters_after_resume"] = _iters(save)
    try:
        run("train.steps=2", "train.save_interval=1", "train.resume=false")
    except ValueError as e:  # RunDirError
        said["refused"] = str(e)
    said["replaced"] = run("train.steps=2", "train.save_interval=1", "train.overwrite=true")
    said["steps_after_replace"] = _steps(os.path.join(save, "metrics.jsonl"))
    return said


def test_sft_resume_fresh_and_overwrite_end_to_end(tiny_run):
    from tests.distributed.helper import run_distributed

    save = os.path.join(tiny_run["root"], "sft")
    said = run_distributed(_sft_restarts, 1, tiny_run, save)[0]
    assert f"removed partial checkpoint {save}/.tmp-iter_0000003 (left by an interrupted save)" in said["resumed"]
    assert f"resumed from {save}/iter_0000002 at step 2" in said["resumed"]
    assert said["steps_after_resume"] == [1, 2, 3, 4]  # step 3 once, although it ran twice
    assert said["iters_after_resume"] == ["iter_0000002", "iter_0000004"]
    assert "train.overwrite=true" in said["refused"] and "iter_0000002, iter_0000004" in said["refused"]
    assert "moved the earlier run" in said["replaced"]
    assert said["steps_after_replace"] == [1, 2]
    assert _iters(save) == ["iter_0000001", "iter_0000002"]
    assert open(os.path.join(save, LATEST)).read() == "2"
    (old,) = os.listdir(os.path.join(save, "replaced"))
    assert _iters(os.path.join(save, "replaced", old)) == ["iter_0000002", "iter_0000004"]
    assert not os.path.exists(os.path.join(save, LOCK))


def _rl_resume(rank, world, setup, save):
    import contextlib
    import io

    from megatron_klear.config import load_config
    from megatron_klear.rl.loop import RLLoop

    cfg = load_config(
        None,
        [
            f"model.path={setup['model']}",
            f"rl.prompts=[{setup['prompts']}]",
            f"train.save_dir={save}",
            "train.steps=2",
            "train.save_interval=1",
            "rl.prompts_per_step=2",
            "rl.responses_per_prompt=2",
            "rl.mini_batch_prompts=2",
            "rl.max_tokens_per_micro_batch=256",
            "rl.max_prompt_length=64",
            "rollout.max_new_tokens=8",
            "reward.workers=1",
        ],
    )
    RLLoop(cfg).run(stop_after=1)
    with open(os.path.join(save, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 2}) + "\n")  # logged by a step whose checkpoint never came
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        loop = RLLoop(cfg)
    loop.close()
    return out.getvalue(), _steps(os.path.join(save, "metrics.jsonl"))


def test_rl_says_where_it_resumed_and_truncates_its_metrics(tiny_run):
    from tests.distributed.helper import run_distributed

    save = os.path.join(tiny_run["root"], "rl")
    printed, steps = run_distributed(_rl_resume, 1, tiny_run, save)[0]
    assert f"resumed from {save}/iter_0000001 at step 1" in printed
    assert steps == [1]
    assert not os.path.exists(os.path.join(save, LOCK))


def test_module_doc_states_the_rules():
    from megatron_klear.training import run_dir

    doc = run_dir.__doc__  # the run directory's rules live with their code
    for rule in ("one run at a time", ".tmp-iter_", "train.overwrite=true", "rotation"):
        assert rule in doc


def test_an_optimizer_state_is_resumed_only_where_megatron_core_can_reshard_it():
    """:func:`optimizer_resume_refusal`'s rules (the processes' side: tests/distributed/test_sft.py
    resumes TP=2, PP=2, CP=2 and DP=2 checkpoints in one process and refuses a dp_reshardable one at
    TP=2): the dp_reshardable format moves only across data-parallel sizes, the others anywhere but
    across virtual pipeline stages; the optimizer kind stays; an older manifest is not judged."""
    from megatron_klear.platform import ParallelConfig
    from megatron_klear.training.checkpointing import (
        DP_RESHARDABLE,
        FULLY_RESHARDABLE,
        MODEL_SPACE,
        optimizer_resume_refusal,
        parallel_layout,
    )

    tp2, tp1 = parallel_layout(ParallelConfig(tp=2)), parallel_layout(ParallelConfig())
    saved = {"world_size": 4, "layout": tp2, "optimizer_state": True}
    # a data-parallel change (the world size alone) is fine in every format
    for fmt in (DP_RESHARDABLE, FULLY_RESHARDABLE, MODEL_SPACE):
        assert optimizer_resume_refusal({**saved, "optimizer_format": fmt}, tp2, fmt) is None
    said = optimizer_resume_refusal({**saved, "optimizer_format": DP_RESHARDABLE}, tp1, DP_RESHARDABLE)
    assert "dp_reshardable" in said and "parallel.tp 2 -> 1" in said and "reshardable_checkpoints=true" in said
    assert optimizer_resume_refusal({**saved, "optimizer_format": FULLY_RESHARDABLE}, tp1, FULLY_RESHARDABLE) is None
    assert optimizer_resume_refusal({**saved, "optimizer_format": MODEL_SPACE}, tp1, MODEL_SPACE) is None
    vpp = parallel_layout(ParallelConfig(tp=2, pp=2, vpp=2))
    said = optimizer_resume_refusal({**saved, "layout": vpp, "optimizer_format": MODEL_SPACE}, tp2, MODEL_SPACE)
    assert "parallel.vpp 2 -> None" in said and "parallel.vpp=2" in said
    said = optimizer_resume_refusal({**saved, "optimizer_format": MODEL_SPACE}, tp2, DP_RESHARDABLE)
    assert "optim.distributed_optimizer=false" in said
    said = optimizer_resume_refusal({**saved, "optimizer_format": FULLY_RESHARDABLE}, tp2, MODEL_SPACE)
    assert "optim.distributed_optimizer=true" in said
    # no moments saved (before the first optimizer step), or a manifest from before the format: not judged
    no_state = {**saved, "optimizer_format": DP_RESHARDABLE, "optimizer_state": False}
    assert optimizer_resume_refusal(no_state, tp1, DP_RESHARDABLE) is None
    assert optimizer_resume_refusal(saved, tp1, DP_RESHARDABLE) is None


def test_a_resume_that_changes_the_global_batch_says_so_and_how_to_keep_it(capsys):
    """A requeue on half the nodes: data.micro_batches_per_step is per rank, so the global batch
    halves; the resume says so and names the setting that keeps the checkpoint's batch."""
    from megatron_klear.sft.trainer import _say_batch_change

    cfg = types.SimpleNamespace(data=types.SimpleNamespace(micro_batches_per_step=2))
    _say_batch_change({"bins_per_step": 8}, types.SimpleNamespace(bins_per_step=4, dp_size=2), cfg)
    out = capsys.readouterr().out
    assert "global batch is now 4 packed rows" in out and "took 8" in out
    assert "data.micro_batches_per_step=4 keeps it" in out
    _say_batch_change({"bins_per_step": 6}, types.SimpleNamespace(bins_per_step=4, dp_size=4), cfg)
    assert "no data.micro_batches_per_step gives it back" in capsys.readouterr().out
    _say_batch_change({"bins_per_step": 4}, types.SimpleNamespace(bins_per_step=4, dp_size=2), cfg)
    assert capsys.readouterr().out == ""


def test_a_resume_says_when_the_checkpoints_schedule_is_kept_over_this_runs(capsys):
    """Megatron-Core's scheduler keeps the checkpoint's schedule on load (use_checkpoint_opt_param_scheduler):
    a run resumed with other settings, or on fewer ranks with its step count from the epochs, is told
    which values it keeps and what keeps the schedule's length."""
    from megatron_klear.training.checkpointing import _check_schedule

    class Scheduler:
        def state_dict(self):
            return {"max_lr": 1e-5, "lr_decay_steps": 240, "lr_decay_style": "cosine"}

    _check_schedule({"max_lr": 1e-5, "lr_decay_steps": 120, "lr_decay_style": "cosine"}, Scheduler(), "ckpt")
    err = capsys.readouterr().err
    assert "schedule is kept: lr_decay_steps 120 (this run's settings give 240" in err and "global batch" in err
    _check_schedule(Scheduler().state_dict(), Scheduler(), "ckpt")
    assert capsys.readouterr().err == ""
