"""avg@k / pass@k aggregation on known outcomes, and the eval CLI end to end on a tiny model."""

import json

import pytest

from megatron_klear.rollout.base import Completion, RolloutEngine


class ScriptedEngine(RolloutEngine):
    """Returns scripted responses (a test double for the engine, to know the right answers)."""

    def __init__(self, tokenizer, script):
        self.tok, self.script = tokenizer, script

    def generate(self, prompts, params, n=1):
        out = []
        for i, _ in enumerate(prompts):
            texts = self.script[i]
            assert len(texts) == n
            out.append(
                [
                    Completion(
                        self.tok(t, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id],
                        [-0.1] * (len(self.tok(t, add_special_tokens=False)["input_ids"]) + 1),
                        "stop",
                    )
                    for t in texts
                ]
            )
        return out

    def update_weights(self, named_tensors, *, version=None):
        raise AssertionError("evaluation never updates weights")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from megatron_klear.models.tiny import build_tokenizer

    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_avg_and_pass_at_k(tokenizer):
    from megatron_klear.data.prompts import Prompt
    from megatron_klear.evaluation import evaluate
    from megatron_klear.rewards import GradingPool, RewardConfig
    from megatron_klear.rollout.base import SamplingParams

    right = "<think>ok</think> The answer is \\boxed{{{}}}."
    prompts = [
        Prompt(id="a", task="math", prompt_ids=[5, 6], answer="12"),
        Prompt(id="b", task="math", prompt_ids=[7], answer="7"),
    ]
    script = [
        [right.format(12), right.format(12), right.format(13), "no think"],  # 2/4 solved
        [right.format(8), right.format(9), right.format(6), right.format(5)],
    ]  # 0/4
    with GradingPool(RewardConfig(workers=1)) as pool:
        summary, records = evaluate(
            ScriptedEngine(tokenizer, script),
            {"toy": prompts},
            tokenizer,
            pool,
            k=4,
            params=SamplingParams(),
            progress=lambda s: None,
        )
    s = summary["toy"]
    assert s["avg@4"] == pytest.approx(100 * (0.5 + 0.0) / 2)
    assert s["pass@4"] == pytest.approx(50.0)
    assert s["grader_errors"] == 0 and s["truncated_frac"] == 0
    assert [r["solved"] for r in records] == [True, True, False, False, False, False, False, False]


def test_eval_cli_on_a_tiny_model(tmp_path):
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3
    from tools.eval import main

    model = make_tiny_qwen3(str(tmp_path / "m"), seed=4)
    bench = write_rl_prompts_jsonl(str(tmp_path / "b.jsonl"), 3)
    out = tmp_path / "r" / "res.json"
    assert (
        main(
            [
                "--model",
                model,
                "--bench",
                f"arith={bench}",
                "--k",
                "2",
                "--max-new-tokens",
                "8",
                "--dtype",
                "float32",
                "--workers",
                "1",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    res = json.load(open(out))["results"]["arith"]
    assert res["prompts"] == 3 and res["k"] == 2 and 0 <= res["avg@2"] <= 100
    assert res["truncated_frac"] > 0  # 8 new tokens: a random tiny model rarely stops
    lines = (tmp_path / "r" / "res.samples.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all(json.loads(x)["length"] <= 8 for x in lines)


def test_eval_writes_each_benchmark_as_it_finishes_and_a_rerun_keeps_them(tmp_path, capsys, monkeypatch):
    """An evaluation job that ends early (a time limit, a lost server) keeps what it finished: the
    results file is written as each benchmark ends (with the ones still pending), and a rerun at
    the same setting evaluates only the rest; a rerun at another setting is refused, naming it."""
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3
    from tools import eval as eval_tool

    model = make_tiny_qwen3(str(tmp_path / "m"), seed=4)
    a = write_rl_prompts_jsonl(str(tmp_path / "a.jsonl"), 2, seed=1)
    b = write_rl_prompts_jsonl(str(tmp_path / "b.jsonl"), 3, seed=2)
    out = tmp_path / "res.json"
    common = ["--model", model, "--k", "2", "--max-new-tokens", "6", "--dtype", "float32", "--workers", "1"]
    written = []
    import megatron_klear.evaluation as evaluation  # (tools/eval.py imports write_results from it in main)

    monkeypatch.setattr(
        evaluation,
        "write_results",
        lambda path, summary, records, meta, _w=evaluation.write_results: (
            written.append((sorted(summary), meta["pending"])),
            _w(path, summary, records, meta),
        ),
    )
    assert eval_tool.main([*common, "--bench", f"a={a}", "--bench", f"b={b}", "--output", str(out)]) == 0
    assert written == [(["a"], ["b"]), (["a", "b"], [])]  # a on disk before b started
    first = [json.loads(x) for x in (tmp_path / "res.samples.jsonl").read_text().splitlines()]
    # the job "ended" after a: the file as it was then, and a rerun that only evaluates b
    done = json.load(open(out))
    del done["results"]["b"]
    out.write_text(json.dumps(done))
    (tmp_path / "res.samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first if r["benchmark"] == "a"))
    written.clear()
    capsys.readouterr()
    assert eval_tool.main([*common, "--bench", f"a={a}", "--bench", f"b={b}", "--output", str(out)]) == 0
    assert "a: already evaluated at this setting" in capsys.readouterr().err
    assert written == [(["a", "b"], [])]  # only b was evaluated
    again = [json.loads(x) for x in (tmp_path / "res.samples.jsonl").read_text().splitlines()]
    assert [r for r in again if r["benchmark"] == "a"] == [r for r in first if r["benchmark"] == "a"]
    assert len([r for r in again if r["benchmark"] == "b"]) == 6
    # another setting: refused, nothing overwritten
    before = out.read_text()
    with pytest.raises(SystemExit, match=r"holds results of another setting \(k: 2 there, 3 now\)"):
        eval_tool.main([*common[:2], "--k", "3", *common[4:], "--bench", f"a={a}", "--output", str(out)])
    assert out.read_text() == before
    # --fresh: evaluated again at the new setting, the old results replaced
    assert (
        eval_tool.main([*common[:2], "--k", "3", *common[4:], "--bench", f"a={a}", "--output", str(out), "--fresh"])
        == 0
    )
    assert set(json.load(open(out))["results"]) == {"a"} and json.load(open(out))["results"]["a"]["k"] == 3


def test_an_evaluation_killed_halfway_resumes_to_the_uninterrupted_results(tmp_path, capsys, monkeypatch):
    """Killed after three graded prompts (before any benchmark finished), a rerun with the same
    --output keeps those three from <output>.partial.jsonl, generates only the rest, and ends with
    the uninterrupted run's responses and metrics: each prompt is seeded by its index in the
    benchmark, not by its place among the prompts left (seeding by that place changes the resumed
    prompts' responses and fails this test). The partial file is gone once the evaluation ends."""
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.evaluation import PartialResults
    from megatron_klear.models.tiny import make_tiny_qwen3
    from tools import eval as eval_tool

    model = make_tiny_qwen3(str(tmp_path / "m"), seed=4)
    a = write_rl_prompts_jsonl(str(tmp_path / "a.jsonl"), 5, seed=1)
    b = write_rl_prompts_jsonl(str(tmp_path / "b.jsonl"), 2, seed=2)
    common = ["--model", model, "--k", "2", "--max-new-tokens", "6", "--dtype", "float32", "--workers", "1"]
    common += ["--temperature", "1.0", "--seed", "7", "--bench", f"a={a}", "--bench", f"b={b}"]
    whole, cut = tmp_path / "whole.json", tmp_path / "cut.json"
    assert eval_tool.main([*common, "--output", str(whole)]) == 0

    added, add = [], PartialResults.add

    class Killed(Exception):
        """The evaluation's process ending after three graded prompts (a time limit, a lost node)."""

    def add_then_die(self, name, index, records):
        add(self, name, index, records)
        added.append((name, index))
        if len(added) == 3:
            raise Killed

    monkeypatch.setattr(PartialResults, "add", add_then_die)
    with pytest.raises(Killed):
        eval_tool.main([*common, "--output", str(cut)])
    assert not cut.exists()  # no benchmark had finished
    partial = tmp_path / "cut.partial.jsonl"
    assert len(partial.read_text().splitlines()) == 1 + 3  # the header and three prompts
    header = json.loads(partial.read_text().splitlines()[0])
    monkeypatch.setattr(PartialResults, "add", add)
    added.clear()
    capsys.readouterr()
    assert eval_tool.main([*common, "--output", str(cut)]) == 0
    assert "a: 3 of 5 prompts kept from the interrupted run" in capsys.readouterr().err
    assert not partial.exists()

    def samples(path):
        return [json.loads(x) for x in open(str(path).replace(".json", ".samples.jsonl"))]

    want, got = samples(whole), samples(cut)
    assert got == want and len(got) == 14
    assert len({r["response"] for r in want if r["benchmark"] == "a"}) > 3  # sampled, not one answer
    strip = lambda res: {n: {k: v for k, v in r.items() if k != "seconds"} for n, r in res.items()}  # noqa: E731
    assert strip(json.load(open(cut))["results"]) == strip(json.load(open(whole))["results"])
    # a partial file of another setting is refused by name
    header["setting"]["k"] = 3
    partial.write_text(json.dumps(header) + "\n")
    with pytest.raises(SystemExit, match=r"cut.partial.jsonl was written at another setting \(k: 3 there, 2 now\)"):
        eval_tool.main([*common, "--output", str(cut)])


def _authors_output_lines():
    """The authors' inference output layout: {"id", "meta": <input line>, "messages": [..., assistant]},
    the input repeated n (= 2) times; ids count every sample."""
    import json as _json

    from tests.data.format_fixtures import lcb_rows

    aime = {
        "messages": [{"role": "user", "content": "AIME question"}],
        "meta": {"unique_id": "2024-II-1", "solution": "73", "answer": "73"},
    }
    hmmt = {
        "id": 0,
        "messages": [{"role": "user", "content": "HMMT question"}],
        "solution": "\\boxed{103}",
        "answer": "103",
    }
    lcb = lcb_rows()[1]
    lcb_q = [{"role": "user", "content": "LCB question"}]
    honest = (
        "<think>min ops</think>\n```python\nclass Solution:\n    def minOperations(self, nums, k):\n"
        "        seen = set()\n        for i in range(len(nums) - 1, -1, -1):\n            if nums[i] <= k:\n"
        "                seen.add(nums[i])\n            if len(seen) == k:\n                return len(nums) - i\n```"
    )
    rows = []
    for sample in range(2):
        for item, response in (
            (aime, "<think>x</think> so \\boxed{73}" if sample == 0 else "<think>x</think> \\boxed{72}"),
            (hmmt, "<think>x</think> \\boxed{103}"),
            (dict(lcb, messages=lcb_q), honest if sample == 1 else "<think>x</think> no code"),
        ):
            msgs = list(item["messages"]) + [{"role": "assistant", "content": response}]
            rows.append({"id": len(rows), "meta": item, "messages": msgs})
    return [_json.dumps(r) for r in rows]


def test_regrade_the_authors_output_file(tmp_path):
    from tools.eval import main

    path = tmp_path / "inference_results_105.jsonl"
    path.write_text("\n".join(_authors_output_lines()) + "\n")
    out = tmp_path / "res.json"
    assert main(["--regrade", f"mixed={path}", "--workers", "1", "--output", str(out)]) == 0
    res = json.load(open(out))["results"]["mixed"]
    assert res["problems"] == 3 and res["samples"] == 6 and res["samples_per_problem"] == [2]
    assert res["per_problem"] == {"2024-II-1": 0.5, "0": 1.0, "3044": 0.5}
    assert res["avg@2"] == pytest.approx(100 * (0.5 + 1.0 + 0.5) / 3) and res["pass@2"] == 100.0
    assert res["grader_errors"] == 0


def test_regrade_names_a_line_without_a_response(tmp_path):
    from megatron_klear.data.jsonl import BadLineError
    from tools.eval import main

    lines = _authors_output_lines()
    broken = json.loads(lines[1])
    broken["messages"] = broken["messages"][:-1]
    broken["error"] = "CUDA out of memory"
    lines[1] = json.dumps(broken)
    path = tmp_path / "out.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadLineError, match=r"out\.jsonl:2: no_response: column messages: .*CUDA out of memory"):
        main(["--regrade", f"x={path}", "--workers", "1", "--output", str(tmp_path / "r.json")])


def test_klear_preset_and_the_missing_repetition_penalty(capsys):
    import argparse

    from tools.eval import KLEAR_PRESET, _apply_klear_preset, main

    args = argparse.Namespace(
        temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=32768, yarn_factor=None, yarn_original=32768, model="m"
    )
    _apply_klear_preset(args, ["--model", "m", "--top-k", "50"], False)
    assert (args.temperature, args.top_p, args.top_k, args.max_new_tokens, args.yarn_factor) == (
        0.6,
        0.95,
        -1,
        65536,
        2.5,
    )
    assert args.repetition_penalty == 1.05  # every engine applies it, by its own rule
    assert "repetition_penalty 1.05 on the response's tokens only (SGLang's rule" in capsys.readouterr().err
    assert KLEAR_PRESET["repetition_penalty"] == 1.05
    with pytest.raises(SystemExit):  # outside SGLang's and vLLM's range
        main(["--url", "http://x", "--bench", "a=b.jsonl", "--repetition-penalty", "2.5", "--output", "x.json"])
    assert "--repetition-penalty 2.5: in (0, 2]" in capsys.readouterr().err
    # on vLLM servers the preset applies it as the authors' vLLM did, unless the command line set another
    for given, want in (([], 1.05), (["--repetition-penalty", "1.2"], 1.2)):
        args = argparse.Namespace(**{**vars(args), "repetition_penalty": 1.2 if given else None, "model": None})
        _apply_klear_preset(args, ["--url", "u", "--server", "vllm", *given], True)
        assert args.repetition_penalty == want
        assert f"repetition_penalty {want:g} on the prompt's and the response's tokens (vLLM" in capsys.readouterr().err


def test_eval_cli_on_a_livecodebench_release_reports_every_problem(tmp_path):
    from megatron_klear.models.tiny import make_tiny_qwen3
    from tests.data.format_fixtures import lcb_rows, write
    from tools.eval import main

    model = make_tiny_qwen3(str(tmp_path / "m"), seed=4)
    bench = write(tmp_path / "test6.parquet", lcb_rows())
    out = tmp_path / "res.json"
    assert (
        main(
            [
                "--model",
                model,
                "--bench",
                f"lcb={bench}",
                "--bench-window",
                "lcb=2024-08-01..2025-05-01",
                "--k",
                "1",
                "--max-new-tokens",
                "4",
                "--dtype",
                "float32",
                "--workers",
                "1",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    res = json.load(open(out))["results"]["lcb"]
    assert res["prompts"] == 2 and sorted(res["per_problem"]) == ["3044", "abc1_a"]  # the 2023 one is outside
    ids = sorted(json.loads(x)["id"] for x in (tmp_path / "res.samples.jsonl").read_text().splitlines())
    assert ids == ["3044", "abc1_a"]


def test_a_livecodebench_window_reads_every_release_file_it_spans_and_prints_its_count(tmp_path, capsys):
    """LiveCodeBench v5 (2024-08-01 .. 2025-02-01) spans two release files: test4.jsonl (August -
    September 2024) and test5.jsonl. A quoted glob reads both; the window keeps the problems of its
    dates from each, and the count is printed beside LiveCodeBench's (279) with the hint. Before,
    the documented command read test5.jsonl only, and the Aug-Sep problems were silently missing."""
    from megatron_klear.models.tiny import make_tiny_qwen3
    from tests.data.format_fixtures import lcb_rows, write
    from tools.eval import main

    model = make_tiny_qwen3(str(tmp_path / "m"), seed=4)
    rows = lcb_rows()  # dated 2024-09-01 (v5), 2025-03-01 (v6), 2023-05-01 (neither)
    (tmp_path / "lcb").mkdir()
    later = dict(rows[0], question_id="abc2_a", question_title="A+B again", contest_date="2024-11-01T00:00:00")
    write(tmp_path / "lcb" / "test4.jsonl", [rows[0], rows[2]])
    write(tmp_path / "lcb" / "test5.jsonl", [later])
    write(tmp_path / "lcb" / "test6.jsonl", [rows[1]])
    out = tmp_path / "res.json"
    args = ["--model", model, "--k", "1", "--max-new-tokens", "4", "--dtype", "float32", "--workers", "1"]
    args += ["--bench", f"lcb_v5={tmp_path}/lcb/test*.jsonl", "--bench-window", "lcb_v5=v5", "--output", str(out)]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "lcb_v5: 2 problems from 3 file(s); LiveCodeBench's v5 window has 279 (a window spans" in err, err
    res = json.load(open(out))["results"]["lcb_v5"]
    assert res["prompts"] == 2
    samples = [json.loads(x) for x in open(tmp_path / "res.samples.jsonl")]
    assert sorted(s["id"] for s in samples) == ["abc1_a", "abc2_a"]


@pytest.mark.parametrize(
    "bench, message",
    [
        (["a={f}", "a={f}"], "--bench a=... given twice"),
        (["a={f},{d}/nothing.jsonl"], "nothing.jsonl' does not exist"),
        (["a={d}/none*.jsonl"], "matches no file"),
    ],
)
def test_a_benchmark_named_twice_or_a_missing_file_is_an_error(tmp_path, capsys, bench, message):
    """A repeated --bench name used to keep the last file silently; now it is refused, as is a file
    or a glob that names nothing."""
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3
    from tools.eval import main

    model = make_tiny_qwen3(str(tmp_path / "m"), seed=4)
    f = write_rl_prompts_jsonl(str(tmp_path / "b.jsonl"), 2)
    args = ["--model", model, "--output", str(tmp_path / "r.json")]
    for b in bench:
        args += ["--bench", b.format(f=f, d=tmp_path)]
    with pytest.raises(SystemExit):
        main(args)
    assert message in capsys.readouterr().err


def test_the_yarn_server_flags_are_the_embedded_engines_yarn_and_keep_rope_theta():
    """The 64K setting's server flags (examples/slurm/eval.sbatch, and the table of docs/data.md that
    users copy) give the servers' transformers YaRN 2.5 over 32768 positions with rope_theta kept
    (the older rope_scaling key leaves it None under transformers 5: every position would be
    rotated wrongly)."""
    import os
    import re

    from transformers import Qwen3Config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = open(os.path.join(root, "examples/slurm/eval.sbatch")).read()
    flags = [re.search(r"^YARN='(.*)'$", script, re.M).group(1)]
    docs = open(os.path.join(root, "docs/data.md")).read()
    flags += re.findall(r"--(?:json-model-override-args|hf-overrides) '(\{.*?\}\})'", docs)
    assert len(flags) == 3, flags  # the script's, and SGLang's and vLLM's in the docs
    for flag in flags:
        config = Qwen3Config(rope_theta=1e6)
        config.update(json.loads(flag))
        rope = config.rope_parameters
        assert rope == {
            "rope_type": "yarn",
            "factor": 2.5,
            "original_max_position_embeddings": 32768,
            "rope_theta": 1e6,
        }, (flag, rope)
    legacy = Qwen3Config(rope_theta=1e6)
    legacy.update({"rope_scaling": {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 32768}})
    assert legacy.rope_parameters.get("rope_theta") is None  # why the flags do not use rope_scaling
