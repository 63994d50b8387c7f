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
            out.append([Completion(self.tok(t, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id],
                                   [-0.1] * (len(self.tok(t, add_special_tokens=False)["input_ids"]) + 1), "stop")
                        for t in texts])
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
    prompts = [Prompt(id="a", task="math", prompt_ids=[5, 6], answer="12"),
               Prompt(id="b", task="math", prompt_ids=[7], answer="7")]
    script = [[right.format(12), right.format(12), right.format(13), "no think"],   # 2/4 solved
              [right.format(8), right.format(9), right.format(6), right.format(5)]]  # 0/4
    with GradingPool(RewardConfig(workers=1)) as pool:
        summary, records = evaluate(ScriptedEngine(tokenizer, script), {"toy": prompts}, tokenizer, pool, k=4,
                                    params=SamplingParams(), progress=lambda s: None)
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
    assert main(["--model", model, "--bench", f"arith={bench}", "--k", "2", "--max-new-tokens", "8",
                 "--dtype", "float32", "--workers", "1", "--output", str(out)]) == 0
    res = json.load(open(out))["results"]["arith"]
    assert res["prompts"] == 3 and res["k"] == 2 and 0 <= res["avg@2"] <= 100
    assert res["truncated_frac"] > 0  # 8 new tokens: a random tiny model rarely stops
    lines = (tmp_path / "r" / "res.samples.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all(json.loads(x)["length"] <= 8 for x in lines)
