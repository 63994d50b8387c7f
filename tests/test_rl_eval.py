"""Held-out evaluation during RL (``rl.eval``, megatron_klear/rl/rollout/validation.py) and the
rollouts on disk (``rl.dump_rollouts``, rl/rollout/records.py, tools/rollouts.py).

The run is ``python -m megatron_klear rl`` on a tiny Qwen3 (embedded engine, one process): its
curve must equal ``tools/eval.py`` run on the export of the same step's weights, with the same
seed, k and sampling (the one evaluation function behind both: equal, not close); every generated
response is on disk with whether it trained, matching the step's own counts, and the tool reads it."""

import gzip
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL = {"k": 3, "seed": 5, "temperature": 1.0, "top_p": 0.95, "top_k": 20, "max_new_tokens": 16}


def _python():
    venv = os.path.join(REPO, ".venv", "bin", "python")
    return venv if os.path.isfile(venv) else sys.executable


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3

    root = tmp_path_factory.mktemp("rl-eval")
    model = make_tiny_qwen3(str(root / "m"), num_layers=2, seed=21)
    prompts = write_rl_prompts_jsonl(str(root / "prompts.jsonl"), 16, seed=3)
    heldout = write_rl_prompts_jsonl(str(root / "heldout.jsonl"), 5, seed=4, split="heldout")
    save = str(root / "run")
    overrides = [
        f"model.path={model}",
        f"rl.prompts=[{prompts}]",
        f"train.save_dir={save}",
        "train.steps=2",
        "rl.prompts_per_step=4",
        "rl.responses_per_prompt=4",
        "rl.mini_batch_prompts=2",
        "rl.max_tokens_per_micro_batch=256",
        "rl.max_prompt_length=64",
        "rollout.max_new_tokens=16",
        "optim.lr=1e-2",
        "optim.min_lr=1e-2",
        "optim.decay_style=constant",
        "reward.workers=1",
        f"rl.eval=[held={heldout}]",
        "rl.eval_interval=1",
        "rl.eval_before_train=true",
        f"rl.eval_k={EVAL['k']}",
        f"rl.eval_seed={EVAL['seed']}",
        f"rl.eval_temperature={EVAL['temperature']}",
        f"rl.eval_top_p={EVAL['top_p']}",
        f"rl.eval_top_k={EVAL['top_k']}",
        f"rl.eval_max_new_tokens={EVAL['max_new_tokens']}",
        "rl.dump_rollouts=1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [_python(), "-m", "megatron_klear", "rl", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in open(os.path.join(save, "metrics.jsonl"))]
    return {"save": save, "heldout": heldout, "records": records, "root": str(root), "stdout": proc.stdout}


@pytest.mark.slow
def test_the_curve_equals_tools_eval_on_the_same_steps_export(run):
    by_step = {r["step"]: r for r in run["records"]}
    k = EVAL["k"]
    assert sorted(by_step) == [0, 1, 2], sorted(by_step)  # before the first step, then after each
    for step, r in by_step.items():
        for key in (f"avg@{k}", f"pass@{k}", "response_length_mean", "truncated_frac", "grader_errors"):
            assert f"eval/held/{key}" in r, (step, sorted(r))
        assert r["time/eval_s"] > 0
    assert [by_step[s]["eval/weight_version"] for s in (0, 1, 2)] == [
        0,
        by_step[1]["weights/version"],
        by_step[2]["weights/version"],
    ]
    assert by_step[2]["weights/version"] > 0  # the weights moved: the last evaluation saw trained weights
    # the same step's weights as a user gets them: the run's checkpoint of step 2 exported to HF,
    # then tools/eval.py on the export
    export = os.path.join(run["root"], "step2-hf")
    convert = [_python(), "tools/convert_megatron_to_hf.py", "--ckpt", os.path.join(run["save"], "iter_0000002")]
    proc = subprocess.run([*convert, "--out", export], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = os.path.join(run["root"], "eval.json")
    args = [
        "--model", export, "--bench", f"held={run['heldout']}", "--k", str(k), "--seed", str(EVAL["seed"]),
        "--temperature", str(EVAL["temperature"]), "--top-p", str(EVAL["top_p"]), "--top-k", str(EVAL["top_k"]),
        "--max-new-tokens", str(EVAL["max_new_tokens"]), "--max-prompt-length", "64", "--dtype", "fp32",
        "--workers", "1", "--output", out,
    ]  # fmt: skip
    proc = subprocess.run([_python(), "tools/eval.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.load(open(out))["results"]["held"]
    assert result[f"avg@{k}"] == by_step[2][f"eval/held/avg@{k}"], (result, by_step[2])
    assert result["response_length_mean"] == by_step[2]["eval/held/response_length_mean"]

    # (a tiny random model solves nothing: the figures above are equal zeros, so the responses
    # themselves are compared) every response the run's evaluation sampled equals tools/eval.py's,
    # and the trained weights answer otherwise than the starting ones
    def responses(path):
        rows = [json.loads(line) for line in open(path)]
        return sorted((r["id"], r["sample"], r["response"]) for r in rows)

    evaluated = responses(os.path.join(run["save"], "eval", "step_0000002.samples.jsonl"))
    assert len(evaluated) == 5 * k and evaluated == responses(out.replace(".json", ".samples.jsonl"))
    assert evaluated != responses(os.path.join(run["save"], "eval", "step_0000000.samples.jsonl"))


@pytest.mark.slow
def test_every_generated_response_is_on_disk_and_the_tool_reads_it(run):
    from megatron_klear.rl.rollout.records import dumped_steps, read_step

    directory = os.path.join(run["save"], "rollouts")
    assert dumped_steps(directory) == [1, 2]
    by_step = {r["step"]: r for r in run["records"]}
    checked = 0
    for step in (1, 2):
        records = read_step(directory, step)
        m = by_step[step]
        assert len(records) == m["rollout/groups_generated"] * 4  # every response generated, kept or not
        assert sum(r["trained"] for r in records) == m["rollout/samples_trained"]
        assert all(r["trained"] == (r["dropped"] is None) for r in records)
        assert {r["dropped"] for r in records} <= {None, "zero_spread", "overlong", "grader_error", "over_quota"}
        assert all(r["response"] and r["length"] == len(r["response_ids"]) for r in records)
        trained = [r for r in records if r["trained"]]
        assert abs(sum(r["reward"] for r in records) / len(records) - m["rollout/reward_mean"]) < 1e-9
        assert all(r["behaviour_logprob_mean"] is not None and r["behaviour_logprob_mean"] <= 0 for r in trained)
        # the trainer's old log-probs of the same response (same weights, fp32): within the step's
        # largest engine/trainer token difference; a mean given to another response is far off
        assert all(r["old_logprob_mean"] is None for r in records if not r["trained"])
        if not m.get("actor/optimizer_steps"):  # every group filtered: nothing trained
            continue
        checked += 1
        bound = m["actor/logprob_mismatch_max"] + 1e-6
        gaps = [abs(r["old_logprob_mean"] - r["behaviour_logprob_mean"]) for r in trained]
        assert max(gaps) <= bound, (max(gaps), bound)
        spread = max(r["behaviour_logprob_mean"] for r in trained) - min(r["behaviour_logprob_mean"] for r in trained)
        assert spread > 10 * bound, (spread, bound)  # responses differ: the match above is per response
    assert checked, "no dumped step had an update"
    with gzip.open(os.path.join(directory, "step_0000002.jsonl.gz"), "rt") as f:
        assert json.loads(f.readline())["step"] == 2
    tool = [_python(), "tools/rollouts.py"]
    show = subprocess.run(
        [*tool, "show", run["save"], "--step", "2", "--trained", "--json"], cwd=REPO, capture_output=True, text=True
    )
    assert show.returncode == 0, show.stderr
    assert len(show.stdout.splitlines()) == by_step[2]["rollout/samples_trained"]
    diff = subprocess.run(
        [*tool, "diff", run["save"], "--step", "1", "--step", "2"], cwd=REPO, capture_output=True, text=True
    )
    assert diff.returncode == 0 and "reward_mean" in diff.stdout, diff.stderr
    missing = subprocess.run([*tool, "show", run["save"], "--step", "7"], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 2 and "dumped steps: [1, 2]" in missing.stderr


@pytest.mark.slow
def test_the_held_out_curve_is_drawn_beside_the_runs_other_charts(run, tmp_path):
    pytest.importorskip("matplotlib")
    metrics = os.path.join(run["save"], "metrics.jsonl")
    proc = subprocess.run(
        [_python(), "tools/plot_run.py", metrics, "--preset", "eval", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["eval_avg.png", "eval_pass.png"]


def test_a_dump_keeps_the_last_files_it_is_told_to(tmp_path):
    from megatron_klear.rl.rollout.records import RolloutDump, dumped_steps, read_step

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

    dump = RolloutDump(str(tmp_path), every=2, keep=2, tokenizer=Tok())
    assert [s for s in range(1, 9) if dump.due(s)] == [2, 4, 6, 8]
    record = {"prompt_ids": [1, 2], "response_ids": [3], "reward": 1.0, "trained": True, "dropped": None}
    for step in (2, 4, 6):
        dump.write(step, [record])
    assert dumped_steps(str(tmp_path / "rollouts")) == [4, 6]
    assert read_step(str(tmp_path / "rollouts"), 6)[0] == {"step": 6, **record, "prompt": "1 2", "response": "3"}
    assert not [p for p in os.listdir(tmp_path / "rollouts") if not p.endswith(".jsonl.gz")]  # no temporary left


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["rl.eval=[held=x.jsonl]"], "neither rl.eval_interval .* nor rl.eval_before_train"),
        (["rl.eval=[x.jsonl]", "rl.eval_interval=5"], r"rl.eval 'x.jsonl': expected NAME=VALUE"),
        (["rl.eval=[a=x.jsonl,a=y.jsonl]", "rl.eval_interval=5"], r"rl.eval a=\.\.\. given twice"),
        (["rl.eval_k=0"], "rl.eval_k must be >= 1"),
        (["rl.dump_rollouts=-1"], "rl.dump_rollouts must be >= 0"),
    ],
)
def test_bad_eval_and_dump_keys_are_refused_by_name(overrides, words):
    from megatron_klear.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=words):
        load_config(None, overrides)
