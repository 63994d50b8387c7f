"""tools/eval.py refuses, before sampling anything, a budget the model's context cannot hold (the
engines would refuse every request: SGLang with HTTP 400, the embedded engine with ValueError),
and says how to extend it."""

import pytest


def test_eval_refuses_a_budget_beyond_the_context(tmp_path):
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl
    from megatron_klear.models.tiny import make_tiny_qwen3
    from tools.eval import main

    model = make_tiny_qwen3(str(tmp_path / "m"), seed=4, max_position_embeddings=512)
    bench = write_rl_prompts_jsonl(str(tmp_path / "b.jsonl"), 2)
    args = [
        "--model",
        model,
        "--bench",
        f"arith={bench}",
        "--k",
        "1",
        "--dtype",
        "float32",
        "--workers",
        "1",
        "--output",
        str(tmp_path / "res.json"),
        "--max-prompt-length",
        "128",
    ]
    with pytest.raises(
        ValueError,
        match=r"context length is 512 tokens.*longest prompt \(\d+\) \+ --max-new-tokens = \d+.*--yarn-factor",
    ):
        main(args + ["--max-new-tokens", "1024"])
    assert not (tmp_path / "res.json").exists()
    assert main(args + ["--max-new-tokens", "8"]) == 0
