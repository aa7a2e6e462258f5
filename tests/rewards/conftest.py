"""Fixtures of the reward tests, each built once per module: `tiny_policy` (an untrained
`tiny-1m` policy), `reward_model` (an untrained `tiny-1m` reward model) and `rm_judge` (a
`RewardModelJudge` on one)."""

from __future__ import annotations

import pytest

from posttrain.models import ByteTokenizer
from posttrain.policy import Policy
from posttrain.rewards import RewardModel, RewardModelJudge


@pytest.fixture(scope="module")
def tiny_policy() -> Policy:
    return Policy.from_spec("tiny-1m", seed=0)


@pytest.fixture(scope="module")
def reward_model() -> RewardModel:
    return RewardModel.from_spec("tiny-1m", seed=0)


@pytest.fixture(scope="module")
def rm_judge() -> RewardModelJudge:
    return RewardModelJudge(RewardModel.from_spec("tiny-1m", seed=0), ByteTokenizer())
