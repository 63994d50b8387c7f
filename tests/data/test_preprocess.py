"""Preprocessing: bad lines by file + line, skip-and-count vs fail, over-long policies, the indexed
dataset and its metadata, atomic output, identical output for any worker count."""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os

import numpy as np
import pytest

from megatron_klear.data import jsonl as J
from megatron_klear.data.chat import ChatRenderer, messages_from_example, tokenizer_fingerprint
from megatron_klear.data.indexed import SFTIndexedReader, load_metadata
from megatron_klear.data.jsonl import BadLineError
from megatron_klear.data.preprocess import PreprocessConfig, preprocess
from tests.data.helpers import synthetic_rows, write_jsonl

GOOD_A = {"prompt": "What is 6*7?", "response": "The answer is \\boxed{42}."}
GOOD_B = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
LONG = {"prompt": "Let x be a real number. " * 8, "response": "Wait, let me double-check. " * 20}


def _config(tmp_path, inputs, tokenizer_dir, **kw):
    kw.setdefault("max_length", 4096)
    return PreprocessConfig(
        inputs=inputs, tokenizer=tokenizer_dir, output_prefix=str(tmp_path / "out" / "ds"), progress_every_s=1e9, **kw
    )


def _sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def mixed_file(tmp_path):
    rows = [
        GOOD_A,  # 1
        "{not json",  # 2
        {"prompt": "only a prompt"},  # 3
        "",  # 4 (blank: ignored)
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},  # 5
        {"prompt": "p", "response": ""},  # 6
        GOOD_B,  # 7
        "[1, 2]",  # 8
    ]
    return write_jsonl(tmp_path / "mixed.jsonl", rows)


def test_skip_counts_and_reports_every_bad_line(tmp_path, tokenizer_dir, tokenizer, mixed_file, capsys):
    meta = preprocess(_config(tmp_path, [mixed_file], tokenizer_dir, on_bad_line="skip"))
    c = meta["counts"]
    assert c["kept"] == 2 and c["examples_read"] == 7 and c["truncated"] == 0 and c["dropped"] == {}
    assert c["skipped"] == {
        J.INVALID_JSON: 1,
        J.MISSING_FIELD: 1,
        J.UNKNOWN_ROLE: 1,
        J.EMPTY_ASSISTANT: 1,
        J.NOT_AN_OBJECT: 1,
    }
    prefix = str(tmp_path / "out" / "ds")
    report = [json.loads(x) for x in open(prefix + ".rejected.jsonl")]
    assert [(r["file"], r["line"], r["reason"]) for r in report] == [
        (mixed_file, 2, J.INVALID_JSON),
        (mixed_file, 3, J.MISSING_FIELD),
        (mixed_file, 5, J.UNKNOWN_ROLE),
        (mixed_file, 6, J.EMPTY_ASSISTANT),
        (mixed_file, 8, J.NOT_AN_OBJECT),
    ]
    assert f"{mixed_file}:5: unknown_role" in capsys.readouterr().err

    # The dataset holds exactly the renderer's tokens and spans for the good lines, in order.
    reader = SFTIndexedReader(prefix)
    renderer = ChatRenderer(tokenizer)
    for i, row in enumerate([GOOD_A, GOOD_B]):
        want = renderer.render(messages_from_example(row))
        assert reader.tokens(i).tolist() == want.token_ids
        assert reader.loss_spans(i).tolist() == [list(s) for s in want.loss_spans]
        assert reader.loss_mask(i).tolist() == want.loss_mask().tolist()
    assert reader.meta["token_dtype"] == "uint16"  # 320-token vocabulary

    # Metadata: sources + sha256, tokenizer hash, token counts, histogram.
    assert meta["sources"] == [
        {
            "path": os.path.abspath(mixed_file),
            "sha256": _sha256(mixed_file),
            "bytes": os.path.getsize(mixed_file),
            "lines": 8,
        }
    ]
    assert meta["tokenizer"]["sha256"] == tokenizer_fingerprint(tokenizer_dir)["sha256"]
    assert meta["tokenizer"]["pad_token_id"] == tokenizer.pad_token_id
    assert meta["tokens"]["total"] == int(reader.lengths.sum())
    assert meta["tokens"]["loss"] == sum(int(reader.loss_mask(i).sum()) for i in range(2))
    hist = meta["lengths"]["histogram"]
    assert sum(hist["counts"]) == 2 and len(hist["edges"]) == len(hist["counts"]) + 1
    for n in reader.lengths:
        k = np.searchsorted(hist["edges"], n, side="right") - 1
        assert hist["counts"][k] >= 1
    assert load_metadata(prefix) == meta


def test_fail_stops_at_first_bad_line_and_writes_nothing(tmp_path, tokenizer_dir, mixed_file):
    with pytest.raises(BadLineError) as e:
        preprocess(_config(tmp_path, [mixed_file], tokenizer_dir, on_bad_line="fail"))
    assert str(e.value).startswith(f"{mixed_file}:2: invalid_json")
    assert (e.value.path, e.value.line) == (mixed_file, 2)
    assert glob.glob(str(tmp_path / "out" / "*")) == []  # temporary files removed too


def test_line_numbers_across_files(tmp_path, tokenizer_dir):
    a = write_jsonl(tmp_path / "a.jsonl", [GOOD_A, GOOD_B])
    b = write_jsonl(tmp_path / "b.jsonl", [GOOD_A, GOOD_A, {"prompt": 1, "response": "r"}])
    with pytest.raises(BadLineError, match=r"b\.jsonl:3: invalid_field: 'prompt' must be a string"):
        preprocess(_config(tmp_path, [a, b], tokenizer_dir))


def test_invalid_utf8_is_a_bad_line(tmp_path, tokenizer_dir):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(json.dumps(GOOD_A).encode() + b"\n" + b'{"prompt": "\xff"}\n')
    meta = preprocess(_config(tmp_path, [str(path)], tokenizer_dir, on_bad_line="skip"))
    assert meta["counts"]["skipped"] == {J.INVALID_JSON: 1}
    assert meta["sources"][0]["sha256"] == _sha256(path)


def test_overlong_policies(tmp_path, tokenizer_dir, tokenizer):
    path = write_jsonl(tmp_path / "long.jsonl", [GOOD_A, LONG, GOOD_B])
    full = ChatRenderer(tokenizer).render(messages_from_example(LONG))
    max_length = len(full) - 10
    assert max_length > full.loss_spans[0][0] + 1

    meta = preprocess(_config(tmp_path, [path], tokenizer_dir, max_length=max_length, overlong="truncate"))
    assert meta["counts"]["kept"] == 3 and meta["counts"]["truncated"] == 1
    reader = SFTIndexedReader(str(tmp_path / "out" / "ds"))
    assert reader.tokens(1).tolist() == full.token_ids[:max_length]
    assert reader.loss_spans(1).tolist() == [[full.loss_spans[0][0], max_length]]

    meta = preprocess(_config(tmp_path, [path], tokenizer_dir, max_length=max_length, overlong="drop"))
    assert meta["counts"]["kept"] == 2 and meta["counts"]["dropped"] == {J.TOO_LONG: 1}
    report = [json.loads(x) for x in open(str(tmp_path / "out" / "ds.rejected.jsonl"))]
    assert [(r["line"], r["reason"]) for r in report] == [(2, J.TOO_LONG)]
    assert f"{len(full)} tokens > max_length {max_length}" in report[0]["detail"]

    # "fail" is fatal even when bad lines are skipped.
    with pytest.raises(BadLineError, match=rf"long\.jsonl:2: too_long: {len(full)} tokens"):
        preprocess(_config(tmp_path, [path], tokenizer_dir, max_length=max_length, overlong="fail", on_bad_line="skip"))

    # Truncating before the response starts leaves nothing to learn: dropped, and said so.
    meta = preprocess(_config(tmp_path, [path], tokenizer_dir, max_length=full.loss_spans[0][0], overlong="truncate"))
    assert full.loss_spans[0][0] > 50  # the short examples fit whole
    assert meta["counts"]["dropped"] == {J.NO_LOSS_AFTER_TRUNCATION: 1} and meta["counts"]["kept"] == 2


def test_output_independent_of_worker_count(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "many.jsonl", synthetic_rows(150, seed=1) + ["oops", ""])
    outputs = {}
    for workers in (1, 2):
        cfg = _config(tmp_path, [path], tokenizer_dir, workers=workers, on_bad_line="skip", chunk_lines=7)
        cfg.output_prefix = str(tmp_path / f"w{workers}" / "ds")
        stream = io.StringIO()
        meta = preprocess(cfg, stream=stream)
        assert meta["counts"]["kept"] == 150 and meta["counts"]["skipped"] == {J.INVALID_JSON: 1}
        # one progress line (the others wait for progress_every_s): all of the input, once processed
        progress = [ln for ln in stream.getvalue().splitlines() if ln.startswith("preprocess: ")]
        kb = f"{os.path.getsize(path) / 1e3:.0f}"
        assert len(progress) == 1 and progress[0].startswith(f"preprocess: {kb}/{kb} kB in "), progress
        assert "| 151 lines (kept 150, rejected 1), " in progress[0], progress
        outputs[workers] = {
            ext: _sha256(cfg.output_prefix + ext)
            for ext in (".bin", ".idx", "_loss_spans.bin", "_loss_spans.idx", ".rejected.jsonl")
        }
    assert outputs[1] == outputs[2]


def test_rerun_replaces_previous_output(tmp_path, tokenizer_dir):
    a = write_jsonl(tmp_path / "a.jsonl", [GOOD_A])
    b = write_jsonl(tmp_path / "b.jsonl", [GOOD_A, GOOD_B, GOOD_B])
    preprocess(_config(tmp_path, [a], tokenizer_dir))
    preprocess(_config(tmp_path, [b], tokenizer_dir))
    reader = SFTIndexedReader(str(tmp_path / "out" / "ds"))
    assert len(reader) == 3 and reader.meta["sources"][0]["path"] == os.path.abspath(b)
    assert sorted(os.listdir(tmp_path / "out")) == [
        "ds.bin",
        "ds.idx",
        "ds.meta.json",
        "ds.rejected.jsonl",
        "ds_loss_spans.bin",
        "ds_loss_spans.idx",
    ]


def test_reader_refuses_incomplete_dataset_and_wrong_tokenizer(tmp_path, tokenizer_dir):
    a = write_jsonl(tmp_path / "a.jsonl", [GOOD_A])
    preprocess(_config(tmp_path, [a], tokenizer_dir))
    prefix = str(tmp_path / "out" / "ds")
    with pytest.raises(ValueError, match="tokenized with tokenizer"):
        SFTIndexedReader(prefix, expected_tokenizer_sha256="0" * 64)
    os.remove(prefix + ".meta.json")
    with pytest.raises(FileNotFoundError, match="preprocessing did not finish"):
        SFTIndexedReader(prefix)


def test_cli(tmp_path, tokenizer_dir, capsys):
    from tools.preprocess_sft import main

    bad = write_jsonl(tmp_path / "bad.jsonl", [GOOD_A, "nope"])
    out = str(tmp_path / "cli" / "ds")
    args = [
        "--input",
        bad,
        "--tokenizer",
        tokenizer_dir,
        "--output-prefix",
        out,
        "--max-length",
        "64",
        "--workers",
        "1",
    ]
    assert main(args) == 1
    assert f"error: {bad}:2: invalid_json" in capsys.readouterr().err
    assert main(args + ["--on-bad-line", "skip"]) == 0
    assert load_metadata(out)["counts"]["skipped"] == {J.INVALID_JSON: 1}
