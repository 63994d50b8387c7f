"""Issue 20 items 3 and 4, at unit level (no model, no processes): a save_dir that holds another run
(another model shape, another job kind, other data) is refused at start-up, before any load, with
one line naming what differs and the three choices; a checkpoint that does not fit on the disk
(known before writing, or a write that runs out of space) is one DiskFullError line naming the
path, the bytes needed and free, with the previous checkpoint intact and the partial one gone.
The same through the trainers and torchrun: tests/distributed/test_bad_lines_and_foreign_runs.py."""

import errno
import json
import os
import types

import pytest
import torch

from megatron_klear.config import JobConfig
from megatron_klear.training import checkpointing
from megatron_klear.training.checkpointing import CheckpointManager
from megatron_klear.training.run_dir import LATEST, RunDirError

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "vocab_size": 389,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def _model(root, name, **changes):
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**QWEN3, **changes}, f)
    return d


def _data(root, name, content):
    from megatron_klear.data.indexed import FORMAT, FORMAT_VERSION

    prefix = os.path.join(root, name)
    with open(prefix + ".meta.json", "w") as f:
        json.dump(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "content_sha256": {"tokens_idx": content, "loss_spans_idx": content},
            },
            f,
        )
    return prefix


def _cfg(model, data=None, prompts=None):
    cfg = JobConfig()
    cfg.model.path, cfg.data.prefix = model, data or ""
    cfg.rl.prompts = [prompts] if prompts else []
    return cfg


@pytest.fixture
def fake_writer(monkeypatch, tmp_path):
    """CheckpointManager.save with Megatron's writer replaced by ``writer.fn`` (default: a marker
    file): the directory handling, the estimate and the error handling are what runs."""
    import megatron.core.dist_checkpointing as mdc

    writer = types.SimpleNamespace(fn=None)

    def fake_save(sharded, path, sharded_strategy=None):
        with open(os.path.join(path, "metadata.json"), "w") as f:
            json.dump({"step": sharded["common"]["step"]}, f)
        if writer.fn:
            writer.fn(path)

    monkeypatch.setattr(mdc, "save", fake_save)
    # a state of 4000 bytes of tensors (the estimate of what the checkpoint needs)
    monkeypatch.setattr(
        CheckpointManager, "_sharded_state", lambda self, state, **kw: {"model": {"w": torch.zeros(1000)}}
    )
    monkeypatch.chdir(tmp_path)
    writer.state = types.SimpleNamespace(
        model=[torch.nn.Linear(2, 2)],  # (its dtype goes to the manifest)
        scheduler=types.SimpleNamespace(state_dict=lambda: {}),
        optimizer=types.SimpleNamespace(optimizer=types.SimpleNamespace(state={})),
        arch=types.SimpleNamespace(hf_config=QWEN3),
    )
    return writer


def _earlier_run(save, job, state, steps=(1, 2)):
    mgr = CheckpointManager(save)
    assert mgr.start_run(job=job) is None
    for s in steps:
        mgr.save(state, s, {})
    mgr.finish()


def _refused(save, job, **kw):
    with pytest.raises(RunDirError) as e:
        CheckpointManager(save).start_run(job=job, **kw)
    assert not os.path.exists(os.path.join(save, "run.lock"))  # not held
    return str(e.value)


def _choices(save, msg):
    assert msg.startswith(f"train.save_dir={save} holds another run (") and "\n" not in msg
    for choice in ("resume it", "choose another train.save_dir", "train.overwrite=true"):
        assert choice in msg, (choice, msg)


# -- item 3 ----------------------------------------------------------------------------------------
def test_another_model_shape_is_refused_before_any_load(tmp_path, fake_writer, monkeypatch):
    root, save = str(tmp_path), str(tmp_path / "run")
    data = _data(root, "data", "a" * 64)
    _earlier_run(save, ("sft", _cfg(_model(root, "m64"), data)), fake_writer.state)
    monkeypatch.setattr(CheckpointManager, "load", lambda *a: pytest.fail("loaded"))
    wide = _model(root, "m128", hidden_size=128, num_attention_heads=8)
    msg = _refused(save, ("sft", _cfg(wide, data)))
    _choices(save, msg)
    assert (
        "(model differs: hidden_size 64, num_heads 4 in its checkpoints, hidden_size 128, num_heads 8 in "
        "this job's model.path)"
    ) in msg
    assert "resume it (with its own settings" in msg and f"(moves it to {save}/replaced/<time>/)" in msg
    # the same job resumes
    mgr = CheckpointManager(save)
    assert mgr.start_run(job=("sft", _cfg(_model(root, "m64"), data))) == os.path.join(save, "iter_0000002")
    mgr.finish()


def test_an_rl_job_on_an_sft_save_dir_is_refused_and_overwrite_would_not_move_its_model(tmp_path, fake_writer):
    root, save = str(tmp_path), str(tmp_path / "sft")
    _earlier_run(save, ("sft", _cfg(_model(root, "m"), _data(root, "data", "a" * 64))), fake_writer.state)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "q", "answer": "1"}\n')
    rl = _cfg(os.path.join(save, "iter_0000002"), prompts=str(prompts))  # the SFT run's checkpoint as model.path
    msg = _refused(save, ("rl", rl))
    _choices(save, msg)
    assert "(job differs: its checkpoints are of an SFT job, this is an RL job)" in msg
    assert f"model.path={save}/iter_0000002 is inside this one, so train.overwrite=true would move it" in msg
    msg = _refused(save, ("rl", rl), overwrite=True)
    assert msg.startswith(f"train.overwrite=true would move model.path={save}/iter_0000002")
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000001", "iter_0000002"]


def test_other_data_is_refused(tmp_path, fake_writer):
    root, save = str(tmp_path), str(tmp_path / "run")
    model = _model(root, "m")
    _earlier_run(save, ("sft", _cfg(model, _data(root, "a", "a" * 64))), fake_writer.state)
    msg = _refused(save, ("sft", _cfg(model, _data(root, "b", "b" * 64))))
    _choices(save, msg)
    assert f"(data differs: its checkpoints were trained on data.prefix={root}/a (content " in msg
    assert f"this job reads data.prefix={root}/b (content " in msg


def test_checkpoints_without_a_job_record_are_judged_by_what_they_hold(tmp_path, fake_writer):
    """Checkpoints written before the job record: the model's shape from hf_config.json, the kind
    and SFT data fingerprint from the common state."""
    root, save = str(tmp_path), str(tmp_path / "run")
    _earlier_run(save, None, fake_writer.state)
    for step in (1, 2):  # what an SFT checkpoint's common.pt holds
        torch.save(
            {"common": {"data": {"dataset": "f" * 64}, "config": {"data": {"prefix": "/old"}}}},
            os.path.join(save, f"iter_{step:07d}", "common.pt"),
        )
    assert "job" not in json.load(open(os.path.join(save, "iter_0000002", "manifest.json")))
    msg = _refused(save, ("sft", _cfg(_model(root, "m", num_hidden_layers=4), _data(root, "d", "d" * 64))))
    assert (
        "model and data differ: num_layers 2 in its checkpoints, num_layers 4 in this job's model.path; "
        "its checkpoints were trained on data.prefix=/old"
    ) in msg


# -- item 4 ----------------------------------------------------------------------------------------
def _iters(save):
    return sorted(os.listdir(save))


def test_a_checkpoint_that_cannot_fit_is_refused_before_writing(tmp_path, fake_writer, monkeypatch):
    save = str(tmp_path / "run")
    mgr = CheckpointManager(save)
    mgr.save(fake_writer.state, 1, {})
    monkeypatch.setattr(checkpointing.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=1500))
    fake_writer.fn = lambda path: pytest.fail("written")
    with pytest.raises(checkpointing.DiskFullError) as e:
        mgr.save(fake_writer.state, 2, {})
    assert str(e.value) == (
        f"not enough disk space for the checkpoint of step 2: {save}/.tmp-iter_0000002 needs about 3.9 KiB "
        f"(4000 bytes), 1.5 KiB (1500 bytes) free; the previous checkpoint {save}/iter_0000001 is intact and a "
        f"restart resumes from it. Free some space or choose another train.save_dir"
    )
    assert isinstance(e.value, ValueError) and e.value.errno == errno.ENOSPC  # a user error: exit 2, one line
    assert _iters(save) == ["iter_0000001", LATEST] and open(os.path.join(save, LATEST)).read() == "1"


@pytest.mark.parametrize("failure", ["enforce", "enospc_in_checkpoint_exception", "enospc_on_rank0"])
def test_a_write_that_runs_out_of_space_is_one_line_and_the_previous_checkpoint_stays(
    tmp_path, fake_writer, monkeypatch, failure
):
    from torch.distributed.checkpoint.api import CheckpointException

    save = str(tmp_path / "run")
    mgr = CheckpointManager(save)
    mgr.save(fake_writer.state, 1, {})

    def fail(path):
        with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
            f.write(b"x" * 600)  # a partial write
        if failure == "enforce":  # what torch.save's zip writer says in Megatron's writer process
            cause = RuntimeError(
                "Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
            )
        elif failure == "enospc_in_checkpoint_exception":
            cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(path, "__0_0.distcp"))
        else:
            return
        raise CheckpointException("write", {0: (cause, None)})

    fake_writer.fn = fail
    if failure == "enospc_on_rank0":  # after the tensors: the manifest hits the full disk
        from megatron_klear.checkpoint import hf_io

        def no_space(directory, info):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(directory, "manifest.json"))

        monkeypatch.setattr(hf_io, "write_manifest", no_space)
    with pytest.raises(checkpointing.DiskFullError) as e:
        mgr.save(fake_writer.state, 2, {})
    msg = str(e.value)
    assert (
        msg.startswith(
            f"not enough disk space for the checkpoint of step 2: {save}/.tmp-iter_0000002 needs "
            f"about 3.9 KiB (4000 bytes), "
        )
        and "\n" not in msg
    )
    cause = "unexpected pos 704 vs 598" if failure == "enforce" else "No space left on device"
    assert (
        "free (the write failed: " in msg
        and cause in msg
        and f"the partial checkpoint was removed); the previous checkpoint {save}/iter_0000001 is intact" in msg
    )
    assert _iters(save) == ["iter_0000001", LATEST] and open(os.path.join(save, LATEST)).read() == "1"


def test_other_write_failures_keep_their_own_error(tmp_path, fake_writer):
    save = str(tmp_path / "run")

    def fail(path):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    fake_writer.fn = fail
    with pytest.raises(PermissionError):
        CheckpointManager(save).save(fake_writer.state, 1, {})


def test_the_entry_point_ends_a_disk_full_save_with_one_line_and_status_2(capsys):
    from megatron_klear.platform.entry import run_entry_point

    def job():
        raise checkpointing.DiskFullError("not enough disk space for the checkpoint of step 2: ...")

    assert run_entry_point(job) == 2
    assert capsys.readouterr().err == "error: not enough disk space for the checkpoint of step 2: ...\n"
