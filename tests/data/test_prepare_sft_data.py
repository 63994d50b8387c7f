"""A published long-CoT SFT set, as downloaded, to the SFT dataset (issue 53, item 2): rows shaped
like OpenThoughts3-1.2M's parquet (ShareGPT ``conversations``) and an OpenAI-style JSONL with
``reasoning_content`` go through tools/prepare_sft_data.py, then tools/preprocess_sft.py; every
assistant turn's chain of thought carries loss, and a row without one is refused naming its file,
row and column."""

import json

import pytest

THOUGHT = "<think>\nTwo and two make four.\n</think>\n\nThe answer is 4."


def _openthoughts_rows():
    def convo(q, a):
        return [{"from": "human", "value": q}, {"from": "gpt", "value": a}]

    base = {"difficulty": 3, "source": "ai2-adapt-dev/openmath-2-math", "domain": "math"}
    return [
        {**base, "conversations": convo("What is 2+2?", THOUGHT)},
        {**base, "conversations": convo("What is 3+3?", "6")},  # no chain of thought
        {**base, "conversations": convo("What is 1+1?", "<think>\n1 and 1.\n</think>\n\n2")},
    ]


@pytest.fixture
def downloads(tmp_path):
    from megatron_klear.data.formats.rows import write_parquet

    (tmp_path / "OpenThoughts3" / "data").mkdir(parents=True)
    write_parquet(str(tmp_path / "OpenThoughts3" / "data" / "train-00000-of-00002.parquet"), _openthoughts_rows()[:2])
    write_parquet(str(tmp_path / "OpenThoughts3" / "data" / "train-00001-of-00002.parquet"), _openthoughts_rows()[2:])
    with open(tmp_path / "chat.jsonl", "w") as f:
        msgs = [
            {"role": "user", "content": "What is 5+5?"},
            {"role": "assistant", "content": "10", "reasoning_content": "Five and five."},
        ]
        f.write(json.dumps({"messages": msgs}) + "\n")
    return tmp_path


def test_a_published_set_becomes_the_sft_dataset_with_its_thinking_trained(downloads, tokenizer_dir, capsys):
    from megatron_klear.data.indexed import SFTIndexedReader
    from tools.prepare_sft_data import main as prepare
    from tools.preprocess_sft import main as preprocess

    out = str(downloads / "sft.jsonl")
    shards = f"{downloads}/OpenThoughts3/data/*.parquet"
    # fail (the default): the row without thinking stops the run, named, and nothing is written
    from megatron_klear.data.jsonl import BadLineError

    with pytest.raises(
        BadLineError, match=r"train-00000-of-00002.parquet:2: no_chain_of_thought: column conversations\[1\]"
    ):
        prepare(["--input", shards, "--output", out])
    assert not (downloads / "sft.jsonl").exists()
    assert (
        prepare(["--input", shards, "--input", str(downloads / "chat.jsonl"), "--output", out, "--on-bad-row", "skip"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "wrote 3 conversations" in printed and "1 bad rows skipped: no_chain_of_thought: 1" in printed
    lines = [json.loads(x) for x in open(out)]
    assert [m["messages"][0]["content"] for m in lines] == ["What is 2+2?", "What is 1+1?", "What is 5+5?"]
    # reasoning_content written inline: trained whatever the chat template does with that field
    assert lines[2]["messages"][1] == {"role": "assistant", "content": "<think>\nFive and five.\n</think>\n\n10"}
    (rejected,) = [json.loads(x) for x in open(out + ".rejected.jsonl")]
    assert rejected["line"] == 2 and rejected["reason"] == "no_chain_of_thought"

    prefix = str(downloads / "klear_sft")
    args = ["--input", out, "--tokenizer", tokenizer_dir, "--output-prefix", prefix, "--max-length", "256"]
    assert preprocess(args + ["--workers", "1"]) == 0
    data = SFTIndexedReader(prefix)
    assert len(data) == 3
    from megatron_klear.data.chat import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    think = tok.convert_tokens_to_ids("<think>")
    for i in range(3):
        tokens, mask = data.tokens(i), data.loss_mask(i)
        trained = [int(t) for t, m in zip(tokens, mask) if m]
        assert think in trained, (i, tok.decode(trained))  # the chain of thought carries loss
