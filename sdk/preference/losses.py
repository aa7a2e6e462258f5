"""Preference optimisation: the pure DPO, IPO, SimPO, KTO and ORPO losses on summed response
log-probabilities, and `step_share`, their share of an optimizer step.

Notation: B = preference pairs, N = KTO rows (desirable or undesirable), K = KTO mismatched
(prompt, completion) pairs for the KL estimate, T = tokens per sequence. Log-probabilities are
summed over the response tokens (`logps_B`), in nats, fp32; `lengths_B` count response tokens.

The pure losses take log-probabilities and return `(losses, chosen_rewards, rejected_rewards)`
like TRL's loss methods, every reward detached:

    =============  ============================================================  ==========
    loss           per pair (h = chosen log-ratio - rejected log-ratio)            paper
    =============  ============================================================  ==========
    dpo_loss       -(1-e) log s(beta h) - e log s(-beta h)  (e = label smoothing)   DPO eq. 7
                   (default; every TRL DPO loss_type / f_divergence_type and DPOP:
                   `posttrain.preference.dpo_family`)
    ipo_loss       (h - 1 / (2 beta))^2  (h per token with lengths)               IPO eq. 17
    simpo_loss     -log s(beta (avg_c - avg_r) - gamma), no reference              SimPO eq. 6
    kto_loss       w_y (1 - s(beta (r - z0)))  /  w_y (1 - s(beta (z0 - r)))         KTO eq. 8
    orpo_loss      -log s(log odds_c - log odds_r)  (added to the chosen NLL)      ORPO eq. 7
    =============  ============================================================  ==========

tests/preference/test_preference.py checks every loss and reward against TRL 1.16's own code on
random log-probabilities (<= 1e-6), plus hand-computed values: all log-probs 0, beta 0.1 -> DPO =
log 2 = 0.693147, hinge = 1, IPO = 25; policy chosen -1, rejected -2, reference -1.5 for both, beta
0.1 -> DPO = -log s(0.1) = 0.644397, rewards +0.05 / -0.05.

The objectives the `Trainer` calls on preference batches (`DPOLoss`, ..., registered as
"dpo", "ipo", "simpo", "kto", "orpo") are in `posttrain.preference.objectives`.

Example:
    >>> import torch
    >>> zeros = torch.zeros(2)
    >>> losses, chosen_rewards, rejected_rewards = dpo_loss(zeros, zeros, zeros, zeros, beta=0.1)
    >>> [round(x, 6) for x in losses.tolist()], chosen_rewards.tolist()
    ([0.693147, 0.693147], [0.0, 0.0])
    >>> round(float(ipo_loss(zeros, zeros, zeros, zeros, beta=0.1)[0][0]), 4)
    25.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.preference.dpo_family import DPO_LOSS_TYPES, F_DIVERGENCE_TYPES, dpo_family_losses
from posttrain.preference.loss_checks import (
    check_beta,
    check_label_smoothing,
    check_lengths,
    check_pairs,
)
from posttrain.train.losses import normalize_by_step

__all__ = [
    "dpo_loss",
    "ipo_loss",
    "simpo_loss",
    "kto_loss",
    "kto_reference_point",
    "orpo_loss",
    "step_share",
    "DPO_LOSS_TYPES",
    "F_DIVERGENCE_TYPES",
]

LossTriple = tuple[Tensor, Tensor, Tensor]

# --------------------------------------------------------------------------------------------
# Pure losses
# --------------------------------------------------------------------------------------------


def dpo_loss(
    policy_chosen_logps_B: Tensor,
    policy_rejected_logps_B: Tensor,
    ref_chosen_logps_B: Tensor,
    ref_rejected_logps_B: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    dpop_lambda: float = 50.0,
    chosen_lengths_B: Tensor | None = None,
    rejected_lengths_B: Tensor | None = None,
) -> LossTriple:
    """Direct Preference Optimization and its family, per pair: every `loss_type` and
    `f_divergence_type` of TRL 1.16's `DPOTrainer`, plus DPOP (`DPO_LOSS_TYPES`,
    `F_DIVERGENCE_TYPES`; the formulas and their papers are tabled in
    `posttrain.preference.dpo_family`, which computes them after the checks here).

    The default, with h = (log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x)):

        sigmoid: -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)
        hinge:   max(0, 1 - beta h)

    `sigmoid` with e = 0 is DPO (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7);
    e > 0 is conservative DPO (cDPO; Mitchell 2023, "A note on DPO with noisy preferences &
    relationship to IPO"): the label is taken to be flipped with probability e. `hinge` is the
    rank-calibration hinge loss of SLiC-HF (Zhao et al. 2023; no equation number checked here)
    applied to the log-ratios with margin 1 / beta, as TRL writes it.

    TRL 1.16 equivalents (tests/preference/test_preference.py, tests/preference/test_dpo_family.py):
    every loss_type equals TRL's of the same name on the same log-probs, except that TRL's "sigmoid"
    ignores label_smoothing (e > 0 here is cDPO, TRL's "aot" evaluated one pair at a time). TRL's
    "robust" loss is not cDPO: it is the unbiased rDPO estimator (Chowdhury et al. 2024),
    `((1-e) l(h) - e l(-h)) / (1 - 2e)` with l(h) = -log sigmoid(beta h).

    Args:
        policy_chosen_logps_B, policy_rejected_logps_B: [B] summed response log-probs of the
            policy (differentiable).
        ref_chosen_logps_B, ref_rejected_logps_B: [B] the same under the reference model.
        beta: > 0; the KL-regularisation strength (the temperature of the implicit reward).
        label_smoothing: e in [0, 0.5); read by sigmoid (cDPO), exo_pair (> 0 needed), robust,
            aot, aot_unpaired.
        loss_type: one of `DPO_LOSS_TYPES`, or a list of them combined with `loss_weights`.
        loss_weights: one finite weight per loss type (None: 1 each).
        f_divergence_type: one of `F_DIVERGENCE_TYPES`; f_alpha_divergence_coef: its alpha.
        discopop_tau: > 0, DiscoPOP's temperature. dpop_lambda: >= 0, DPOP's penalty weight.
        chosen_lengths_B, rejected_lengths_B: [B] response token counts (>= 0), both or
            neither; needed by ipo, sigmoid_norm and sft, ignored by the other loss types.

    Returns:
        losses [B] fp32; chosen_rewards, rejected_rewards [B] = beta * log-ratio, detached.

    Raises:
        TypeError: for an input that is not a tensor.
        ValueError: for shapes that are not four equal [B], a NaN or infinite log-prob,
            beta <= 0, e outside [0, 0.5), an unknown loss_type or f_divergence_type (naming
            the allowed values), an option a selected loss does not read set to a non-default
            value, or missing lengths (`posttrain.preference.dpo_family.check_dpo_options`).
    """
    check_pairs(
        policy_chosen_logps_B=policy_chosen_logps_B,
        policy_rejected_logps_B=policy_rejected_logps_B,
        ref_chosen_logps_B=ref_chosen_logps_B,
        ref_rejected_logps_B=ref_rejected_logps_B,
    )
    check_beta(beta)
    check_label_smoothing(label_smoothing)
    if chosen_lengths_B is not None or rejected_lengths_B is not None:
        check_lengths(policy_chosen_logps_B, chosen_lengths_B, rejected_lengths_B)
    return dpo_family_losses(
        policy_chosen_logps_B,
        policy_rejected_logps_B,
        ref_chosen_logps_B,
        ref_rejected_logps_B,
        beta=beta,
        loss_type=loss_type,
        loss_weights=loss_weights,
        label_smoothing=label_smoothing,
        f_divergence_type=f_divergence_type,
        f_alpha_divergence_coef=f_alpha_divergence_coef,
        discopop_tau=discopop_tau,
        dpop_lambda=dpop_lambda,
        chosen_lengths_B=chosen_lengths_B,
        rejected_lengths_B=rejected_lengths_B,
    )


def ipo_loss(
    policy_chosen_logps_B: Tensor,
    policy_rejected_logps_B: Tensor,
    ref_chosen_logps_B: Tensor,
    ref_rejected_logps_B: Tensor,
    *,
    beta: float = 0.1,
    chosen_lengths_B: Tensor | None = None,
    rejected_lengths_B: Tensor | None = None,
) -> LossTriple:
    """Identity Preference Optimisation loss per pair (Azar et al. 2023, "A General Theoretical
    Paradigm to Understand Learning from Human Preferences", eq. 17, beta = tau):

        (h - 1 / (2 beta))^2,  h = chosen log-ratio - rejected log-ratio.

    With lengths, each log-ratio is first divided by its response length (clamped at 1): TRL 1.16
    `DPOTrainer` loss_type "ipo" does this (its comment says the IPO authors confirmed that the
    paper's results use the per-token form). Without lengths this is eq. 17 on summed
    log-probabilities, which TRL computes when every response has one token.

    Args:
        policy_chosen_logps_B, policy_rejected_logps_B, ref_chosen_logps_B, ref_rejected_logps_B:
            [B] summed response log-probs.
        beta: > 0 (tau in the paper): the target log-ratio gap is 1 / (2 beta).
        chosen_lengths_B, rejected_lengths_B: [B] response token counts (>= 0), both or neither.

    Returns:
        losses [B]; chosen_rewards, rejected_rewards [B] = beta * (summed) log-ratio, detached
        (as TRL logs them, unnormalised).

    Raises:
        TypeError: for an input that is not a tensor.
        ValueError: for mismatched shapes, a NaN or infinite log-prob, only one of the lengths,
            a negative length, or beta <= 0.
    """
    check_pairs(
        policy_chosen_logps_B=policy_chosen_logps_B,
        policy_rejected_logps_B=policy_rejected_logps_B,
        ref_chosen_logps_B=ref_chosen_logps_B,
        ref_rejected_logps_B=ref_rejected_logps_B,
    )
    check_beta(beta)
    chosen_logratios_B = policy_chosen_logps_B - ref_chosen_logps_B
    rejected_logratios_B = policy_rejected_logps_B - ref_rejected_logps_B
    chosen_score_B, rejected_score_B = _per_token(
        chosen_logratios_B, rejected_logratios_B, chosen_lengths_B, rejected_lengths_B
    )
    losses_B = (chosen_score_B - rejected_score_B - 1 / (2 * beta)) ** 2
    return (losses_B, beta * chosen_logratios_B.detach(), beta * rejected_logratios_B.detach())


def simpo_loss(
    policy_chosen_logps_B: Tensor,
    policy_rejected_logps_B: Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 1.0,
    label_smoothing: float = 0.0,
    chosen_lengths_B: Tensor | None = None,
    rejected_lengths_B: Tensor | None = None,
) -> LossTriple:
    """Simple Preference Optimization loss per pair (Meng et al. 2024, "SimPO", eq. 6): no
    reference model, length-normalised log-probabilities and a target reward margin gamma:

        -(1 - e) log sigmoid(beta (a_c - a_r) - gamma) - e log sigmoid(-(beta (a_c - a_r) - gamma))

    where a = log pi(y|x) / |y| is the average log-probability per response token. e = 0 is the
    paper's loss; TRL 1.16 `trl.experimental.cpo.CPOTrainer.cpo_loss` with loss_type "simpo"
    (and `cpo_alpha=0`, no NLL term) computes the same, label smoothing included.

    Args:
        policy_chosen_logps_B, policy_rejected_logps_B: [B] average log-probs per token, or
            summed log-probs when the lengths are given.
        beta: > 0, the reward scale (the paper uses 2.0 - 2.5).
        gamma: the target margin between the rewards beta * a (>= 0).
        label_smoothing: e in [0, 0.5).
        chosen_lengths_B, rejected_lengths_B: [B] response token counts, both or neither.

    Returns:
        losses [B]; chosen_rewards, rejected_rewards [B] = beta * a, detached.

    Raises:
        TypeError: for an input that is not a tensor.
        ValueError: for mismatched shapes, a NaN or infinite log-prob, only one of the lengths,
            a negative length, beta <= 0, gamma < 0 or e outside [0, 0.5).
    """
    check_pairs(
        policy_chosen_logps_B=policy_chosen_logps_B, policy_rejected_logps_B=policy_rejected_logps_B
    )
    check_beta(beta)
    check_label_smoothing(label_smoothing)
    if not (math.isfinite(gamma) and gamma >= 0):
        raise ValueError(f"gamma={gamma!r}; must be a finite number >= 0")
    chosen_avg_B, rejected_avg_B = _per_token(
        policy_chosen_logps_B, policy_rejected_logps_B, chosen_lengths_B, rejected_lengths_B
    )
    # written as TRL writes it: beta * ((a_c - a_r) - gamma / beta)
    logits_B = beta * ((chosen_avg_B - rejected_avg_B) - gamma / beta)
    losses_B = _smoothed_logistic(logits_B, label_smoothing)
    return losses_B, beta * chosen_avg_B.detach(), beta * rejected_avg_B.detach()


def kto_reference_point(policy_kl_logps_K: Tensor, ref_kl_logps_K: Tensor) -> Tensor:
    """KTO's reference point z0: the batch estimate of KL(pi || ref), clamped at 0, detached.

    z0 = max(0, mean_k (log pi(y'_k|x_k) - log ref(y'_k|x_k))) over mismatched pairs (x_k, y'_k)
    (a completion of another row paired with this row's prompt), as in Ethayarajh et al. 2024,
    section 4.1, and TRL 1.16 `KTOTrainer`. No gradient flows through it.

    Args:
        policy_kl_logps_K, ref_kl_logps_K: [K] summed log-probs of the mismatched completions.

    Returns:
        A scalar fp32 tensor >= 0 (no host sync).

    Raises:
        ValueError: if the shapes differ, a log-prob is NaN or infinite, or K = 0.
    """
    check_pairs(policy_kl_logps_K=policy_kl_logps_K, ref_kl_logps_K=ref_kl_logps_K)
    if policy_kl_logps_K.numel() == 0:
        raise ValueError("kto_reference_point needs at least one mismatched pair (K >= 1)")
    return (policy_kl_logps_K - ref_kl_logps_K).mean().clamp(min=0).detach()


def kto_loss(
    policy_logps_N: Tensor,
    ref_logps_N: Tensor,
    desirable_N: Tensor,
    *,
    reference_point: Tensor | float = 0.0,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> LossTriple:
    """Kahneman-Tversky Optimization loss per row (Ethayarajh et al. 2024, "KTO: Model
    Alignment as Prospect Theoretic Optimization", eq. 8; TRL's comment cites it as eq. 7 of the
    arXiv version). With r = log pi(y|x) - log ref(y|x) and z0 the reference point:

        desirable:    lambda_D (1 - sigmoid(beta (r - z0)))
        undesirable:  lambda_U (1 - sigmoid(beta (z0 - r)))

    Rows are unpaired; TRL 1.16 `KTOTrainer` loss_type "kto" computes the same values.

    Args:
        policy_logps_N, ref_logps_N: [N] summed response log-probs.
        desirable_N: [N] bool, True for a desirable row.
        reference_point: z0, a finite detached scalar (a 0-dim tensor from
            `kto_reference_point`) or a float; 0 disables it.
        beta: > 0.
        desirable_weight, undesirable_weight: lambda_D, lambda_U > 0.

    Returns:
        losses [N] in row order, weights applied; chosen_rewards [N_D] and rejected_rewards
        [N_U] = beta * r of the desirable and undesirable rows in row order, detached (as TRL
        returns them: one tensor per kind, not per pair).

    Raises:
        TypeError: for a log-prob input that is not a tensor.
        ValueError: for mismatched shapes, a NaN or infinite log-prob, a non-bool
            `desirable_N`, a reference_point that is not a finite scalar, beta or a weight <= 0.
    """
    check_pairs(policy_logps_N=policy_logps_N, ref_logps_N=ref_logps_N)
    if desirable_N.shape != policy_logps_N.shape or desirable_N.dtype != torch.bool:
        raise ValueError(
            f"desirable_N must be a bool tensor shaped like the log-probs "
            f"{tuple(policy_logps_N.shape)}; got {desirable_N.dtype} "
            f"{tuple(desirable_N.shape)}"
        )
    check_beta(beta)
    for name, weight in (
        ("desirable_weight", desirable_weight),
        ("undesirable_weight", undesirable_weight),
    ):
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"{name}={weight!r}; must be a finite number > 0")
    logratios_N = policy_logps_N - ref_logps_N
    z0 = torch.as_tensor(reference_point, dtype=logratios_N.dtype, device=logratios_N.device)
    if z0.ndim != 0 or not bool(torch.isfinite(z0)):
        raise ValueError(
            f"reference_point must be a finite scalar (a float or a 0-dim tensor); "
            f"got shape {tuple(z0.shape)}" + ("" if z0.ndim else f", value {z0}")
        )
    desirable_losses_N = desirable_weight * (1 - torch.sigmoid(beta * (logratios_N - z0)))
    undesirable_losses_N = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios_N)))
    losses_N = torch.where(desirable_N, desirable_losses_N, undesirable_losses_N)
    rewards_N = beta * logratios_N.detach()
    return losses_N, rewards_N[desirable_N], rewards_N[~desirable_N]


def orpo_loss(
    policy_chosen_logps_B: Tensor,
    policy_rejected_logps_B: Tensor,
    *,
    beta: float = 0.1,
    chosen_lengths_B: Tensor | None = None,
    rejected_lengths_B: Tensor | None = None,
) -> LossTriple:
    """The odds-ratio term of ORPO per pair (Hong et al. 2024, "ORPO: Monolithic Preference
    Optimization without Reference Model", eqs. 4 and 7), weighted by beta (lambda in the paper):

        beta * -log sigmoid(log odds(y_c|x) - log odds(y_r|x)),
        odds(y|x) = P / (1 - P),  log P = average log-prob per response token.

    ORPO's full loss adds this to the chosen response's NLL (eq. 6; `ORPOLoss`). TRL 1.16
    `trl.experimental.orpo.ORPOTrainer.odds_ratio_loss` returns the opposite sign (its losses are
    beta * log sigmoid(...) <= 0 and are subtracted from the NLL); the rewards are the same.

    Args:
        policy_chosen_logps_B, policy_rejected_logps_B: [B] average log-probs per token (< 0),
            or summed log-probs when the lengths are given.
        beta: > 0, the weight of the odds-ratio term.
        chosen_lengths_B, rejected_lengths_B: [B] response token counts, both or neither.

    Returns:
        losses [B] >= 0; chosen_rewards, rejected_rewards [B] = beta * average log-prob, detached.

    Raises:
        TypeError: for an input that is not a tensor.
        ValueError: for mismatched shapes, a NaN or infinite log-prob, an average log-prob
            >= 0 (odds P / (1 - P) need P < 1), only one of the lengths, a negative length, or
            beta <= 0.
    """
    check_pairs(
        policy_chosen_logps_B=policy_chosen_logps_B, policy_rejected_logps_B=policy_rejected_logps_B
    )
    check_beta(beta)
    chosen_avg_B, rejected_avg_B = _per_token(
        policy_chosen_logps_B.float(),
        policy_rejected_logps_B.float(),
        chosen_lengths_B,
        rejected_lengths_B,
    )
    if not bool(((chosen_avg_B < 0) & (rejected_avg_B < 0)).all()):
        raise ValueError(
            f"orpo_loss needs average log-probs < 0 (P < 1, else the odds are "
            f"infinite); got policy_chosen_logps_B max {float(chosen_avg_B.max()):g}, "
            f"policy_rejected_logps_B max {float(rejected_avg_B.max()):g} per token"
        )
    log_odds_B = (chosen_avg_B - rejected_avg_B) - (
        _log1mexp(chosen_avg_B) - _log1mexp(rejected_avg_B)
    )
    losses_B = -beta * F.logsigmoid(log_odds_B)
    return losses_B, beta * chosen_avg_B.detach(), beta * rejected_avg_B.detach()


def step_share(losses_B: Tensor, num_units_in_step: Tensor | int) -> Tensor:
    """This micro-batch's share of the step loss: `losses_B.sum() / num_units_in_step`, where
    `num_units_in_step` counts the pairs (KTO: rows) of every micro-batch of the optimizer step,
    so the shares add up to the mean over the step's pairs.

    Raises:
        ValueError: if `num_units_in_step` is below 1: an int, or a tensor on the CPU (a tensor
            on an accelerator is not checked, to avoid a host sync; the trainer checks the
            count once per step).
    """
    count: Tensor | float = num_units_in_step
    if isinstance(count, Tensor) and count.device.type == "cpu" and count.numel() == 1:
        count = count.item()
    if isinstance(count, (int, float)) and not count >= 1:
        raise ValueError(
            f"num_units_in_step={count!r}; it counts the pairs (KTO: rows) of the "
            "whole optimizer step and must be >= 1"
        )
    return normalize_by_step(losses_B.sum(), num_units_in_step)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _smoothed_logistic(logits_B: Tensor, label_smoothing: float) -> Tensor:
    losses_B = -F.logsigmoid(logits_B)
    if label_smoothing:
        losses_B = (1 - label_smoothing) * losses_B - label_smoothing * F.logsigmoid(-logits_B)
    return losses_B


def _per_token(
    chosen_B: Tensor,
    rejected_B: Tensor,
    chosen_lengths_B: Tensor | None,
    rejected_lengths_B: Tensor | None,
) -> tuple[Tensor, Tensor]:
    if chosen_lengths_B is None and rejected_lengths_B is None:
        return chosen_B, rejected_B
    chosen_lengths_B, rejected_lengths_B = check_lengths(
        chosen_B, chosen_lengths_B, rejected_lengths_B
    )
    return (
        chosen_B / chosen_lengths_B.to(chosen_B.dtype).clamp(min=1.0),
        rejected_B / rejected_lengths_B.to(rejected_B.dtype).clamp(min=1.0),
    )


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (Maechler 2012, "Accurately computing
    log(1 - exp(-|a|))": log(-expm1(x)) above -log 2, log1p(-exp(x)) below)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
