"""Math benchmark and training rows as published: AIME/HMMT/MATH-style files, NeMo-Skills' prepared
JSONL, and the Klear authors' inference JSONL.

Columns read (case-insensitive; the first present wins, and the summary says which was used):
- the question: ``messages`` (a chat ending with a user turn: the authors' ``*.qs.jsonl``), else
  ``problem`` | ``question`` (wrapped in :data:`DEFAULT_TEMPLATE` unless another is given);
- the answer: ``expected_answer`` (NeMo-Skills) | ``answer`` | ``meta.answer`` | ``solution`` |
  ``meta.solution``; a solution holding ``\\boxed{...}`` gives its last boxed content;
- the id: ``id`` | ``unique_id`` | ``meta.unique_id`` | ``problem_idx`` | ``idx``, else the row number.
"""

from __future__ import annotations

from .rows import RowError

DEFAULT_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
QUESTION_COLUMNS = ("problem", "question")
ANSWER_COLUMNS = ("expected_answer", "answer", "meta.answer", "solution", "meta.solution")
ID_COLUMNS = ("id", "unique_id", "meta.unique_id", "problem_idx", "idx")


def _get(row: dict, dotted: str):
    cur = row
    for part in dotted.split("."):
        if not isinstance(cur, dict):
            return None
        lower = {k.lower(): k for k in cur if isinstance(k, str)}
        if part not in lower:
            return None
        cur = cur[lower[part]]
    return cur


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1].strip() if depth == 0 else None


def answer_of(row: dict) -> tuple[str, str]:
    """(answer, the column it came from)."""
    for col in ANSWER_COLUMNS:
        value = _get(row, col)
        if value is None:
            continue
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise RowError("bad_answer", col, f"expected a non-empty string, got {value!r}"[:200])
        if col.endswith("solution"):
            boxed = last_boxed(value)
            if boxed is None and "\\boxed" in value:
                raise RowError("bad_answer", col, "an unbalanced \\boxed{")
            value = boxed if boxed is not None else value
            if boxed is None and len(value) > 64:  # a worked solution with no boxed answer
                raise RowError("bad_answer", col, "a solution with no \\boxed{} answer")
        return value.strip(), col
    raise RowError("missing_field", "/".join(ANSWER_COLUMNS), "no answer column")


def messages_of(row: dict, template: str) -> tuple[list, str]:
    msgs = _get(row, "messages")
    if msgs is not None:
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(isinstance(m, dict) for m in msgs)
            or msgs[-1].get("role") != "user"
        ):
            raise RowError("bad_messages", "messages", "must be a list of chat messages ending with a user turn")
        return [{"role": m.get("role"), "content": m.get("content")} for m in msgs], "messages"
    for col in QUESTION_COLUMNS:
        q = _get(row, col)
        if q is not None:
            if not isinstance(q, str) or not q.strip():
                raise RowError("missing_field", col, "empty question")
            return [{"role": "user", "content": template.format(problem=q)}], col
    raise RowError("missing_field", "messages/problem/question", "no question column")


def convert(row: dict, row_no: int, *, template: str = DEFAULT_TEMPLATE, stats=None) -> dict:
    msgs, qcol = messages_of(row, template)
    answer, acol = answer_of(row)
    ident = next((v for v in (_get(row, c) for c in ID_COLUMNS) if v is not None), row_no)
    if stats is not None:
        stats["question_columns"][qcol] += 1
        stats["answer_columns"][acol] += 1
    return {"id": str(ident), "task": "math", "messages": msgs, "answer": answer}
