"""The verl / Klear RL layout: ``data_source``, ``prompt`` (chat messages), ``ability``,
``reward_model.ground_truth``, ``extra_info``; parquet or JSONL.

``data_source`` picks the verifier as the authors' ``verl/utils/reward_score/__init__.py`` does
(``dapo_wi_rllm_compute_score``, with the math sources of ``_default_compute_score``):

- math (``math_*``, ``MATH##*``, ``aime*``, ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,
  ``openai/gsm8k``, ``numina_*``): the ground truth is the answer;
- ``coder1*`` (Code-R1, ``code_r1_compute.py``): ground truth JSON with stdin ``inputs``/``outputs``,
  or ``functional`` check code (a string, or a list of them), or ``pytest`` code;
- rLLM's sources (``rllm_code_reward.py``; a ``_longcot`` suffix is dropped, as theirs does), the
  ground truth a JSON string: ``taco``/``apps``/``code_contests`` ``{"inputs", "outputs", "fn_name"?}``;
  ``codeforces`` ``[{"input", "output"}]``; ``livecodebench`` ``[{"input", "output", "testtype",
  "metadata": {"func_name"}}]``; ``primeintellect`` ``[{"input", "output", "fn_name"?}]`` (or a
  Python literal of it); ``leetcode`` ``{"functional": check code}``; ``kodcode`` a pytest file;
  ``humanevalplus`` HumanEval+ check code.

Check code becomes (call, expected) pairs (:mod:`.functional`). Any other ``data_source`` is an
error naming it (``ifeval`` included: it has no tests this project runs).
"""

from __future__ import annotations

import ast
import json

from . import functional
from .rows import RowError

MATH_EXACT = {"lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "openai/gsm8k", "math_dapo", "math_stem"}
MATH_PREFIXES = ("math_", "MATH##", "aime", "numina_")
RLLM_SOURCES = (
    "apps",
    "taco",
    "code_contests",
    "codeforces",
    "livecodebench",
    "kodcode",
    "leetcode",
    "primeintellect",
    "humanevalplus",
)


def family(data_source) -> str:
    """``math``, ``coder1`` or the rLLM source name; ValueError naming an unknown one."""
    if not isinstance(data_source, str) or not data_source:
        raise ValueError(f"data_source {data_source!r}: expected a non-empty string")
    if data_source in MATH_EXACT or data_source.startswith(MATH_PREFIXES):
        return "math"
    if data_source == "coder1" or "coder1_longcot" in data_source:
        return "coder1"
    base = data_source[: -len("_longcot")] if data_source.endswith("_longcot") else data_source
    if base in RLLM_SOURCES:
        return base
    raise ValueError(
        f"data_source {data_source!r} has no verifier here (the authors' dispatch knows math_*, "
        f"MATH##*, aime*, coder1*, and rLLM's {', '.join(RLLM_SOURCES)}; see docs/data.md)"
    )


def _json(gt, col):
    if isinstance(gt, str):
        try:
            return json.loads(gt)
        except ValueError:
            raise RowError("bad_tests", col, "not JSON") from None
    return gt


def _check_code(code, col) -> dict:
    try:
        return functional.convert(code)
    except functional.NotConvertible as e:
        raise RowError("unsupported_tests", col, f"check code not read as (call, expected) pairs: {e}") from None


def _pairs(tests: list, col: str, fn_key: str | None = None) -> dict:
    if not isinstance(tests, list) or not tests or not all(isinstance(t, dict) for t in tests):
        raise RowError("bad_tests", col, "expected a non-empty list of {input, output} objects")
    for i, t in enumerate(tests):
        if "input" not in t or "output" not in t:
            raise RowError("bad_tests", f"{col}[{i}]", "needs input and output")
    out = {"inputs": [t["input"] for t in tests], "outputs": [t["output"] for t in tests]}
    if fn_key == "metadata":
        types = {t.get("testtype", "stdin") for t in tests}
        if len(types) > 1:
            raise RowError("bad_tests", col, "stdin and functional tests mixed")
        if types == {"functional"}:
            name = (tests[0].get("metadata") or {}).get("func_name")
            if not name:
                raise RowError("missing_field", f"{col}[0].metadata.func_name", "functional tests need it")
            out["fn_name"] = name
    elif fn_key and tests[0].get(fn_key):
        out["fn_name"] = tests[0][fn_key]
    return out


def code_tests(fam: str, gt, col: str = "reward_model.ground_truth") -> dict:
    """The project's tests for one code row's ground truth."""
    if fam == "coder1":
        gt = _json(gt, col)
        if not isinstance(gt, dict):
            raise RowError("bad_tests", col, "expected a JSON object")
        if "functional" in gt:
            f = gt["functional"]
            codes = f if isinstance(f, list) else [f]
            merged = {"kind": "expr", "inputs": [], "outputs": []}
            for i, code in enumerate(codes):
                t = _check_code(code, f"{col}.functional" + (f"[{i}]" if isinstance(f, list) else ""))
                if t.get("kind") != "expr":  # HumanEval+-style lists inside a Code-R1 row: keep them whole
                    if len(codes) > 1:
                        raise RowError("unsupported_tests", f"{col}.functional", "mixed check styles")
                    return t
                merged["inputs"] += t["inputs"]
                merged["outputs"] += t["outputs"]
            return merged
        if "pytest" in gt:
            return _check_code(gt["pytest"], f"{col}.pytest")
        if "inputs" in gt and "outputs" in gt:
            return {k: gt[k] for k in ("inputs", "outputs", "fn_name") if k in gt}
        raise RowError("unsupported_tests", col, f"keys {sorted(gt)}: none of functional, pytest, inputs/outputs")
    if fam in ("taco", "apps", "code_contests"):
        gt = _json(gt, col)
        if not isinstance(gt, dict) or "inputs" not in gt or "outputs" not in gt:
            raise RowError("bad_tests", col, "expected {inputs, outputs}")
        return {k: gt[k] for k in ("inputs", "outputs", "fn_name") if k in gt and gt[k] is not None}
    if fam == "codeforces":
        return _pairs(_json(gt, col), col)
    if fam == "livecodebench":
        return _pairs(_json(gt, col), col, fn_key="metadata")
    if fam == "primeintellect":
        gt = _json(gt, col)
        if isinstance(gt, str):
            try:
                gt = ast.literal_eval(gt)
            except (ValueError, SyntaxError):
                raise RowError("bad_tests", col, "a string that is not a Python literal") from None
        return _pairs(gt, col, fn_key="fn_name")
    if fam == "leetcode":
        gt = _json(gt, col)
        if not isinstance(gt, dict) or "functional" not in gt:
            raise RowError("bad_tests", col, "expected {functional: check code}")
        return _check_code(gt["functional"], f"{col}.functional")
    if fam in ("kodcode", "humanevalplus"):
        return _check_code(_json(gt, col), col)
    raise AssertionError(fam)


def convert(row: dict, row_no: int, *, stats=None) -> dict:
    try:
        fam = family(row.get("data_source"))
    except ValueError as e:
        raise RowError("unknown_data_source", "data_source", str(e)) from None
    msgs = row.get("prompt")
    if (
        not isinstance(msgs, list)
        or not msgs
        or not all(isinstance(m, dict) for m in msgs)
        or msgs[-1].get("role") != "user"
    ):
        raise RowError("bad_messages", "prompt", "must be a list of chat messages ending with a user turn")
    rm = row.get("reward_model")
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise RowError("missing_field", "reward_model.ground_truth", "missing")
    gt = rm["ground_truth"]
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    ident = extra.get("index")
    out = {
        "id": f"{row['data_source']}-{ident if ident is not None else row_no}",
        "messages": [{"role": m.get("role"), "content": m.get("content")} for m in msgs],
        "data_source": row["data_source"],
    }
    if fam == "math":
        if isinstance(gt, list) and len(gt) == 1:
            gt = gt[0]
        if isinstance(gt, (int, float)) and not isinstance(gt, bool):
            gt = str(gt)
        if not isinstance(gt, str) or not gt.strip():
            raise RowError("bad_answer", "reward_model.ground_truth", f"expected an answer string, got {gt!r}"[:200])
        out.update(task="math", answer=gt.strip())
    else:
        out.update(task="code", tests=code_tests(fam, gt))
    if stats is not None:
        stats["data_sources"][row["data_source"]] += 1
    return out
