"""verl loaded on first use (`posttrain.rl.verl_registry.core_algos()`): the names listed without
it equal verl's own registries, so they cannot drift from the pinned verl, and an RL step still
computes with verl's functions. tests/project/test_import_cost.py checks that importing the
trainer, the RL workflow or the CLI does not load verl."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from posttrain.rl import RLAlgorithm, policy_loss
from posttrain.rl.advantages import compute_advantages
from posttrain.rl.verl_registry import (
    _ADV_INPUTS,
    BUILTIN_ADVANTAGE_ESTIMATORS,
    BUILTIN_POLICY_LOSSES,
    _required_params,
    advantage_estimators,
    core_algos,
    policy_losses,
)


def test_builtin_names_equal_verls_registries():
    """verl's own entries (those its core_algos defines; other tests of this process may have
    registered more) are the listed names: the usable estimators, every policy loss."""
    verl = core_algos()
    assert verl is sys.modules["verl.trainer.ppo.core_algos"]
    own_estimators = {
        name
        for name, fn in verl.ADV_ESTIMATOR_REGISTRY.items()
        if fn.__module__ == verl.__name__ and _required_params(fn) <= _ADV_INPUTS
    }
    own_losses = {
        n for n, fn in verl.POLICY_LOSS_REGISTRY.items() if fn.__module__ == verl.__name__
    }
    assert sorted(own_estimators) == list(BUILTIN_ADVANTAGE_ESTIMATORS)
    assert sorted(own_losses) == list(BUILTIN_POLICY_LOSSES)
    # once verl is loaded the names come from its registries, registered ones included
    assert set(BUILTIN_ADVANTAGE_ESTIMATORS) <= set(advantage_estimators())
    assert set(BUILTIN_POLICY_LOSSES) <= set(policy_losses())
    assert "remax" in verl.ADV_ESTIMATOR_REGISTRY and "remax" not in advantage_estimators()


def test_unknown_names_still_list_the_valid_ones():
    with pytest.raises(ValueError, match="unknown policy_loss 'vanila'; valid: .*vanilla"):
        RLAlgorithm(policy_loss="vanila")
    with pytest.raises(ValueError, match="unknown advantage_estimator 'grp'; valid: .*grpo"):
        RLAlgorithm(advantage_estimator="grp")


def test_an_rl_step_computes_with_verls_functions(monkeypatch):
    """Each verl function a step uses is called through the accessor, with the values by hand:
    GRPO on scores [1, 0, 0, 1] gives +-0.5 / sqrt(1/3) = +-0.866 (unbiased std); PPO clip with
    old = new log-probs (ratio 1) and advantage 1 gives -1 per token, k3 KL to an equal
    reference 0, so the token-mean loss is -1."""
    verl = core_algos()
    called: list[str] = []
    for name in ("get_adv_estimator_fn", "get_policy_loss_fn", "agg_loss", "kl_penalty"):
        original = getattr(verl, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            called.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(verl, name, spy)

    mask_BT = torch.ones(4, 2)
    adv_BT, _ = compute_advantages(
        "grpo",
        scores_B=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        response_mask_BT=mask_BT,
        group_ids=["p"] * 4,
    )
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(adv_BT[:, 0], torch.tensor([1.0, -1.0, -1.0, 1.0]) * expected)

    logprobs_BT = torch.zeros(4, 2, requires_grad=True)
    loss, _ = policy_loss(
        logprobs_BT,
        torch.zeros(4, 2),
        torch.ones(4, 2),
        mask_BT,
        algo=RLAlgorithm(kl_coef=0.1, group_size=4),
        ref_logprobs_BT=torch.zeros(4, 2),
    )
    assert float(loss.detach()) == pytest.approx(-1.0, abs=1e-6)
    assert {"get_adv_estimator_fn", "get_policy_loss_fn", "agg_loss", "kl_penalty"} <= set(called)
