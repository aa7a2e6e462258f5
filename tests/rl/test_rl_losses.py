"""RL losses (posttrain.rl.algorithms): loss aggregation modes by definition and the step
normaliser (micro-batches equal one big batch), the policy loss (PPO clip by hand, every verl
policy loss), KL to the reference (descent, gradients, values by hand) and the value loss.

Notation: B = sequences, T = response tokens. Reference values are computed by hand in the
docstrings, or by a plain-Python loop written here."""

from __future__ import annotations

import math

import pytest
import torch

import posttrain.rl.algorithms as rl
import posttrain.rl.config as rl_config
from posttrain.rl import RLAlgorithm, aggregate, kl_loss, policy_loss, step_units, value_loss

# --------------------------------------------------------------------------------------------
# Aggregation and the step normaliser
# --------------------------------------------------------------------------------------------


def test_aggregation_modes_by_definition():
    """Loss 1 on masks [1, 1, 1] and [1, 0, 0]: token-mean 4 / 4 = 1, token-sum 4,
    seq-mean-token-sum (3 + 1) / 2 = 2, seq-mean-token-mean (3/3 + 1/1) / 2 = 1."""
    mask_BT = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    ones_BT = torch.ones(2, 3)
    expected = {
        "token-mean": 1.0,
        "token-sum": 4.0,
        "seq-mean-token-sum": 2.0,
        "seq-mean-token-mean": 1.0,
    }
    for mode, value in expected.items():
        assert float(aggregate(ones_BT, mask_BT, loss_agg_mode=mode)) == pytest.approx(value)
    assert int(step_units(mask_BT, "token-mean")) == 4
    assert int(step_units(mask_BT, "seq-mean-token-mean")) == 2
    assert int(step_units(torch.tensor([[1, 0], [0, 0]]), "seq-mean-token-sum")) == 1


def _rollout_batch(B=4, T=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 1, 3, 2][:B]
    mask_BT = torch.zeros(B, T)
    for b, n in enumerate(lengths):
        mask_BT[b, :n] = 1
    old_BT = -torch.rand(B, T, generator=gen) - 0.5
    new_BT = old_BT + 0.3 * torch.randn(B, T, generator=gen)
    ref_BT = old_BT + 0.2 * torch.randn(B, T, generator=gen)
    adv_BT = torch.randn(B, 1, generator=gen).expand(B, T) * mask_BT
    return new_BT, old_BT, ref_BT, adv_BT, mask_BT


@pytest.mark.parametrize(
    "algo",
    [
        RLAlgorithm(loss_agg_mode="token-mean", kl_coef=0.1, entropy_coef=0.01),
        RLAlgorithm.grpo(),
        RLAlgorithm.rloo(kl_coef=0.05, kl_estimator="k2"),
        RLAlgorithm.gspo(clip_ratio_low=0.2, clip_ratio_high=0.2),
        RLAlgorithm.cispo(),
        RLAlgorithm(policy_loss="sapo", loss_agg_mode="seq-mean-token-mean"),
        RLAlgorithm(policy_loss="geo_mean", loss_agg_mode="seq-mean-token-mean"),
    ],
    ids=["token-mean+kl+entropy", "grpo", "rloo", "gspo", "cispo", "sapo", "geo_mean"],
)
def test_micro_batches_equal_one_big_batch(algo):
    """bs1 x ga4 == bs4 x ga1: gradients of the four one-row shares, each divided by the step
    normaliser, add up to the gradient of the one four-row batch."""
    new_BT, old_BT, ref_BT, adv_BT, mask_BT = _rollout_batch()
    entropy_BT = torch.rand(4, 5, generator=torch.Generator().manual_seed(3))
    units = step_units(mask_BT, algo.loss_agg_mode)

    big = new_BT.clone().requires_grad_(True)
    loss_big, _ = policy_loss(
        big,
        old_BT,
        adv_BT,
        mask_BT,
        algo=algo,
        ref_logprobs_BT=ref_BT,
        entropy_BT=entropy_BT,
        num_units_in_step=units,
    )
    loss_big.backward()

    small = new_BT.clone().requires_grad_(True)
    total = 0.0
    for b in range(4):
        rows = slice(b, b + 1)
        share, _ = policy_loss(
            small[rows],
            old_BT[rows],
            adv_BT[rows],
            mask_BT[rows],
            algo=algo,
            ref_logprobs_BT=ref_BT[rows],
            entropy_BT=entropy_BT[rows],
            num_units_in_step=units,
        )
        share.backward()
        total += float(share.detach())
    assert total == pytest.approx(float(loss_big), abs=1e-6)
    torch.testing.assert_close(small.grad, big.grad, atol=1e-7, rtol=1e-5)
    assert big.grad.abs().sum() > 0


def test_without_the_step_normaliser_accumulation_is_not_invariant():
    """The check above is not vacuous: normalising each micro-batch by itself weights the
    tokens of short micro-batches more."""
    new_BT, old_BT, _, adv_BT, mask_BT = _rollout_batch()
    algo = RLAlgorithm()
    big = new_BT.clone().requires_grad_(True)
    policy_loss(big, old_BT, adv_BT, mask_BT, algo=algo)[0].backward()
    small = new_BT.clone().requires_grad_(True)
    for b in range(4):
        policy_loss(
            small[b : b + 1], old_BT[b : b + 1], adv_BT[b : b + 1], mask_BT[b : b + 1], algo=algo
        )[0].backward()
    assert not torch.allclose(small.grad, big.grad)


# --------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------


def test_ppo_clip_loss_by_hand():
    """PPO eq. 7 per token, eps 0.2, dual-clip c = 3; old log-probs 0, so r = exp(logprob).
      r = 1.5, A = +1: min(1.5, 1.2) -> loss -1.2, clipped, gradient 0
      r = 0.5, A = +1: min(0.5, 0.8) -> loss -0.5, gradient d(-r)/dlogp = -0.5
      r = 1.1, A = -1: min(-1.1, -1.1) -> loss 1.1, gradient +1.1
      r = 4.0, A = -1: max(4, 1.2) = 4 > c = 3 -> dual clip, loss 3, gradient 0
    Token mean: (-1.2 - 0.5 + 1.1 + 3) / 4 = 0.6; gradients / 4. Clipped tokens (pg_losses2 >
    pg_losses1): only the first -> clipfrac 0.25; dual-clipped: 1 of 4 -> clipfrac_lower 0.25."""
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 4.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, metrics = policy_loss(
        logp, torch.zeros(1, 4), adv, torch.ones(1, 4), algo=RLAlgorithm(group_size=2)
    )
    loss.backward()
    assert float(loss) == pytest.approx(0.6, abs=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5, 1.1, 0.0]]) / 4)
    assert float(metrics["clipfrac"]) == pytest.approx(0.25)
    assert float(metrics["clipfrac_lower"]) == pytest.approx(0.25)
    assert float(metrics["ratio_max"]) == pytest.approx(4.0)
    assert float(metrics["ratio_mean"]) == pytest.approx((1.5 + 0.5 + 1.1 + 4.0) / 4)
    assert set(metrics) >= {"loss", "pg_loss", "clipfrac", "ppo_kl", "ratio_mean", "ratio_max"}
    assert all(
        isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad
        for v in metrics.values()
    )


def test_on_policy_loss_is_minus_mean_advantage():
    """With logprobs = old logprobs, r = 1 everywhere and every loss of the PPO family gives
    -mean(A) (token-mean); the gradient is -A / N (REINFORCE)."""
    adv = torch.tensor([[2.0, -1.0], [0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    for name in ("vanilla", "gspo", "cispo", "dppo_tv"):
        algo = RLAlgorithm(policy_loss=name, group_size=2)
        logp = torch.full((2, 2), -1.0, requires_grad=True)
        loss, _ = policy_loss(logp, logp.detach(), adv, mask, algo=algo)
        if name in ("vanilla", "gspo"):  # cispo, dppo_tv: value -sg(r) A logprob, same gradient
            assert float(loss) == pytest.approx(-1.5 / 3), name
        loss.backward()
        torch.testing.assert_close(logp.grad, -adv * mask / 3, msg=name)


def test_every_verl_policy_loss_runs():
    new_BT, old_BT, ref_BT, adv_BT, mask_BT = _rollout_batch()
    for name in rl.policy_losses():
        options = {"dro_beta": 0.1} if name == "dro" else {}
        mode = rl_config.FIXED_AGG_MODE.get(name, "token-mean")
        algo = RLAlgorithm(policy_loss=name, loss_agg_mode=mode, policy_loss_options=options)
        logp = new_BT.clone().requires_grad_(True)
        loss, metrics = policy_loss(
            logp, old_BT, adv_BT, mask_BT, algo=algo, ref_logprobs_BT=ref_BT
        )
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), name
        assert "kl" in metrics and "pg_loss" in metrics, name


def test_policy_loss_input_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="ref_logprobs_BT"):
        policy_loss(x, x, x, x, algo=RLAlgorithm(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy_BT"):
        policy_loss(x, x, x, x, algo=RLAlgorithm(entropy_coef=0.1))
    with pytest.raises(ValueError, match="one 2-D shape"):
        policy_loss(x, torch.zeros(2, 4), x, x, algo=RLAlgorithm())


# --------------------------------------------------------------------------------------------
# KL to the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k2", "k3", "low_var_kl", "mse", "k1+", "k3+"])
def test_kl_descent_moves_towards_the_reference(estimator):
    """One gradient step on kl_coef x KL alone moves each log-prob towards its reference, from
    above and from below: k2' = logp - ref, k3' = 1 - exp(ref - logp), both with the sign of
    logp - ref."""
    ref = torch.tensor([[-2.0, -2.0, -0.5]])
    start = torch.tensor([[-1.0, -3.0, -0.6]])
    logp = start.clone().requires_grad_(True)
    algo = RLAlgorithm(kl_coef=0.5, kl_estimator=estimator, group_size=2)
    loss, metrics = policy_loss(
        logp, logp.detach(), torch.zeros(1, 3), torch.ones(1, 3), algo=algo, ref_logprobs_BT=ref
    )
    if not estimator.startswith("k1"):  # k1's sample values can be negative
        assert float(metrics["kl"]) > 0
    loss.backward()
    with torch.no_grad():
        moved = start - 0.1 * logp.grad
    assert ((moved - ref).abs() < (start - ref).abs()).all(), logp.grad


def test_k1_gradient_is_one_per_token():
    """k1 = logp - ref has gradient 1 whichever side logp is on: alone it pushes every sampled
    log-prob down (zero in expectation over samples), which is why k1+ / k2 / k3 exist."""
    logp = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    loss, kl_BT = kl_loss(
        logp,
        torch.tensor([[-2.0, -2.0]]),
        torch.ones(1, 2),
        estimator="k1",
        loss_agg_mode="token-mean",
    )
    loss.backward()
    torch.testing.assert_close(kl_BT, torch.tensor([[1.0, -1.0]]))
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5, 0.5]]))


def test_kl_values_by_hand():
    """logp = -1, ref = -2, log r = ref - logp = -1: k1 = -log r = 1, k2 = (log r)^2 / 2 = 0.5,
    k3 = r - 1 - log r = e^-1 - 1 + 1 = 0.36788."""
    logp, ref, mask = torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), torch.ones(1, 1)
    for estimator, value in (("k1", 1.0), ("k2", 0.5), ("k3", math.exp(-1))):
        loss, _ = kl_loss(logp, ref, mask, estimator=estimator, loss_agg_mode="token-mean")
        assert float(loss) == pytest.approx(value, abs=1e-6), estimator


# --------------------------------------------------------------------------------------------
# Value loss
# --------------------------------------------------------------------------------------------


def test_value_loss_by_hand():
    """v = 0.5, v_old = 0, R = 1, clip 0.2: clip(v) = 0.2; (0.5 - 1)^2 = 0.25, (0.2 - 1)^2 =
    0.64; max 0.64 -> 0.5 * 0.64 = 0.32, clipfrac 1. Second token v = 0.1 (inside the clip):
    0.81 both -> 0.405. Token mean (0.64 + 0.81) / 2 * 0.5 = 0.3625."""
    values = torch.tensor([[0.5, 0.1]], requires_grad=True)
    loss, metrics = value_loss(
        values, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), algo=RLAlgorithm.ppo()
    )
    assert float(loss) == pytest.approx(0.3625)
    assert float(metrics["vf_clipfrac"]) == pytest.approx(0.5)
    loss.backward()
    # d/dv of 0.5 * (v - R)^2 / 2 on the unclipped token = (0.1 - 1) / 2; the clipped one is 0.
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.45]]))
