"""A synthetic reasoning task for tiny CPU runs, the demo, the benchmarks and tests (nothing is
downloaded): **digit chains**, short arithmetic chains with a ``<think>`` trace and a boxed answer,
graded by the real math grader.

The task
--------
A problem is a chain of ``terms`` digits joined by ``+`` (or ``+`` / ``-``: :class:`ChainTask`; the
default is three digits 0-9 added, 1,000 problems)::

    user:      What is 7+5+8?
    assistant: <think>7+5=12
               12+8=20</think>
               \\boxed{20}

The trace works left to right, one partial result per line, and the answer after ``</think>`` is
the last partial result in ``\\boxed{}`` (0..27 by default: a small answer space of one- or
two-digit results). Everything is in the JSONL formats the real pipeline reads: SFT chats
(``{"messages": [...]}``) and RL / evaluation prompts (``{"id", "task": "math", "prompt",
"answer"}``), graded by ``megatron_klear.rewards`` (math-verify on the answer after the last
``</think>``; the Klear format scores for a missing ``</think>`` / ``<think>``).

Why this shape: a tiny Qwen3 (~0.1 M parameters besides the embeddings, byte-level tokens; no
spaces in the notation, so ``12`` is always ``1`` ``2``) learns the format within a few dozen SFT
steps and the ~300 single-step facts (``a+b`` for a partial result ``a`` and a digit ``b``) over a
few hundred; each problem chains two facts through the trace, so an early error propagates to the
answer, as in real reasoning.

The imperfect teacher
---------------------
``write_sft_jsonl(..., slip_rate=p)`` writes SFT data the way distillation data comes: a fraction
``p`` of the teacher's responses has one slip (at a random step, a partial result off by 1 or 2;
the chain continues from it, so the boxed answer is wrong). Klear-Reasoner's SFT keeps such
incorrect responses for hard prompts. A model trained on it knows the arithmetic (its greedy answer
is mostly right) but at temperature 1 it samples the teacher's slips: the regime where RL with a
verifiable reward has something to learn, as the demo shows. One slip at most per response: two
could cancel out, and an outcome reward would then credit wrong steps.

Train / held-out split
----------------------
A problem is *held out* when a hash of its question text (sha256, independent of any seed and of
Python's hash randomisation) falls in the held-out bucket (``heldout_every``: 1 problem in 8, 126
of the default 1,000). :func:`problems` enumerates either side, and SFT chats and RL prompts are
drawn from the training side only, so no problem is both trained on and evaluated, whatever the
seeds. The held-out problems use the same single-step facts: the evaluation measures whether a
model composes what it learnt on new chains, not whether it memorised answers.

The long-tailed variant
-----------------------
:class:`LongTailTask`: the same chains, with the number of terms drawn from a heavy-tailed law
(``P(terms = k)`` proportional to ``(k - min_terms + 1) ** -tail`` for ``min_terms <= k <=
max_terms``), so the teacher's responses are long-tailed the way long-CoT responses are: most
short, a few many times longer, the longest capped (here by ``max_terms``, in RL by the response
budget). The defaults (2-20 terms, tail 1.3) give, in tiny-tokenizer tokens, a median of 27, a
p90 of ~100 and a longest of ~170 (max / median ~6.3; benchmarks/async_rl.py). Its space is too
large to enumerate: :func:`sample_problems` draws problems i.i.d. (the split is the same hash of
the question text) and :func:`problems` refuses it.

Determinism: every writer draws from ``random.Random`` seeded by its ``seed`` only, so a seed gives
byte-identical files on any machine; different seeds give different samples and orders.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from dataclasses import dataclass

from megatron_klear.utils import atomic

SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class ChainTask:
    """The problem space: chains of ``terms`` digits in 0..``max_digit`` joined by ``ops``."""

    terms: int = 3
    max_digit: int = 9
    ops: str = "+"
    heldout_every: int = 8  # 1 problem in heldout_every is held out (by a hash of its question)

    def __post_init__(self):
        if self.terms < 2 or not 1 <= self.max_digit <= 9 or not self.ops or set(self.ops) - set("+-"):
            raise ValueError(f"ChainTask: need terms >= 2, 1 <= max_digit <= 9, ops from '+-' (got {self})")
        if self.heldout_every < 2:
            raise ValueError("ChainTask.heldout_every must be >= 2")


DEFAULT_TASK = ChainTask()


@dataclass(frozen=True)
class LongTailTask:
    """Digit chains with a long-tailed number of terms: ``P(terms = k)`` proportional to
    ``(k - min_terms + 1) ** -tail`` for ``min_terms <= k <= max_terms`` (the cap is the budget
    that caps a long-CoT batch); digits in 0..``max_digit`` joined by ``ops``."""

    min_terms: int = 2
    max_terms: int = 20
    tail: float = 1.3
    max_digit: int = 9
    ops: str = "+"
    heldout_every: int = 8

    def __post_init__(self):
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(f"LongTailTask: need 2 <= min_terms <= max_terms (got {self})")
        if not self.tail >= 0:
            raise ValueError(f"LongTailTask.tail must be >= 0 (0: every length equally likely), got {self.tail}")
        if not 1 <= self.max_digit <= 9 or not self.ops or set(self.ops) - set("+-"):
            raise ValueError(f"LongTailTask: need 1 <= max_digit <= 9, ops from '+-' (got {self})")
        if self.heldout_every < 2:
            raise ValueError("LongTailTask.heldout_every must be >= 2")

    def terms_probabilities(self) -> dict:
        """``{terms: probability}`` of the law above (sums to 1)."""
        weights = {k: (k - self.min_terms + 1) ** -self.tail for k in range(self.min_terms, self.max_terms + 1)}
        total = sum(weights.values())
        return {k: w / total for k, w in weights.items()}

    def draw(self, rng: random.Random) -> "Problem":
        """One problem: its number of terms from the law, then its digits and operators uniformly."""
        probs = self.terms_probabilities()
        terms = rng.choices(list(probs), weights=list(probs.values()))[0]
        digits = tuple(rng.randint(0, self.max_digit) for _ in range(terms))
        return Problem(digits, tuple(rng.choice(self.ops) for _ in range(terms - 1)))


@dataclass(frozen=True)
class Problem:
    digits: tuple
    ops: tuple  # len(digits) - 1 operators

    @property
    def question(self) -> str:
        return f"What is {self.expression}?"

    @property
    def expression(self) -> str:
        return str(self.digits[0]) + "".join(f"{o}{d}" for o, d in zip(self.ops, self.digits[1:]))

    def steps(self) -> list:
        """The trace: ``(left, op, digit, result)`` per step, left to right."""
        out, value = [], self.digits[0]
        for o, d in zip(self.ops, self.digits[1:]):
            new = value + d if o == "+" else value - d
            out.append((value, o, d, new))
            value = new
        return out

    @property
    def answer(self) -> int:
        return self.steps()[-1][3]

    @property
    def response(self) -> str:
        return self.teacher_response()

    def teacher_response(self, rng: random.Random | None = None, slip_rate: float = 0.0) -> str:
        """The worked response. With ``slip_rate`` > 0, an imperfect teacher: with that probability
        the response has one slip -- at one step, chosen at random, the partial result is off by
        1 or 2 -- and the chain continues from the slipped value, so the boxed answer is wrong
        too. One slip at most: two slips could cancel out, and an outcome reward would then credit
        wrong steps."""
        slip_at = rng.randrange(self.terms - 1) if slip_rate and rng is not None and rng.random() < slip_rate else -1
        lines, value = [], self.digits[0]
        for i, (o, d) in enumerate(zip(self.ops, self.digits[1:])):
            new = value + d if o == "+" else value - d
            if i == slip_at:
                new += rng.choice((-2, -1, 1, 2))
            lines.append(f"{value}{o}{d}={new}")
            value = new
        return "<think>" + "\n".join(lines) + f"</think>\n\\boxed{{{value}}}"

    @property
    def terms(self) -> int:
        return len(self.digits)

    @property
    def id(self) -> str:
        return "chain-" + self.expression.replace("+", "p").replace("-", "m")


def is_heldout(problem: Problem, task: ChainTask = DEFAULT_TASK) -> bool:
    """Whether ``problem`` belongs to the held-out side: a stable hash of its question text."""
    return is_heldout_question(problem.question, task)


def is_heldout_question(question: str, task: ChainTask = DEFAULT_TASK) -> bool:
    """:func:`is_heldout` from the question text alone (as the data files hold it)."""
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") % task.heldout_every == 0


def problems(split: str, task: ChainTask = DEFAULT_TASK) -> list:
    """Every problem of one side of the split, in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(task, LongTailTask):
        raise ValueError(
            "problems(): a LongTailTask's space is too large to enumerate; draw problems with "
            "sample_problems(n, ...) (and give write_rl_prompts_jsonl an n)"
        )
    out = []
    for digits in itertools.product(range(task.max_digit + 1), repeat=task.terms):
        for ops in itertools.product(task.ops, repeat=task.terms - 1):
            p = Problem(digits, ops)
            if is_heldout(p, task) == (split == "heldout"):
                out.append(p)
    return out


def sample_problems(n: int, seed: int = 0, split: str = "train", task: ChainTask = DEFAULT_TASK) -> list:
    """``n`` problems of ``split`` drawn with ``random.Random(seed)``: without replacement while
    the side lasts, then another shuffled pass (so n may exceed the side's size). A
    :class:`LongTailTask` draws them i.i.d. from its law (rejecting those of the other side)."""
    if isinstance(task, LongTailTask):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        rng, out = random.Random(f"long-tail-{seed}"), []
        while len(out) < n:
            p = task.draw(rng)
            if is_heldout(p, task) == (split == "heldout"):
                out.append(p)
        return out
    pool = problems(split, task)
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        order = list(pool)
        rng.shuffle(order)
        out += order[: n - len(out)]
    return out


def length_percentiles(lengths) -> dict:
    """``{"p50", "p90", "max"}`` of ``lengths`` (nearest rank: the smallest value with at least that
    share of the values at or below it)."""
    values = sorted(lengths)
    if not values:
        raise ValueError("length_percentiles: no lengths")
    rank = lambda q: values[max(0, -(-len(values) * q // 100) - 1)]  # noqa: E731 - ceil(n q / 100) - 1
    return {"p50": rank(50), "p90": rank(90), "max": values[-1]}


def example(problem: Problem) -> dict:
    """``{"question", "answer", "response"}`` of one problem."""
    return {"question": problem.question, "answer": str(problem.answer), "response": problem.response}


def _write_lines(path: str, rows) -> str:
    with atomic.atomic_file(path) as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_sft_jsonl(
    path: str, n: int, seed: int = 0, chat_format: bool = True, task: ChainTask = DEFAULT_TASK, slip_rate: float = 0.0
) -> str:
    """``n`` SFT examples of training problems, as ``{"messages": [...]}`` lines (or
    ``{"prompt", "response"}``). ``slip_rate``: the fraction of responses with one slip (see
    :meth:`Problem.teacher_response`; 0: every response is correct)."""
    if not 0 <= slip_rate < 1:
        raise ValueError(f"slip_rate must be in [0, 1), got {slip_rate}")
    rows = []
    slips = random.Random(f"slips-{seed}")
    for p in sample_problems(n, seed, "train", task):
        question, response = p.question, p.teacher_response(slips, slip_rate)
        if chat_format:
            rows.append(
                {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": response}]}
            )
        else:
            rows.append({"prompt": question, "response": response})
    return _write_lines(path, rows)


def write_rl_prompts_jsonl(
    path: str, n: int | None, seed: int = 0, split: str = "train", task: ChainTask = DEFAULT_TASK
) -> str:
    """Math prompts ``{"id", "task": "math", "prompt", "answer"}`` of ``split``: RL prompts
    (``"train"``) or evaluation prompts (``"heldout"``). ``n=None``: every problem of the side, in
    a seeded order."""
    chosen = sample_problems(len(problems(split, task)) if n is None else n, seed, split, task)
    rows = [
        {
            "id": f"{p.id}-{i}" if n is not None and n > len(set(chosen)) else p.id,
            "task": "math",
            "prompt": p.question,
            "answer": str(p.answer),
        }
        for i, p in enumerate(chosen)
    ]
    return _write_lines(path, rows)
