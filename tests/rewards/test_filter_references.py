"""Reference results from tools/eval.py for the RL data filter (issue 53, item 2): the samples file
that tools/eval.py writes is what tools/filter_rl_data.py --references reads, by problem id, so
that a user can make the paper's pass-rate filter's references with the project's own tools."""

import json

from megatron_klear.rewards.filters import filter_main, load_eval_references


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_the_filter_keeps_the_problems_whose_reference_samples_pass(tmp_path, capsys):
    problems = _write(
        tmp_path / "math.jsonl",
        [
            {"id": "a", "task": "math", "prompt": "1+1?", "answer": "2"},
            {"id": "b", "task": "math", "prompt": "2+2?", "answer": "4"},
            {"id": 7, "task": "math", "prompt": "3+3?", "answer": "6"},  # a numeric id, as some sets have
            {"id": "d", "task": "math", "prompt": "4+4?", "answer": "8", "reference_passed": [True]},
        ],
    )
    samples = [("a", [True, True, False]), ("b", [False, False, True]), ("7", [True, False])]
    refs = _write(
        tmp_path / "ref.samples.jsonl",
        [{"benchmark": "m", "id": i, "sample": j, "solved": s} for i, flags in samples for j, s in enumerate(flags)],
    )
    assert load_eval_references([refs]) == dict(samples)
    out, dropped = str(tmp_path / "kept.jsonl"), str(tmp_path / "dropped.jsonl")
    assert filter_main(["--input", problems, "--references", refs, "--output", out, "--dropped", dropped]) == 0
    kept = [json.loads(x)["id"] for x in open(out)]
    assert kept == ["a", 7, "d"]  # pass rates 2/3, 1/2 (inclusive), and its own reference_passed
    (gone,) = [json.loads(x) for x in open(dropped)]
    assert gone["id"] == "b" and "reference pass@1 0.333 < 0.5 (1/3 passed)" in gone["reason"]


def test_a_references_file_that_is_not_an_eval_sample_file_is_refused_naming_the_line(tmp_path, capsys):
    problems = _write(tmp_path / "p.jsonl", [{"id": "a", "task": "math", "prompt": "?", "answer": "2"}])
    refs = _write(tmp_path / "r.jsonl", [{"id": "a", "solved": True}, {"id": "a", "passed": 1}])
    assert filter_main(["--input", problems, "--references", refs, "--output", str(tmp_path / "o.jsonl")]) == 2
    assert f"{refs}:2: not a tools/eval.py sample line" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_what_tools_eval_writes_is_what_the_filter_reads(tmp_path, capsys):
    """End to end on a tiny model: tools/eval.py's samples of a problem file give the filter one
    reference per sample for every problem (a random tiny model solves none: all dropped)."""
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3
    from tools.eval import main

    model = make_tiny_qwen3(str(tmp_path / "m"), seed=4)
    bench = write_rl_prompts_jsonl(str(tmp_path / "raw.jsonl"), 3)
    out = tmp_path / "ref.json"
    args = ["--model", model, "--bench", f"raw={bench}", "--k", "2", "--max-new-tokens", "4"]
    assert main(args + ["--dtype", "float32", "--workers", "1", "--output", str(out)]) == 0
    refs = load_eval_references([str(tmp_path / "ref.samples.jsonl")])
    ids = [str(json.loads(x)["id"]) for x in open(bench)]
    assert sorted(refs) == sorted(ids) and all(len(v) == 2 for v in refs.values())
    kept, dropped = str(tmp_path / "kept.jsonl"), str(tmp_path / "dropped.jsonl")
    argv = ["--input", bench, "--references", str(tmp_path / "ref.samples.jsonl"), "--output", kept]
    assert filter_main(argv + ["--dropped", dropped]) == 0
    reasons = [json.loads(x)["reason"] for x in open(dropped)]
    assert len(reasons) == 3 and all(r.startswith("reference pass@1 0.000") for r in reasons), reasons
