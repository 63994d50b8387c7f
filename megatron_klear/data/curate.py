"""The paper's SFT data policy: difficulty from pass rate, wrong answers kept only where hard.

Klear-Reasoner's finding (docs/recipe.md, "SFT"): with several teacher responses per
prompt, keep only the correct ones for EASY prompts, but keep the incorrect ones too for HARD
prompts (they help exploration). Difficulty comes from the pass rate.

Input: JSONL, one teacher response per line::

    {"prompt_id": "p1", "prompt": "...", "response": "...", "correct": true}
    {"prompt_id": "p2", "prompt": "...", "response": "...", "answer": "42"}         # math: graded
    {"prompt_id": "p3", "prompt": "...", "response": "...", "tests": {...}}         # code: graded

``correct`` (a boolean) is used as given. Otherwise ``answer`` (string or list of strings) is graded
with the project's math grader and ``tests`` with its code grader (every test run; correct means
all pass), through ``megatron_klear.rewards.GradingPool`` (see :class:`PoolGrader` and
:func:`curation_reward_config`). A response whose grading fails (grader error, not a wrong answer)
is dropped and counted, and does not enter the pass rate.

Policy:
1. ``pass_rate(prompt) = correct / graded`` over all of the prompt's graded responses (exact
   duplicates included: they are samples of the teacher like any other).
2. A prompt is hard when ``pass_rate < hard_below`` (default 0.5; the paper does not publish its
   threshold), else easy.
3. Easy prompt: keep correct responses only. Hard prompt: keep every response.
4. Exact duplicates (same prompt text and response text) among the kept: the first is kept.

Output: the kept input records, in input order, each with ``correct``, ``pass_rate`` and
``difficulty`` added; ready for ``tools/preprocess_sft.py`` (prompt/response format). The input is
read twice (grading and pass rates first, then selection) so that files larger than memory work;
only one verdict per line and one hash per kept response are held.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, TextIO

from megatron_klear.data.jsonl import (
    INVALID_FIELD,
    MISSING_FIELD,
    BadLineError,
    BadLinePolicy,
    ExampleError,
    HashingLineReader,
    check_input_files,
    parse_json_object,
)
from megatron_klear.utils import atomic

INCONSISTENT_PROMPT = "inconsistent_prompt"

# Why a response is not in the output.
DROP_INCORRECT_EASY = "incorrect_on_easy_prompt"
DROP_DUPLICATE = "duplicate"
DROP_GRADING_ERROR = "grading_error"


def verdict_from_grade(result) -> tuple:
    """``(correct, detail)`` from a rewards ``GradeResult``; ``correct`` is None on a grader error.

    Correct means every check passed: the math answer, or all of the code tests (curation runs
    every test, unlike the RL reward's sampled subset and partial credit).
    """
    if result.error:
        return None, result.error
    return (result.total > 0 and result.passed == result.total), result.detail


def curation_reward_config(**overrides):
    """The graders' settings for curation: every code test, and no penalty for a missing
    ``<think>`` (teacher templates often put it in the prompt); a missing ``</think>`` (a
    truncated response) still counts as incorrect."""
    from megatron_klear.rewards.config import RewardConfig

    return RewardConfig(**{"code_max_tests": None, "require_think_open": False, **overrides})


def grading_item(index: int, record: dict) -> dict:
    """A record as a ``megatron_klear.rewards`` grading item (math if it has an answer)."""
    if "answer" in record:
        return {"id": index, "task": "math", "response": record["response"], "answer": record["answer"]}
    return {"id": index, "task": "code", "response": record["response"], "tests": record["tests"]}


class PoolGrader:
    """The default grader: the project's ``rewards.GradingPool`` (worker processes with deadlines
    and memory limits; code runs sandboxed). Called with a batch of records, returns one
    ``(correct, detail)`` per record. The pool starts on the first batch."""

    def __init__(self, workers: Optional[int] = None, reward_config=None):
        self.workers = workers
        self.reward_config = reward_config
        self._pool = None

    def __call__(self, records: list) -> list:
        if self._pool is None:
            from megatron_klear.rewards.pool import GradingPool

            self._pool = GradingPool(self.reward_config or curation_reward_config(), workers=self.workers)
        results = self._pool.grade_many([grading_item(i, r) for i, r in enumerate(records)])
        return [verdict_from_grade(r) for r in results]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def validate_record(obj: dict) -> dict:
    """Check the fields curation needs; raise :class:`ExampleError` naming the field."""
    if "prompt_id" not in obj:
        raise ExampleError(MISSING_FIELD, "'prompt_id' is missing")
    pid = obj["prompt_id"]
    if isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise ExampleError(INVALID_FIELD, f"'prompt_id' must be a string or an integer, got {type(pid).__name__}")
    for key in ("prompt", "response"):
        if key not in obj:
            raise ExampleError(MISSING_FIELD, f"'{key}' is missing")
        if not isinstance(obj[key], str):
            raise ExampleError(INVALID_FIELD, f"'{key}' must be a string, got {type(obj[key]).__name__}")
        if not obj[key].strip():
            raise ExampleError(INVALID_FIELD, f"'{key}' is empty")
    if "correct" in obj:
        if not isinstance(obj["correct"], bool):
            raise ExampleError(INVALID_FIELD, f"'correct' must be true or false, got {obj['correct']!r:.40}")
    elif "answer" not in obj and "tests" not in obj:
        raise ExampleError(
            MISSING_FIELD, "need 'correct' (true/false), or 'answer' (math) or 'tests' (code) to grade with"
        )
    return obj


@dataclass
class CurateConfig:
    inputs: list
    output: str
    hard_below: float = 0.5
    on_bad_line: str = "fail"
    report: Optional[str] = None  # summary JSON path
    grading_workers: Optional[int] = None  # GradingPool processes (None: the reward config's)
    grading_batch: int = 256  # records handed to the grader at a time

    def validate(self) -> None:
        check_input_files(self.inputs)
        if not 0.0 <= self.hard_below <= 1.0:
            raise ValueError(f"hard_below must be in [0, 1], got {self.hard_below}")
        BadLinePolicy(self.on_bad_line)


@dataclass
class _PromptStats:
    prompt_sha: bytes
    where: str
    graded: int = 0
    correct: int = 0
    kept: Counter = field(default_factory=Counter)


def _records(paths, policy: BadLinePolicy, readers_out: list):
    """``(path, line, record)`` for every valid record; bad lines go to ``policy``."""
    for path in paths:
        reader = HashingLineReader(path)
        readers_out.append(reader)
        for lineno, text in reader:
            try:
                if isinstance(text, ExampleError):
                    raise text
                yield path, lineno, validate_record(parse_json_object(text))
            except ExampleError as e:
                policy.handle(BadLineError.from_example_error(path, lineno, e))


def _sha(*parts: str) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass") + b"\0")
    return h.digest()


def curate(
    cfg: CurateConfig,
    *,
    grader: Optional[Callable[[list], list]] = None,
    stream: Optional[TextIO] = None,
) -> dict:
    """Run the policy; write ``cfg.output`` (atomically) and return the summary.

    ``grader(records) -> [(correct, detail), ...]`` grades records that have no ``correct`` flag;
    by default a :class:`PoolGrader` over the project's graders.
    """
    stream = stream or sys.stderr
    cfg.validate()
    bad = BadLinePolicy(cfg.on_bad_line, stream=stream)

    # Pass 1: verdicts (given or graded) and per-prompt pass rates.
    own_grader = grader is None
    if own_grader:
        grader = PoolGrader(cfg.grading_workers)
    verdicts: list = []  # one per valid record, in order: True / False / None (error) / "bad"
    pids: list = []
    prompts: dict = {}
    pending: list = []  # (index, where, record) awaiting the grader
    graded_lines = 0
    grading_errors: list = []

    def flush():
        nonlocal graded_lines
        if not pending:
            return
        results = grader([rec for _, _, rec in pending])
        if len(results) != len(pending):
            raise RuntimeError(f"grader returned {len(results)} verdicts for {len(pending)} records")
        for (k, where, _), (ok, detail) in zip(pending, results):
            verdicts[k] = ok
            if ok is None and len(grading_errors) < 20:
                grading_errors.append(f"{where}: {detail}")
        graded_lines += len(pending)
        pending.clear()

    readers1: list = []
    try:
        for path, lineno, rec in _records(cfg.inputs, bad, readers1):
            pid = rec["prompt_id"]
            psha = _sha(rec["prompt"])
            st = prompts.get(pid)
            if st is None:
                st = prompts[pid] = _PromptStats(psha, f"{path}:{lineno}")
            elif st.prompt_sha != psha:
                bad.handle(
                    BadLineError(
                        path,
                        lineno,
                        INCONSISTENT_PROMPT,
                        f"prompt_id {pid!r} has a different prompt text than at {st.where}",
                    )
                )
                verdicts.append("bad")
                pids.append(pid)
                continue
            pids.append(pid)
            if "correct" in rec:
                verdicts.append(rec["correct"])
            else:
                verdicts.append(None)
                pending.append((len(verdicts) - 1, f"{path}:{lineno}", rec))
                if len(pending) >= cfg.grading_batch:
                    flush()
        flush()
    finally:
        if own_grader:
            grader.close()
    for pid, ok in zip(pids, verdicts):
        if ok is not None and ok != "bad":
            prompts[pid].graded += 1
            prompts[pid].correct += int(ok)
    shas = [r.sha256 for r in readers1]

    def rate(st):
        return st.correct / st.graded if st.graded else None

    # Pass 2: select, dedup, write.
    seen: set = set()
    dropped: Counter = Counter()
    kept_by: Counter = Counter()
    readers2: list = []
    quiet = BadLinePolicy("skip", echo_first=0)  # bad lines were reported in pass 1
    with atomic.atomic_path(cfg.output) as tmp:
        with open(tmp, "w", encoding="utf-8") as out:
            for k, (_path, _lineno, rec) in enumerate(_records(cfg.inputs, quiet, readers2)):
                ok = verdicts[k]
                if ok == "bad":
                    continue
                if ok is None:
                    dropped[DROP_GRADING_ERROR] += 1
                    continue
                st = prompts[rec["prompt_id"]]
                pr = rate(st)
                hard = pr < cfg.hard_below
                if not hard and not ok:
                    dropped[DROP_INCORRECT_EASY] += 1
                    continue
                key = _sha(rec["prompt"], rec["response"])
                if key in seen:
                    dropped[DROP_DUPLICATE] += 1
                    continue
                seen.add(key)
                difficulty = "hard" if hard else "easy"
                kept_by[(difficulty, "correct" if ok else "incorrect")] += 1
                st.kept[ok] += 1
                out.write(
                    json.dumps({**rec, "correct": ok, "pass_rate": pr, "difficulty": difficulty}, ensure_ascii=False)
                    + "\n"
                )
        if [r.sha256 for r in readers2] != shas:
            raise RuntimeError(f"an input file changed while curating {cfg.inputs}; nothing written")

    rated = [st for st in prompts.values() if st.graded]
    hard_prompts = [st for st in rated if rate(st) < cfg.hard_below]
    summary = {
        "inputs": [{"path": os.path.abspath(p), "sha256": s} for p, s in zip(cfg.inputs, shas)],
        "output": os.path.abspath(cfg.output),
        "hard_below": cfg.hard_below,
        "responses": {
            "read": len(verdicts) - verdicts.count("bad"),
            "graded_by_grader": graded_lines,
            "bad_lines": dict(sorted(bad.counts.items())),
            "kept": sum(kept_by.values()),
            "kept_by": {f"{d}/{c}": n for (d, c), n in sorted(kept_by.items())},
            "dropped": dict(sorted(dropped.items())),
        },
        "prompts": {
            "total": len(prompts),
            "easy": len(rated) - len(hard_prompts),
            "hard": len(hard_prompts),
            "hard_unsolved": sum(st.correct == 0 for st in hard_prompts),
            "no_graded_response": len(prompts) - len(rated),
            "with_kept_responses": sum(bool(st.kept) for st in prompts.values()),
        },
        "first_grading_errors": grading_errors,
    }
    if cfg.report:
        from megatron_klear.data.indexed import write_json_atomic

        write_json_atomic(cfg.report, summary)
    return summary


def format_summary(summary: dict) -> str:
    r, p = summary["responses"], summary["prompts"]
    lines = [
        f"prompts: {p['total']:,} ({p['easy']:,} easy, {p['hard']:,} hard with pass rate < "
        f"{summary['hard_below']:g}, of which {p['hard_unsolved']:,} never solved; "
        f"{p['no_graded_response']:,} without a gradable response)",
        f"responses: read {r['read']:,}, kept {r['kept']:,}",
    ]
    for k, n in r["kept_by"].items():
        lines.append(f"  kept {k}: {n:,}")
    for k, n in r["dropped"].items():
        lines.append(f"  dropped ({k}): {n:,}")
    for k, n in r["bad_lines"].items():
        lines.append(f"  bad lines skipped ({k}): {n:,}")
    for e in summary["first_grading_errors"]:
        lines.append(f"  grading error: {e}")
    lines.append(f"wrote {summary['output']}")
    return "\n".join(lines)
