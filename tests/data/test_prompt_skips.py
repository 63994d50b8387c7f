"""rl.on_bad_line=skip (issue 20 item 5): each rejected line is named once (global rank 0 only), the
total follows with a count per reason, every skipped line is in <save_dir>/skipped_prompt_lines.jsonl
(the note after the first 20 names it), the first step's metrics carry data/skipped_prompt_lines, and
a JSON error names its real column. In process; the same through torchrun in
tests/distributed/test_bad_lines_and_foreign_runs.py."""

import io
import json

import pytest

from megatron_klear.data import prompts as prompts_module
from megatron_klear.data.jsonl import BadLineError
from megatron_klear.data.prompts import REPORT_NAME, PromptDataset


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _rows(n_bad=25):
    rows, bad = [], []
    for i in range(40):
        if i % 3 == 1 and len(bad) < n_bad:
            rows.append(
                f'{{"id": "b{i}", "prompt": "q{i}", "answer": "1"'
                if len(bad) % 2
                else {"id": f"b{i}", "task": "math", "prompt": f"q{i}"}
            )  # a missing } or a missing answer
            bad.append(i + 1)
        else:
            rows.append({"id": f"ok{i}", "prompt": f"q{i}", "answer": "1"})
    return rows, bad


def test_each_skipped_line_is_named_once_counted_and_reported(tmp_path, tokenizer):
    rows, bad = _rows(13)
    rows += [f'{{"id": "x{i}", "prompt": "q"' for i in range(12)]  # 25 bad lines in all
    bad += list(range(41, 53))
    path = _write(tmp_path / "p.jsonl", rows)
    out = io.StringIO()
    ds = PromptDataset([path], tokenizer, on_bad_line="skip", report_dir=str(tmp_path / "run"), stream=out)
    report = str(tmp_path / "run" / REPORT_NAME)
    printed = out.getvalue().splitlines()
    named = [line for line in printed if line.startswith("rejected ")]
    assert len(named) == 20 and len(set(named)) == 20  # each once
    assert f"(further rejected lines go only to {report})" in printed
    assert ds.skipped == 25 and len(ds) == 40 - 13
    assert printed[-1] == (
        f"on_bad_line=skip: skipped 25 bad prompt lines (invalid_json: 18, missing_field: 7); each listed in {report}"
    )
    records = [json.loads(line) for line in open(report)]
    assert [r["line"] for r in records] == bad and all(r["file"] == path for r in records)
    # a fresh read without bad lines leaves no stale report behind
    PromptDataset(
        [_write(tmp_path / "good.jsonl", [{"prompt": "q", "answer": "1"}])],
        tokenizer,
        on_bad_line="skip",
        report_dir=str(tmp_path / "run"),
        stream=io.StringIO(),
    )
    assert not (tmp_path / "run" / REPORT_NAME).exists()


def test_only_rank0_prints_and_writes_the_report(tmp_path, tokenizer, monkeypatch, capsys):
    path = _write(tmp_path / "p.jsonl", [{"id": "ok", "prompt": "q", "answer": "1"}, "{broken"])
    monkeypatch.setattr(prompts_module, "is_rank0", lambda: False)
    ds = PromptDataset([path], tokenizer, on_bad_line="skip", report_dir=str(tmp_path / "run"))
    assert ds.skipped == 1
    assert capsys.readouterr().err == "" and not (tmp_path / "run").exists()
    monkeypatch.setattr(prompts_module, "is_rank0", lambda: True)
    PromptDataset([path], tokenizer, on_bad_line="skip", report_dir=str(tmp_path / "run"))
    err = capsys.readouterr().err
    assert err.count("p.jsonl:2: invalid_json") == 1 and "skipped 1 bad prompt lines" in err


def test_without_a_save_dir_the_note_does_not_promise_a_report(tmp_path, tokenizer):
    path = _write(tmp_path / "p.jsonl", [{"id": "ok", "prompt": "q", "answer": "1"}] + ["{bad"] * 3)
    out = io.StringIO()
    PromptDataset([path], tokenizer, on_bad_line="skip", stream=out)
    assert "report" not in out.getvalue().replace("listed in a report", "")
    assert "set train.save_dir to get each listed in a report" in out.getvalue()


@pytest.mark.parametrize(
    "line, where",
    [
        ('{"id": "x", "prompt": "q", "answer": "1"', "Expecting ',' delimiter at column 41, the end of the line"),
        ('{"id": "x" "prompt": "q"}', "Expecting ',' delimiter at column 12"),
        ('{"id": "x", "prompt": "q", "answer": tru}', "Expecting value at column 38"),
    ],
)
def test_json_errors_name_their_real_column(tmp_path, tokenizer, line, where):
    path = _write(tmp_path / "p.jsonl", [line])
    with pytest.raises(BadLineError) as e:
        PromptDataset([path], tokenizer)
    assert f"p.jsonl:1: invalid_json: {where}" in str(e.value)


def test_the_first_steps_metrics_count_the_skipped_lines(monkeypatch):
    from megatron_klear.config import JobConfig
    from megatron_klear.rl.rollout import sampling
    from megatron_klear.rl.rollout.manager import RolloutManager
    from megatron_klear.rl.rollout.schedules import Synchronous

    cfg = JobConfig()
    cfg.rl.prompts = ["p.jsonl"]
    manager = RolloutManager(cfg)
    manager.batches = Synchronous(sampling.FullBatches(cfg, None, None, None, []))
    monkeypatch.setattr(sampling, "dynamic_sampling", lambda batch, rl: ([], {"rollout/generation_batches": 1}))

    class Prompts:
        skipped = 7

        def take(self, n):
            return []

        def state_dict(self):
            return {}

    first = manager.generate(Prompts(), step=0, weight_version=0)[1]
    second = manager.generate(Prompts(), step=1, weight_version=1)[1]
    assert first["data/skipped_prompt_lines"] == 7 and "data/skipped_prompt_lines" not in second
