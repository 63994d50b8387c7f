"""One RL batch on a verl parquet of math and code prompts grades both (issue 23).

A full RL step needs torchrun and a Megatron model (minutes on 2 CPU cores: tests/distributed runs
those on the project's own JSONL). Here the batch goes through the code path the loop uses to
generate and grade: rl.prompts read by PromptDataset (format detected), rl/rollout/sampling.py
``generate_and_grade`` with the embedded engine on a tiny model, the reward pool; then the same
path with scripted responses (right and wrong for each problem), so the rewards, groups and
advantages the actor would train on are known."""

import io

import pytest

from megatron_klear.config import JobConfig
from megatron_klear.data.prompts import PromptDataset
from megatron_klear.rewards import GradingPool, RewardConfig
from megatron_klear.rl.rollout.sampling import generate_and_grade
from megatron_klear.rollout.base import Completion, RolloutEngine, SamplingParams

from ..rewards.test_functional_grading import HONEST
from .format_fixtures import verl_rows, write

ROWS = [0, 1, 3, 6, 7]  # math_longcot_math_verify, aime2024, coder1 (functional), codeforces, livecodebench


class _Recording:
    """The grading pool, recording what was submitted and graded."""

    def __init__(self, pool):
        self.pool, self.items, self.futures = pool, [], []

    def submit(self, item):
        fut = self.pool.submit(item)
        self.items.append(item)
        self.futures.append(fut)
        return fut


class _Scripted(RolloutEngine):
    def __init__(self, tok, texts):
        self.tok, self.texts = tok, texts

    def generate(self, prompts, params, n=1):
        return [
            [
                Completion(
                    self.tok(t, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id],
                    [-0.1] * (len(self.tok(t, add_special_tokens=False)["input_ids"]) + 1),
                    "stop",
                )
                for t in self.texts[i]
            ]
            for i in range(len(prompts))
        ]

    def update_weights(self, named_tensors, *, version=None):
        raise AssertionError("not here")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_klear.data.chat import generation_stop_ids, load_tokenizer
    from megatron_klear.models.tiny import make_tiny_qwen3

    d = tmp_path_factory.mktemp("rlbatch")
    model = make_tiny_qwen3(str(d / "m"), seed=4)
    tok = load_tokenizer(model)
    path = write(d / "train.parquet", [verl_rows()[i] for i in ROWS])
    log = io.StringIO()
    ds = PromptDataset([path], tok, max_prompt_length=256, stream=log)
    cfg = JobConfig()
    cfg.rl.responses_per_prompt = 2
    cfg.rl.prompts_per_step = len(ROWS)
    return {"model": model, "tok": tok, "ds": ds, "log": log.getvalue(), "cfg": cfg, "stop": generation_stop_ids(tok)}


def test_the_embedded_engine_batch_is_graded_by_each_task(setup):
    from megatron_klear.rollout.config import RolloutConfig
    from megatron_klear.rollout.factory import make_engine

    assert "format=verl; 5 rows" in setup["log"]
    prompts = setup["ds"].take(len(ROWS))
    engine = make_engine(RolloutConfig(engine="embedded", dtype="float32"), setup["model"], device="cpu")
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=list(setup["stop"]), seed=1)
    with GradingPool(RewardConfig(workers=1)) as pool:
        rec = _Recording(pool)
        _, metrics = generate_and_grade(engine, rec, setup["tok"], prompts, params, setup["cfg"], setup["stop"])
        grades = [f.result() for f in rec.futures]
    assert metrics["rollout/groups_generated"] == 5 and len(rec.items) == 10
    assert metrics["rollout/grader_errors"] == 0
    for item, g in zip(rec.items, grades):
        p = next(q for q in prompts if q.id == item["id"])
        if p.task == "math":
            assert item["answer"] == p.answer and "tests" not in item
        else:  # the code grader ran on the problem's tests (6 random tokens: no program to run)
            assert item["tests"] == p.tests and g.total == len(p.tests["inputs"]), (item["id"], g)


def test_scripted_right_and_wrong_responses_give_the_rewards_and_groups(setup):
    ds, tok = setup["ds"], setup["tok"]
    prompts = sorted(ds.prompts, key=lambda p: p.id)
    answers = {"math_longcot_math_verify-0": "204", "aime2024-1": "73"}
    fence = "<think>ok</think>\n```python\n{}\n```"
    honest = {
        "coder1-3": HONEST["coder1"],
        "codeforces-6": HONEST["codeforces"],
        "livecodebench-7": HONEST["livecodebench"],
    }
    texts = []
    for p in prompts:
        if p.task == "math":
            texts.append([f"<think>ok</think> \\boxed{{{answers[p.id]}}}", "<think>ok</think> \\boxed{1}"])
        else:
            texts.append([fence.format(honest[p.id]), fence.format("print('nothing')")])
    params = SamplingParams(max_new_tokens=64, stop_token_ids=list(setup["stop"]))
    with GradingPool(RewardConfig(workers=1)) as pool:
        rec = _Recording(pool)
        samples, metrics = generate_and_grade(
            _Scripted(tok, texts), rec, tok, prompts, params, setup["cfg"], setup["stop"]
        )
        grades = [f.result() for f in rec.futures]
    assert [g.solved for g in grades] == [True, False] * 5
    assert all(right.reward == 1.0 and wrong.reward < 1.0 for right, wrong in zip(grades[::2], grades[1::2]))
    assert metrics["rollout/accuracy"] == 0.5 and metrics["rollout/groups_kept"] == 5
    assert len(samples) == 10 and all((s.advantage > 0) == s.positive for s in samples)
