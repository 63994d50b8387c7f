"""RL prompt data: chat rendering with a generation prompt, left truncation, grading items, bad
lines with file:line, and a seeded, resumable order across epochs."""

import json

import pytest

from megatron_klear.data.jsonl import BadLineError
from megatron_klear.data.prompts import PromptDataset


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_rendering_truncation_and_items(tmp_path, tokenizer):
    long_q = "Find the value. " * 40
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"id": "m1", "task": "math", "prompt": "What is 2+2?", "answer": "4"},
            {
                "id": "c1",
                "task": "code",
                "messages": [{"role": "user", "content": "Echo."}],
                "tests": {"inputs": ["1\n"], "outputs": ["1\n"]},
            },
            {"id": "m2", "prompt": long_q, "answer": "0"},
        ],
    )
    ds = PromptDataset([path], tokenizer, max_prompt_length=32)
    m1, c1, m2 = ds.prompts
    want = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(m1.prompt_ids) == want and want.endswith("<|im_start|>assistant\n")
    assert m2.truncated and len(m2.prompt_ids) == 32
    full = tokenizer(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": long_q}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )["input_ids"]
    assert m2.prompt_ids == full[-32:]  # left-truncated: the end of the prompt is kept
    assert m1.grade_item("x") == {"id": "m1", "task": "math", "response": "x", "answer": "4"}
    assert c1.grade_item("y")["tests"] == {"inputs": ["1\n"], "outputs": ["1\n"]} and m2.task == "math"


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "invalid"),
        ({"id": "x", "task": "poetry", "prompt": "p"}, "bad_task"),
        ({"id": "x", "task": "math", "prompt": "p"}, "missing_field"),
        ({"id": "x", "task": "code", "prompt": "p", "tests": {"inputs": [1], "outputs": []}}, "bad_tests"),
        ({"id": "x", "messages": [{"role": "assistant", "content": "hi"}], "answer": "1"}, "bad_messages"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, tokenizer, line, reason):
    path = _write(tmp_path / "p.jsonl", [{"id": "ok", "prompt": "q", "answer": "1"}, line])
    with pytest.raises(BadLineError, match=rf"p.jsonl:2: {reason}"):
        PromptDataset([path], tokenizer)
    ds = PromptDataset([path], tokenizer, on_bad_line="skip")
    assert [p.id for p in ds.prompts] == ["ok"] and ds.policy.total == 1


def test_order_is_seeded_epochwise_and_resumable(tmp_path, tokenizer):
    path = _write(tmp_path / "p.jsonl", [{"id": str(i), "prompt": f"q{i}", "answer": "1"} for i in range(7)])
    a = PromptDataset([path], tokenizer, seed=3)
    first = [p.id for p in a.take(5)]
    state = a.state_dict()
    rest = [p.id for p in a.take(9)]  # crosses into epoch 1 and 2
    assert sorted(first + rest[:2]) == sorted(str(i) for i in range(7))  # epoch 0 = each prompt once
    b = PromptDataset([path], tokenizer, seed=3)
    b.load_state_dict(state)
    assert [p.id for p in b.take(9)] == rest
    # the order's digest: a crc32 chained over the ids taken, carried through the state
    import zlib

    want = 0
    for i in first + rest:
        want = zlib.crc32(i.encode(), want)
    assert a.digest == b.digest == want and b.progress()["data/order_digest"] == want
    c = PromptDataset([path], tokenizer, seed=3)
    c.take(6)
    c.take(8)  # the same prompts, taken in other batch sizes: the same digest
    assert c.digest == want
    assert [p.id for p in PromptDataset([path], tokenizer, seed=4).take(5)] != first
    with pytest.raises(ValueError, match="seed=3"):
        PromptDataset([path], tokenizer, seed=4).load_state_dict(state)
