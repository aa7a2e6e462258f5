"""Judges as rewards: a notebook class satisfies the `Judge` protocols, judge failures through
`run_verifier` and `score_batch` are typed outcomes, a judge verifier pickles with its builder,
and LLM, reward-model and scripted judges score a real GRPO rollout and step (a judge's failure
is excluded and counted, never a 0.0 reward for the policy)."""

import functools
import math
import pickle
import time

import cloudpickle
import pytest
import torch
from _judge_helpers import ScriptedPolicy

from posttrain.envs import ReasoningGymGroupBuilder, chain_sum_task
from posttrain.models import ByteTokenizer
from posttrain.policy import Policy
from posttrain.rewards import (
    Judge,
    JudgeResult,
    LLMJudge,
    LLMPairwiseJudge,
    Outcome,
    PairwiseJudge,
    RewardModelJudge,
    count_outcomes,
    judge_as_verifier,
    render_pair,
    run_verifier,
    score_batch,
)
from posttrain.rl import RLAlgorithm, RLTrainer, collect_groups, outcome_counts, split_groups

ITEM = {"question": "5 + 7 =", "answer": "12", "metadata": {}}


def _score_3(text):
    return "Score: 3"


# --------------------------------------------------------------------------------------------
# Judges as verifiers: run_verifier / score_batch budgets
# --------------------------------------------------------------------------------------------


class RaisingJudge:
    def judge(self, completions, items):
        raise RuntimeError("judge server down")


class SlowJudge:
    def judge(self, completions, items):
        time.sleep(1.0)
        return [JudgeResult.from_score(1.0)] * len(completions)


class WrongCountJudge:
    def judge(self, completions, items):
        return []


def test_a_notebook_class_satisfies_the_protocols():
    assert isinstance(RaisingJudge(), Judge)
    assert isinstance(LLMJudge(ScriptedPolicy(lambda t: ""), "r"), Judge)
    assert isinstance(LLMPairwiseJudge(ScriptedPolicy(lambda t: "")), PairwiseJudge)
    with pytest.raises(TypeError, match="judge"):
        judge_as_verifier(lambda c, i: 1.0)


def test_judge_failures_through_run_verifier_are_typed():
    assert (
        run_verifier(judge_as_verifier(RaisingJudge()), "x", ITEM).reason
        == "RuntimeError: judge server down"
    )
    assert (
        run_verifier(judge_as_verifier(SlowJudge()), "x", ITEM, timeout_s=0.05).outcome
        is Outcome.TIMEOUT
    )
    assert (
        "returned 0 results" in run_verifier(judge_as_verifier(WrongCountJudge()), "x", ITEM).reason
    )
    verifier = judge_as_verifier(
        LLMJudge(ScriptedPolicy(lambda t: "Score: 8" if "Response:\n12" in t else "hmm"), "r")
    )
    results = score_batch(verifier, ["12", "13", "12"], [ITEM] * 3, timeout_s=60.0)
    assert count_outcomes(results) == {
        "ok": 2,
        "wrong": 0,
        "format_error": 0,
        "timeout": 0,
        "error": 1,
    }
    assert isinstance(results[0], JudgeResult) and results[0].raw == "Score: 8"


def test_llm_judge_verifier_pickles_with_its_builder(tiny_policy):
    verifier = judge_as_verifier(LLMJudge(tiny_policy, "r", max_new_tokens=4))
    builder = ReasoningGymGroupBuilder(ITEM, "chain_sum", verifier=verifier)
    copy = pickle.loads(cloudpickle.dumps(builder))  # a torchtune model pickles with cloudpickle
    [env] = copy.make_envs(1)
    assert env.step("12").verifier_result.outcome is Outcome.ERROR
    scripted = judge_as_verifier(LLMJudge(ScriptedPolicy(_score_3), "r"))
    assert pickle.loads(pickle.dumps(scripted))("12", ITEM).score == 0.3  # the lock is rebuilt


# --------------------------------------------------------------------------------------------
# Inside a real GRPO rollout and step
# --------------------------------------------------------------------------------------------


def test_untrained_llm_judge_as_reward_in_a_grpo_rollout(tiny_policy):
    judge = LLMJudge(
        Policy.from_spec("tiny-1m", seed=1), "Is the answer correct?", max_new_tokens=8
    )
    verifier = judge_as_verifier(judge)
    items = chain_sum_task(size=8, held_out_size=2).train_items[:2]
    builders = [ReasoningGymGroupBuilder(it, "chain_sum", verifier=verifier) for it in items]
    groups = collect_groups(
        tiny_policy, builders, group_size=3, max_new_tokens=4, seed=0, verifier_timeout_s=30.0
    )
    counts = outcome_counts(groups)
    assert sum(counts.values()) == 6 and counts["error"] == 6  # untrained judge: garbage
    for t in (t for g in groups for t in g):
        assert t.outcome == "error" and t.reward == 0.0
        assert t.info["verifier_reason"].startswith("no score found in judge output")
    kept, split = split_groups(groups)  # the judge's failure: excluded and counted, not trained
    assert kept == [] and split["groups_excluded_error"] == 2


def test_reward_model_judge_as_reward_in_a_grpo_rollout(tiny_policy, reward_model):
    verifier = judge_as_verifier(RewardModelJudge(reward_model, ByteTokenizer()))
    items = chain_sum_task(size=8, held_out_size=2).train_items[:2]
    builders = [ReasoningGymGroupBuilder(it, "chain_sum", verifier=verifier) for it in items]
    groups = collect_groups(tiny_policy, builders, group_size=3, max_new_tokens=4, seed=0)
    rows = [t for g in groups for t in g]
    expected = reward_model.score(
        [
            render_pair(ByteTokenizer(), it["question"], t.text)
            for it, g in zip(items, groups)
            for t in g
        ]
    )
    assert [t.reward for t in rows] == pytest.approx(expected, rel=1e-6, abs=1e-5)  # raw rewards
    assert {t.outcome for t in rows} <= {"ok", "wrong"}


def test_scripted_judge_rewards_reach_a_grpo_step(tiny_policy):
    """A judge that scores by the completion's length gives mixed rewards to the first group and
    no verdict to the second: one RLTrainer step trains on the first, and excludes and counts
    the second (the judge failed: `error`, never a 0.0 reward for the policy)."""
    task = chain_sum_task(size=16, held_out_size=2)
    mute_on = task.train_items[1]["question"]

    def reply(text):
        completion = text.split("Response:\n")[1].rsplit("\n\nRate", 1)[0]
        return "???" if mute_on in text else f"Score: {min(10, len(completion))}"

    verifier = judge_as_verifier(LLMJudge(ScriptedPolicy(reply), "r"))
    task = chain_sum_task(
        size=16,
        held_out_size=2,
        builder=functools.partial(ReasoningGymGroupBuilder, task="chain_sum", verifier=verifier),
    )
    policy = Policy.from_spec("tiny-1m", seed=0)
    trainer = RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=1e-4),
        task=task,
        algo=RLAlgorithm.grpo(group_size=4, kl_coef=0.0),
        prompts_per_step=2,
        max_new_tokens=6,
        progress=False,
    )
    row = trainer.step()
    outcomes = {k: row[f"outcome_{k}"] for k in ("ok", "wrong", "format_error", "timeout", "error")}
    assert outcomes["error"] == 4 and outcomes["ok"] + outcomes["wrong"] == 4
    assert outcomes["format_error"] == outcomes["timeout"] == 0
    assert row["groups_kept"] == 1 and row["groups_excluded_error"] == 1
    assert math.isfinite(row["reward_mean"])
