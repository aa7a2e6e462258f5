"""Judges: typed results (an unparsable judge text is the judge's `error`, never the policy's
format_error nor a silent 0.0), LLM and reward-model judges, pairwise judges with position-bias
control, and bad inputs (a clear error naming the argument, or a typed outcome for that row).
(Verdict parsers: test_judge_parsing.py; judges as verifiers and GRPO rewards:
test_judges_as_rewards.py.)"""

import doctest
import math

import pytest
from _judge_helpers import ScriptedPolicy

from posttrain.models import ByteTokenizer
from posttrain.rewards import (
    JudgeResult,
    LLMJudge,
    LLMPairwiseJudge,
    Outcome,
    PairwiseOutcome,
    PairwiseResult,
    RewardModelJudge,
    RewardModelPairwiseJudge,
    VerifierResult,
    count_outcomes,
    count_pairwise,
    render_pair,
)
from posttrain.rewards import judges as judges_module

ITEM = {"question": "5 + 7 =", "answer": "12", "metadata": {}}


# --------------------------------------------------------------------------------------------
# LLMJudge
# --------------------------------------------------------------------------------------------


def test_llm_judge_outcomes_are_typed_and_keep_the_raw_text():
    replies = {
        "12": "Correct. Score: 9",
        "13": "Wrong. Score: 2",
        "x": "no idea",
        "y": "Score: 11",
        "z": "Score: 5",
    }
    policy = ScriptedPolicy(lambda text: replies[text.split("Response:\n")[1].split("\n")[0]])
    judge = LLMJudge(policy, "Is it correct?", score_range=(0, 10))
    results = judge.judge(list(replies), [ITEM] * 5)
    assert all(isinstance(r, JudgeResult) and isinstance(r, VerifierResult) for r in results)
    assert [r.outcome.value for r in results] == ["ok", "wrong", "error", "error", "ok"]
    assert [r.score for r in results] == [0.9, 0.2, 0.0, 0.0, 0.5]  # 5/10 meets ok_threshold 0.5
    assert [r.raw_score for r in results] == [9.0, 2.0, None, None, 5.0]
    assert [r.raw for r in results] == list(replies.values())
    assert "no score found" in results[2].reason and "'no idea'" in results[2].reason
    assert "outside score_range [0, 10]" in results[3].reason
    assert count_outcomes(results) == {
        "ok": 2,
        "wrong": 1,
        "format_error": 0,
        "timeout": 0,
        "error": 2,
    }
    # one batched, greedy generate call; the prompt holds rubric, question and completion
    [(texts, settings)] = policy.calls
    assert len(texts) == 5 and settings["temperature"] == 0.0
    assert "Is it correct?" in texts[0] and "5 + 7 =" in texts[0] and "Response:\n12" in texts[0]


def test_llm_judge_raw_scale_custom_parse_and_batching():
    policy = ScriptedPolicy(lambda text: "7/7" if "good" in text else "1/7")
    judge = LLMJudge(
        policy,
        "r",
        score_range=(1, 7),
        normalize=False,
        batch_size=2,
        parse=lambda t: float(t.split("/")[0]),
    )
    results = judge.judge(["good", "bad", "good"], [ITEM] * 3)
    assert [(r.score, r.outcome.value) for r in results] == [
        (7.0, "ok"),
        (1.0, "wrong"),
        (7.0, "ok"),
    ]
    assert [len(texts) for texts, _ in policy.calls] == [2, 1]
    raising = LLMJudge(ScriptedPolicy(lambda t: "?"), "r", parse=lambda t: float(t))
    [r] = raising.judge(["a"], [ITEM])
    assert r.outcome is Outcome.ERROR and "parse raised ValueError" in r.reason


def test_llm_judge_per_item_failures_do_not_fail_the_batch():
    policy = ScriptedPolicy(lambda text: "Score: 10", max_seq_len=100)
    judge = LLMJudge(policy, "r")
    results = judge.judge(["fine", "x" * 200, "fine"], [ITEM, ITEM, {"answer": "3"}])
    assert [r.outcome.value for r in results] == ["ok", "error", "error"]
    assert "judge prompt has" in results[1].reason and "at most 99" in results[1].reason
    assert "no string 'question'" in results[2].reason
    assert all(r.score == 0.0 for r in results[1:])


def test_llm_judge_rejects_bad_settings():
    policy = ScriptedPolicy(lambda t: "")
    with pytest.raises(ValueError, match="score_range"):
        LLMJudge(policy, "r", score_range=(5, 5))
    with pytest.raises(ValueError, match="placeholders"):
        LLMJudge(policy, "r", template="{rubric} {answer_text}")
    with pytest.raises(ValueError, match="ok_threshold"):
        LLMJudge(policy, "r", ok_threshold=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        LLMJudge(policy, "r", max_new_tokens=0)
    with pytest.raises(ValueError, match="one item per completion"):
        LLMJudge(policy, "r").judge(["a", "b"], [ITEM])


def test_untrained_llm_judge_gives_errors_deterministically(tiny_policy):
    judge = LLMJudge(tiny_policy, "Is the answer correct?", max_new_tokens=8)
    first = judge.judge(["12", "13", "banana"], [ITEM] * 3)
    again = judge.judge(["12", "13", "banana"], [ITEM] * 3)
    assert [r.raw for r in first] == [r.raw for r in again]  # greedy
    assert all(r.outcome is Outcome.ERROR and r.score == 0.0 for r in first)
    assert all(r.reason.startswith("no score found in judge output ") for r in first)
    assert all(isinstance(r.raw, str) and r.raw_score is None for r in first)


# --------------------------------------------------------------------------------------------
# Reward-model judges
# --------------------------------------------------------------------------------------------


def test_reward_model_judge_scores_the_rendered_pair(reward_model):
    tok = ByteTokenizer()
    judge = RewardModelJudge(reward_model, tok)
    results = judge.judge(["12", "13"], [ITEM, ITEM])
    expected = reward_model.score([render_pair(tok, ITEM["question"], c) for c in ("12", "13")])
    assert [r.raw_score for r in results] == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert [r.score for r in results] == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert all(r.outcome is (Outcome.OK if r.score >= 0 else Outcome.WRONG) for r in results)
    sig = RewardModelJudge(reward_model, tok, normalize="sigmoid").judge(["12"], [ITEM])[0]
    assert sig.score == pytest.approx(1 / (1 + math.exp(-expected[0])), abs=1e-6)
    with pytest.raises(ValueError, match="normalize"):
        RewardModelJudge(reward_model, tok, normalize="tanh")


def test_reward_model_judge_failures_are_typed(reward_model):
    judge = RewardModelJudge(reward_model, ByteTokenizer())
    results = judge.judge(["ok", "x" * 600, "ok"], [ITEM, ITEM, {"answer": "1"}])
    assert [r.outcome.value for r in results[1:]] == ["error", "error"]
    assert "max_seq_len is 512" in results[1].reason
    assert "no string 'question'" in results[2].reason


def test_reward_model_judge_from_a_saved_folder(reward_model, tmp_path):
    reward_model.save(tmp_path / "rm", ByteTokenizer())
    judge = RewardModelJudge.from_pretrained(tmp_path / "rm", normalize="sigmoid")
    direct = RewardModelJudge(reward_model, ByteTokenizer(), normalize="sigmoid")
    assert judge.judge(["12"], [ITEM])[0].score == pytest.approx(
        direct.judge(["12"], [ITEM])[0].score, abs=1e-6
    )


# --------------------------------------------------------------------------------------------
# Pairwise judges
# --------------------------------------------------------------------------------------------


def _first_answer(text):
    return text.split("[Answer A]\n")[1].split("\n")[0]


def test_llm_pairwise_judge_controls_position_bias():
    def reply(text):
        first = _first_answer(text)
        if first in ("good", "bad"):  # a fair judge: prefers "good" in either order
            return "Answer: A" if first == "good" else "Answer: B"
        if first.startswith("biased"):  # always picks the first position
            return "Answer: A"
        return "I cannot decide"

    policy = ScriptedPolicy(reply)
    judge = LLMPairwiseJudge(policy)
    results = judge.compare(
        ["good", "bad", "biased1", "x"], ["bad", "good", "biased2", "y"], [ITEM] * 4
    )
    assert [r.outcome.value for r in results] == ["a", "b", "inconsistent", "error"]
    assert [r.prob_a for r in results] == [1.0, 0.0, None, None]
    assert [r.winner for r in results] == ["A", "B", None, None]
    assert "same position both times" in results[2].reason
    assert results[3].raw == ("I cannot decide", "I cannot decide")
    assert count_pairwise(results) == {"a": 1, "b": 1, "tie": 0, "inconsistent": 1, "error": 1}
    assert "no A/B verdict" in results[3].reason
    [(texts, settings)] = policy.calls  # both orders of all pairs in one batched call
    assert len(texts) == 8 and settings["temperature"] == 0.0
    one_order = LLMPairwiseJudge(ScriptedPolicy(reply), both_orders=False)
    assert one_order.compare(["biased1"], ["biased2"], [ITEM])[0].outcome is PairwiseOutcome.A


def test_pairwise_result_validates():
    with pytest.raises(ValueError, match="needs prob_a"):
        PairwiseResult(PairwiseOutcome.INCONSISTENT, 0.5)
    with pytest.raises(ValueError, match="needs prob_a"):
        PairwiseResult(PairwiseOutcome.A, None)
    assert PairwiseResult("tie", 0.5).outcome is PairwiseOutcome.TIE


def test_reward_model_pairwise_judge_is_bradley_terry(reward_model):
    tok = ByteTokenizer()
    judge = RewardModelPairwiseJudge(reward_model, tok)
    r = RewardModelJudge(reward_model, tok).rewards(["12", "13"], [ITEM, ITEM])
    ab, ba, same = judge.compare(["12", "13", "12"], ["13", "12", "12"], [ITEM] * 3)
    assert ab.prob_a == pytest.approx(1 / (1 + math.exp(-(r[0] - r[1]))), abs=1e-6)
    assert ba.prob_a == pytest.approx(1 - ab.prob_a, abs=1e-6)
    assert {ab.winner, ba.winner} == {"A", "B"}  # no position bias
    assert same.outcome is PairwiseOutcome.TIE and same.prob_a == 0.5
    [err] = judge.compare(["a"], ["b" * 600], [ITEM])
    assert err.outcome is PairwiseOutcome.ERROR and err.prob_a is None


def test_doctests():
    result = doctest.testmod(judges_module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


# --------------------------------------------------------------------------------------------
# Bad inputs: a clear error naming the argument, or a typed outcome for that row only
# --------------------------------------------------------------------------------------------


def test_templates_must_show_the_judge_the_completion_and_question():
    policy = ScriptedPolicy(lambda t: "")
    with pytest.raises(ValueError, match=r"lacks the placeholders \{completion\}"):
        LLMJudge(policy, "x", template="{rubric} {question} rate it")
    with pytest.raises(ValueError, match=r"lacks the placeholders \{question\}"):
        LLMJudge(policy, "x", template="{completion} rate it")
    with pytest.raises(ValueError, match=r"lacks the placeholders \{completion_b\}"):
        LLMPairwiseJudge(policy, template="{question} {completion_a}")


def test_judge_settings_are_validated_naming_the_argument(reward_model):
    policy, tok = ScriptedPolicy(lambda t: ""), ByteTokenizer()
    for bad in ((0, 5, 10), 10, ("a", 5)):
        with pytest.raises(ValueError, match="score_range=.*two finite numbers"):
            LLMJudge(policy, "r", score_range=bad)
    for bad in (None, "0.5", math.nan):
        with pytest.raises(ValueError, match="ok_threshold"):
            LLMJudge(policy, "r", ok_threshold=bad)
    with pytest.raises(ValueError, match="ok_threshold='x'; must be a finite number"):
        RewardModelJudge(reward_model, tok, ok_threshold="x")
    with pytest.raises(ValueError, match="tie_tol='a'; must be a finite number >= 0"):
        RewardModelPairwiseJudge(reward_model, tok, tie_tol="a")
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match=f"batch_size={bad!r}; must be an integer >= 1"):
            RewardModelJudge(reward_model, tok, batch_size=bad)
        with pytest.raises(ValueError, match="batch_size"):
            RewardModelPairwiseJudge(reward_model, tok, batch_size=bad)
        with pytest.raises(ValueError, match="batch_size"):
            LLMJudge(policy, "r", batch_size=bad)


def test_out_of_range_whole_numbers_are_judge_errors():
    judge = LLMJudge(ScriptedPolicy(lambda t: t.split("Response:\n")[1].split("\n")[0]), "r")
    results = judge.judge(["Score: 1e3", "Score: -1", "Score: 7/10"], [ITEM] * 3)
    assert [r.outcome.value for r in results] == ["error", "error", "ok"]
    assert "score 1000 outside score_range" in results[0].reason


@pytest.mark.parametrize("parse", [lambda t: "seven", lambda t: [7], lambda t: True])
def test_a_parse_returning_a_non_number_is_a_judge_error(parse):
    judge = LLMJudge(ScriptedPolicy(lambda t: "Score: 7"), "r", parse=parse)
    [r] = judge.judge(["c"], [ITEM])
    assert r.outcome is Outcome.ERROR and "not a number" in r.reason


def test_non_string_completions_and_questions_are_errors_for_their_row_only(reward_model):
    policy = ScriptedPolicy(lambda t: "Score: 7")
    results = LLMJudge(policy, "r").judge(["c", None, "c"], [{"question": None}, ITEM, ITEM])
    assert [r.outcome.value for r in results] == ["error", "error", "ok"]
    assert "no string 'question'" in results[0].reason
    assert "completion is a NoneType" in results[1].reason
    assert "None" not in "".join(policy.calls[0][0])  # nothing rendered "None" into a prompt
    rm_results = RewardModelJudge(reward_model, ByteTokenizer()).judge([None, 5, "12"], [ITEM] * 3)
    assert [r.outcome.value for r in rm_results[:2]] == ["error", "error"]
    assert "completion is a int" in rm_results[1].reason
    assert rm_results[2].outcome in (Outcome.OK, Outcome.WRONG)
    [pair] = LLMPairwiseJudge(ScriptedPolicy(lambda t: "Answer: A")).compare([None], ["b"], [ITEM])
    assert pair.outcome is PairwiseOutcome.ERROR and "completion is a NoneType" in pair.reason


def test_a_raising_pairwise_parser_is_named_in_the_reason():
    def parse(text):
        raise RuntimeError("boom")

    [r] = LLMPairwiseJudge(ScriptedPolicy(lambda t: "A"), parse=parse).compare(["a"], ["b"], [ITEM])
    assert r.outcome is PairwiseOutcome.ERROR
    assert "parse raised RuntimeError: boom" in r.reason
