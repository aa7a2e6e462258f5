"""Advantages from verl's estimators, by name: outcome scores placed on the last response token,
group ids made dense, and the estimator's result fixed where verl's own is off.

Notation: B = sequences in a micro-batch, T = response tokens (right-padded; `response_mask_BT`
is 1 on real response tokens), G = group size (completions per prompt).

Every estimator is verl's (`verl.trainer.ppo.core_algos.get_adv_estimator_fn(name)`, verl 0.9.1:
grpo, rloo, reinforce_plus_plus, gae, ...), chosen through `RLAlgorithm.advantage_estimator`
(`posttrain.rl.config`); `posttrain.rl.algorithms` (the losses) exports these names too.

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

from posttrain.core.masked import keep_selected, masked_mean
from posttrain.rl.verl_registry import _estimator_fn, verl_algo_config

__all__ = ["scores_to_token_rewards", "compute_advantages", "sequence_advantages"]

# Estimators whose advantage is exactly 0 when every reward of a group is equal (by definition).
_ZERO_FOR_EQUAL_GROUPS = frozenset(
    {"grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo", "gpg"}
)


def scores_to_token_rewards(scores_B: Tensor, response_mask_BT: Tensor) -> Tensor:
    """Outcome rewards as verl's `token_level_rewards`: each score on its row's last response
    token, 0 elsewhere. Returns [B, T] in the scores' float dtype.

    Raises:
        ValueError: on mismatched shapes, or a row without response tokens.
    """
    if (
        scores_B.dim() != 1
        or response_mask_BT.dim() != 2
        or scores_B.shape[0] != response_mask_BT.shape[0]
    ):
        raise ValueError(
            f"scores must be [B] and response_mask [B, T]; got "
            f"{tuple(scores_B.shape)} and {tuple(response_mask_BT.shape)}"
        )
    mask = response_mask_BT != 0
    lengths_B = mask.sum(dim=-1)
    if bool((lengths_B == 0).any()):
        rows = torch.nonzero(lengths_B == 0).flatten().tolist()
        raise ValueError(
            f"rows {rows} have no response token, so their score has nowhere to go;"
            " drop them (or record them as failed rollouts) before computing "
            "advantages"
        )
    T = mask.shape[1]
    last_B = T - 1 - mask.flip(-1).int().argmax(dim=-1)
    rewards_BT = torch.zeros(
        mask.shape,
        dtype=scores_B.dtype if scores_B.is_floating_point() else torch.float32,
        device=scores_B.device,
    )
    rewards_BT[torch.arange(mask.shape[0], device=mask.device), last_B] = scores_B.to(
        rewards_BT.dtype
    )
    return rewards_BT


def compute_advantages(
    name: str,
    *,
    response_mask_BT: Tensor,
    token_level_rewards_BT: Tensor | None = None,
    scores_B: Tensor | None = None,
    group_ids: Sequence[Any] | np.ndarray | Tensor | None = None,
    values_BT: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Tensor, Tensor]:
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
    assert token_level_rewards_BT is not None  # exactly one of the two was given (above)
    if token_level_rewards_BT.shape != response_mask_BT.shape:
        raise ValueError(
            f"token_level_rewards_BT {tuple(token_level_rewards_BT.shape)} and "
            f"response_mask_BT {tuple(response_mask_BT.shape)} differ in shape"
        )
    token_level_rewards_BT = keep_selected(token_level_rewards_BT, response_mask_BT)
    if not bool(torch.isfinite(token_level_rewards_BT).all()):
        raise ValueError(
            "rewards contain NaN or inf on response tokens; record the failed "
            "rollouts as typed outcomes and give them an explicit reward (or drop "
            "them) first"
        )
    out_dtype = (
        token_level_rewards_BT.dtype
        if token_level_rewards_BT.is_floating_point()
        else torch.float32
    )
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
            raise ValueError(
                f"advantage estimator {name!r} needs values_BT of shape "
                f"{tuple(mask_BT.shape)}; got "
                f"{None if values_BT is None else tuple(values_BT.shape)}"
            )
        kwargs["values"] = keep_selected(values_BT.detach().to(torch.float64), mask_BT)
    if "gamma" in params:
        kwargs["gamma"] = gamma
    if "lam" in params:
        kwargs["lam"] = lam
    if "norm_adv_by_std_in_grpo" in params:
        kwargs["norm_adv_by_std_in_grpo"] = norm_adv_by_std_in_grpo
    if "config" in params:
        kwargs["config"] = verl_algo_config(
            gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo
        )
    advantages_BT, returns_BT = fn(**kwargs)

    if name in _ZERO_FOR_EQUAL_GROUPS and index is not None:
        flat_B = _rows_of_constant_groups(rewards_BT.sum(dim=-1), index)
        if flat_B.any():
            advantages_BT = advantages_BT.masked_fill(flat_B[:, None], 0.0)
            returns_BT = returns_BT.masked_fill(flat_B[:, None], 0.0)
    # gae's whitening leaves (0 - mean) / std on padding: zero everything outside the mask.
    return (
        keep_selected(advantages_BT, mask_BT).to(out_dtype),
        keep_selected(returns_BT, mask_BT).to(out_dtype),
    )


def sequence_advantages(advantages_BT: Tensor, response_mask_BT: Tensor) -> list[float]:
    """One advantage per row: the mean of `advantages_BT` [B, T] over the row's response tokens
    (`response_mask_BT` [B, T], 1 on them; 0.0 for a row without any). A list of B floats (one
    host sync), for the replay buffer's records. Masked positions are ignored whatever they
    hold."""
    return masked_mean(advantages_BT.float(), response_mask_BT.float(), dim=-1).tolist()


def _dense_group_index(group_ids: Any, B: int, name: str) -> np.ndarray:
    """Group ids -> int64 array of dense ids in order of first appearance; checks group sizes."""
    if group_ids is None:
        raise ValueError(
            f"advantage estimator {name!r} compares completions of the same prompt:"
            " pass group_ids (one id per row)"
        )
    ids = group_ids.tolist() if isinstance(group_ids, (Tensor, np.ndarray)) else list(group_ids)
    if len(ids) != B:
        raise ValueError(f"group_ids has {len(ids)} entries for {B} rows")
    dense: dict[Any, int] = {}
    index = np.array([dense.setdefault(g, len(dense)) for g in ids], dtype=np.int64)
    sizes = np.bincount(index)
    if (sizes < 2).any():
        lonely = [g for g, i in dense.items() if sizes[i] < 2]
        raise ValueError(
            f"advantage estimator {name!r} needs at least 2 completions per group; "
            f"groups {lonely[:5]} have one (verl would use the raw reward as its "
            "advantage). Drop them or sample more completions"
        )
    return index


def _rows_of_constant_groups(scores_B: Tensor, index: np.ndarray) -> Tensor:
    idx = torch.as_tensor(index, device=scores_B.device)
    n = int(idx.max()) + 1
    high = torch.full((n,), -torch.inf, dtype=scores_B.dtype, device=scores_B.device)
    low = torch.full((n,), torch.inf, dtype=scores_B.dtype, device=scores_B.device)
    high = high.scatter_reduce(0, idx, scores_B, reduce="amax")
    low = low.scatter_reduce(0, idx, scores_B, reduce="amin")
    return (high == low)[idx]
