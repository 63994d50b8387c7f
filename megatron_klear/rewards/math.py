"""Math reward: math-verify on the answer section, with the traps of real RL data handled.

Built on math-verify, pinned to 0.9.0 (setup.py): its extraction and normalisation change between
releases, and a silent change there changes every reward of a run.

How a response is graded (the Klear recipe: docs/recipe.md, "Rewards"; docs/rewards.md, "Math"):
1. Think format first: no `</think>` -> `no_think_close` (-0.5), no `<think>` -> `no_think_open` (-2).
2. Only the text after the last `</think>` counts. A `\\boxed{}` answer there is taken first; with
   no box, math-verify's own extraction ("the answer is ...", last expression) is the fallback.
3. Several *different* boxed answers, or a hedged one ("7 or 8"), are not credited: a policy must
   not learn to list candidates.
4. The gold answer is wrapped as `\\boxed{...}` before parsing: math-verify extracts a bare gold
   such as `016` or `\\frac12` unreliably, and a gold that parses to nothing makes every answer
   "wrong" without any error.
5. Plain words ("Monday") would parse as a product of symbols (so "Dynamo" would equal
   "Monday"); they are compared as text instead. Multiple-choice letters are compared as letters.
6. Numbers with more than ~10^5 digits (`10^{10^{10}}`, `(10^9)!`) never reach sympy, which would
   try to expand them: they are credited only when structurally identical to the gold.
7. Numbers are compared without any absolute tolerance, at every order of magnitude (math-verify's
   own comparison rounds floats to 6 decimal places and chops differences below ~1e-15, so
   `0.0000001` equalled `0.0000002` and `1/20!` equalled `1/21!`; its `sympy_numeric_eq` is
   replaced, see `_numeric_eq`). A decimal is the exact rational it spells (`0.5` = 1/2, `5.0` = 5,
   `1.5 \\times 10^{-10}` = 3/(2*10^10)); two rational values are equal only when exactly equal
   (`0.333333` is not 1/3); exact irrational values (`\\frac{2}{\\sqrt 2}`, `\\sqrt 2`) are equal
   when they agree to 30 significant digits; a decimal against an irrational value is equal
   within the relative tolerance `RewardConfig.math_float_rel_tol` (1e-6: `1.414214` is
   `\\sqrt 2`, `1.41421` is not). A whole answer in e-notation (`1.5e-10`, `2.5E30`) is read as
   scientific notation, not as Euler's number.
8. Whether several boxed answers differ is decided by this same equivalence (`\\boxed{5}` ...
   `\\boxed{5.0}` is one answer).

This module does no time limiting itself: math-verify's own timeouts use `signal.alarm`, which
raises off the main thread (frameworks that call it from threads have scored every sample 0).
The worker pool (pool.py) runs `grade_math` in worker processes under a deadline and a memory
limit, and reports a timeout or a crash as an error with its reason.
"""

from __future__ import annotations

import logging
import math as _m
import re
from functools import lru_cache

from .config import RewardConfig
from .response import answer_section, think_format_score
from .result import GradeResult

__all__ = ["grade_math", "boxed_contents", "MATH_VERIFY_VERSION"]

MATH_VERIFY_VERSION = "0.9.0"

#: log10 of the largest magnitude we let sympy evaluate (about 10^5 digits).
HUGE_LOG10 = 1e5
#: Without a box, only the tail of the answer section is searched (regex cost on long tails).
_NO_BOX_TAIL_CHARS = 4000
#: Exact irrational values agree to this relative precision when equal (evaluated at 50 digits).
_EXACT_REL_TOL = 1e-30
#: More distinct boxed answers than this are "several different answers" without comparing them.
_MAX_BOXES_COMPARED = 8
_SCIENTIFIC = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))[eE]([+-]?\d+)")

_HEDGE = re.compile(r"(\bor\b|\\lor\b|\\vee\b|\beither\b)", re.IGNORECASE)
_WORDS = re.compile(r"[A-Za-z]{2,}(?:[ ,'-]+[A-Za-z]+)*")
_NOT_WORDS = {
    "pi",
    "inf",
    "infty",
    "oo",
    "sin",
    "cos",
    "tan",
    "cot",
    "sec",
    "csc",
    "log",
    "ln",
    "exp",
    "sqrt",
    "max",
    "min",
    "mod",
    "gcd",
    "lcm",
    "det",
    "arcsin",
    "arccos",
    "arctan",
    "sinh",
    "cosh",
    "tanh",
    "none",
    "nan",
    "i",
    "e",
}
_CHOICE = re.compile(r"\(?\s*([A-J])\s*\)?\.?")
_TEXT_WRAP = re.compile(r"^\\(?:text|textbf|mathrm|mathbf|textit)\{(.*)\}$", re.DOTALL)


@lru_cache(maxsize=1)
def _mv():
    """math-verify, imported and checked on first use (it pulls in sympy and antlr: ~0.5 s); once
    per process: its version comes from the package metadata, a file read that cost 1.4 ms, more
    than the rest of a grading, when every call made it."""
    import math_verify

    version = getattr(math_verify, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as _version

            version = _version("math-verify")
        except Exception:  # noqa: BLE001 -- metadata missing or unreadable: reported as unknown
            version = "unknown"
    if version != MATH_VERIFY_VERSION:
        logging.getLogger(__name__).warning(
            "math-verify %s is installed but rewards are validated against %s: parsing differs "
            "between releases; pin math-verify==%s",
            version,
            MATH_VERIFY_VERSION,
            MATH_VERIFY_VERSION,
        )
    # We disable math-verify's signal-based timeouts (the pool enforces deadlines); silence its
    # one-time warning about that.
    for name in ("math_verify", "math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    _install_numeric_eq()
    return math_verify


# --------------------------------------------------------------------------- number equality


class _Tolerance:
    """The relative tolerance of the grading in progress (set by grade_math; workers are
    single-threaded)."""

    rel = 1e-6


def _exact_decimals(expr):
    """``expr`` with every Float replaced by the exact decimal it was written as, and whether
    there was one. (latex2sympy keeps enough binary precision for the digits written, so the
    shortest decimal at that precision is the literal.)"""
    import sympy

    floats = expr.atoms(sympy.Float)
    if not floats:
        return expr, False
    return expr.xreplace({f: sympy.Rational(str(f)) for f in floats}), True


def _number(expr):
    """(value, had a decimal) for a constant scalar expression, else None."""
    import sympy

    if not isinstance(expr, sympy.Expr) or expr.free_symbols:
        return None
    if expr.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
        return None
    value, had_decimal = _exact_decimals(expr)
    try:
        value = value.doit()  # percent (UnevaluatedExpr), factorials
    except Exception:  # noqa: BLE001 - sympy raises anything
        pass
    return (value, had_decimal) if value.is_number else None


def numbers_equal(a, b, rel_tol: float | None = None) -> bool | None:
    """Equality of two constant sympy expressions (None when either is not a number): rationals
    exactly; irrational values at 50 digits, relative 1e-30 when both are exact, ``rel_tol``
    when a decimal approximation takes part. Never an absolute tolerance."""
    import sympy

    na, nb = _number(a), _number(b)
    if na is None or nb is None:
        return None
    (x, dx), (y, dy) = na, nb
    if x.is_Rational and y.is_Rational:
        return bool(x == y)
    tol = (_Tolerance.rel if rel_tol is None else rel_tol) if (dx or dy) else _EXACT_REL_TOL
    try:
        diff = abs(sympy.N(x - y, 50))
        scale = max(abs(sympy.N(x, 50)), abs(sympy.N(y, 50)))
        if not (diff.is_number and scale.is_number):
            return None
        if scale == 0:
            return True
        return bool(diff <= tol * scale)
    except Exception:  # noqa: BLE001 - evalf can fail on exotic expressions
        return None


def _numeric_eq(a, b, float_rounding=None, numeric_precision=None) -> bool:
    """Replaces math-verify's ``sympy_numeric_eq`` (same signature; its rounding arguments are
    ignored): :func:`numbers_equal` for numbers, a percentage also compared by its number
    (50% = 50, as math-verify does), matrices element by element. Anything with free symbols
    returns False here and is left to math-verify's symbolic comparison (simplify(a - b) == 0)."""
    from math_verify.grader import get_pct_val
    from sympy import MatrixBase

    if isinstance(a, MatrixBase) or isinstance(b, MatrixBase):
        try:
            a, b = a.doit(), b.doit()
        except Exception:  # noqa: BLE001
            return False
        if isinstance(a, MatrixBase) and isinstance(b, MatrixBase) and a.shape == b.shape:
            return all(_numeric_eq(x, y) for x, y in zip(a, b))
        return False
    left = [a] + [v for v in (get_pct_val(a),) if v is not None]
    right = [b] + [v for v in (get_pct_val(b),) if v is not None]
    return any(numbers_equal(x, y) is True for x in left for y in right)


def _install_numeric_eq() -> None:
    import math_verify.grader as grader

    if getattr(grader.sympy_numeric_eq, "__name__", "") != _numeric_eq.__name__:
        grader.sympy_numeric_eq = _numeric_eq


def _scientific(s: str) -> str:
    """``1.5e-10`` (the whole answer) -> ``1.5 \\times 10^{-10}``; anything else unchanged."""
    m = _SCIENTIFIC.fullmatch(s.strip())
    return f"{m.group(1)} \\times 10^{{{int(m.group(2))}}}" if m else s


@lru_cache(maxsize=1)
def _configs():
    mv = _mv()
    boxed_only = [mv.LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    anywhere = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    return boxed_only, anywhere


# --------------------------------------------------------------------------- boxed extraction


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at text[start] == '{', and the index after it."""
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None


def boxed_contents(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` / `\\fbox{...}` (and `\\boxed 5`) in order of appearance.

    An unclosed box (truncated output) is ignored.
    """
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\b", text):
        j = m.end()
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            got = _braced(text, j)
            if got is not None:
                out.append(got[0])
        elif m.group(0) == "\\boxed" and j > m.end():
            tok = re.match(r"[^\s$]+", text[j:])
            if tok:
                out.append(tok.group(0))
    return out


def _squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


# --------------------------------------------------------------------------- answer forms


def _strip_math_delims(s: str) -> str:
    s = s.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s


def _unwrap_text(s: str) -> str:
    s = s.strip()
    m = _TEXT_WRAP.match(s)
    return m.group(1).strip() if m else s


def _as_words(s: str) -> str | None:
    """Lower-cased text when `s` is a plain word answer ("Monday", "\\text{no solution}")."""
    t = _unwrap_text(s).strip().rstrip(".")
    if _WORDS.fullmatch(t) and t.lower() not in _NOT_WORDS:
        return re.sub(r"\s+", " ", t.lower())
    return None


def _as_choice(s: str) -> str | None:
    m = _CHOICE.fullmatch(_unwrap_text(s).strip())
    return m.group(1) if m else None


def _is_hedged(s: str) -> bool:
    return bool(_HEDGE.search(re.sub(r"\\text\{([^{}]*)\}", r" \1 ", s)))


# --------------------------------------------------------------------------- magnitude guard


def _log10_bound(expr) -> float | None:
    """Upper bound on log10|expr| for a numeric sympy expression; None when unknown.

    Computed on the unevaluated tree with floats, so `10^{10^{10}}` costs microseconds instead of
    the gigabytes sympy would allocate.
    """
    import sympy

    if isinstance(expr, sympy.Integer):
        v = abs(int(expr))
        return -_m.inf if v == 0 else _m.log10(v)
    if isinstance(expr, sympy.Rational):
        return _m.log10(abs(int(expr.p))) - _m.log10(abs(int(expr.q)))
    if isinstance(expr, sympy.Float):
        v = abs(float(expr))
        return -_m.inf if v == 0 else _m.log10(v) if _m.isfinite(v) else _m.inf
    if expr in (sympy.pi, sympy.E):
        return 0.5
    if isinstance(expr, sympy.Pow):
        lb, le = _log10_bound(expr.base), _log10_bound(expr.exp)
        if lb is None or le is None:
            return None
        if lb <= 0:
            return 0.0 if lb > -_m.inf else -_m.inf
        if le > 300:
            return _m.inf
        return (10.0**le) * lb
    if isinstance(expr, sympy.Mul):
        parts = [_log10_bound(a) for a in expr.args]
        return None if any(p is None for p in parts) else sum(parts)
    if isinstance(expr, sympy.Add):
        parts = [_log10_bound(a) for a in expr.args]
        return None if any(p is None for p in parts) else max(parts) + _m.log10(len(parts))
    if isinstance(expr, sympy.factorial):
        ln = _log10_bound(expr.args[0])
        if ln is None:
            return None
        if ln > 300:
            return _m.inf
        n = 10.0**ln
        return n * _m.log10(n + 1.0)
    return None


def _is_huge(expr) -> bool:
    """True when some power or factorial inside `expr` has more than ~1e5 digits."""
    import sympy

    if not isinstance(expr, sympy.Basic):
        return False
    for sub in sympy.preorder_traversal(expr):
        if isinstance(sub, (sympy.Pow, sympy.factorial)) and not sub.free_symbols:
            bound = _log10_bound(sub)
            if bound is not None and bound > HUGE_LOG10:
                return True
    return False


# --------------------------------------------------------------------------- grading


def _parse_gold(gold: str):
    g = _strip_math_delims(str(gold))
    boxes = boxed_contents(g)
    if boxes:
        g = boxes[-1]
    words = _as_words(g)
    if words is not None:
        return g, [f"text:{words}"], words
    return g, _parse_boxed(g), None


def _verdict(cfg: RewardConfig, ok: bool, why: str) -> GradeResult:
    return GradeResult(reward=cfg.correct if ok else cfg.wrong, passed=int(ok), total=1, detail=why)


def _parse_boxed(text: str) -> list:
    return list(_parse_cached(text, boxed=True))


@lru_cache(maxsize=16384)
def _parse_cached(text: str, boxed: bool) -> tuple:
    """math-verify's parse of an answer (``boxed``: ``text`` is a boxed answer's contents) or of a
    response's tail, memoised: parsing is a pure function of the text, and an RL step grades the
    same gold answers and many identical answers over and over (sympy's parse is most of a
    grading's time). Callers get a fresh list each time (verify takes lists)."""
    boxed_only, anywhere = _configs()
    if boxed:
        return tuple(
            _mv().parse("\\boxed{" + _scientific(text) + "}", extraction_config=boxed_only, parsing_timeout=None)
        )
    return tuple(_mv().parse(text, extraction_config=anywhere, parsing_timeout=None))


def _match(answer_text: str, pred, g_text: str, g_parsed, g_words) -> str | None:
    """The grading equivalence: why ``answer_text`` (``pred``: its parse, or None to parse it as
    a boxed answer) equals the gold (from :func:`_parse_gold`), or None when it does not."""
    # Cheap and exact first: identical strings need no sympy.
    if _squash(_unwrap_text(answer_text)) == _squash(_unwrap_text(g_text)):
        return "correct (identical)"
    if g_words is not None:
        return "correct (text)" if _as_words(answer_text) == g_words else None
    if not any(not isinstance(x, str) for x in g_parsed):
        return None  # a gold math-verify does not understand: identical text only
    g_choice = _as_choice(g_text)
    if g_choice is not None and _as_choice(answer_text) is not None:
        return "correct (choice)" if _as_choice(answer_text) == g_choice else None
    if _as_words(answer_text) is not None:
        return None  # a word answer against a mathematical gold
    if pred is None:
        pred = _parse_boxed(answer_text)
    if not pred:
        return None
    if any(_is_huge(x) for x in g_parsed) or any(_is_huge(x) for x in pred):
        same = any(isinstance(a, type(b)) and a == b for a in g_parsed for b in pred if not isinstance(a, str))
        return "correct (structurally identical huge number)" if same else None
    return "correct" if _mv().verify(g_parsed, pred, timeout_seconds=None) else None


def _one_answer(boxes: list[str]) -> bool:
    """Do all boxed answers say the same thing as the last one (by the grading equivalence)?"""
    last = boxes[-1]
    others = list(dict.fromkeys(b for b in boxes if _squash(b) != _squash(last)))
    if not others:
        return True
    if len(others) >= _MAX_BOXES_COMPARED:
        return False
    l_text, l_parsed, l_words = _parse_gold(last)
    return all(_match(b, None, l_text, l_parsed, l_words) is not None for b in others)


def grade_math(response: str, gold: str | list[str], cfg: RewardConfig | None = None) -> GradeResult:
    """Grade one math response against its gold answer(s) (any one may match).

    Raises nothing for bad model output (that is a verdict); a gold answer that cannot be parsed
    is reported as an error (a data problem, not the policy's fault).
    """
    cfg = cfg or RewardConfig()
    if not isinstance(response, str):
        return GradeResult.failure(cfg.wrong, f"response must be a string, got {type(response).__name__}")
    golds = gold if isinstance(gold, list) else [gold]
    if not golds or not all(isinstance(g, (str, int, float)) and not isinstance(g, bool) for g in golds):
        return GradeResult.failure(cfg.wrong, f"answer must be a string or a list of strings, got {gold!r:.80}")
    golds = [str(g) for g in golds]

    fmt = think_format_score(response, cfg)
    if fmt is not None:
        return GradeResult(reward=fmt[0], passed=0, total=1, detail=fmt[1])
    section = answer_section(response) or ""
    _mv()  # imported and set up (the numeric equality) before any parse or verify
    _Tolerance.rel = cfg.math_float_rel_tol

    boxes = boxed_contents(section)
    if boxes and not _one_answer(boxes):
        distinct = len(dict.fromkeys(_squash(b) for b in boxes))
        return _verdict(cfg, False, f"several different boxed answers ({distinct})")
    found = None
    if boxes:
        answer_text = boxes[-1]
        hedge_text = answer_text
    else:
        lines = [ln for ln in section.strip().splitlines() if ln.strip()]
        hedge_text = lines[-1] if lines else ""
        tail = section[-_NO_BOX_TAIL_CHARS:]
        found = list(_parse_cached(tail, boxed=False))
        if not found:
            return _verdict(cfg, False, "no answer found after </think>")
        answer_text = found[-1] if isinstance(found[-1], str) else str(found[0])

    last_error = None
    for g in golds:
        g_text, g_parsed, g_words = _parse_gold(g)
        if g_words is None and not any(not isinstance(x, str) for x in g_parsed):
            # Only math-verify's string fallback came back: the gold is not mathematics it
            # understands. Identical text still counts; anything else is a data error.
            if _match(answer_text, found, g_text, g_parsed, g_words):
                return _verdict(cfg, True, "correct (identical)")
            last_error = f"gold answer {g!r:.80} could not be parsed by math-verify"
            continue
        if _is_hedged(hedge_text) and not _is_hedged(g_text):
            return _verdict(cfg, False, f"hedged answer {hedge_text!r:.80}")
        why = _match(answer_text, found, g_text, g_parsed, g_words)
        if why is not None:
            return _verdict(cfg, True, why)
    if last_error is not None and len(golds) == 1:
        return GradeResult.failure(cfg.wrong, last_error)
    return _verdict(cfg, False, f"wrong answer {answer_text!r:.80}")
