"""tools/eval.py grades like LiveCodeBench (every test, not RL's sample of 16) and copes with chat
templates that open <think> inside the prompt (issue 11, items 3 and 10).

The engine is a scripted stand-in (behind --url) and grading runs in this process in the sandbox
level this machine supports, so the tool's own wiring (its RewardConfig, its prompt detection) is
what is tested.
"""

import json
from concurrent.futures import Future
from dataclasses import replace

import pytest

from megatron_klear.rewards.code import parse_tests, select_tests
from megatron_klear.rollout.base import Completion, RolloutEngine

from .conftest import small_limits

RIGHT_MATH = "The answer is \\boxed{12}."


class _Engine(RolloutEngine):
    """Answers every prompt with ``text``, k times."""

    text = ""

    def __init__(self, urls, **kw):
        from megatron_klear.data.chat import load_tokenizer

        self.tok = load_tokenizer(_Engine.tokenizer_dir)

    def check_context_length(self, needed, what):
        pass

    def generate(self, prompts, params, n=1):
        ids = self.tok(_Engine.text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [[Completion(ids, [-0.1] * len(ids), "stop") for _ in range(n)] for _ in prompts]

    def update_weights(self, named_tensors, *, version=None):
        raise AssertionError


class _Pool:
    """GradingPool's interface, grading in this process with the test sandbox."""

    configs = []

    def __init__(self, config=None, workers=None):
        from megatron_klear.rewards.sandbox import Sandbox

        self.cfg = config
        _Pool.configs.append(config)
        self._cfg = replace(config, sandbox=small_limits(_Pool.level))
        self._sb = Sandbox(self._cfg.sandbox, level=_Pool.level)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._sb.close()

    def submit(self, item):
        from megatron_klear.rewards.items import grade_item, parse_item

        f = Future()
        f.set_result(grade_item(parse_item(item), self._cfg, sandbox=self._sb))
        return f


@pytest.fixture
def eval_main(monkeypatch, tmp_path, level):
    from dataclasses import replace as with_builder

    import megatron_klear.rewards as rewards
    from megatron_klear.models.tiny import build_tokenizer
    from megatron_klear.rollout.engines import ENGINES

    tok_dir = str(tmp_path / "tok")
    build_tokenizer(tok_dir)
    _Engine.tokenizer_dir, _Pool.level, _Pool.configs = tok_dir, level, []
    # the SGLang engine's entry of the table builds the scripted one (tools/eval.py --url: sglang)
    monkeypatch.setitem(ENGINES, "sglang", with_builder(ENGINES["sglang"], builder=lambda r, **_: _Engine(r.urls)))
    monkeypatch.setattr(rewards, "GradingPool", _Pool)
    from tools.eval import main

    def run(bench_lines, response, *extra):
        bench = tmp_path / "bench.jsonl"
        bench.write_text("".join(json.dumps(x) + "\n" for x in bench_lines))
        out = tmp_path / "res.json"
        _Engine.text = response
        assert (
            main(
                [
                    "--url",
                    "http://scripted:1",
                    "--tokenizer",
                    _Engine.tokenizer_dir,
                    "--bench",
                    f"b={bench}",
                    "--k",
                    "2",
                    "--workers",
                    "1",
                    "--output",
                    str(out),
                    "--fresh",  # (each call another scripted response: never the last call's results)
                    *extra,
                ]
            )
            == 0
        )
        recs = [json.loads(x) for x in (tmp_path / "res.samples.jsonl").read_text().splitlines()]
        return json.load(open(out))["results"]["b"], recs

    return run


def test_evaluation_runs_every_test_not_a_sample(eval_main):
    """40 tests, the program fails one that RL's seeded 16-test sample leaves out: solved under RL's
    reward (16/16), unsolved in evaluation (39/40)."""
    n = 40
    inputs, outputs = [f"{i}\n" for i in range(n)], [str(2 * i) for i in range(n)]
    key = parse_tests({"inputs": inputs, "outputs": outputs}).key
    skipped = next(i for i in range(n) if i not in select_tests(n, 16, 0, key))
    outputs[skipped] = "wrong expected output"
    problem = {"id": "p", "task": "code", "prompt": "double it", "tests": {"inputs": inputs, "outputs": outputs}}
    program = "<think>easy</think>\n```python\nprint(2 * int(input()))\n```"
    summary, recs = eval_main([problem], program)
    assert [r["solved"] for r in recs] == [False, False], recs[0]["detail"]  # was 16/16: solved
    assert recs[0]["detail"].startswith("39/40 tests passed")
    assert _Pool.configs[-1].code_max_tests is None
    assert summary["avg@2"] == 0.0 and summary["pass@2"] == 0.0


def test_evaluate_refuses_a_pool_that_samples_tests():
    from megatron_klear.data.prompts import Prompt
    from megatron_klear.evaluation import evaluate, evaluation_reward_config
    from megatron_klear.rewards import RewardConfig

    class P:
        cfg = RewardConfig()

    code = Prompt(id="c", task="code", prompt_ids=[1], tests={"inputs": ["1"], "outputs": ["1"]})
    with pytest.raises(ValueError, match="every test"):
        evaluate(None, {"lcb": [code]}, None, P(), k=1, params=None)
    cfg = evaluation_reward_config(RewardConfig(code_max_tests=16, code_test_sampling="per_call", workers=3))
    assert (cfg.code_max_tests, cfg.code_test_sampling, cfg.workers, cfg.require_think_open) == (None, "fixed", 3, True)
    assert not evaluation_reward_config(think_in_prompt=True).require_think_open


def _think_template(tok_dir):
    """The tiny tokenizer with a template whose generation prompt opens <think> (as Qwen3 and
    DeepSeek-R1 style templates do)."""
    path = f"{tok_dir}/chat_template.jinja"
    template = open(path).read()
    opened = template.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
    assert opened != template
    open(path, "w").write(opened)


def test_think_opened_in_the_prompt(eval_main):
    """A response that continues the prompt's <think> and closes it is graded on its answer; without
    the option (or the detection) every such response scored the missing-<think> penalty."""
    math = [{"id": "m", "task": "math", "prompt": "What is 3 * 4?", "answer": "12"}]
    response = "3 * 4 = 12.</think>\n" + RIGHT_MATH
    summary, recs = eval_main(math, response)  # plain template, auto: off
    assert summary["avg@2"] == 0.0 and recs[0]["detail"] == "missing <think>"
    summary, _ = eval_main(math, response, "--think-in-prompt", "yes")
    assert summary["avg@2"] == 100.0
    _think_template(_Engine.tokenizer_dir)
    summary, recs = eval_main(math, response)  # auto: detected
    assert summary["avg@2"] == 100.0 and not _Pool.configs[-1].require_think_open
    summary, recs = eval_main(math, response, "--think-in-prompt", "no")
    assert summary["avg@2"] == 0.0


def test_end_of_turn_is_found_for_templates_that_open_think(tmp_path):
    """Such templates are not prefix-stable (a past assistant turn has no <think>); the stop token
    must still be found rather than the evaluation failing on it."""
    from megatron_klear.data.chat import end_of_turn_ids, load_tokenizer
    from megatron_klear.models.tiny import IM_END_ID, build_tokenizer

    build_tokenizer(str(tmp_path))
    _think_template(str(tmp_path))
    assert end_of_turn_ids(load_tokenizer(str(tmp_path))) == [IM_END_ID]
