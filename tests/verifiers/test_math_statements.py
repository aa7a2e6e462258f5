"""One final answer (verifiers/math_statements.py): a completion that states more than one (an
alternative, a relation math-verify does not compare, two statements with different values) is a
format_error whatever the extraction order; one answer stated several ways is credited."""

import doctest

import pytest

from posttrain.rewards import Outcome
from posttrain.verifiers import MathAnswerVerifier, math_answer, math_statements

# --------------------------------------------------------------------------------------------
# One final answer: a hedge is a format_error, whatever the extraction order
# --------------------------------------------------------------------------------------------

HEDGES = [
    "\\boxed{3 (or 4)}",
    "\\boxed{3 \\text{ or } 4}",
    "\\boxed{3 \\; \\mathrm{or} \\; 4}",
    "The answer is 3 or maybe 4.",
    "The answer is 3 (or 4).",
    "The answer is $3$ or $4$.",
    "3 or maybe 4",
    "3 (or 4)",
    "$3$ or $4$",
    "\\boxed{3} or \\boxed{4}",
    "\\boxed{3} \\text{ or } \\boxed{4}",
    "so \\boxed{3}. Hmm, maybe \\boxed{4}",
    "first \\boxed{3} then \\boxed{4}",
    "The answer is 3. \\boxed{4}",
    "\\boxed{3}. The answer is 4.",
    "\\boxed{x \\approx 3}",
    "\\boxed{3 \\approx 4}",
    "\\boxed{4 \\approx 3}",
    "$x \\approx 4$",
    "The answer is $x \\approx 4$.",
    "\\boxed{x \\sim 4}",
    "\\boxed{3 \\to 4}",
    "\\boxed{3 \\rightarrow 4}",
    "\\boxed{3 \\equiv 4}",
    "\\boxed{3 \\cong 4}",
    "\\boxed{3 ≈ 4}",
    "\\boxed{3 \\Rightarrow 4}",
    "\\boxed{3 \\mapsto 4}",
    "\\boxed{3 \\lesssim 4}",
    "\\boxed{3 \\in 4}",
    "\\boxed{3 ~ 4}",
]
ORDERS = [
    math_answer.DEFAULT_EXTRACT,
    ("marker", "boxed", "whole"),
    ("whole", "marker", "boxed"),
    "anywhere",
]


@pytest.mark.parametrize("completion", HEDGES)
def test_a_hedged_answer_is_never_credited(completion):
    """Each states 3 and 4 (or 3 approximately): before, each was credited for one of them
    under some extraction order. Now format_error for both references and every order."""
    for extract in ORDERS:
        verify = MathAnswerVerifier(extract=extract)
        for reference in ("3", "4"):
            result = verify(completion, {"answer": reference})
            assert result.outcome is Outcome.FORMAT_ERROR and result.score == 0.0, (
                extract,
                reference,
                result,
            )
            assert result.reason.startswith(("not one answer", "no answer found")), result


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("\\boxed{x \\ge 5}", "x \\geq 5"),  # relations math-verify compares are answers
        ("\\boxed{x \\neq 3}", "x \\ne 3"),
        ("\\boxed{x \\in [0, 1)}", "[0,1)"),
        ("\\boxed{\\lim_{x \\to 0} \\frac{\\sin x}{x}}", "1"),  # \\to inside a subscript
        ("\\boxed{1}, \\boxed{2} and \\boxed{3}", "$\\{1,2,3\\}$"),
        ("\\boxed{4}. The answer is 4.", "4"),  # two statements, one value
        ("The answer is $\\frac{1}{2}$. So \\boxed{0.5}", "1/2"),
        ("\\boxed{\\boxed{3}}", "3"),
        ("The answer is $12$.\n\n\\boxed{12}", "12"),
        ("The forecast is 3, or so they say. Answer: 3", "3"),  # prose before the statement
        # a reference that itself reads as alternatives or a relation is the question's own form
        ("\\boxed{x = 1 \\text{ or } x = 2}", "x = 1 or x = 2"),
        ("The answer is 3 or 4", "3 or 4"),
        ("\\boxed{x \\approx 3}", "x \\approx 3"),
    ],
)
def test_one_answer_stated_several_ways_is_credited(completion, reference):
    for extract in ORDERS[:3]:
        result = MathAnswerVerifier(extract=extract)(completion, {"answer": reference})
        assert result.ok, (extract, result)


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("First we decide whether the answer is positive or negative. So \\boxed{-2}.", "-2"),
        ("We check if the answer is an integer or a fraction: \\boxed{\\frac{1}{3}}.", "1/3"),
    ],
)
def test_prose_after_an_answer_marker_is_not_a_hedge(completion, reference):
    """ "the answer is positive or negative" in the reasoning states no answer: the box is read."""
    assert MathAnswerVerifier()(completion, {"answer": reference}).ok
    hedging = "First we decide whether the answer is 2 or -2. So \\boxed{-2}."
    assert MathAnswerVerifier()(hedging, {"answer": "-2"}).outcome is Outcome.FORMAT_ERROR


def test_statements_and_hedges_located():
    from posttrain.verifiers.math_statements import hedge, last_math, statements

    found = statements("First \\boxed{1}, then \\boxed{2} and \\boxed{3}. So the answer is 4.")
    assert [(s.text, s.source) for s in found] == [
        ("1", "boxed"),
        ("2, 3", "boxed"),
        ("4", "marker"),
    ]
    assert hedge("x \\approx 3") == "'\\approx' in the answer"
    assert hedge("3", after=" (or 4)") == "'or' right after the answer"
    assert hedge("4", before="3 or $") == "'or' right before the answer"
    assert hedge("e^{i\\pi} \\text{ for } x_{n \\to \\infty}") is None
    assert hedge("x \\ge 5") is None and hedge("\\{x \\mid x > 0\\}") == "'\\mid' in the answer"
    assert last_math("we get $3$ and then 4.5 apples").text == "4.5"


def test_twenty_thousand_statements_are_found_in_one_pass():
    """Box runs are found in one pass over the braces and the gaps between boxes (a quadratic
    search would take minutes here); the two values stated make a format_error."""
    from posttrain.verifiers.math_statements import box_runs

    completion = "\\boxed{1} then " * 20_000 + "\\boxed{2}"
    assert len(box_runs(completion)) == 20_001
    result = MathAnswerVerifier()(completion, {"answer": "2"})
    assert result.outcome is Outcome.FORMAT_ERROR and "differ" in result.reason, result


def test_many_different_statements_are_a_format_error_without_parsing_each():
    completion = " then ".join(f"\\boxed{{{i}}}" for i in range(20))
    result = MathAnswerVerifier()(completion, {"answer": "19"})
    assert result.outcome is Outcome.FORMAT_ERROR and "MAX_STATEMENTS=8" in result.reason


def test_doctests():
    result = doctest.testmod(math_statements)
    assert result.failed == 0 and result.attempted > 0
