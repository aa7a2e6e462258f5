"""One reward rule: NaN, inf and anything beyond float32 (1e39) are the same counted error
wherever a reward enters (a verifier's score, `VerifierResult`, `StepResult`, `Trajectory`, a
group reward hook, the trainer's batch), and `fit()` goes on."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from posttrain.rewards.verifier import (
    FLOAT32_MAX,
    Outcome,
    VerifierResult,
    check_reward,
    count_outcomes,
    run_verifier,
)
from posttrain.rl.environment import Group, StepResult, Trajectory, group_rewards, screen_rewards


def test_the_reward_rule_is_float32_range():
    assert FLOAT32_MAX == float(torch.finfo(torch.float32).max) == float(np.finfo(np.float32).max)
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(1e39))  # what 1e39 becomes in the trainer's batch
    for ok in [0, 1, -1.5, FLOAT32_MAX, -FLOAT32_MAX, np.float32(0.5), torch.tensor(0.25)]:
        assert check_reward(ok) == float(ok)
    for bad in [1e39, -1e39, math.inf, -math.inf, math.nan, 3.5e38, 10**400]:
        with pytest.raises(ValueError, match="reward"):
            check_reward(bad)
    for bad in ["1.0", None, [1.0], torch.tensor([1.0, 2.0])]:
        with pytest.raises(ValueError, match="reward"):
            check_reward(bad)


@pytest.mark.parametrize("bad", [1e39, -1e39, math.inf, math.nan])
def test_every_entry_point_applies_the_rule(bad):
    message = "must be a finite number within float32 range"
    result = run_verifier(lambda c, i: bad, "x", {}, timeout_s=30)
    assert result.outcome is Outcome.ERROR and message in result.reason
    assert count_outcomes([result])["error"] == 1
    with pytest.raises(ValueError, match=f"VerifierResult score {message}"):
        VerifierResult(bad, "ok")
    with pytest.raises(ValueError, match=f"StepResult reward {message}"):
        StepResult(done=True, reward=bad)
    fields = dict(
        group_id=0,
        prompt_ids=[1],
        completion_ids=[2],
        logprobs=[0.0],
        outcome="ok",
        finish_reason="stop",
        text="",
    )
    with pytest.raises(ValueError, match=f"Trajectory reward {message}"):
        Trajectory(reward=bad, **fields)

    class Hook:
        def make_envs(self, group_size):
            return []

        def group_rewards(self, trajectories):
            return [0.0, bad]

    pair = [Trajectory(reward=0.0, **fields), Trajectory(reward=1.0, **fields)]
    with pytest.raises(ValueError, match=f"Hook.group_rewards reward 1 {message}"):
        group_rewards(Hook(), pair)
    group = Group(pair)
    pair[1].reward = bad  # edited after it was built
    screen_rewards([group])
    assert group.outcomes == ["ok", "error"] and group.rewards == [0.0, 0.0]
    assert message in pair[1].info["error"]


class _Env:
    """One episode; `mode` says how its reward breaks the rule (or "fine")."""

    def __init__(self, mode, verify):
        self.mode, self.verify = mode, verify

    def initial_messages(self):
        return [{"role": "user", "content": self.mode}]

    def step(self, text):
        if self.mode == "step":
            return StepResult(done=True, reward=1e39)
        verify = self.verify if self.mode == "verifier" else (lambda c, i: 1.0)
        result = run_verifier(verify, text, {}, timeout_s=30)
        return StepResult(done=True, reward=result.score, verifier_result=result)


class _Builder:
    def __init__(self, mode, verify):
        self.mode, self.verify = mode, verify

    def make_envs(self, group_size):
        return [_Env(self.mode, self.verify) for _ in range(group_size)]


class _HookBuilder(_Builder):
    def group_rewards(self, trajectories):
        return [-1e39] * len(trajectories)


class _Task:
    def __init__(self, verify):
        self.verify = verify

    def builders(self, batch_index, batch_size):
        return [
            _Builder("step", self.verify),
            _Builder("verifier", self.verify),
            _HookBuilder("fine", self.verify),
            _Builder("fine", self.verify),
        ][:batch_size]

    def held_out(self, n):
        return []


def test_rewards_beyond_float32_are_counted_errors_and_fit_goes_on():
    """1e39 from a StepResult, from a verifier and -1e39 from a group hook: each is outcome
    error for its group (4 samples), counted and excluded, and `fit()` runs both steps."""
    from posttrain.policy import Policy
    from posttrain.rl import RLAlgorithm, RLTrainer

    policy = Policy.from_spec("tiny-1m", seed=0)
    trainer = RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=1e-3),
        task=_Task(lambda c, i: 1e39),
        algo=RLAlgorithm.grpo(group_size=4, kl_coef=0.0),
        prompts_per_step=4,
        max_new_tokens=2,
        progress=False,
    )
    metrics = trainer.fit(2)
    assert trainer.step_count == 2 and len(metrics) == 2
    for row in metrics.to_dict("records"):
        assert row["outcome_error"] == 12 and row["groups_excluded_error"] == 3
        assert row["groups_kept"] == 1 and row["outcome_ok"] == 4
    reasons = {
        t.info.get("error", t.info.get("verifier_reason", ""))
        for g in trainer.last_groups
        for t in g
    }
    assert any("StepResult reward must be a finite number" in r for r in reasons), reasons
    assert any("verifier score must be a finite number" in r for r in reasons), reasons
    assert any("group_rewards" in r for r in reasons), reasons
