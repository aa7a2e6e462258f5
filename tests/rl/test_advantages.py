"""Advantage estimators (posttrain.rl.algorithms, verl's `core_algos` behind posttrain's
conventions): GRPO with the unbiased std and without it (Dr. GRPO), groups kept apart, RLOO,
REINFORCE++ and GAE by hand or against a plain-Python loop, scores on the last response token,
and input errors.

Notation: B = sequences, T = response tokens. Reference values are computed by hand in the
docstrings, or by a plain-Python loop written here."""

from __future__ import annotations

import math

import pytest
import torch

import posttrain.rl.algorithms as rl
from posttrain.rl import compute_advantages


def test_grpo_unbiased_std():
    """[1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735, so
    A = +-0.5 / (0.57735 + 1e-6) = +-0.866024. Every response token carries it."""
    mask_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv_BT, ret_BT = compute_advantages(
        "grpo",
        scores_B=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        response_mask_BT=mask_BT,
        group_ids=["p"] * 4,
    )
    assert adv_BT.shape == (4, 3) and adv_BT.dtype == torch.float32
    expected_B = torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(adv_BT, expected_B[:, None] * mask_BT)
    assert abs(float(adv_BT[0, 0]) - 0.866024) < 1e-5
    torch.testing.assert_close(ret_BT, adv_BT)


def test_grpo_without_std_is_dr_grpo():
    """norm_adv_by_std_in_grpo=False: A = r - mean = +-0.5."""
    adv_BT, _ = compute_advantages(
        "grpo",
        scores_B=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        response_mask_BT=torch.ones(4, 1),
        group_ids=[0] * 4,
        norm_adv_by_std_in_grpo=False,
    )
    torch.testing.assert_close(adv_BT[:, 0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_groups_are_separate_and_tensor_ids_work():
    """Two groups [1, 0] and [3, 3, 3]: the first gives +-0.5 / (std 0.70711 + 1e-6) = +-0.70711,
    the second (all equal) exactly 0. Ids given as a torch tensor (verl would key its dicts by
    tensor identity)."""
    adv_BT, _ = compute_advantages(
        "grpo",
        scores_B=torch.tensor([1.0, 0.0, 3.0, 3.0, 3.0]),
        response_mask_BT=torch.ones(5, 2),
        group_ids=torch.tensor([7, 7, 9, 9, 9]),
    )
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(adv_BT[:, 0], torch.tensor([a, -a, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized"])
def test_equal_rewards_give_exact_zero(name):
    """Seven rewards of 0.7: no learning signal, so every advantage is exactly 0, no NaN. (verl
    alone, in fp32, gives +-0.056 for GRPO: the fp32 mean is not exactly 0.7 and the std is
    ~1e-8, so the rounding error is divided by ~1e-6.)"""
    adv_BT, ret_BT = compute_advantages(
        name, scores_B=torch.full((7,), 0.7), response_mask_BT=torch.ones(7, 3), group_ids=[0] * 7
    )
    assert torch.equal(adv_BT, torch.zeros(7, 3)) and torch.equal(ret_BT, torch.zeros(7, 3))


def test_rloo_leave_one_out_by_hand():
    """RLOO: A_i = r_i - mean_{j != i} r_j. Rewards [1, 0, 0, 1]: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3.
    Rewards [2, 0, 1]: 2 - 0.5 = 1.5, 0 - 1.5 = -1.5, 1 - 1 = 0."""
    adv_BT, _ = compute_advantages(
        "rloo",
        scores_B=torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 1.0]),
        response_mask_BT=torch.ones(7, 1),
        group_ids=["a"] * 4 + ["b"] * 3,
    )
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1.5, -1.5, 0.0]
    torch.testing.assert_close(adv_BT[:, 0], torch.tensor(expected))


def test_rloo_matches_a_python_loop():
    gen = torch.Generator().manual_seed(0)
    scores_B = torch.randint(0, 5, (12,), generator=gen).float()
    groups = [i // 4 for i in range(12)]
    adv_BT, _ = compute_advantages(
        "rloo", scores_B=scores_B, response_mask_BT=torch.ones(12, 1), group_ids=groups
    )
    for i in range(12):
        others = [float(scores_B[j]) for j in range(12) if groups[j] == groups[i] and j != i]
        assert abs(float(adv_BT[i, 0]) - (float(scores_B[i]) - sum(others) / len(others))) < 1e-5


def test_reinforce_plus_plus_by_hand():
    """Masks [1, 1] and [1, 0], scores [1, 0], gamma 1: token returns [1, 1] and [0]. Whitened
    over the three tokens: mean 2/3, unbiased var ((1/3)^2 * 2 + (2/3)^2) / 2 = 1/3, so
    advantages (1/3) / 0.57735 = 0.57735 and (-2/3) / 0.57735 = -1.15470.
    With gamma 0.5 the returns of row 0 are [0.5, 1]."""
    mask_BT = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv_BT, ret_BT = compute_advantages(
        "reinforce_plus_plus", scores_B=torch.tensor([1.0, 0.0]), response_mask_BT=mask_BT
    )
    torch.testing.assert_close(ret_BT, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(
        adv_BT, torch.tensor([[0.57735, 0.57735], [-1.15470, 0.0]]), atol=1e-4, rtol=0
    )
    _, ret_BT = compute_advantages(
        "reinforce_plus_plus",
        scores_B=torch.tensor([1.0, 0.0]),
        response_mask_BT=mask_BT,
        gamma=0.5,
    )
    torch.testing.assert_close(ret_BT[0], torch.tensor([0.5, 1.0]))


def test_gae_by_hand():
    """One row, reward 1 on the last of 2 tokens, values [0.5, 0.25], gamma = lam = 1:
    delta_1 = 1 - 0.25 = 0.75, A_1 = 0.75; delta_0 = 0 + 0.25 - 0.5 = -0.25, A_0 = -0.25 + 0.75
    = 0.5; returns = A + V = [1, 1]. verl whitens the advantages over the batch's tokens:
    mean 0.625, unbiased std 0.17678 -> [-0.70711, 0.70711]."""
    adv_BT, ret_BT = compute_advantages(
        "gae",
        scores_B=torch.tensor([1.0]),
        response_mask_BT=torch.ones(1, 2),
        values_BT=torch.tensor([[0.5, 0.25]]),
    )
    torch.testing.assert_close(ret_BT, torch.tensor([[1.0, 1.0]]))
    torch.testing.assert_close(adv_BT, torch.tensor([[-0.70711, 0.70711]]), atol=1e-4, rtol=0)
    # A padded third token changes nothing and gets 0 (verl's whitening would leave -mean/std).
    adv_BT, ret_BT = compute_advantages(
        "gae",
        scores_B=torch.tensor([1.0]),
        response_mask_BT=torch.tensor([[1.0, 1.0, 0.0]]),
        values_BT=torch.tensor([[0.5, 0.25, 0.7]]),
    )
    torch.testing.assert_close(adv_BT, torch.tensor([[-0.70711, 0.70711, 0.0]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(ret_BT, torch.tensor([[1.0, 1.0, 0.0]]))


def test_scores_go_on_the_last_response_token():
    rewards_BT = rl.scores_to_token_rewards(
        torch.tensor([2.0, 3.0]), torch.tensor([[1, 1, 0], [0, 1, 1]])
    )
    torch.testing.assert_close(rewards_BT, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 3.0]]))
    with pytest.raises(ValueError, match="no response token"):
        rl.scores_to_token_rewards(torch.tensor([1.0]), torch.zeros(1, 2))


def test_advantage_input_errors():
    mask_BT = torch.ones(2, 1)
    with pytest.raises(ValueError, match="valid: .*grpo"):
        compute_advantages("nope", scores_B=torch.ones(2), response_mask_BT=mask_BT)
    with pytest.raises(ValueError, match="exactly one"):
        compute_advantages("grpo", response_mask_BT=mask_BT, group_ids=[0, 0])
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", scores_B=torch.ones(2), response_mask_BT=mask_BT)
    with pytest.raises(ValueError, match="at least 2 completions"):
        compute_advantages(
            "grpo", scores_B=torch.ones(2), response_mask_BT=mask_BT, group_ids=[0, 1]
        )
    with pytest.raises(ValueError, match="NaN"):
        compute_advantages(
            "grpo",
            scores_B=torch.tensor([1.0, math.nan]),
            response_mask_BT=mask_BT,
            group_ids=[0, 0],
        )
    with pytest.raises(ValueError, match="values_BT"):
        compute_advantages("gae", scores_B=torch.ones(2), response_mask_BT=mask_BT)


def test_every_offered_estimator_runs():
    gen = torch.Generator().manual_seed(1)
    mask_BT = torch.ones(4, 3)
    for name in rl.advantage_estimators():
        adv_BT, ret_BT = compute_advantages(
            name,
            scores_B=torch.rand(4, generator=gen),
            response_mask_BT=mask_BT,
            group_ids=[0, 0, 1, 1],
            values_BT=torch.rand(4, 3, generator=gen),
        )
        assert adv_BT.shape == ret_BT.shape == (4, 3), name
        assert torch.isfinite(adv_BT).all(), name
    assert {"grpo", "rloo", "reinforce_plus_plus", "gae"} <= set(rl.advantage_estimators())
    assert "remax" not in rl.advantage_estimators()  # needs reward baselines posttrain lacks
