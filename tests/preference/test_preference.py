"""Preference optimisation: every loss and its rewards against TRL 1.16's own code and
hand-computed values (the Trainer: tests/preference/test_preference_training.py; data and the
reference cache: tests/preference/test_preference_data.py; pairs by rejection sampling:
tests/preference/test_preference_pairs.py).

Shapes: B = pairs, N = KTO rows, K = KTO mismatched pairs, T = tokens.

TRL 1.x has no standalone dpo_loss / kto_loss: the losses live inline in
`DPOTrainer._compute_loss` / `KTOTrainer._compute_loss`, which run the model. The harness below
builds those trainers with `object.__new__` (no model, no dataset), sets the attributes the method
reads, and passes a stand-in model whose forward returns per-token log-probabilities that sum to
the log-probabilities under test; the loss formulas that then run are TRL's own lines. Per-pair
rewards come from TRL's `accelerator.gather` calls (DPO) or one-row calls (KTO: TRL returns only
the mean loss); per-pair losses come from one-pair calls. SimPO and ORPO are TRL methods that take
log-probabilities directly (`CPOTrainer.cpo_loss`, `ORPOTrainer.odds_ratio_loss`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from posttrain.preference import (
    dpo_loss,
    ipo_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    simpo_loss,
    step_share,
)

SEEDS = (0, 1, 2)
BETAS = (0.05, 0.1, 0.5)
B = 6

# --------------------------------------------------------------------------------------------
# TRL harness
# --------------------------------------------------------------------------------------------


from _trl_harness import _Accelerator, _close, _FixedLogps  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _common(trainer_cls, **attributes):
    trainer = object.__new__(trainer_cls)
    trainer.accelerator = _Accelerator()
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._total_train_tokens, trainer._tp_size = 0, 1
    trainer.aux_loss_enabled, trainer.args = False, SimpleNamespace()
    for name, value in attributes.items():
        setattr(trainer, name, value)
    return trainer


def _completion_inputs(lengths, first_id=1):
    """input_ids / attention_mask / completion_mask [rows, T] with `lengths[r]` completion tokens
    after one prompt token (TRL's IPO divides by these counts)."""
    rows, T = len(lengths), int(max(lengths)) + 1
    completion_mask = torch.zeros(rows, T, dtype=torch.long)
    for r, n in enumerate(lengths):
        completion_mask[r, 1 : 1 + int(n)] = 1
    return {
        "input_ids": torch.full((rows, T), first_id),
        "attention_mask": torch.ones(rows, T, dtype=torch.long),
        "completion_mask": completion_mask,
    }


def trl_dpo(loss_type, beta, pc, pr, rc, rr, *, label_smoothing=0.0, lc=None, lr=None):
    """TRL `DPOTrainer._compute_loss` on summed log-probs: (mean loss, chosen_rewards [B],
    rejected_rewards [B])."""
    from trl.trainer.dpo_trainer import DPOTrainer

    lc = torch.ones(len(pc)) if lc is None else lc
    lr = torch.ones(len(pc)) if lr is None else lr
    model = _FixedLogps(torch.cat([pc, pr]))
    trainer = _common(
        DPOTrainer,
        model=model,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
    )
    inputs = {
        **_completion_inputs(torch.cat([lc, lr]).tolist()),
        "ref_chosen_logps": rc,
        "ref_rejected_logps": rr,
    }
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    chosen_rewards, rejected_rewards = trainer.accelerator.gathered[:2]
    return loss, chosen_rewards, rejected_rewards


def trl_dpo_per_pair(loss_type, beta, pc, pr, rc, rr, **kwargs):
    """TRL's loss of each pair alone ([B])."""
    lc, lr = kwargs.pop("lc", None), kwargs.pop("lr", None)
    out = []
    for b in range(len(pc)):
        one = slice(b, b + 1)
        out.append(
            trl_dpo(
                loss_type,
                beta,
                pc[one],
                pr[one],
                rc[one],
                rr[one],
                lc=None if lc is None else lc[one],
                lr=None if lr is None else lr[one],
                **kwargs,
            )[0]
        )
    return torch.stack(out)


def trl_kto(
    beta,
    logps,
    ref_logps,
    desirable,
    kl_logps,
    ref_kl_logps,
    *,
    desirable_weight=1.0,
    undesirable_weight=1.0,
):
    """TRL `KTOTrainer._compute_loss`: (mean loss, metrics dict)."""
    from trl.trainer.kto_trainer import KTOTrainer

    model = _FixedLogps(logps, kl_logps)
    trainer = _common(
        KTOTrainer,
        model=model,
        calculate_KL=True,
        precompute_ref_logps=True,
        loss_type="kto",
        beta=beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
    )
    kl = _completion_inputs([1] * len(kl_logps), first_id=2)
    inputs = {
        **_completion_inputs([1] * len(logps)),
        "label": desirable,
        "ref_logps": ref_logps,
        "KL_input_ids": kl["input_ids"],
        "KL_attention_mask": kl["attention_mask"],
        "KL_completion_mask": kl["completion_mask"],
        "ref_KL_logps": ref_kl_logps,
    }
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    return loss, trainer._metrics["train"]


def _random_pairs(seed):
    """Summed log-probs [B] of policy and reference, and response lengths [B] (1..12 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    lengths_c = torch.randint(1, 13, (B,), generator=gen).float()
    lengths_r = torch.randint(1, 13, (B,), generator=gen).float()
    per_token = lambda L: -(0.05 + 3 * torch.rand(B, generator=gen)) * L  # noqa: E731
    return (
        per_token(lengths_c),
        per_token(lengths_r),
        per_token(lengths_c),
        per_token(lengths_r),
        lengths_c,
        lengths_r,
    )


# --------------------------------------------------------------------------------------------
# The pure losses against TRL
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge"])
def test_dpo_matches_trl(seed, beta, loss_type):
    pc, pr, rc, rr, _, _ = _random_pairs(seed)
    losses_B, chosen_B, rejected_B = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type)
    trl_mean, trl_chosen, trl_rejected = trl_dpo(loss_type, beta, pc, pr, rc, rr)
    _close(losses_B, trl_dpo_per_pair(loss_type, beta, pc, pr, rc, rr))
    _close(losses_B.mean(), trl_mean)
    _close(chosen_B, trl_chosen)
    _close(rejected_B, trl_rejected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("label_smoothing", [0.1, 0.3])
def test_conservative_dpo_matches_trl_aot_one_pair_at_a_time(seed, label_smoothing):
    """cDPO = TRL 1.16 loss_type 'aot' on one pair (its sort over the batch is then the
    identity); TRL 'sigmoid' ignores label_smoothing, and 'robust' is another estimator."""
    pc, pr, rc, rr, _, _ = _random_pairs(seed)
    losses_B, chosen_B, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=label_smoothing)
    _close(losses_B, trl_dpo_per_pair("aot", 0.1, pc, pr, rc, rr, label_smoothing=label_smoothing))
    _close(chosen_B, trl_dpo("aot", 0.1, pc, pr, rc, rr, label_smoothing=label_smoothing)[1])
    sigmoid_mean = trl_dpo("sigmoid", 0.1, pc, pr, rc, rr, label_smoothing=label_smoothing)[0]
    _close(dpo_loss(pc, pr, rc, rr, beta=0.1)[0].mean(), sigmoid_mean)
    robust = trl_dpo_per_pair("robust", 0.1, pc, pr, rc, rr, label_smoothing=label_smoothing)
    assert float((robust - losses_B).abs().max()) > 1e-3


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", BETAS)
def test_ipo_matches_trl_with_and_without_length_normalisation(seed, beta):
    pc, pr, rc, rr, lc, lr = _random_pairs(seed)
    losses_B, chosen_B, rejected_B = ipo_loss(
        pc, pr, rc, rr, beta=beta, chosen_lengths_B=lc, rejected_lengths_B=lr
    )
    _close(losses_B, trl_dpo_per_pair("ipo", beta, pc, pr, rc, rr, lc=lc, lr=lr))
    _, trl_chosen, trl_rejected = trl_dpo("ipo", beta, pc, pr, rc, rr, lc=lc, lr=lr)
    _close(chosen_B, trl_chosen)
    _close(rejected_B, trl_rejected)
    # eq. 17 on summed log-ratios = TRL's 'ipo' when every response has one token
    _close(ipo_loss(pc, pr, rc, rr, beta=beta)[0], trl_dpo_per_pair("ipo", beta, pc, pr, rc, rr))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta,gamma", [(2.0, 1.0), (2.5, 1.375), (0.1, 0.5)])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_simpo_matches_trl_cpo_loss(seed, beta, gamma, label_smoothing):
    from trl.experimental.cpo import CPOTrainer

    pc, pr, _, _, lc, lr = _random_pairs(seed)
    trainer = _common(
        CPOTrainer,
        alpha=0.0,
        loss_type="simpo",
        beta=beta,
        simpo_gamma=gamma,
        label_smoothing=label_smoothing,
    )
    trl_losses, trl_chosen, trl_rejected = trainer.cpo_loss(pc / lc, pr / lr)
    for ours in (
        simpo_loss(
            pc,
            pr,
            beta=beta,
            gamma=gamma,
            label_smoothing=label_smoothing,
            chosen_lengths_B=lc,
            rejected_lengths_B=lr,
        ),
        simpo_loss(pc / lc, pr / lr, beta=beta, gamma=gamma, label_smoothing=label_smoothing),
    ):
        _close(ours[0], trl_losses)
        _close(ours[1], trl_chosen)
        _close(ours[2], trl_rejected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.33), (0.7, 1.0)])
def test_kto_matches_trl(seed, beta, weights):
    gen = torch.Generator().manual_seed(seed)
    N, K = 7, 7
    logps, ref_logps = -20 * torch.rand(N, generator=gen), -20 * torch.rand(N, generator=gen)
    desirable = torch.tensor([True, False, True, True, False, False, True])
    kl_logps = -20 * torch.rand(K, generator=gen)
    for shift in (-3.0, 3.0):  # the KL estimate negative (clamped to 0) and positive
        ref_kl_logps = kl_logps - shift + torch.rand(K, generator=gen)
        z0 = kto_reference_point(kl_logps, ref_kl_logps)
        losses_N, chosen, rejected = kto_loss(
            logps,
            ref_logps,
            desirable,
            reference_point=z0,
            beta=beta,
            desirable_weight=weights[0],
            undesirable_weight=weights[1],
        )
        trl_mean, _ = trl_kto(
            beta,
            logps,
            ref_logps,
            desirable,
            kl_logps,
            ref_kl_logps,
            desirable_weight=weights[0],
            undesirable_weight=weights[1],
        )
        _close(losses_N.mean(), trl_mean)
        for n in range(N):  # one row at a time, with the batch's mismatched pairs
            one = slice(n, n + 1)
            loss_n, metrics = trl_kto(
                beta,
                logps[one],
                ref_logps[one],
                desirable[one],
                kl_logps,
                ref_kl_logps,
                desirable_weight=weights[0],
                undesirable_weight=weights[1],
            )
            _close(losses_N[n], loss_n)
            key = "rewards/chosen" if desirable[n] else "rewards/rejected"
            ours = chosen if desirable[n] else rejected
            index = (
                int(desirable[: n + 1].sum() if desirable[n] else (~desirable[: n + 1]).sum()) - 1
            )
            _close(ours[index], metrics[key][-1])
            _close(z0, metrics["kl"][-1])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", BETAS)
def test_orpo_odds_ratio_matches_trl_up_to_its_sign(seed, beta):
    from trl.experimental.orpo import ORPOTrainer

    pc, pr, _, _, lc, lr = _random_pairs(seed)
    trainer = _common(ORPOTrainer, beta=beta)
    trl_losses, trl_chosen, trl_rejected, _, _ = trainer.odds_ratio_loss(pc / lc, pr / lr)
    losses_B, chosen_B, rejected_B = orpo_loss(
        pc, pr, beta=beta, chosen_lengths_B=lc, rejected_lengths_B=lr
    )
    _close(losses_B, -trl_losses)
    _close(chosen_B, trl_chosen)
    _close(rejected_B, trl_rejected)


# --------------------------------------------------------------------------------------------
# Hand-computed values
# --------------------------------------------------------------------------------------------


def test_hand_computed_values():
    """All log-probs 0, beta 0.1: DPO = log 2 = 0.693147 (cDPO too: both terms are log 2), hinge =
    1, IPO = (0 - 1/0.2)^2 = 25. Policy chosen -1, rejected -2, reference -1.5 for both, beta 0.1: h
    = 0.5 + 0.5 = 1; DPO = -log sigmoid(0.1) = 0.644397, rewards +0.05 / -0.05; cDPO e = 0.1:
    0.9 * 0.644397 + 0.1 * -log sigmoid(-0.1) (= 0.744397) = 0.654397; hinge = 1 - 0.1 = 0.9.
    IPO per token with lengths 2 and 4: h = 0.5/2 + 0.5/4 = 0.375 -> (0.375 - 5)^2 = 21.390625.
    SimPO averages -1 and -2, beta 2, gamma 1: -log sigmoid(2 - 1) = 0.313262, rewards -2, -4.
    KTO beta 0.1: mismatched log-ratios 0.3, -0.1 -> z0 = 0.1; desirable r = 0.6:
    1 - sigmoid(0.05) = 0.487503; undesirable r = 0.1 with lambda_U = 2: 2 (1 - sigmoid(0)) = 1.
    ORPO beta 0.1, P(chosen) = 0.5 (odds 1), P(rejected) = 0.2 (odds 1/4):
    0.1 * -log sigmoid(log 4) = 0.1 * log(5/4) = 0.0223144.
    """
    z, one = torch.zeros(1), torch.ones(1)
    assert float(dpo_loss(z, z, z, z, beta=0.1)[0]) == pytest.approx(0.693147, abs=1e-6)
    assert float(dpo_loss(z, z, z, z, beta=0.1, label_smoothing=0.2)[0]) == pytest.approx(
        0.693147, abs=1e-6
    )
    assert float(dpo_loss(z, z, z, z, beta=0.1, loss_type="hinge")[0]) == pytest.approx(1.0)
    assert float(ipo_loss(z, z, z, z, beta=0.1)[0]) == pytest.approx(25.0, abs=1e-4)

    pc, pr, ref = -1 * one, -2 * one, -1.5 * one
    losses, chosen, rejected = dpo_loss(pc, pr, ref, ref, beta=0.1)
    assert float(losses) == pytest.approx(0.644397, abs=1e-6)
    assert (float(chosen), float(rejected)) == pytest.approx((0.05, -0.05), abs=1e-7)
    assert float(dpo_loss(pc, pr, ref, ref, beta=0.1, label_smoothing=0.1)[0]) == pytest.approx(
        0.654397, abs=1e-6
    )
    assert float(dpo_loss(pc, pr, ref, ref, beta=0.1, loss_type="hinge")[0]) == pytest.approx(0.9)
    assert float(
        ipo_loss(pc, pr, ref, ref, beta=0.1, chosen_lengths_B=2 * one, rejected_lengths_B=4 * one)[
            0
        ]
    ) == pytest.approx(21.390625, abs=1e-5)

    losses, chosen, rejected = simpo_loss(-one, -2 * one, beta=2.0, gamma=1.0)
    assert float(losses) == pytest.approx(0.313262, abs=1e-6)
    assert (float(chosen), float(rejected)) == (-2.0, -4.0)

    z0 = kto_reference_point(torch.tensor([0.3, -0.1]), torch.zeros(2))
    assert float(z0) == pytest.approx(0.1, abs=1e-7)
    assert float(kto_reference_point(torch.tensor([-0.3]), torch.zeros(1))) == 0.0
    losses, chosen, rejected = kto_loss(
        torch.tensor([0.6, 0.1]),
        torch.zeros(2),
        torch.tensor([True, False]),
        reference_point=z0,
        beta=0.1,
        undesirable_weight=2.0,
    )
    assert losses.tolist() == pytest.approx([0.487503, 1.0], abs=1e-6)
    assert chosen.tolist() == pytest.approx([0.06]) and rejected.tolist() == pytest.approx([0.01])

    losses = orpo_loss(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.2)]), beta=0.1)[0]
    assert float(losses) == pytest.approx(0.0223144, abs=1e-7)


def test_losses_reject_bad_arguments():
    z = torch.zeros(2)
    with pytest.raises(ValueError, match="beta=0"):
        dpo_loss(z, z, z, z, beta=0)
    with pytest.raises(ValueError, match="label_smoothing=0.5"):
        dpo_loss(z, z, z, z, label_smoothing=0.5)
    with pytest.raises(ValueError, match="loss_type='ipo'; allowed: sigmoid, hinge"):
        dpo_loss(z, z, z, z, loss_type="ipo")
    with pytest.raises(ValueError, match=r"one shape \[B\]"):
        dpo_loss(z, torch.zeros(3), z, z)
    with pytest.raises(ValueError, match="both chosen_lengths_B and rejected_lengths_B"):
        ipo_loss(z, z, z, z, chosen_lengths_B=torch.ones(2))
    with pytest.raises(ValueError, match="desirable_N must be a bool"):
        kto_loss(z, z, torch.ones(2))
    with pytest.raises(ValueError, match="gamma"):
        simpo_loss(z, z, gamma=-1.0)


def test_step_share_is_the_pair_mean_over_the_step():
    """Micro-batch A: one pair with loss 2; B: three pairs with loss 1. Step: 5 / 4 = 1.25."""
    shares = step_share(torch.tensor([2.0]), 4) + step_share(torch.tensor([1.0, 1.0, 1.0]), 4)
    assert float(shares) == 1.25


# --------------------------------------------------------------------------------------------
# Objectives on a tiny model, through the Trainer
# --------------------------------------------------------------------------------------------
