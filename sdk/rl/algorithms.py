"""RL math on tensors: the step normaliser, policy loss, KL to a reference, value loss.

Notation: B = sequences in a micro-batch, T = response tokens (right-padded; `response_mask_BT`
is 1 on real response tokens), G = group size (completions per prompt).

Every estimator and loss is verl's (`verl.trainer.ppo.core_algos`, verl 0.9.1), chosen by name
through `RLAlgorithm` (`posttrain.rl.config`); this module adapts argument conventions and fixes
the step normaliser, it does not re-implement the formulas:

    advantage estimators  get_adv_estimator_fn(name)   grpo, rloo, reinforce_plus_plus, gae, ...
                          (in posttrain.rl.advantages)
    policy losses         get_policy_loss_fn(name)     vanilla (PPO clip), gspo, cispo, sapo, ...
    KL estimators         kl_penalty(logp, ref, mode)  k1, k2, k3 (Schulman 2020)
    aggregation           agg_loss(...)                token-mean, seq-mean-token-sum, ...
    value loss            compute_value_loss(...)      clipped, for PPO with a value head
    rollout correction    compute_rollout_correction_weights(...), in posttrain.rl.lowbit_rollout

Step normaliser. As for SFT (`posttrain.train.losses`), a loss over several micro-batches must
equal the loss over the one big batch. Each call gets `num_units_in_step`: what the aggregation
mode divides by, counted over every micro-batch of the optimizer step (`step_units` per
micro-batch, summed): trained tokens for 'token-mean', sequences with at least one response token
for the seq-mean modes. It is passed to verl's `agg_loss` as `batch_num_tokens` /
`global_batch_size`. Without it, each micro-batch is normalised by itself (verl's fallback) and
accumulation is not invariant.

verl quirks handled here (verl 0.9.1; those of the advantage estimators are handled in
`posttrain.rl.advantages`, whose names this module exports too):
  * geo_mean takes a plain mean over the micro-batch's rows; it is rescaled to the step here.
  * verl's loss metrics are Python floats (it calls .item(): one host sync per metric).
  * verl reduces with `(x * mask).sum()`: NaN or inf on a masked position poisons the loss and
    its gradient. Every [B, T] input is passed through `posttrain.core.masked.keep_selected`
    (0 on masked positions, gradient exactly 0 there) before verl sees it, and posttrain's own
    metrics use `masked_mean` / `masked_max`: whatever padding holds, losses, gradients and
    metrics equal those with zeros there.

Example (the step normaliser: 3 response tokens, 2 rows that have one):
    >>> import torch
    >>> mask_BT = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    >>> int(step_units(mask_BT, "token-mean")), int(step_units(mask_BT, "seq-mean-token-mean"))
    (3, 2)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posttrain.core.masked import keep_selected, masked_max, masked_mean
from posttrain.rl.advantages import (  # importable from here too
    compute_advantages,
    scores_to_token_rewards,
    sequence_advantages,
)
from posttrain.rl.config import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    ROLLOUT_CORRECTIONS,
    RLAlgorithm,
    advantage_estimators,
    is_group_estimator,
    policy_losses,
    register_advantage_estimator,
    register_policy_loss,
    verl_actor_config,
)
from posttrain.rl.verl_registry import _kl_penalty, core_algos

__all__ = [
    "RLAlgorithm",
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "ROLLOUT_CORRECTIONS",
    "advantage_estimators",
    "policy_losses",
    "is_group_estimator",
    "register_advantage_estimator",
    "register_policy_loss",
    "step_units",
    "accumulate_metrics",
    "STEP_SHARES",
    "scores_to_token_rewards",
    "compute_advantages",
    "sequence_advantages",
    "aggregate",
    "kl_loss",
    "policy_loss",
    "value_loss",
]


# --------------------------------------------------------------------------------------------
# Normaliser
# --------------------------------------------------------------------------------------------


def step_units(response_mask_BT: Tensor, loss_agg_mode: str) -> Tensor:
    """This micro-batch's share of the step normaliser (int64 scalar, no host sync).

    'token-mean' and 'token-sum': response tokens; seq-mean modes: rows with at least one
    response token. Sum it over the micro-batches of a step (and all-reduce over ranks) and pass
    the total as `num_units_in_step`.

    Raises:
        ValueError: for an unknown mode.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}"
        )
    mask = response_mask_BT != 0
    if loss_agg_mode.startswith("token-"):
        return mask.sum()
    return mask.any(dim=-1).sum()


STEP_SHARES = frozenset({"loss", "pg_loss", "kl_loss", "entropy_loss", "vf_loss"})
"""The metrics of `policy_loss` / `value_loss` that are shares of the step (summed over its
micro-batches); the others are per-token means of the micro-batch, or ratio_max."""


def accumulate_metrics(
    totals: dict[str, Tensor], metrics: dict[str, Tensor], weight: Tensor
) -> None:
    """Add one micro-batch's metrics to the minibatch's `totals`, in place: step shares
    (`STEP_SHARES`) are summed, ratio_max is a maximum, per-token means are weighted by
    `weight`, the micro-batch's share of the minibatch's response tokens."""
    for key, value in metrics.items():
        value = value.detach().float()
        if key == "ratio_max":
            totals[key] = torch.maximum(totals.get(key, value), value)
        else:
            totals[key] = totals.get(key, 0.0) + (value if key in STEP_SHARES else value * weight)


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def _global_batch_info(
    loss_agg_mode: str,
    num_units_in_step: Tensor | int | None,
    dp_size: int,
    loss_scale_factor: int | None,
) -> dict[str, Any]:
    if isinstance(num_units_in_step, int) and num_units_in_step < 1:
        raise ValueError(
            f"num_units_in_step={num_units_in_step}; a step must train at least one unit"
        )
    if dp_size > 1 and num_units_in_step is None:
        raise ValueError("dp_size > 1 needs num_units_in_step counted over all ranks")
    token_mode = loss_agg_mode.startswith("token-")
    return {
        "dp_size": dp_size,
        "batch_num_tokens": num_units_in_step if token_mode else None,
        "global_batch_size": None if token_mode else num_units_in_step,
        "loss_scale_factor": loss_scale_factor,
    }


def aggregate(
    loss_BT: Tensor,
    response_mask_BT: Tensor,
    *,
    loss_agg_mode: str,
    num_units_in_step: Tensor | int | None = None,
    dp_size: int = 1,
    loss_scale_factor: int | None = None,
) -> Tensor:
    """verl's `agg_loss` with the step normaliser. Scalar.

    Modes (M = mask, sums over the micro-batch, N = num_units_in_step, local count if None):
        token-mean:          sum_bt L*M / N_tokens
        token-sum:           sum_bt L*M
        seq-mean-token-sum:  sum_b (sum_t L*M) / N_seqs
        seq-mean-token-mean: sum_b (sum_t L*M / sum_t M) / N_seqs
        seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor
    All times dp_size (gradients averaged over ranks).
    Worked case: L = 1 on masks [1,1,1] and [1,0,0]: 4/4 = 1.0, 4, (3+1)/2 = 2.0, (1+1)/2 = 1.0.
    Masked positions of `loss_BT` count as 0 whatever they hold (their gradient is 0); a caller
    computing `loss_BT` from tensors that may hold NaN/inf on padding sanitises those inputs
    with `keep_selected` first, or the gradient of that computation is NaN there.
    """
    return core_algos().agg_loss(
        loss_mat=keep_selected(loss_BT, response_mask_BT),
        loss_mask=response_mask_BT.to(loss_BT.dtype),
        loss_agg_mode=loss_agg_mode,
        **_global_batch_info(loss_agg_mode, num_units_in_step, dp_size, loss_scale_factor),
    )


def kl_loss(
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    response_mask_BT: Tensor,
    *,
    estimator: str,
    loss_agg_mode: str,
    num_units_in_step: Tensor | int | None = None,
    dp_size: int = 1,
    loss_scale_factor: int | None = None,
) -> tuple[Tensor, Tensor]:
    """KL to a frozen reference as a loss term: verl `kl_penalty(logprob, ref, estimator)`
    aggregated like the policy loss. Minimising it pulls the policy towards the reference.

    With r = ref / pi on a sampled token (Schulman 2020, http://joschu.net/blog/kl-approx.html):
    k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (clamped to [-10, 10] by verl). On samples
    of pi, k2's gradient is that of KL(pi || ref) and k3's that of KL(ref || pi); k1's gradient
    is 1 per token, zero in expectation, so k1 alone does not pull towards the reference
    (use 'k1+' / 'k3+': value of k1 / k3, gradient of k2).

    Masked positions of both inputs are ignored whatever they hold (`keep_selected` first).

    Returns:
        (loss share, per-token estimates [B, T] detached, 0 on masked positions).
    """
    kl_BT = _kl_penalty(
        keep_selected(logprobs_BT, response_mask_BT),
        keep_selected(ref_logprobs_BT.detach(), response_mask_BT),
        estimator,
    )
    kl_BT = keep_selected(kl_BT, response_mask_BT)
    loss = aggregate(
        kl_BT,
        response_mask_BT,
        loss_agg_mode=loss_agg_mode,
        num_units_in_step=num_units_in_step,
        dp_size=dp_size,
        loss_scale_factor=loss_scale_factor,
    )
    return loss, kl_BT.detach()


def policy_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    response_mask_BT: Tensor,
    *,
    algo: RLAlgorithm,
    ref_logprobs_BT: Tensor | None = None,
    entropy_BT: Tensor | None = None,
    num_units_in_step: Tensor | int | None = None,
    dp_size: int = 1,
    rollout_is_weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the step's policy loss: verl's `algo.policy_loss`, plus
    `algo.kl_coef` x KL to the reference, minus `algo.entropy_coef` x entropy.

    PPO clip ('vanilla', Schulman et al. 2017, eq. 7, with dual clip): per token
        max(-A r, -A clip(r, 1 - low, 1 + high)), and min(that, -A c) where A < 0,
    r = exp(logprobs - old_logprobs). GRPO (Shao et al. 2024, eq. 3) is this loss with group
    advantages and 'seq-mean-token-mean'; GSPO (Zheng et al. 2025) uses the sequence ratio
    exp(mean_t log r); CISPO uses -sg(clip(r)) A logprobs.

    Args:
        logprobs_BT: [B, T] log-probabilities of the sampled tokens under the current policy
            (requires grad), from the sampling distribution (same temperature / top-p).
        old_logprobs_BT: [B, T] under the policy that sampled them.
        advantages_BT: [B, T].
        response_mask_BT: [B, T], 1 on response tokens.
        algo: the algorithm (loss name, aggregation, clip range, KL, entropy weights).
        ref_logprobs_BT: [B, T] under the frozen reference; required when algo.kl_coef > 0.
        entropy_BT: [B, T] token entropies of the current policy; required when
            algo.entropy_coef > 0, else only reported.
        num_units_in_step: step normaliser (see the module docstring and `step_units`); None
            normalises by this micro-batch alone.
        dp_size: data-parallel ranks whose gradients are averaged.
        rollout_is_weights_BT: [B, T] truncated importance weights pi_trainer / pi_sampler
            (`rollout_correction_weights`), passed to verl's loss as `rollout_is_weights`: each
            token's policy-loss term is multiplied by its weight (detached here). None: no
            correction (the default path, unchanged).

    Returns:
        (loss, metrics). Metrics are detached 0-dim tensors. Shares of the step (sum them over
        micro-batches): loss, pg_loss, kl_loss, entropy_loss. Means over this micro-batch's
        response tokens: kl (the estimator's value), entropy, ratio_mean, clipfrac,
        clipfrac_lower, ppo_kl (verl's, mean of old - new logprob); ratio_max is the token
        maximum (token ratio, also for gspo).

    Raises:
        ValueError: on shape mismatches or a missing reference / entropy input.
    """
    shape = logprobs_BT.shape
    named = {
        "old_logprobs_BT": old_logprobs_BT,
        "advantages_BT": advantages_BT,
        "response_mask_BT": response_mask_BT,
        "ref_logprobs_BT": ref_logprobs_BT,
        "entropy_BT": entropy_BT,
        "rollout_is_weights_BT": rollout_is_weights_BT,
    }
    if logprobs_BT.dim() != 2 or any(t is not None and t.shape != shape for t in named.values()):
        raise ValueError(
            "logprobs_BT and the other [B, T] inputs must share one 2-D shape; got "
            f"logprobs_BT {tuple(shape)}, "
            + ", ".join(f"{k} {tuple(v.shape)}" for k, v in named.items() if v is not None)
        )
    if algo.kl_coef > 0 and ref_logprobs_BT is None:
        raise ValueError(f"algo.kl_coef={algo.kl_coef} needs ref_logprobs_BT (or set kl_coef=0)")
    if algo.entropy_coef > 0 and entropy_BT is None:
        raise ValueError(f"algo.entropy_coef={algo.entropy_coef} needs entropy_BT")
    mask_BT = response_mask_BT.to(logprobs_BT.dtype)
    # padding may hold anything (NaN, inf, -inf log-probs): 0 there before verl's (x * mask)
    logprobs_BT, old_logprobs_BT, advantages_BT = (
        keep_selected(t, mask_BT) for t in (logprobs_BT, old_logprobs_BT, advantages_BT)
    )
    ref_logprobs_BT, entropy_BT, rollout_is_weights_BT = (
        None if t is None else keep_selected(t, mask_BT)
        for t in (ref_logprobs_BT, entropy_BT, rollout_is_weights_BT)
    )
    info = _global_batch_info(
        algo.loss_agg_mode, num_units_in_step, dp_size, algo.loss_scale_factor
    )
    config = verl_actor_config(algo, **info)
    pg_loss, verl_metrics = core_algos().get_policy_loss_fn(algo.policy_loss)(
        old_log_prob=old_logprobs_BT.detach(),
        log_prob=logprobs_BT,
        advantages=advantages_BT.detach(),
        response_mask=mask_BT,
        loss_agg_mode=algo.loss_agg_mode,
        config=config,
        rollout_is_weights=(
            None if rollout_is_weights_BT is None else rollout_is_weights_BT.detach()
        ),
    )
    if algo.policy_loss == "geo_mean" and num_units_in_step is not None:
        # verl's geo_mean is torch.mean over this micro-batch's rows: make it a share of the step.
        pg_loss = pg_loss * (shape[0] * dp_size) / num_units_in_step

    with torch.no_grad():
        ratio_BT = torch.exp(logprobs_BT.detach() - old_logprobs_BT.detach())
        metrics = {
            "ratio_mean": masked_mean(ratio_BT, mask_BT),
            "ratio_max": masked_max(ratio_BT, mask_BT),
        }
    for key, value in verl_metrics.items():
        key = key.removeprefix("actor/").replace("pg_clipfrac", "clipfrac")
        metrics[key] = torch.as_tensor(value, dtype=torch.float32)

    loss = pg_loss
    if ref_logprobs_BT is not None:
        kl_share, kl_BT = kl_loss(
            logprobs_BT,
            ref_logprobs_BT,
            mask_BT,
            estimator=algo.kl_estimator,
            loss_agg_mode=algo.loss_agg_mode,
            num_units_in_step=num_units_in_step,
            dp_size=dp_size,
            loss_scale_factor=algo.loss_scale_factor,
        )
        if algo.kl_coef > 0:
            loss = loss + algo.kl_coef * kl_share
        metrics["kl_loss"] = kl_share.detach()
        metrics["kl"] = masked_mean(kl_BT, mask_BT)
    if entropy_BT is not None:
        entropy_share = aggregate(
            entropy_BT,
            mask_BT,
            loss_agg_mode=algo.loss_agg_mode,
            num_units_in_step=num_units_in_step,
            dp_size=dp_size,
            loss_scale_factor=algo.loss_scale_factor,
        )
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * entropy_share
        metrics["entropy_loss"] = entropy_share.detach()
        metrics["entropy"] = masked_mean(entropy_BT.detach(), mask_BT)
    metrics["pg_loss"] = pg_loss.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics


def value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    response_mask_BT: Tensor,
    *,
    algo: RLAlgorithm,
    num_units_in_step: Tensor | int | None = None,
    dp_size: int = 1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss of PPO (verl `compute_value_loss`, from TRL):
        0.5 x agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)),  c = algo.value_clip,
    aggregated with algo.loss_agg_mode and the step normaliser. The caller adds
    `algo.value_coef * loss` to the policy loss.

    Args:
        values_BT: [B, T] current value predictions (requires grad).
        old_values_BT: [B, T] predictions when the batch was collected (the GAE inputs).
        returns_BT: [B, T] targets (from `compute_advantages('gae', ...)`).
        response_mask_BT: [B, T].

    Returns:
        (loss share, {"vf_loss": share, "vf_clipfrac": fraction of tokens where the clipped term
        was larger}), metrics detached. Masked positions of every input are ignored whatever
        they hold.
    """
    shape = values_BT.shape
    if any(t.shape != shape for t in (old_values_BT, returns_BT, response_mask_BT)):
        raise ValueError(
            f"values_BT {tuple(shape)}, old_values_BT {tuple(old_values_BT.shape)}, "
            f"returns_BT {tuple(returns_BT.shape)} and response_mask_BT "
            f"{tuple(response_mask_BT.shape)} must have one shape"
        )
    info = _global_batch_info(
        algo.loss_agg_mode, num_units_in_step, dp_size, algo.loss_scale_factor
    )
    values_BT, old_values_BT, returns_BT = (
        keep_selected(t, response_mask_BT)
        for t in (values_BT, old_values_BT.detach(), returns_BT.detach())
    )
    loss, clipfrac = core_algos().compute_value_loss(
        vpreds=values_BT,
        returns=returns_BT,
        values=old_values_BT,
        response_mask=response_mask_BT.to(values_BT.dtype),
        cliprange_value=algo.value_clip,
        loss_agg_mode=algo.loss_agg_mode,
        **info,
    )
    return loss, {"vf_loss": loss.detach(), "vf_clipfrac": clipfrac.detach()}
