"""collect_groups: group shapes, sampler log-probs vs teacher-forced recomputation, typed failures
(verifier raises / times out, NaN group reward, empty completion), multi-turn token masks."""

import math
import time

import pytest
import torch
from _env_helpers import ScriptedTurnsPolicy

from posttrain.envs import CalculatorGroupBuilder, ReasoningGymGroupBuilder, chain_sum_task
from posttrain.models import ByteTokenizer
from posttrain.policy import Policy
from posttrain.rl import collect_groups, outcome_counts, split_groups

ITEM = {"question": "4 - 1 =", "answer": "3", "metadata": {}}


@pytest.fixture(scope="module")
def policy():
    return Policy.from_spec("tiny-1m", seed=0)


def test_groups_of_g_with_sampler_logprobs_equal_to_recomputation(policy, monkeypatch):
    builders = chain_sum_task(size=16, held_out_size=2).builders(0, 3)
    calls = []
    generate = policy.generate
    monkeypatch.setattr(policy, "generate", lambda *a, **k: calls.append(k) or generate(*a, **k))
    groups = collect_groups(
        policy, builders, group_size=4, max_new_tokens=6, temperature=0.7, seed=1, policy_version=5
    )
    assert len(calls) == 1 and calls[0]["n"] == 4  # one batched call for single-turn envs
    assert [len(g) for g in groups] == [4, 4, 4]
    assert [g.group_id for g in groups] == [0, 1, 2]
    rows = [t for g in groups for t in g]
    assert all(t.policy_version == 5 and t.completion_mask is None for t in rows)
    assert sum(outcome_counts(groups).values()) == 12
    recomputed = policy.logprobs(
        [t.prompt_ids for t in rows], [t.completion_ids for t in rows], temperature=0.7
    )
    for t, lp in zip(rows, recomputed):
        torch.testing.assert_close(torch.tensor(t.logprobs), lp, atol=1e-5, rtol=0)


def test_same_seed_same_groups(policy):
    builders = chain_sum_task(size=16, held_out_size=2).builders(0, 2)
    a = collect_groups(policy, builders, group_size=2, max_new_tokens=4, seed=3)
    b = collect_groups(policy, builders, group_size=2, max_new_tokens=4, seed=3)
    assert [t.completion_ids for g in a for t in g] == [t.completion_ids for g in b for t in g]


def _raises(completion, item):
    raise KeyError("answer")


def _hangs(completion, item):
    time.sleep(600)
    return 1.0


def test_verifier_errors_and_timeouts_are_typed_and_exclude_their_group(policy):
    """The hanging verifier sleeps 600 s past a 2 s budget, which the others (milliseconds)
    never reach, even on a busy machine."""
    builders = [
        ReasoningGymGroupBuilder(ITEM, "chain_sum"),
        ReasoningGymGroupBuilder(ITEM, "chain_sum", verifier=_raises),
        ReasoningGymGroupBuilder(ITEM, "chain_sum", verifier=_hangs),
    ]
    groups = collect_groups(
        policy, builders, group_size=2, max_new_tokens=3, seed=0, verifier_timeout_s=2.0
    )
    assert groups[1].outcomes == ["error", "error"] and groups[1].rewards == [0.0, 0.0]
    assert groups[2].outcomes == ["timeout", "timeout"]
    assert outcome_counts(groups)["error"] == 2 and outcome_counts(groups)["timeout"] == 2
    kept, counts = split_groups(groups)
    assert [g.group_id for g in kept] == [0]
    assert counts["groups_excluded_error"] == 2


class _NaNGroupBuilder(ReasoningGymGroupBuilder):
    def group_rewards(self, trajectories):
        return [math.nan] * len(trajectories)


def test_nan_group_reward_is_an_error_outcome_not_a_crash(policy):
    groups = collect_groups(
        policy, [_NaNGroupBuilder(ITEM, "chain_sum")], group_size=2, max_new_tokens=3, seed=0
    )
    assert groups[0].outcomes == ["error", "error"] and groups[0].rewards == [0.0, 0.0]
    assert "must be a finite number" in groups[0].trajectories[0].info["error"]


def test_empty_completion_is_scored():
    groups = collect_groups(
        ScriptedTurnsPolicy([""]),
        [ReasoningGymGroupBuilder(ITEM, "chain_sum")],
        group_size=2,
        max_new_tokens=3,
    )
    t = groups[0].trajectories[0]
    assert t.text == "" and t.completion_ids == [ByteTokenizer.END]
    assert t.outcome in ("wrong", "format_error") and t.reward == 0.0


def test_multi_turn_observation_tokens_are_masked_context():
    item = {"question": "What is 2 + 3?", "answer": "5"}
    policy = ScriptedTurnsPolicy(["<calc>2+3</calc>", "<answer>5</answer>"])
    [group] = collect_groups(
        policy, [CalculatorGroupBuilder(item)], group_size=1, max_new_tokens=32
    )
    t = group.trajectories[0]
    assert t.outcome == "ok" and t.reward == 1.0 and t.text == "<calc>2+3</calc><answer>5</answer>"
    mask = t.completion_mask
    assert mask is not None and not all(mask) and mask[0] and mask[-1]
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, mask) if not m)
    assert all(lp == -0.5 for lp, m in zip(t.logprobs, mask) if m)
    # prompt + completion is exactly the rendered conversation (the tool turn as context)
    tok = ByteTokenizer()
    messages = [
        *CalculatorGroupBuilder(item).make_envs(1)[0].initial_messages(),
        {"role": "assistant", "content": "<calc>2+3</calc>"},
        {"role": "tool", "content": "<result>5</result>"},
        {"role": "assistant", "content": "<answer>5</answer>"},
    ]
    assert t.prompt_ids + t.completion_ids == tok.render_chat(messages).input_ids


def test_doctests():
    import doctest

    import posttrain.rl.rollout as module

    assert doctest.testmod(module).failed == 0
