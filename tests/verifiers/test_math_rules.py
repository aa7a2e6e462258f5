"""Numbers and variables in MathAnswerVerifier (verifiers/math_rules.py): exact where both sides
are exact, by relative tolerance where a float takes part, wherever math-verify compares numbers;
with strict=True variables keep their case. Reference values by hand or with Python's exact
integers and fractions, in the comments."""

import doctest
import threading

import pytest

from posttrain.rewards import Outcome
from posttrain.verifiers import MathAnswerVerifier, math_rules

# --------------------------------------------------------------------------------------------
# Numbers: exact where both sides are exact, by relative tolerance where one is a float
# --------------------------------------------------------------------------------------------


def test_tiny_exact_numbers_are_not_all_equal():
    """1/2^99 = 1.58e-30 and 1/2^98 = 3.16e-30 differ by a factor 2; math-verify chopped their
    difference to zero (and so credited any tiny number for any other)."""
    result = MathAnswerVerifier()("\\boxed{\\frac{1}{2^{99}}}", {"answer": "\\frac{1}{2^{98}}"})
    assert result.outcome is Outcome.WRONG, result


NUMBERS = [
    # (completion, reference, equal?) by hand or with Python's exact ints / Fractions
    ("\\boxed{2^{-99}}", "\\frac{1}{2^{99}}", True),
    ("\\boxed{10^{-30}}", "2 \\cdot 10^{-30}", False),
    ("\\boxed{100!}", "100!", True),
    ("\\boxed{100!}", "100!+1", False),
    ("\\boxed{2^{100}}", str(2**100), True),
    ("\\boxed{2^{100}}", str(2**100 + 1), False),
    ("\\boxed{\\sqrt{3+2\\sqrt{2}}}", "1+\\sqrt{2}", True),  # (1 + sqrt 2)^2 = 3 + 2 sqrt 2
    ("\\boxed{\\sqrt{2}+10^{-40}}", "\\sqrt{2}", False),
    # inside sets, intervals, equations and matrices too
    ("\\boxed{\\{10^{-9}, 1\\}}", "\\{2 \\cdot 10^{-9}, 1\\}", False),
    ("\\boxed{(0, 10^{-8})}", "(0, 10^{-9})", False),
    ("\\boxed{x = 10^{-7}}", "x = 2 \\cdot 10^{-7}", False),
    (
        "\\boxed{\\begin{pmatrix} 0.0000001 & 1 \\end{pmatrix}}",
        "\\begin{pmatrix} 0.0000002 & 1 \\end{pmatrix}",
        False,
    ),
    # a float: 6 significant digits of the larger side, and at least 6 decimals
    ("\\boxed{0.0000001}", "0.0000002", False),
    ("\\boxed{0.000000123457}", "0.0000001234567", True),  # 1.234567e-7 -> 1.23457e-7
    ("\\boxed{0.00000012346}", "0.0000001234567", False),  # 1.2346e-7 != 1.23457e-7
    ("\\boxed{0.000000953674}", "\\frac{1}{2^{20}}", True),  # 2^-20 = 9.5367431640625e-7
    ("\\boxed{0.000001}", "\\frac{1}{2^{20}}", False),
    ("\\boxed{1234567.4}", "1234567", False),  # 6 decimals, not 6 digits
    ("\\boxed{1234567.0000001}", "1234567", True),
    ("\\boxed{3.14159265}", "\\pi", True),
    ("\\boxed{0.00000000206115}", "e^{-20}", True),  # e^-20 = 2.0611536e-9
    ("\\boxed{0.00000000206}", "e^{-20}", False),
    # a percentage: its number or its fraction, at the same tolerance
    ("\\boxed{0.00002\\%}", "0.0000002", True),
    ("\\boxed{0.00001\\%}", "0.0000002", False),
]


@pytest.mark.parametrize("completion, reference, equal", NUMBERS)
def test_numbers_exact_or_by_relative_tolerance(completion, reference, equal):
    result = MathAnswerVerifier()(completion, {"answer": reference})
    assert result.outcome is (Outcome.OK if equal else Outcome.WRONG), result


def test_numbers_equal_on_sympy_values():
    """The rule itself, on values built in sympy: exact for rationals whatever their size,
    rounding only where a float takes part (module docstring of math_rules)."""
    from sympy import Float, Integer, Rational, factorial, sqrt

    from posttrain.verifiers.math_rules import numbers_equal

    assert not numbers_equal(Rational(1, 2**99), Rational(1, 2**98), 6, 15)
    assert not numbers_equal(factorial(30), factorial(30) + 1, 6, 15)
    assert numbers_equal(sqrt(8), 2 * sqrt(2), 6, 15)
    assert not numbers_equal(Float("1e-7"), Float("2e-7"), 6, 15)
    assert numbers_equal(Float("1.0e-7"), Rational(1, 10**7), 6, 15)
    assert numbers_equal(Float("0.333333"), Rational(1, 3), 6, 15)
    assert not numbers_equal(Float("0.3333"), Rational(1, 3), 6, 15)
    assert numbers_equal(Float("42.0"), Integer(42), 6, 15)  # sympy: Float(42) != 42
    assert numbers_equal(Float("0.3333"), Rational(1, 3), 4, 15)  # float_rounding is a setting


def test_math_verify_outside_the_verifier_is_unchanged():
    """The rules apply inside the verifier only: math_verify.verify called directly still
    rounds and lowercases as it ships (other code in the process is not affected)."""
    import math_verify

    MathAnswerVerifier()("\\boxed{1}", {"answer": "1"})  # installs the rules
    assert math_verify.verify(
        math_verify.parse("$\\frac{1}{2^{99}}$"), math_verify.parse("$\\frac{1}{2^{98}}$")
    )
    assert math_verify.verify(math_verify.parse("$X$"), math_verify.parse("$x$"))


# --------------------------------------------------------------------------------------------
# strict=True keeps the case of variables
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, reference, equal",
    [
        ("\\boxed{X}", "x", False),
        ("\\boxed{2X+1}", "2x+1", False),
        ("\\boxed{X = 3}", "x = 3", False),
        ("\\boxed{\\Pi}", "\\pi", False),  # the capital letter, not the constant
        ("\\boxed{X}", "X", True),
        ("\\boxed{(A)}", "A", True),
        ("\\boxed{\\text{Yes}}", "yes", True),  # words: math-verify compares them without case
    ],
)
def test_strict_keeps_the_case_of_variables(completion, reference, equal):
    result = MathAnswerVerifier()(completion, {"answer": reference})
    assert result.outcome is (Outcome.OK if equal else Outcome.WRONG), result


def test_strict_false_matches_variables_whatever_their_case():
    """The reference is parsed once per strict setting (cached): neither leaks into the other."""
    item = {"answer": "2x+1"}
    assert MathAnswerVerifier(strict=False)("\\boxed{2X+1}", item).ok
    assert MathAnswerVerifier()("\\boxed{2X+1}", item).outcome is Outcome.WRONG
    assert MathAnswerVerifier(strict=False)("\\boxed{2X+1}", item).ok


def test_case_is_kept_on_a_worker_thread():
    results = []
    worker = threading.Thread(
        target=lambda: results.append(MathAnswerVerifier()("\\boxed{X}", {"answer": "x"}))
    )
    worker.start()
    worker.join(60)
    assert results and results[0].outcome is Outcome.WRONG, results


def test_doctests():
    result = doctest.testmod(math_rules)
    assert result.failed == 0 and result.attempted > 0
