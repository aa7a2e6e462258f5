"""RL math on tensors: advantages, policy loss, KL to a reference, value loss.

Notation: B = sequences in a micro-batch, T = response tokens (right-padded; `response_mask_BT`
is 1 on real response tokens), G = group size (completions per prompt).

Every estimator and loss is verl's (`verl.trainer.ppo.core_algos`, verl 0.9.1), chosen by name
through `RLAlgorithm` (`posttrain.rl.config`); this module adapts argument conventions and fixes
the step normaliser, it does not re-implement the formulas:

    advantage estimators  get_adv_estimator_fn(name)   grpo, rloo, reinforce_plus_plus, gae, ...
    policy losses         get_policy_loss_fn(name)     vanilla (PPO clip), gspo, cispo, sapo, ...
    KL estimators         kl_penalty(logp, ref, mode)  k1, k2, k3 (Schulman 2020)
    aggregation           agg_loss(...)                token-mean, seq-mean-token-sum, ...
    value loss            compute_value_loss(...)      clipped, for PPO with a value head
    rollout correction    compute_rollout_correction_weights(...), in posttrain.rl.lowbit_rollout

Step normaliser. As for SFT (`posttrain.train.losses`), a loss over several micro-batches must equal the
loss over the one big batch. Each call gets `num_units_in_step`: what the aggregation mode divides
by, counted over every micro-batch of the optimizer step (`step_units` per micro-batch, summed):
trained tokens for 'token-mean', sequences with at least one response token for the seq-mean
modes. It is passed to verl's `agg_loss` as `batch_num_tokens` / `global_batch_size`. Without it,
each micro-batch is normalised by itself (verl's fallback) and accumulation is not invariant.

verl quirks handled here (verl 0.9.1):
  * GRPO divides by std + 1e-6. In fp32 the group mean of equal rewards is often not exactly
    the reward (7 x 0.7 -> advantages of +-0.056 instead of 0). Advantages are computed in
    float64, and groups whose rewards are all equal get exactly 0 (grpo, rloo, opo, gpg, ...).
  * Group ids used as dict keys: a torch tensor of ids hashes by identity (KeyError or one group
    per row). Ids are mapped to dense Python ints first.
  * A group of one gets its raw reward as advantage (GRPO) or 0 (RLOO); group estimators here
    refuse groups of one (ValueError).
  * gae and reinforce_plus_plus whiten advantages over all tokens of the batch (unbiased std),
    so they need at least two response tokens per call and depend on the whole batch.
  * geo_mean takes a plain mean over the micro-batch's rows; it is rescaled to the step here.
  * verl's loss metrics are Python floats (it calls .item(): one host sync per metric).
  * verl reduces with `(x * mask).sum()`: NaN or inf on a masked position poisons the loss and
    its gradient. Every [B, T] input is passed through `posttrain.core.masked.keep_selected`
    (0 on masked positions, gradient exactly 0 there) before verl sees it, and posttrain's own
    metrics use `masked_mean` / `masked_max`: whatever padding holds, losses, gradients and
    metrics equal those with zeros there.

Example:
    >>> import torch
    >>> adv_BT, _ = compute_advantages("grpo", scores_B=torch.tensor([1., 0., 0., 1.]),
    ...                                response_mask_BT=torch.ones(4, 2), group_ids=[0, 0, 0, 0])
    >>> [round(float(a), 3) for a in adv_BT[:, 0]]
    [0.866, -0.866, -0.866, 0.866]
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from verl.trainer.ppo import core_algos

from posttrain.core.masked import keep_selected, masked_max, masked_mean
from posttrain.rl.config import (KL_ESTIMATORS, LOSS_AGG_MODES, ROLLOUT_CORRECTIONS,
                                 RLAlgorithm, _estimator_fn, advantage_estimators,
                                 is_group_estimator, policy_losses, register_advantage_estimator,
                                 register_policy_loss, verl_actor_config, verl_algo_config)

__all__ = ["RLAlgorithm", "LOSS_AGG_MODES", "KL_ESTIMATORS", "ROLLOUT_CORRECTIONS",
           "advantage_estimators",
           "policy_losses", "is_group_estimator", "register_advantage_estimator",
           "register_policy_loss", "step_units", "accumulate_metrics", "STEP_SHARES",
           "scores_to_token_rewards",
           "compute_advantages", "sequence_advantages", "aggregate", "kl_loss", "policy_loss",
           "value_loss"]

# Estimators whose advantage is exactly 0 when every reward of a group is equal (by definition).
_ZERO_FOR_EQUAL_GROUPS = frozenset({"grpo", "grpo_vectorized", "grpo_passk", "rloo",
                                    "rloo_vectorized", "opo", "gpg"})


# --------------------------------------------------------------------------------------------
# Normaliser and rewards
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
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: "
                         f"{', '.join(LOSS_AGG_MODES)}")
    mask = response_mask_BT != 0
    if loss_agg_mode.startswith("token-"):
        return mask.sum()
    return mask.any(dim=-1).sum()


STEP_SHARES = frozenset({"loss", "pg_loss", "kl_loss", "entropy_loss", "vf_loss"})
"""The metrics of `policy_loss` / `value_loss` that are shares of the step (summed over its
micro-batches); the others are per-token means of the micro-batch, or ratio_max."""


def accumulate_metrics(totals: dict[str, Tensor], metrics: dict[str, Tensor],
                       weight: Tensor) -> None:
    """Add one micro-batch's metrics to the minibatch's `totals`, in place: step shares
    (`STEP_SHARES`) are summed, ratio_max is a maximum, per-token means are weighted by
    `weight`, the micro-batch's share of the minibatch's response tokens."""
    for key, value in metrics.items():
        value = value.detach().float()
        if key == "ratio_max":
            totals[key] = torch.maximum(totals.get(key, value), value)
        else:
            totals[key] = totals.get(key, 0.0) + (value if key in STEP_SHARES else value * weight)


def scores_to_token_rewards(scores_B: Tensor, response_mask_BT: Tensor) -> Tensor:
    """Outcome rewards as verl's `token_level_rewards`: each score on its row's last response
    token, 0 elsewhere. Returns [B, T] in the scores' float dtype.

    Raises:
        ValueError: on mismatched shapes, or a row without response tokens.
    """
    if scores_B.dim() != 1 or response_mask_BT.dim() != 2 or \
            scores_B.shape[0] != response_mask_BT.shape[0]:
        raise ValueError(f"scores must be [B] and response_mask [B, T]; got "
                         f"{tuple(scores_B.shape)} and {tuple(response_mask_BT.shape)}")
    mask = response_mask_BT != 0
    lengths_B = mask.sum(dim=-1)
    if bool((lengths_B == 0).any()):
        rows = torch.nonzero(lengths_B == 0).flatten().tolist()
        raise ValueError(f"rows {rows} have no response token, so their score has nowhere to go;"
                         " drop them (or record them as failed rollouts) before computing "
                         "advantages")
    T = mask.shape[1]
    last_B = T - 1 - mask.flip(-1).int().argmax(dim=-1)
    rewards_BT = torch.zeros(mask.shape, dtype=scores_B.dtype if scores_B.is_floating_point()
                             else torch.float32, device=scores_B.device)
    rewards_BT[torch.arange(mask.shape[0], device=mask.device), last_B] = \
        scores_B.to(rewards_BT.dtype)
    return rewards_BT


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


def compute_advantages(name: str, *, response_mask_BT: Tensor,
                       token_level_rewards_BT: Tensor | None = None,
                       scores_B: Tensor | None = None,
                       group_ids: Sequence[Any] | np.ndarray | Tensor | None = None,
                       values_BT: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0,
                       norm_adv_by_std_in_grpo: bool = True) -> tuple[Tensor, Tensor]:
    """Advantages and returns from verl's estimator `name`.

    Args:
        name: a verl estimator (`advantage_estimators()`): 'grpo' (Shao et al. 2024, eq. 3:
            (r - mean_G) / (std_G + 1e-6), std unbiased), 'rloo' (Ahmadian et al. 2024:
            r_i - mean of the other G - 1 rewards), 'reinforce_plus_plus' (Hu 2025: discounted
            return, whitened over the batch's tokens), 'gae' (Schulman et al. 2016; advantages
            whitened over the batch's tokens, returns = raw advantages + values), ...
        response_mask_BT: [B, T], 1 on response tokens.
        token_level_rewards_BT: [B, T] rewards per token; or
        scores_B: [B] one outcome reward per sequence, placed on its last response token.
        group_ids: B hashable ids (prompt of each completion); required by group estimators.
        values_BT: [B, T] value estimates of the old policy (gae).
        gamma, lam: discount and GAE lambda (gae, reinforce_plus_plus).
        norm_adv_by_std_in_grpo: divide by the group std (False: Dr. GRPO).

    Returns:
        (advantages_BT, returns_BT), detached, in the rewards' float dtype (computed in float64),
        0 outside the response mask.

    Raises:
        ValueError: unknown estimator; not exactly one of token_level_rewards_BT / scores_B;
            shapes; NaN or inf rewards on response tokens (masked positions are ignored, whatever
            they hold); missing group_ids or values; a group of size one for a group
            estimator; fewer than two response tokens for a whitening estimator (from verl).
    """
    fn = _estimator_fn(name)
    params = inspect.signature(fn).parameters
    if (token_level_rewards_BT is None) == (scores_B is None):
        raise ValueError("pass exactly one of token_level_rewards_BT ([B, T]) and scores_B ([B])")
    if response_mask_BT.dim() != 2:
        raise ValueError(f"response_mask_BT must be [B, T]; got {tuple(response_mask_BT.shape)}")
    if scores_B is not None:
        token_level_rewards_BT = scores_to_token_rewards(scores_B, response_mask_BT)
    if token_level_rewards_BT.shape != response_mask_BT.shape:
        raise ValueError(f"token_level_rewards_BT {tuple(token_level_rewards_BT.shape)} and "
                         f"response_mask_BT {tuple(response_mask_BT.shape)} differ in shape")
    token_level_rewards_BT = keep_selected(token_level_rewards_BT, response_mask_BT)
    if not bool(torch.isfinite(token_level_rewards_BT).all()):
        raise ValueError("rewards contain NaN or inf on response tokens; record the failed "
                         "rollouts as typed outcomes and give them an explicit reward (or drop "
                         "them) first")
    out_dtype = (token_level_rewards_BT.dtype if token_level_rewards_BT.is_floating_point()
                 else torch.float32)
    rewards_BT = token_level_rewards_BT.detach().to(torch.float64)
    mask_BT = response_mask_BT.detach().to(torch.float64)
    B = mask_BT.shape[0]

    kwargs: dict[str, Any] = {"token_level_rewards": rewards_BT, "response_mask": mask_BT}
    index = None
    if "index" in params:
        index = _dense_group_index(group_ids, B, name)
        kwargs["index"] = index
    if "values" in params:
        if values_BT is None or values_BT.shape != mask_BT.shape:
            raise ValueError(f"advantage estimator {name!r} needs values_BT of shape "
                             f"{tuple(mask_BT.shape)}; got "
                             f"{None if values_BT is None else tuple(values_BT.shape)}")
        kwargs["values"] = keep_selected(values_BT.detach().to(torch.float64), mask_BT)
    if "gamma" in params:
        kwargs["gamma"] = gamma
    if "lam" in params:
        kwargs["lam"] = lam
    if "norm_adv_by_std_in_grpo" in params:
        kwargs["norm_adv_by_std_in_grpo"] = norm_adv_by_std_in_grpo
    if "config" in params:
        kwargs["config"] = verl_algo_config(gamma=gamma, lam=lam,
                                            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    advantages_BT, returns_BT = fn(**kwargs)

    if name in _ZERO_FOR_EQUAL_GROUPS and index is not None:
        flat_B = _rows_of_constant_groups(rewards_BT.sum(dim=-1), index)
        if flat_B.any():
            advantages_BT = advantages_BT.masked_fill(flat_B[:, None], 0.0)
            returns_BT = returns_BT.masked_fill(flat_B[:, None], 0.0)
    # gae's whitening leaves (0 - mean) / std on padding: zero everything outside the mask.
    return (keep_selected(advantages_BT, mask_BT).to(out_dtype),
            keep_selected(returns_BT, mask_BT).to(out_dtype))


def sequence_advantages(advantages_BT: Tensor, response_mask_BT: Tensor) -> list[float]:
    """One advantage per row: the mean of `advantages_BT` [B, T] over the row's response tokens
    (`response_mask_BT` [B, T], 1 on them; 0.0 for a row without any). A list of B floats (one
    host sync), for the replay buffer's records. Masked positions are ignored whatever they
    hold."""
    return masked_mean(advantages_BT.float(), response_mask_BT.float(), dim=-1).tolist()


def _dense_group_index(group_ids: Any, B: int, name: str) -> np.ndarray:
    """Group ids -> int64 array of dense ids in order of first appearance; checks group sizes."""
    if group_ids is None:
        raise ValueError(f"advantage estimator {name!r} compares completions of the same prompt:"
                         " pass group_ids (one id per row)")
    ids = group_ids.tolist() if isinstance(group_ids, (Tensor, np.ndarray)) else list(group_ids)
    if len(ids) != B:
        raise ValueError(f"group_ids has {len(ids)} entries for {B} rows")
    dense: dict[Any, int] = {}
    index = np.array([dense.setdefault(g, len(dense)) for g in ids], dtype=np.int64)
    sizes = np.bincount(index)
    if (sizes < 2).any():
        lonely = [g for g, i in dense.items() if sizes[i] < 2]
        raise ValueError(f"advantage estimator {name!r} needs at least 2 completions per group; "
                         f"groups {lonely[:5]} have one (verl would use the raw reward as its "
                         "advantage). Drop them or sample more completions")
    return index


def _rows_of_constant_groups(scores_B: Tensor, index: np.ndarray) -> Tensor:
    idx = torch.as_tensor(index, device=scores_B.device)
    n = int(idx.max()) + 1
    high = torch.full((n,), -torch.inf, dtype=scores_B.dtype, device=scores_B.device)
    low = torch.full((n,), torch.inf, dtype=scores_B.dtype, device=scores_B.device)
    high = high.scatter_reduce(0, idx, scores_B, reduce="amax")
    low = low.scatter_reduce(0, idx, scores_B, reduce="amin")
    return (high == low)[idx]


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def _global_batch_info(loss_agg_mode: str, num_units_in_step: Tensor | int | None,
                       dp_size: int, loss_scale_factor: int | None) -> dict[str, Any]:
    if isinstance(num_units_in_step, int) and num_units_in_step < 1:
        raise ValueError(f"num_units_in_step={num_units_in_step}; a step must train at least one "
                         "unit")
    if dp_size > 1 and num_units_in_step is None:
        raise ValueError("dp_size > 1 needs num_units_in_step counted over all ranks")
    token_mode = loss_agg_mode.startswith("token-")
    return {"dp_size": dp_size,
            "batch_num_tokens": num_units_in_step if token_mode else None,
            "global_batch_size": None if token_mode else num_units_in_step,
            "loss_scale_factor": loss_scale_factor}


def aggregate(loss_BT: Tensor, response_mask_BT: Tensor, *, loss_agg_mode: str,
              num_units_in_step: Tensor | int | None = None, dp_size: int = 1,
              loss_scale_factor: int | None = None) -> Tensor:
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
    return core_algos.agg_loss(loss_mat=keep_selected(loss_BT, response_mask_BT),
                               loss_mask=response_mask_BT.to(loss_BT.dtype),
                               loss_agg_mode=loss_agg_mode,
                               **_global_batch_info(loss_agg_mode, num_units_in_step, dp_size,
                                                    loss_scale_factor))


def kl_loss(logprobs_BT: Tensor, ref_logprobs_BT: Tensor, response_mask_BT: Tensor, *,
            estimator: str, loss_agg_mode: str, num_units_in_step: Tensor | int | None = None,
            dp_size: int = 1, loss_scale_factor: int | None = None) -> tuple[Tensor, Tensor]:
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
    kl_BT = core_algos.kl_penalty(keep_selected(logprobs_BT, response_mask_BT),
                                  keep_selected(ref_logprobs_BT.detach(), response_mask_BT),
                                  estimator)
    kl_BT = keep_selected(kl_BT, response_mask_BT)
    loss = aggregate(kl_BT, response_mask_BT, loss_agg_mode=loss_agg_mode,
                     num_units_in_step=num_units_in_step, dp_size=dp_size,
                     loss_scale_factor=loss_scale_factor)
    return loss, kl_BT.detach()


def policy_loss(logprobs_BT: Tensor, old_logprobs_BT: Tensor, advantages_BT: Tensor,
                response_mask_BT: Tensor, *, algo: RLAlgorithm,
                ref_logprobs_BT: Tensor | None = None, entropy_BT: Tensor | None = None,
                num_units_in_step: Tensor | int | None = None, dp_size: int = 1,
                rollout_is_weights_BT: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
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
    named = {"old_logprobs_BT": old_logprobs_BT, "advantages_BT": advantages_BT,
             "response_mask_BT": response_mask_BT, "ref_logprobs_BT": ref_logprobs_BT,
             "entropy_BT": entropy_BT, "rollout_is_weights_BT": rollout_is_weights_BT}
    if logprobs_BT.dim() != 2 or any(t is not None and t.shape != shape for t in named.values()):
        raise ValueError("logprobs_BT and the other [B, T] inputs must share one 2-D shape; got "
                         f"logprobs_BT {tuple(shape)}, " + ", ".join(
                             f"{k} {tuple(v.shape)}" for k, v in named.items() if v is not None))
    if algo.kl_coef > 0 and ref_logprobs_BT is None:
        raise ValueError(f"algo.kl_coef={algo.kl_coef} needs ref_logprobs_BT (or set kl_coef=0)")
    if algo.entropy_coef > 0 and entropy_BT is None:
        raise ValueError(f"algo.entropy_coef={algo.entropy_coef} needs entropy_BT")
    mask_BT = response_mask_BT.to(logprobs_BT.dtype)
    # padding may hold anything (NaN, inf, -inf log-probs): 0 there before verl's (x * mask)
    logprobs_BT, old_logprobs_BT, advantages_BT, ref_logprobs_BT, entropy_BT, \
        rollout_is_weights_BT = (None if t is None else keep_selected(t, mask_BT) for t in (
            logprobs_BT, old_logprobs_BT, advantages_BT, ref_logprobs_BT, entropy_BT,
            rollout_is_weights_BT))
    info = _global_batch_info(algo.loss_agg_mode, num_units_in_step, dp_size,
                              algo.loss_scale_factor)
    config = verl_actor_config(algo, **info)
    pg_loss, verl_metrics = core_algos.get_policy_loss_fn(algo.policy_loss)(
        old_log_prob=old_logprobs_BT.detach(), log_prob=logprobs_BT,
        advantages=advantages_BT.detach(), response_mask=mask_BT,
        loss_agg_mode=algo.loss_agg_mode, config=config,
        rollout_is_weights=(None if rollout_is_weights_BT is None
                            else rollout_is_weights_BT.detach()))
    if algo.policy_loss == "geo_mean" and num_units_in_step is not None:
        # verl's geo_mean is torch.mean over this micro-batch's rows: make it a share of the step.
        pg_loss = pg_loss * (shape[0] * dp_size) / num_units_in_step

    with torch.no_grad():
        ratio_BT = torch.exp(logprobs_BT.detach() - old_logprobs_BT.detach())
        metrics = {"ratio_mean": masked_mean(ratio_BT, mask_BT),
                   "ratio_max": masked_max(ratio_BT, mask_BT)}
    for key, value in verl_metrics.items():
        key = key.removeprefix("actor/").replace("pg_clipfrac", "clipfrac")
        metrics[key] = torch.as_tensor(value, dtype=torch.float32)

    loss = pg_loss
    if ref_logprobs_BT is not None:
        kl_share, kl_BT = kl_loss(logprobs_BT, ref_logprobs_BT, mask_BT,
                                  estimator=algo.kl_estimator, loss_agg_mode=algo.loss_agg_mode,
                                  num_units_in_step=num_units_in_step, dp_size=dp_size,
                                  loss_scale_factor=algo.loss_scale_factor)
        if algo.kl_coef > 0:
            loss = loss + algo.kl_coef * kl_share
        metrics["kl_loss"] = kl_share.detach()
        metrics["kl"] = masked_mean(kl_BT, mask_BT)
    if entropy_BT is not None:
        entropy_share = aggregate(entropy_BT, mask_BT, loss_agg_mode=algo.loss_agg_mode,
                                  num_units_in_step=num_units_in_step, dp_size=dp_size,
                                  loss_scale_factor=algo.loss_scale_factor)
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * entropy_share
        metrics["entropy_loss"] = entropy_share.detach()
        metrics["entropy"] = masked_mean(entropy_BT.detach(), mask_BT)
    metrics["pg_loss"] = pg_loss.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics


def value_loss(values_BT: Tensor, old_values_BT: Tensor, returns_BT: Tensor,
               response_mask_BT: Tensor, *, algo: RLAlgorithm,
               num_units_in_step: Tensor | int | None = None,
               dp_size: int = 1) -> tuple[Tensor, dict[str, Tensor]]:
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
        raise ValueError(f"values_BT {tuple(shape)}, old_values_BT {tuple(old_values_BT.shape)}, "
                         f"returns_BT {tuple(returns_BT.shape)} and response_mask_BT "
                         f"{tuple(response_mask_BT.shape)} must have one shape")
    info = _global_batch_info(algo.loss_agg_mode, num_units_in_step, dp_size,
                              algo.loss_scale_factor)
    values_BT, old_values_BT, returns_BT = (keep_selected(t, response_mask_BT) for t in (
        values_BT, old_values_BT.detach(), returns_BT.detach()))
    loss, clipfrac = core_algos.compute_value_loss(
        vpreds=values_BT, returns=returns_BT, values=old_values_BT,
        response_mask=response_mask_BT.to(values_BT.dtype), cliprange_value=algo.value_clip,
        loss_agg_mode=algo.loss_agg_mode, **info)
    return loss, {"vf_loss": loss.detach(), "vf_clipfrac": clipfrac.detach()}
