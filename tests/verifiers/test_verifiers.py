"""Verifiers: typed outcomes, time budgets, the reasoning-gym adapter, the simple verifiers and
the registry (the math answer verifier: tests/verifiers/test_math_answer.py)."""

import doctest
import importlib
import math
import pickle
import re
import time
from fractions import Fraction

import cloudpickle
import pytest
from _waits import LATE_S

from posttrain.rewards import (
    Outcome,
    Verifier,
    VerifierResult,
    as_score_fn,
    count_outcomes,
    run_verifier,
    score_batch,
)
from posttrain.verifiers import (
    ExactMatchVerifier,
    FormatVerifier,
    MathAnswerVerifier,
    ReasoningGymVerifier,
    RegexVerifier,
    get_verifier,
    register_verifier,
    registered_verifiers,
)

# --------------------------------------------------------------------------------------------
# VerifierResult and Outcome
# --------------------------------------------------------------------------------------------


def test_outcome_is_a_string_enum():
    assert Outcome.OK == "ok" and str(Outcome.FORMAT_ERROR) == "format_error"
    assert [o.value for o in Outcome] == ["ok", "wrong", "format_error", "timeout", "error"]


def test_verifier_result_validates_and_coerces():
    result = VerifierResult(1, "ok")
    assert result.score == 1.0 and isinstance(result.score, float)
    assert result.outcome is Outcome.OK and result.ok and result.scored
    assert not VerifierResult(0.5, Outcome.WRONG).ok and VerifierResult(0.5, "wrong").scored
    assert not VerifierResult.failure("timeout", "slow").scored
    with pytest.raises(ValueError, match="finite"):
        VerifierResult(float("nan"), "ok")
    with pytest.raises(ValueError, match="finite"):
        VerifierResult(float("inf"), "wrong")
    with pytest.raises(ValueError, match="not one of"):
        VerifierResult(1.0, "correct")
    with pytest.raises(ValueError, match="real number"):
        VerifierResult("1.0", "ok")
    with pytest.raises(AttributeError):
        result.score = 0.0  # frozen


def test_from_score_maps_one_to_ok_and_keeps_partial_credit():
    assert VerifierResult.from_score(1.0).outcome is Outcome.OK
    partial = VerifierResult.from_score(0.05)
    assert partial.outcome is Outcome.WRONG and partial.score == 0.05


def test_count_outcomes_has_every_key():
    results = [
        VerifierResult(1.0, "ok"),
        VerifierResult(0.0, "wrong"),
        VerifierResult.failure("timeout", "t"),
        VerifierResult.failure("timeout", "t"),
    ]
    assert count_outcomes(results) == {
        "ok": 1,
        "wrong": 1,
        "format_error": 0,
        "timeout": 2,
        "error": 0,
    }
    assert count_outcomes([]) == dict.fromkeys([o.value for o in Outcome], 0)


# --------------------------------------------------------------------------------------------
# run_verifier / score_batch: failures become typed outcomes
# --------------------------------------------------------------------------------------------


def _raises(completion, item):
    raise ZeroDivisionError("boom")


@pytest.mark.parametrize("timeout_s", [30.0, None])
def test_a_verifier_that_raises_is_an_error(timeout_s):
    result = run_verifier(_raises, "x", {}, timeout_s=timeout_s)
    assert result.outcome is Outcome.ERROR and result.score == 0.0
    assert result.reason == "ZeroDivisionError: boom"


def test_a_verifier_that_hangs_is_a_timeout_and_blocks_nothing_after_it():
    """The hanging call sleeps 600 s: it is cut at its budget (late by at most LATE_S on a
    loaded machine), and the next call does not queue behind it."""

    def hangs(completion, item):  # a local function: shipped by value (nothing to import)
        time.sleep(600)
        return 1.0

    start = time.monotonic()
    result = run_verifier(hangs, "x", {}, timeout_s=0.2)
    assert result.outcome is Outcome.TIMEOUT and result.score == 0.0
    assert result.reason == "verifier ran past 0.2 s (worker process killed)"
    assert time.monotonic() - start < 0.2 + LATE_S
    start = time.monotonic()  # not queued behind it: at most a replacement worker's start
    assert run_verifier(lambda c, i: 1.0, "x", {}, timeout_s=30).ok
    assert time.monotonic() - start < LATE_S


@pytest.mark.parametrize(
    "value, reason",
    [
        (
            float("nan"),
            "must be a finite number within float32 range (|x| <= 3.4028235e+38), got nan",
        ),
        (float("inf"), "within float32 range (|x| <= 3.4028235e+38), got inf"),
        (-math.inf, "within float32 range (|x| <= 3.4028235e+38), got -inf"),
        (1e39, "within float32 range (|x| <= 3.4028235e+38), got 1e+39"),
        ("1.0", "expected a VerifierResult or a real number"),
        (None, "expected a VerifierResult or a real number"),
    ],
)
def test_bad_returns_are_errors_with_a_reason(value, reason):
    result = run_verifier(lambda c, i: value, "x", {})
    assert result.outcome is Outcome.ERROR and result.score == 0.0
    assert reason in result.reason


def test_a_verifier_building_a_nan_result_is_an_error():
    result = run_verifier(lambda c, i: VerifierResult(float("nan"), "ok"), "x", {})
    assert result.outcome is Outcome.ERROR and "finite" in result.reason


@pytest.mark.parametrize(
    "value, outcome, score",
    [
        (1.0, "ok", 1.0),
        (1, "ok", 1.0),
        (True, "ok", 1.0),
        (0.0, "wrong", 0.0),
        (0.25, "wrong", 0.25),
        (False, "wrong", 0.0),
        (Fraction(1, 2), "wrong", 0.5),
    ],
)
def test_bare_numbers_are_accepted(value, outcome, score):
    """A notebook function may return a float: >= 1 is ok, anything else wrong with that score."""
    result = run_verifier(lambda c, i: value, "x", {})
    assert (result.outcome.value, result.score) == (outcome, score)


def test_score_batch_keeps_order_and_finishes_quickly_with_several_hangers():
    """Six calls sleep 600 s: each is cut at its 1 s budget, the batch ends long before any of
    them would (a few rounds of the budget, late by at most LATE_S)."""

    def verifier(completion, item):
        if completion == "hang":
            time.sleep(600)
        if completion == "raise":
            raise RuntimeError("bad")
        return float(completion == item["answer"])

    completions = ["1", "hang", "2", "hang", "raise", "hang", "nope", "hang", "1", "hang", "hang"]
    items = [
        {"answer": "1"},
        {},
        {"answer": "2"},
        {},
        {},
        {},
        {"answer": "3"},
        {},
        {"answer": "1"},
        {},
        {},
    ]
    start = time.monotonic()
    results = score_batch(verifier, completions, items, timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert elapsed < 6 * 1.0 + LATE_S, elapsed
    assert [r.outcome.value for r in results] == [
        "ok",
        "timeout",
        "ok",
        "timeout",
        "error",
        "timeout",
        "wrong",
        "timeout",
        "ok",
        "timeout",
        "timeout",
    ]
    assert count_outcomes(results) == {
        "ok": 3,
        "wrong": 1,
        "format_error": 0,
        "timeout": 6,
        "error": 1,
    }


def test_score_batch_with_one_worker_and_inline():
    verify = MathAnswerVerifier()
    items = [{"answer": str(i)} for i in range(20)]
    completions = [f"answer: {i}" for i in range(20)]
    for kwargs in ({"max_workers": 1}, {"timeout_s": None}):
        assert all(r.ok for r in score_batch(verify, completions, items, **kwargs))


def test_score_batch_is_cheap_for_thousands_of_calls():
    """2,000 calls cost this process well under a second of CPU (the verifier is shipped once,
    not per call); counted in CPU seconds, which waiting for a core does not inflate. Wall-clock
    throughput is a benchmark's business."""
    verify = MathAnswerVerifier()
    items = [{"answer": str(i)} for i in range(2000)]
    completions = [f"so the answer is {i}." for i in range(2000)]
    start = time.process_time()
    results = score_batch(verify, completions, items, timeout_s=30.0)
    assert all(r.ok for r in results)
    assert time.process_time() - start < 5.0


def test_score_batch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="one item per completion"):
        score_batch(lambda c, i: 1.0, ["a", "b"], [{}])
    with pytest.raises(ValueError, match="timeout_s"):
        score_batch(lambda c, i: 1.0, ["a"], [{}], timeout_s=0)
    with pytest.raises(ValueError, match="max_workers"):
        score_batch(lambda c, i: 1.0, ["a"], [{}], max_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        run_verifier(lambda c, i: 1.0, "a", {}, timeout_s=-1)


def test_notebook_closures_and_classes_are_verifiers():
    threshold = 3

    class LongEnough:  # defined "in a cell": no base class, no import
        def __call__(self, completion, item):
            return VerifierResult.from_score(float(len(completion) >= threshold))

    assert isinstance(LongEnough(), Verifier)
    assert run_verifier(LongEnough(), "abcd", {}).ok
    assert run_verifier(lambda c, i: len(c) >= threshold, "ab", {}).outcome is Outcome.WRONG


def test_as_score_fn_gives_plain_floats_and_pickles():
    score = as_score_fn(MathAnswerVerifier(), timeout_s=30.0)
    assert score("\\boxed{2}", {"answer": "2"}) == 1.0
    assert score("nothing", {"answer": "2"}) == 0.0
    assert pickle.loads(pickle.dumps(score))("2", {"answer": "2"}) == 1.0


# --------------------------------------------------------------------------------------------
# ReasoningGymVerifier
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chain_sum_items():
    import reasoning_gym

    return list(
        reasoning_gym.create_dataset(
            "chain_sum", size=8, seed=3, min_terms=2, max_terms=2, min_digits=1, max_digits=2
        )
    )


def test_reasoning_gym_adapter_on_chain_sum(chain_sum_items):
    verify = ReasoningGymVerifier("chain_sum", min_terms=2, max_terms=2)
    for item in chain_sum_items:
        right = run_verifier(verify, f"  {item['answer']}\n", item)
        assert right.outcome is Outcome.OK and right.score == 1.0
        wrong = run_verifier(verify, str(int(item["answer"]) + 1), item)
        assert wrong.outcome is Outcome.WRONG and wrong.score == 0.0
        assert "chain_sum scored 0" in wrong.reason
        empty = run_verifier(verify, "", item)
        assert empty.scored and empty.score == 0.0


def test_reasoning_gym_extract_modes(chain_sum_items):
    item = chain_sum_items[0]
    answer = item["answer"]
    assert ReasoningGymVerifier("chain_sum", extract="answer_prefix")(
        f"thinking... Answer: {answer}", item
    ).ok
    tag = ReasoningGymVerifier("chain_sum", extract="answer_tag")
    assert tag(f"<answer>{answer}</answer>", item).ok
    assert tag(answer, item).outcome is Outcome.FORMAT_ERROR
    last_line = ReasoningGymVerifier("chain_sum", extract=lambda text: text.splitlines()[-1])
    assert last_line(f"work\n{answer}", item).ok
    with pytest.raises(ValueError, match="extract must be"):
        ReasoningGymVerifier("chain_sum", extract="boxed")


def test_reasoning_gym_partial_credit_is_wrong_with_its_score():
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("countdown", size=1, seed=0)
    item = dataset[0]
    verify = ReasoningGymVerifier(dataset)  # a dataset object works too
    assert verify.name == "countdown"
    assert verify(item["answer"], item).ok
    partial = verify("1 + 2", item)
    assert partial.outcome is Outcome.WRONG and 0.0 < partial.score < 1.0


@pytest.mark.parametrize(
    "answer, score",
    [
        ("nilaid", 1.0),
        ("NILAID", 1.0),  # case-insensitive, as the task's scorer
        ("nilaidxy", 0.8),  # every letter in place, longer than the word: 1 - 0.2
        ("nilai", 5 / 6),
        ("nilaix", 5 / 6),
        ("ilaid", 0.0),  # counted from the start
        ("", 0.0),
    ],
)
def test_spell_backward_deducts_for_an_answer_longer_than_the_word(answer, score):
    """The task's scorer sums 1/6 six times to 0.9999999999999999, misses its own `== 1.0`
    test and scores the word plus anything as ~1.0 (GRPO learned to never stop); the adapter
    applies the deduction. Scores by hand from the rule in reasoning-gym's code."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(
        "spell_backward", size=1, seed=0, min_word_len=6, max_word_len=6
    )
    item = {**dataset[0], "answer": "nilaid"}  # the reversal of "dialin"
    if answer == "nilaidxy":  # the defect this fixes, as the task's own scorer has it
        assert dataset.score_answer(answer, item) == 0.9999999999999999
    result = ReasoningGymVerifier("spell_backward")(answer, item)
    assert result.score == pytest.approx(score, abs=1e-12)
    assert result.ok is (score == 1.0)


def test_spell_backward_fix_agrees_with_the_task_where_its_sum_is_exact():
    """For 3-5 letter words the task's per-letter sum reaches exactly 1.0: the two agree on
    every kind of answer, to the last bit."""
    import reasoning_gym

    verify = ReasoningGymVerifier("spell_backward")
    dataset = reasoning_gym.create_dataset(
        "spell_backward", size=30, seed=1, min_word_len=3, max_word_len=5
    )
    for item in dataset:
        word = item["answer"]
        for answer in (word, word.upper(), word + "x", word[:-1], word[1:], "zz"):
            assert verify(answer, item).score == dataset.score_answer(answer, item), answer


def test_reasoning_gym_unknown_task_lists_names():
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'chain_summ'.*chain_sum"):
        ReasoningGymVerifier("chain_summ")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['max_digit'\].*max_digits"):
        ReasoningGymVerifier("chain_sum", max_digit=2)


# --------------------------------------------------------------------------------------------
# Simple verifiers
# --------------------------------------------------------------------------------------------


def test_exact_match():
    assert ExactMatchVerifier()(" the  big\ncat ", {"answer": "the big cat"}).ok
    assert not ExactMatchVerifier()("The big cat", {"answer": "the big cat"}).ok
    assert ExactMatchVerifier(case_sensitive=False)("The BIG cat", {"answer": "the big cat"}).ok


def test_regex():
    assert RegexVerifier(r"\d+")("abc 12", {}).ok
    assert not RegexVerifier(r"\d+", mode="fullmatch")("abc 12", {}).ok
    assert RegexVerifier(r"\d+", mode="fullmatch")(" 12\n", {}).ok
    assert RegexVerifier(r"yes", flags=re.IGNORECASE)("YES", {}).ok
    with pytest.raises(ValueError, match="does not compile"):
        RegexVerifier("(")
    with pytest.raises(ValueError, match="mode"):
        RegexVerifier("a", mode="match")


def test_format():
    verify = FormatVerifier()
    assert verify("think <answer>4</answer>", {}).ok
    for text in ["4", "<answer></answer>", "<answer>4", "<ans>4</ans>"]:
        assert verify(text, {}).outcome is Outcome.FORMAT_ERROR
    inner = FormatVerifier(inner=MathAnswerVerifier())
    assert inner("<answer>1/2</answer>", {"answer": "0.5"}).ok
    assert inner("<answer>2</answer>", {"answer": "0.5"}).outcome is Outcome.WRONG
    with pytest.raises(ValueError, match="tag"):
        FormatVerifier(tag="<answer>")


# --------------------------------------------------------------------------------------------
# Registry and pickling
# --------------------------------------------------------------------------------------------


def test_registry_has_the_builtins_and_builds_with_options():
    assert {"math_answer", "reasoning_gym", "exact_match", "regex", "format"} <= set(
        registered_verifiers()
    )
    assert isinstance(get_verifier("math_answer"), MathAnswerVerifier)
    assert get_verifier("regex", pattern="a+", mode="fullmatch")("aaa", {}).ok
    assert get_verifier("reasoning_gym", dataset_or_name="chain_sum").name == "chain_sum"


def test_registry_unknown_name_lists_the_names():
    with pytest.raises(
        ValueError, match="unknown verifier 'maths'.*math_answer.*posttrain.verifiers"
    ):
        get_verifier("maths")


def test_a_rerun_notebook_cell_replaces_its_verifier_and_another_definition_still_raises():
    # Two runs of the same cell: new function objects with the same module and qualified name.
    cell = (
        "@register_verifier('cell_verifier')\n"
        "def cell_verifier():\n"
        "    return lambda c, i: {score}\n"
    )
    scope = {"register_verifier": register_verifier, "__name__": "__main__"}
    exec(cell.format(score=0.0), scope)
    with pytest.warns(UserWarning, match="'cell_verifier' registered again by the same definition"):
        exec(cell.format(score=1.0), scope)
    assert run_verifier(get_verifier("cell_verifier"), "x", {}).score == 1.0
    other = {"register_verifier": register_verifier, "__name__": "some_module"}
    with pytest.raises(ValueError, match="'cell_verifier' is already registered"):
        exec(cell.format(score=0.5), other)


def test_registry_rejects_a_second_definition_under_a_name():
    with pytest.raises(ValueError, match="already registered"):
        register_verifier("math_answer")(ExactMatchVerifier)

    @register_verifier("test_twice")
    def make():
        return lambda c, i: 1.0

    register_verifier("test_twice")(make)  # the very same object again: a no-op

    def other():
        return lambda c, i: 0.0

    with pytest.raises(ValueError, match="already registered"):
        register_verifier("test_twice")(other)


@pytest.mark.parametrize(
    "dumps, loads", [(pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)]
)
def test_verifiers_pickle(dumps, loads, chain_sum_items):
    item = chain_sum_items[0]
    rg = ReasoningGymVerifier("chain_sum")
    assert rg(item["answer"], item).ok  # builds and caches its scoring dataset first
    for verifier, completion, ref in [
        (rg, item["answer"], item),
        (MathAnswerVerifier(), "\\boxed{2}", {"answer": "2"}),
        (ExactMatchVerifier(), "a", {"answer": "a"}),
        (RegexVerifier("a+"), "aa", {}),
        (FormatVerifier(inner=MathAnswerVerifier()), "<answer>2</answer>", {"answer": "2"}),
    ]:
        copy = loads(dumps(verifier))
        assert run_verifier(copy, completion, ref).ok
    assert len(pickle.dumps(rg)) < 1000


def test_cloudpickle_ships_a_notebook_closure():
    offset = 1
    verifier = cloudpickle.loads(cloudpickle.dumps(lambda c, i: float(int(c) == i["n"] + offset)))
    assert run_verifier(verifier, "3", {"n": 2}).ok


@pytest.mark.parametrize(
    "module",
    [
        "posttrain.rewards.verifier",
        "posttrain.verifiers",
        "posttrain.verifiers.basic",
        "posttrain.verifiers.math_answer",
        "posttrain.verifiers.reasoning_gym",
    ],
)
def test_doctests(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
