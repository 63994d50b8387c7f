"""The synthetic digit-chain task (data/synthetic.py): answers the real math grader accepts,
train / held-out problems disjoint, files identical for a seed."""

import hashlib
import json

import pytest

from megatron_klear.data import synthetic as syn


def test_reference_responses_are_graded_correct_and_wrong_answers_are_not():
    from megatron_klear.rewards.math import grade_math

    chosen = syn.sample_problems(40, seed=3, split="train") + syn.sample_problems(40, seed=3, split="heldout")
    for p in chosen:
        ex = syn.example(p)
        # the answer is the chain's value, worked left to right in the trace
        assert int(ex["answer"]) == eval(p.expression)
        assert ex["response"].startswith("<think>") and "</think>" in ex["response"]
        assert ex["response"].count("\n") == len(p.digits) - 1  # one line per step, then the answer
        good = grade_math(ex["response"], ex["answer"])
        assert good.solved and good.reward == 1.0, (ex, good)
        wrong = ex["response"].replace(f"\\boxed{{{ex['answer']}}}", f"\\boxed{{{int(ex['answer']) + 1}}}")
        bad = grade_math(wrong, ex["answer"])
        assert not bad.solved and bad.reward == -1.0 and bad.error is None, (wrong, bad)
        # the Klear format scores: no </think> (a truncated trace) and no <think>
        assert grade_math(ex["response"].split("</think>")[0], ex["answer"]).reward == -0.5
        assert grade_math(ex["response"].replace("<think>", ""), ex["answer"]).reward == -2.0


def test_the_imperfect_teachers_slips_are_wrong_answers_one_per_response(tmp_path):
    from megatron_klear.rewards.math import grade_math

    path = syn.write_sft_jsonl(str(tmp_path / "sft.jsonl"), 400, seed=5, slip_rate=0.6)
    rows = [json.loads(x)["messages"] for x in open(path)]
    by_question = {p.question: p for p in syn.problems("train")}
    slipped = 0
    for user, assistant in rows:
        p = by_question[user["content"]]
        lines = assistant["content"].split("</think>")[0].removeprefix("<think>").split("\n")
        # a slip changes one partial result and everything after it: the first wrong line is off by 1 or 2
        first = next(
            (i for i, (line, ok) in enumerate(zip(lines, p.steps())) if int(line.split("=")[1]) != ok[3]), None
        )
        if first is None:
            assert assistant["content"] == p.response
            assert grade_math(assistant["content"], str(p.answer)).solved
            continue
        slipped += 1
        left, _, result = lines[first].partition("=")
        assert abs(int(result) - eval(left)) in (1, 2)
        for line in lines[first + 1 :]:  # no second slip: the chain goes on correctly from the slipped value
            left, _, result = line.partition("=")
            assert int(result) == eval(left)
        assert not grade_math(assistant["content"], str(p.answer)).solved  # a slip is always a wrong answer
    assert 0.5 < slipped / len(rows) < 0.7
    # and the +/- task: answers (negative ones too) verified by the grader
    task = syn.ChainTask(ops="+-")
    for p in syn.sample_problems(30, seed=2, split="heldout", task=task):
        assert grade_math(p.response, str(p.answer)).solved and p.answer == eval(p.expression)


def test_train_and_heldout_are_disjoint_and_cover_the_space():
    task = syn.DEFAULT_TASK
    train, held = syn.problems("train"), syn.problems("heldout")
    assert len(train) + len(held) == (task.max_digit + 1) ** task.terms * len(task.ops) ** (task.terms - 1)
    assert not {p.question for p in train} & {p.question for p in held}
    assert 0.08 < len(held) / (len(train) + len(held)) < 0.17  # about 1 in heldout_every = 8
    # and the files: whatever the seeds, no held-out question among SFT chats or RL prompts
    held_q = {p.question for p in held}
    for seed in range(3):
        sft = [syn.example(p)["question"] for p in syn.sample_problems(4000, seed=seed, split="train")]
        assert not held_q & set(sft)
    # another task shape has its own split
    small = syn.ChainTask(terms=2, ops="+", heldout_every=4)
    assert len(syn.problems("train", small)) + len(syn.problems("heldout", small)) == 100


def test_files_are_deterministic_per_seed(tmp_path):
    def digest(path):
        return hashlib.sha256(open(path, "rb").read()).hexdigest()

    a = syn.write_sft_jsonl(str(tmp_path / "a.jsonl"), 64, seed=7)
    b = syn.write_sft_jsonl(str(tmp_path / "b.jsonl"), 64, seed=7)
    c = syn.write_sft_jsonl(str(tmp_path / "c.jsonl"), 64, seed=8)
    assert digest(a) == digest(b) != digest(c)
    p1 = syn.write_rl_prompts_jsonl(str(tmp_path / "p1.jsonl"), 32, seed=1)
    p2 = syn.write_rl_prompts_jsonl(str(tmp_path / "p2.jsonl"), 32, seed=1)
    assert digest(p1) == digest(p2)
    rows = [json.loads(x) for x in open(p1)]
    assert len({r["id"] for r in rows}) == 32 and all(r["task"] == "math" for r in rows)
    held = [json.loads(x) for x in open(syn.write_rl_prompts_jsonl(str(tmp_path / "h.jsonl"), None, split="heldout"))]
    assert len(held) == len(syn.problems("heldout")) and len({r["id"] for r in held}) == len(held)
    # more prompts than the side holds: another pass, ids stay unique
    many = [json.loads(x) for x in open(syn.write_rl_prompts_jsonl(str(tmp_path / "m.jsonl"), 600, split="heldout"))]
    assert len({r["id"] for r in many}) == 600


def test_bad_task_and_split_are_refused():
    with pytest.raises(ValueError, match="split"):
        syn.problems("test")
    with pytest.raises(ValueError, match="ChainTask"):
        syn.ChainTask(terms=1)


# -- the long-tailed variant (benchmarks/async_rl.py) ----------------------------------------------------
def test_chain_task_files_are_unchanged_by_the_long_tailed_variant(tmp_path):
    """The digit-chain task's files, pinned (sha256 of what the task wrote before LongTailTask existed)."""

    def digest(path):
        return hashlib.sha256(open(path, "rb").read()).hexdigest()

    assert (
        digest(syn.write_sft_jsonl(str(tmp_path / "a.jsonl"), 64, seed=7, slip_rate=0.6))
        == "f3e6529ffc29877598f50673ab4127cc2e9701ebdfa5c37b679751838285d7f6"
    )
    assert (
        digest(syn.write_rl_prompts_jsonl(str(tmp_path / "b.jsonl"), 100, seed=3))
        == "17aeaebb0f15fa22e0f3c7a5f1ae8b5b2e5bb4a724e0d9233a7fe13dd1f5db15"
    )
    assert (
        digest(
            syn.write_rl_prompts_jsonl(str(tmp_path / "c.jsonl"), None, split="heldout", task=syn.ChainTask(ops="+-"))
        )
        == "78bc30752d78b4c584ab8ad4aea74dd77dfe1bb2190afece18baf177491768c7"
    )


def test_length_percentiles_are_nearest_rank():
    import numpy as np

    assert syn.length_percentiles(range(10, 0, -1)) == {"p50": 5, "p90": 9, "max": 10}  # by hand
    assert syn.length_percentiles([7]) == {"p50": 7, "p90": 7, "max": 7}
    assert syn.length_percentiles([3, 1, 2]) == {"p50": 2, "p90": 3, "max": 3}
    rng = np.random.default_rng(0)
    for n in (2, 11, 100, 1001):
        values = rng.integers(1, 500, n).tolist()
        want = {f"p{q}": int(np.percentile(values, q, method="inverted_cdf")) for q in (50, 90)}
        assert syn.length_percentiles(values) == {**want, "max": max(values)}
    with pytest.raises(ValueError, match="no lengths"):
        syn.length_percentiles([])


def test_long_tailed_terms_follow_the_law():
    task = syn.LongTailTask(min_terms=2, max_terms=3, tail=1.0)
    assert task.terms_probabilities() == pytest.approx({2: 2 / 3, 3: 1 / 3})  # 1 : 1/2, by hand
    task = syn.LongTailTask()
    law = task.terms_probabilities()
    assert list(law) == list(range(2, 21)) and sum(law.values()) == pytest.approx(1.0)
    assert law[2] / law[3] == pytest.approx(2**1.3) and law[2] / law[20] == pytest.approx(19**1.3)
    drawn = syn.sample_problems(20000, seed=1, task=task)
    for k in (2, 3, 5, 10, 20):
        freq = sum(p.terms == k for p in drawn) / len(drawn)
        # within 5 standard errors of the law (the held-out side removes 1 in 8 of every length alike)
        assert abs(freq - law[k]) < 5 * (law[k] * (1 - law[k]) / len(drawn)) ** 0.5 + 0.005, (k, freq, law[k])
    assert all(p.digits and all(0 <= d <= 9 for d in p.digits) and set(p.ops) <= {"+"} for p in drawn[:200])


def test_long_tailed_teacher_lengths(tokenizer):
    """The teacher's responses in tokens: median short, a long tail, the longest at most 8x the median
    (a long-CoT batch capped at its budget)."""
    task = syn.LongTailTask()
    chosen = syn.sample_problems(3000, seed=0, task=task)
    lengths = [len(tokenizer(p.response)["input_ids"]) for p in chosen]
    q = syn.length_percentiles(lengths)
    # one line per step: "<think>a+b=c" ... about 8 tokens a step
    assert 18 <= q["p50"] <= 36 and q["p50"] <= q["p90"] <= q["max"]
    assert q["p90"] >= 2.5 * q["p50"]  # long-tailed
    assert q["max"] <= 8 * q["p50"]  # capped
    longest = syn.Problem((9,) * task.max_terms, ("+",) * (task.max_terms - 1))  # the longest trace possible
    assert q["max"] <= len(tokenizer(longest.response)["input_ids"]) and q["max"] >= 0.8 * len(
        tokenizer(longest.response)["input_ids"]
    )


def test_long_tailed_split_files_and_refusals(tmp_path):
    from megatron_klear.rewards.math import grade_math

    task = syn.LongTailTask()
    train = syn.sample_problems(500, seed=4, task=task)
    held = syn.sample_problems(100, seed=4, split="heldout", task=task)
    assert not any(syn.is_heldout(p, task) for p in train) and all(syn.is_heldout(p, task) for p in held)
    assert not {p.question for p in train} & {p.question for p in held}
    for p in held[:30]:
        assert grade_math(p.response, str(p.answer)).solved and p.answer == eval(p.expression)
    a = syn.write_sft_jsonl(str(tmp_path / "a.jsonl"), 50, seed=2, task=task, slip_rate=0.5)
    b = syn.write_sft_jsonl(str(tmp_path / "b.jsonl"), 50, seed=2, task=task, slip_rate=0.5)
    assert open(a).read() == open(b).read()
    rows = [
        json.loads(x)
        for x in open(syn.write_rl_prompts_jsonl(str(tmp_path / "h.jsonl"), 64, seed=1, split="heldout", task=task))
    ]
    assert len({r["id"] for r in rows}) == 64 and all(r["task"] == "math" for r in rows)
    with pytest.raises(ValueError, match="too large to enumerate"):
        syn.problems("train", task)
    with pytest.raises(ValueError, match="too large to enumerate"):
        syn.write_rl_prompts_jsonl(str(tmp_path / "x.jsonl"), None, task=task)
    with pytest.raises(ValueError, match="split"):
        syn.sample_problems(3, split="test", task=task)
    with pytest.raises(ValueError, match="min_terms"):
        syn.LongTailTask(min_terms=1)
    with pytest.raises(ValueError, match="tail"):
        syn.LongTailTask(tail=-0.5)
    # tail 0: every length equally likely (benchmarks/algos.py's long task)
    flat = syn.LongTailTask(min_terms=4, max_terms=7, tail=0.0).terms_probabilities()
    assert flat == pytest.approx({k: 0.25 for k in range(4, 8)})
