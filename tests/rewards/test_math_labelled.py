"""A hand-labelled set of (response, gold, verdict) cases for the math grader.

Each verdict is what a careful human grader would say, not what the library happens to return;
the set covers the traps named in the issue: leading zeros, several boxed / hedged answers, comma
lists vs ordered tuples, percent, degrees, units, intervals, text answers, huge exponents.
"""

import time

import pytest

from megatron_klear.rewards import RewardConfig
from megatron_klear.rewards.math import boxed_contents, grade_math

OK, WRONG = "correct", "wrong"
T = "<think>Let me work this out carefully.</think>\n"

# (id, response (after the think block unless it starts with '!'), gold, verdict)
CASES = [
    # leading zeros (AIME-style answers)
    ("zeros-016", r"The answer is $\boxed{016}$.", "16", OK),
    ("zeros-gold-016", r"$\boxed{16}$", "016", OK),
    ("zeros-007", r"\boxed{007}", "7", OK),
    ("zeros-0100", r"\boxed{0100}", "100", OK),
    ("zeros-not-decimal", r"\boxed{0.16}", "16", WRONG),
    # several boxed answers, hedges
    ("multi-box-or", r"It is \boxed{7} or \boxed{8}.", "7", WRONG),
    ("multi-box-changed-mind", r"First \boxed{8}, no wait: \boxed{7}", "7", WRONG),
    ("multi-box-same-twice", r"\boxed{7}. Double-checking: \boxed{7}", "7", OK),
    # whether boxed answers differ: the grading equivalence, not their spelling
    ("multi-box-5-and-5.0", r"\boxed{5} ... so the answer is \boxed{5.0}", "5", OK),
    ("multi-box-frac-and-decimal", r"\boxed{\frac{1}{2}}, i.e. \boxed{0.5}", r"\frac12", OK),
    ("multi-box-power-and-decimal", r"\boxed{10^{-7}} = \boxed{0.0000001}", "10^{-7}", OK),
    ("multi-box-text-case", r"\boxed{\text{Monday}}, so \boxed{monday}", "Monday", OK),
    ("multi-box-leading-zero", r"\boxed{016} (that is, \boxed{16})", "16", OK),
    ("multi-box-close-not-equal", r"\boxed{5} or maybe \boxed{5.0000001}", "5", WRONG),
    ("multi-box-tiny-not-equal", r"\boxed{0.0000002} and \boxed{0.0000001}", "0.0000001", WRONG),
    ("multi-box-three-one-differs", r"\boxed{5}, \boxed{5.0}, \boxed{6}", "6", WRONG),
    ("hedge-text-or", r"\boxed{7 \text{ or } 8}", "7", WRONG),
    ("hedge-bare-or", r"\boxed{7 or 8}", "7", WRONG),
    ("hedge-lor", r"\boxed{7 \lor 8}", "7", WRONG),
    ("hedge-list", r"\boxed{7, 8}", "7", WRONG),
    ("hedge-no-box", "The answer is either 3 or 4.", "3", WRONG),
    # comma lists vs ordered tuples
    ("list-reordered", r"\boxed{3, 2, 1}", "1, 2, 3", OK),
    ("list-missing", r"\boxed{1, 2}", "1, 2, 3", WRONG),
    ("set-reordered", r"\boxed{\{2, 1\}}", r"\{1, 2\}", OK),
    ("tuple-same", r"\boxed{(1,2)}", "(1, 2)", OK),
    ("tuple-swapped", r"\boxed{(2, 1)}", "(1, 2)", WRONG),
    ("tuple-negative", r"\boxed{(3,-1)}", "(3, -1)", OK),
    ("tuple-negative-swapped", r"\boxed{(-1, 3)}", "(3, -1)", WRONG),
    ("triple-swapped", r"\boxed{(1, 3, 2)}", "(1, 2, 3)", WRONG),
    ("pair-written-as-list-swapped", r"\boxed{2, 1}", "(1, 2)", WRONG),
    # percent
    ("pct-same", r"\boxed{50\%}", r"50\%", OK),
    ("pct-dropped", r"\boxed{50}", r"50\%", OK),
    ("pct-added", r"\boxed{50\%}", "50", OK),
    ("pct-as-fraction", r"\boxed{0.5}", r"50\%", OK),
    ("pct-wrong", r"\boxed{25\%}", r"50\%", WRONG),
    # degrees
    ("deg-dropped", r"\boxed{30}", r"30^\circ", OK),
    ("deg-added", r"\boxed{30^{\circ}}", "30", OK),
    ("deg-wrong", r"\boxed{30^\circ}", r"45^\circ", WRONG),
    # units
    ("unit-dropped", r"\boxed{5}", r"5 \text{ cm}", OK),
    ("unit-added", r"\boxed{5\text{ cm}}", "5", OK),
    ("unit-mathrm-area", r"\boxed{12 \mathrm{~m}^2}", "12", OK),
    ("unit-wrong-value", r"\boxed{6 \text{ cm}}", "5", WRONG),
    ("unit-dollars", r"\boxed{\$18.90}", "18.90", OK),
    # intervals
    ("interval-same", r"\boxed{(1,2]}", "(1, 2]", OK),
    ("interval-closed-vs-half", r"\boxed{[1,2]}", "(1, 2]", WRONG),
    ("interval-infinity", r"\boxed{[0,\infty)}", r"[0, \infty)", OK),
    ("interval-wrong-end", r"\boxed{(-\infty, 3]}", r"(-\infty, 3)", WRONG),
    ("interval-union", r"\boxed{(-\infty,-1) \cup (1,\infty)}", r"(-\infty,-1)\cup(1,\infty)", OK),
    # text answers
    ("text-wrapped", r"\boxed{\text{Monday}}", "Monday", OK),
    ("text-anagram", r"\boxed{Dynamo}", "Monday", WRONG),
    ("text-case", r"\boxed{monday}", r"\text{Monday}", OK),
    ("text-other-day", r"\boxed{\text{Tuesday}}", "Monday", WRONG),
    ("text-phrase", r"\boxed{\text{No solution}}", "no solution", OK),
    ("text-yes", r"\boxed{\text{yes}}", "Yes", OK),
    ("text-no-anagram", r"\boxed{On}", "No", WRONG),
    ("choice-same", r"\boxed{B}", "B", OK),
    ("choice-parens", r"\boxed{(B)}", "B", OK),
    ("choice-text", r"\boxed{\text{(B)}}", "B", OK),
    ("choice-wrong", r"\boxed{D}", "(C)", WRONG),
    # very large / nested exponents
    ("big-2^100-expanded", r"\boxed{1267650600228229401496703205376}", "2^{100}", OK),
    ("big-tower-vs-small", r"\boxed{10^{10^{10}}}", "3", WRONG),
    ("big-tower-same", r"\boxed{10^{10^{10}}}", "10^{10^{10}}", OK),
    ("big-tower-spacing", r"\boxed{10^{ 10^{10} }}", "10^{10^{10}}", OK),
    ("big-tower-off-by-one", r"\boxed{10^{10^{10}} + 1}", "10^{10^{10}}", WRONG),
    ("big-tower-different", r"\boxed{2^{2^{101}}}", "2^{2^{100}}", WRONG),
    ("big-factorial", r"\boxed{(10^{10})!}", "5", WRONG),
    ("big-3^3^3", r"\boxed{7625597484987}", "3^{3^{3}}", OK),
    ("big-10^100", r"\boxed{10^{100}}", "10^{100}", OK),
    # ordinary algebra and arithmetic
    ("frac-decimal", r"\boxed{0.5}", r"\frac{1}{2}", OK),
    ("frac-dfrac", r"\boxed{\dfrac{1}{2}}", r"\frac12", OK),
    ("sqrt-rationalised", r"\boxed{\frac{2}{\sqrt{2}}}", r"\sqrt{2}", OK),
    ("sqrt-rounded", r"\boxed{1.414}", r"\sqrt{2}", WRONG),
    ("poly-factored", r"\boxed{(x+1)^2}", "x^2+2x+1", OK),
    ("assignment", r"\boxed{x=2}", "2", OK),
    ("thousands-comma", r"\boxed{1000}", "1,000", OK),
    ("sign", r"\boxed{3}", "-3", WRONG),
    ("reciprocal", r"\boxed{\frac{4}{3}}", r"\frac{3}{4}", WRONG),
    ("pi", r"\boxed{\pi}", r"\pi", OK),
    ("no-box-sentence", "So the final answer is 5.", "5", OK),
    ("no-box-wrong", "So the final answer is 6.", "5", WRONG),
    ("empty-answer", "", "5", WRONG),
    ("answer-only-in-think", r"!<think>I get \boxed{5}</think> Done.", "5", WRONG),
    ("last-think-close-counts", r"!<think>a</think>\boxed{4}</think>\boxed{5}", "5", OK),
    ("gold-already-boxed", r"\boxed{12}", r"\boxed{12}", OK),
    ("gold-in-dollars", r"\boxed{12}", "$12$", OK),
    # magnitudes from 10^-40 to 10^40: rationals are equal only when exactly equal, a decimal
    # approximating an irrational within a relative 1e-6 (never an absolute tolerance, which
    # would make all small numbers equal)
    ("tiny-decimal-double", r"\boxed{0.0000001}", "0.0000002", WRONG),
    ("tiny-decimal-same", r"\boxed{0.00000010}", "0.0000001", OK),
    ("tiny-decimal-vs-power", r"\boxed{0.0000001}", "10^{-7}", OK),
    ("tiny-power-off-by-10", r"\boxed{10^{-21}}", "10^{-20}", WRONG),
    ("tiny-power-base2", r"\boxed{2^{-60}}", "2^{-61}", WRONG),
    ("tiny-power-base2-same", r"\boxed{\frac{1}{2^{60}}}", "2^{-60}", OK),
    ("tiny-factorial-reciprocal", r"\boxed{\frac{1}{20!}}", r"\frac{1}{21!}", WRONG),
    ("tiny-factorial-same", r"\boxed{\frac{1}{2432902008176640000}}", r"\frac{1}{20!}", OK),
    ("tiny-factorial-ratio", r"\boxed{\frac{1}{25!}}", r"\frac{2}{25!}", WRONG),
    ("tiny-sci-times", r"\boxed{3 \times 10^{-9}}", r"1 \times 10^{-9}", WRONG),
    ("tiny-sci-times-same", r"\boxed{1.5 \times 10^{-10}}", r"\frac{3}{2 \cdot 10^{10}}", OK),
    ("tiny-sci-e", r"\boxed{1.5e-10}", r"1.5 \times 10^{-10}", OK),
    ("tiny-sci-e-wrong", r"\boxed{1.6e-10}", r"1.5 \times 10^{-10}", WRONG),
    ("tiny-sci-e-both", r"\boxed{3e-9}", "1e-9", WRONG),
    ("tiny-sci-40", r"\boxed{2 \times 10^{-40}}", r"10^{-40}", WRONG),
    ("tiny-irrational-scaled", r"\boxed{\sqrt{2} \cdot 10^{-20}}", r"\sqrt{3} \cdot 10^{-20}", WRONG),
    ("tiny-irrational-exp", r"\boxed{e^{-40}}", r"e^{-41}", WRONG),
    ("tiny-irrational-decimal", r"\boxed{4.248354255 \times 10^{-18}}", r"e^{-40}", OK),
    ("tiny-irrational-decimal-coarse", r"\boxed{4.25 \times 10^{-18}}", r"e^{-40}", WRONG),
    ("tiny-tuple", r"\boxed{(10^{-20}, 1)}", r"(2 \cdot 10^{-20}, 1)", WRONG),
    ("tiny-interval", r"\boxed{(0, 10^{-30})}", r"(0, 10^{-29})", WRONG),
    ("huge-power-plus-one", r"\boxed{10^{20}+1}", "10^{20}", WRONG),
    ("huge-factorial-expanded", r"\boxed{2432902008176640000}", "20!", OK),
    ("huge-factorial-off-by-one", r"\boxed{2432902008176640001}", "20!", WRONG),
    ("huge-sci-rounded", r"\boxed{2.4329 \times 10^{18}}", "20!", WRONG),
    ("huge-sci-e", r"\boxed{2.5e30}", r"25 \times 10^{29}", OK),
    ("huge-decimal-integer", r"\boxed{1000000.5}", "1000000", WRONG),
    ("huge-irrational-decimal", r"\boxed{5.184705528587072 \times 10^{21}}", "e^{50}", OK),
    ("huge-irrational-plus-one", r"\boxed{e^{50}+1}", "e^{50}", WRONG),
    ("rational-vs-truncated-decimal", r"\boxed{0.333333}", r"\frac{1}{3}", WRONG),
    ("irrational-decimal-6-digits", r"\boxed{1.414214}", r"\sqrt{2}", OK),
    ("irrational-decimal-5-digits", r"\boxed{1.41421}", r"\sqrt{2}", WRONG),
    ("decimal-trailing-zero", r"\boxed{5.0}", "5", OK),
]


def _response(text: str) -> str:
    return text[1:] if text.startswith("!") else T + text


def test_the_labelled_set_is_large_and_balanced():
    assert len(CASES) >= 60
    assert len({c[0] for c in CASES}) == len(CASES)
    verdicts = [c[3] for c in CASES]
    assert verdicts.count(OK) >= 25 and verdicts.count(WRONG) >= 25


@pytest.mark.parametrize("case_id,text,gold,verdict", CASES, ids=[c[0] for c in CASES])
def test_labelled_case(case_id, text, gold, verdict):
    res = grade_math(_response(text), gold)
    assert res.error is None, res.error
    expected_reward = 1.0 if verdict == OK else -1.0
    assert res.reward == expected_reward, f"{case_id}: {res.detail}"
    assert res.passed == int(verdict == OK) and res.total == 1
    assert res.solved is (verdict == OK)


def test_huge_answers_are_decided_without_expanding_them():
    grade_math(T + r"\boxed{2^{10}}", "1024")  # the first grading's one-time imports are not timed
    t = time.thread_time()  # CPU of this thread, which grades: what expanding burns, whatever the load
    for text, gold in [
        (r"\boxed{10^{10^{10}}}", "3"),
        (r"\boxed{(10^{10})!}", "5"),
        (r"\boxed{2^{2^{2^{100}}}}", "7"),
        (r"\boxed{2^{2^{101}}}", "2^{2^{100}}"),
    ]:
        assert grade_math(T + text, gold).reward == -1.0
    assert time.thread_time() - t < 2.0  # sympy expanding any of these takes minutes or OOMs


# --------------------------------------------------------------------------- format scores


def test_think_format_scores_default_and_configurable():
    assert grade_math(r"<think>so \boxed{5}", "5").reward == -0.5  # truncated
    assert grade_math(r"reasoning</think>\boxed{5}", "5").reward == -2.0  # no <think>
    assert grade_math(r"\boxed{5}", "5").reward == -0.5  # </think> first
    assert grade_math(r"<think>a</think>\boxed{5}", "5").reward == 1.0
    assert grade_math(r"<think>a</think>\boxed{6}", "5").reward == -1.0
    cfg = RewardConfig(correct=2.0, wrong=0.0, no_think_close=-1.0, no_think_open=-3.0)
    assert grade_math(r"<think>a</think>\boxed{5}", "5", cfg).reward == 2.0
    assert grade_math(r"<think>a</think>\boxed{6}", "5", cfg).reward == 0.0
    assert grade_math(r"<think>so \boxed{5}", "5", cfg).reward == -1.0
    assert grade_math(r"a</think>\boxed{5}", "5", cfg).reward == -3.0
    # templates that put <think> in the prompt
    cfg2 = RewardConfig(require_think_open=False)
    assert grade_math(r"reasoning</think>\boxed{5}", "5", cfg2).reward == 1.0


def test_format_verdicts_say_why():
    assert grade_math(r"<think>so \boxed{5}", "5").detail == "missing </think>"
    assert grade_math(r"x</think>\boxed{5}", "5").detail == "missing <think>"
    assert "several different boxed" in grade_math(T + r"\boxed{1} \boxed{2}", "1").detail
    assert "hedged" in grade_math(T + r"\boxed{1 or 2}", "1").detail


def test_any_of_several_golds():
    assert grade_math(T + r"\boxed{-4}", ["4", "-4"]).reward == 1.0
    assert grade_math(T + r"\boxed{3}", ["4", "-4"]).reward == -1.0


def test_unparseable_gold_is_an_error_not_a_silent_wrong():
    res = grade_math(T + r"\boxed{5}", r"\frac{")
    assert res.error is not None and "could not be parsed" in res.error
    assert res.reward == -1.0


def test_bad_argument_types_are_errors():
    assert grade_math(None, "5").error.startswith("response must be a string")
    assert "answer must be" in grade_math(T + r"\boxed{5}", {"x": 1}).error


def test_boxed_contents_nesting_and_truncation():
    assert boxed_contents(r"\boxed{\frac{1}{2}} and \fbox{3} and \boxed {x}") == [r"\frac{1}{2}", "3", "x"]
    assert boxed_contents(r"\boxed 5$") == ["5"]
    assert boxed_contents(r"\boxed{\frac{1}{2}") == []  # unclosed (truncated) box is not an answer
    assert boxed_contents(r"\boxed{a\}b}") == [r"a\}b"]


def test_number_equality_is_relative_never_absolute_and_configurable():
    """The tolerance for a decimal against an irrational value is relative and set by
    RewardConfig.math_float_rel_tol; rationals are exact whatever it is."""
    loose = RewardConfig(math_float_rel_tol=1e-3)
    assert grade_math(T + r"\boxed{1.414}", r"\sqrt{2}").reward == -1.0
    assert grade_math(T + r"\boxed{1.414}", r"\sqrt{2}", loose).reward == 1.0
    assert grade_math(T + r"\boxed{1.414 \times 10^{-30}}", r"\sqrt{2} \cdot 10^{-30}", loose).reward == 1.0
    assert grade_math(T + r"\boxed{1.5 \times 10^{-30}}", r"\sqrt{2} \cdot 10^{-30}", loose).reward == -1.0
    # rationals: exact, even under a loose tolerance, at every magnitude
    for a, b in [("0.3333", r"\frac13"), ("1000001", "1000000"), (r"10^{-40}", r"1.001 \times 10^{-40}")]:
        assert grade_math(T + rf"\boxed{{{a}}}", b, loose).reward == -1.0, (a, b)
    with pytest.raises(ValueError, match="math_float_rel_tol"):
        RewardConfig(math_float_rel_tol=-1e-6)


def test_the_grader_checks_math_verify_s_version_once_and_parses_each_answer_once(monkeypatch):
    """A grading reads math-verify's version from the package metadata once per process, not per
    call (that read cost more than the grading), and parses a repeated answer once; the memoised
    parse hands out fresh lists with the same verdicts."""
    import importlib.metadata

    import megatron_klear.rewards.math as math_grader

    reads = []
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: reads.append(name) or real(name))
    math_grader._mv.cache_clear()
    math_grader._parse_cached.cache_clear()
    responses = [T + r"\boxed{\frac{1}{2}}", T + r"\boxed{0.5}", T + r"\boxed{\frac{1}{2}}", T + "so 1/2"]
    verdicts = [grade_math(r, "1/2").passed for r in responses * 3]
    assert verdicts == [1, 1, 1, 1] * 3
    assert reads.count("math-verify") <= 1
    info = math_grader._parse_cached.cache_info()
    assert info.misses == 4 and info.hits > info.misses  # gold, two boxed answers, one tail; the rest hits
    first, second = math_grader._parse_boxed("1/2"), math_grader._parse_boxed("1/2")
    assert first == second and first is not second
