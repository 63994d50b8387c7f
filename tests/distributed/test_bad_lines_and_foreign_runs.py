"""Issue 20 items 3, 4 and 5 through ``torchrun --nproc-per-node 2`` (the unit-level cases are in
tests/training/test_save_dir_owner_and_disk_full.py and tests/data/test_prompt_skips.py):

* disk full during an SFT save (a simulated ENOSPC in Megatron's writer): one ``error:`` line naming
  the path, the bytes needed and free, each rank exits with 2, the previous checkpoint intact, the
  partial one removed;
* that SFT run's save_dir given to an RL job (``model.path`` its checkpoint: the easy mistake):
  refused before any load, with the choices (another model width, other data: at unit level, through
  the same CheckpointManager.start_run);
* ``rl.on_bad_line=skip`` on an RL run started from that checkpoint: each rejected line printed once,
  the total on the console and in metrics.jsonl, every line in the report, real JSON columns;
* that SFT run resumed in another precision: refused by name, and its weights start a new run."""

import json
import os
import re
import signal

import pytest

from tests.launch import torchrun
from tests.tiny_sft import sft_data

RL = [
    "train.steps=1",
    "rl.prompts_per_step=2",
    "rl.responses_per_prompt=2",
    "rl.mini_batch_prompts=2",
    "rl.max_tokens_per_micro_batch=256",
    "rl.max_prompt_length=64",
    "rollout.max_new_tokens=8",
    "reward.workers=1",
]


def _user_error(rc, out, message):
    """The message once (rank 0), the ranks ended with the user-error status (2; or torchrun ended
    one with SIGTERM as soon as the other had exited), no traceback of ours."""
    assert rc != 0 and out.count(f"error: {message}") == 1, out
    codes = re.findall(r"exitcode\s*: (-?\d+)", out)
    assert rc == 2 or ("2" in codes and set(codes) <= {"2", str(-signal.SIGTERM)}), out
    assert "megatron_klear" not in "".join(ln for ln in out.splitlines() if ln.strip().startswith("File ")), out


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """An SFT run whose second save finds the disk full."""
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("issue20")
    model = make_tiny_qwen3(str(root / "model"), num_layers=2, seed=5)
    sft_data(root, model, 24, seed=1)
    save = str(root / "sft")
    rc, out = torchrun(
        "tests/distributed/enospc_sft.py",
        f"model.path={model}",
        f"data.prefix={root}/data",
        "data.seq_length=128",
        f"train.save_dir={save}",
        "train.steps=2",
        "train.save_interval=1",
        env={"KLEAR_TEST_ENOSPC_STEP": "2"},
    )
    return {"root": str(root), "model": model, "save": save, "rc": rc, "out": out}


def test_disk_full_during_a_save_is_one_line_and_the_previous_checkpoint_stays(sft_run):
    save, out = sft_run["save"], sft_run["out"]
    line = next((ln for ln in out.splitlines() if ln.startswith("error: ")), out)
    assert line.startswith(
        f"error: not enough disk space for the checkpoint of step 2: {save}/.tmp-iter_0000002 needs about "
    ), out
    assert (
        " bytes), " in line
        and " free (the write failed: No space left on device; the partial checkpoint was "
        f"removed); the previous checkpoint {save}/iter_0000001 is intact and a restart resumes from it"
        in line
    ), out
    _user_error(sft_run["rc"], out, line[len("error: ") :])
    assert "CheckpointException" not in out and "unexpected pos" not in out, out
    assert sorted(n for n in os.listdir(save) if "iter_" in n) == ["iter_0000001"]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "1"


def test_an_rl_job_on_the_sft_save_dir_is_refused_before_any_load(sft_run):
    save = sft_run["save"]
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl

    prompts = write_rl_prompts_jsonl(os.path.join(sft_run["root"], "prompts.jsonl"), 8, seed=3)
    rc, out = torchrun(
        "-m",
        "megatron_klear",
        "rl",
        f"model.path={save}/iter_0000001",
        f"rl.prompts=[{prompts}]",
        f"train.save_dir={save}",
        *RL,
    )
    _user_error(
        rc,
        out,
        f"train.save_dir={save} holds another run (job differs: its checkpoints are of an SFT job, "
        f"this is an RL job): resume it (with its own settings: {save}/config.yaml), choose another "
        f"train.save_dir (model.path={save}/iter_0000001 is inside this one, so train.overwrite=true "
        f"would move it to {save}/replaced/<time>/ too)",
    )
    assert "KeyError" not in out and "resumed from" not in out, out


def test_skipped_prompt_lines_are_named_once_counted_and_reported(sft_run):
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl

    root = sft_run["root"]
    prompts = write_rl_prompts_jsonl(os.path.join(root, "bad_prompts.jsonl"), 8, seed=3)
    good = open(prompts).read().splitlines()
    bad = [good[0][:-1]] * 22 + ['{"id": "n", "task": "math", "prompt": "no answer"}'] * 3  # a missing } / answer
    with open(prompts, "w") as f:
        f.write("\n".join(good + bad) + "\n")
    run = os.path.join(root, "rl")
    rc, out = torchrun(
        "-m",
        "megatron_klear",
        "rl",
        f"model.path={sft_run['save']}/iter_0000001",
        f"rl.prompts=[{prompts}]",
        f"train.save_dir={run}",
        "rl.on_bad_line=skip",
        *RL,
    )
    assert rc == 0, out
    report = os.path.join(run, "skipped_prompt_lines.jsonl")
    named = [ln for ln in out.splitlines() if ln.startswith("rejected ")]
    assert len(named) == 20 and len(set(named)) == 20, out  # once each: rank 0 only
    col = len(good[0])  # the line lacks its last character: the error is at the end of the line
    assert named[0] == (
        f"rejected {prompts}:9: invalid_json: Expecting ',' delimiter at column {col}, the end of "
        f"the line (an unclosed object, array or string?)"
    ), out
    assert out.count(f"(further rejected lines go only to {report})") == 1, out
    assert (
        out.count(
            f"on_bad_line=skip: skipped 25 bad prompt lines (invalid_json: 22, missing_field: 3); "
            f"each listed in {report}"
        )
        == 1
    ), out
    assert [r["line"] for r in map(json.loads, open(report))] == list(range(9, 34))
    first = json.loads(open(os.path.join(run, "metrics.jsonl")).readline())
    assert first["step"] == 1 and first["data/skipped_prompt_lines"] == 25


def test_a_run_resumed_in_another_precision_is_refused_by_name_and_its_weights_start_a_new_one(sft_run):
    """The SFT run above trained in fp32 (model.dtype auto on the CPU); resumed with model.dtype=bf16
    it is refused before any load, naming both precisions and both ways on (Megatron's optimizer
    state is laid out by parameter dtype: the load alone ends in a KeyError of every key); the way
    it names, a new run from the checkpoint's weights in bf16, trains."""
    save, root, model = sft_run["save"], sft_run["root"], sft_run["model"]
    manifest = json.load(open(os.path.join(save, "iter_0000001", "manifest.json")))
    assert manifest["param_dtype"] == "float32", manifest
    common = [f"data.prefix={root}/data", "data.seq_length=128", "model.dtype=bf16", "train.steps=2"]
    rc, out = torchrun("-m", "megatron_klear", "sft", f"model.path={model}", f"train.save_dir={save}", *common)
    ckpt = f"{save}/iter_0000001"
    _user_error(
        rc,
        out,
        f"{ckpt}: its model and optimizer state were trained in fp32, this run builds the model in bf16 "
        f"(model.dtype): a run resumes only in its own precision. Set model.dtype=fp32 to resume it, or "
        f"start a new run from its weights: model.path={ckpt} with another train.save_dir",
    )
    assert "KeyError" not in out and "resumed from" not in out, out
    fresh = os.path.join(root, "sft-bf16")
    rc, out = torchrun("-m", "megatron_klear", "sft", f"model.path={ckpt}", f"train.save_dir={fresh}", *common)
    assert rc == 0, out
    assert json.load(open(os.path.join(fresh, "iter_0000002", "manifest.json")))["param_dtype"] == "bfloat16"
