"""From rollout groups to a training batch: the exclusion rule (`split_groups`) and the
right-padded tensors of the kept trajectories (`make_batch`), as `posttrain.rl.trainer` uses them.

Notation: B = trajectories, T = padded tokens per row (prompt + completion).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from posttrain.data.collate import right_pad
from posttrain.rl.environment import Group, screen_rewards
from posttrain.rl.rollout import EXCLUDED_OUTCOMES

__all__ = ["split_groups", "make_batch"]


def split_groups(groups: Sequence[Group]) -> tuple[list[Group], dict[str, int]]:
    """Apply the exclusion rule. Returns (kept groups, counts): groups_excluded_error (a member
    has an outcome in `EXCLUDED_OUTCOMES`), groups_excluded_empty (a member sampled no token),
    groups_zero_signal (kept, all rewards equal: zero advantage under group estimators)."""
    kept, counts = (
        [],
        {"groups_excluded_error": 0, "groups_excluded_empty": 0, "groups_zero_signal": 0},
    )
    for group in screen_rewards(groups):  # a reward that breaks check_reward -> outcome error
        if any(t.outcome in EXCLUDED_OUTCOMES for t in group):
            counts["groups_excluded_error"] += 1
        elif any(not any(t.completion_mask or [True] * len(t.completion_ids)) for t in group):
            counts["groups_excluded_empty"] += 1
        else:
            kept.append(group)
            counts["groups_zero_signal"] += len(set(group.rewards)) == 1
    return kept, counts


def make_batch(groups: Sequence[Group], pad_id: int) -> dict[str, Tensor]:
    """Right-padded tensors of all trajectories of `groups`.

    Returns {input_ids_BT (int64), attention_mask_BT (bool), response_mask_BT (bool: sampled
    completion tokens), old_logprobs_BT (float32, the sampler's, 0 elsewhere), scores_B,
    group_ids_B (int64, dense: 0, 1, ... in order of first appearance)}.
    """
    rows = [t for g in groups for t in g]
    dense: dict[int | str, int] = {}
    input_ids_BT, attention_mask_BT = right_pad(
        [list(t.prompt_ids) + list(t.completion_ids) for t in rows], pad_id
    )
    masks = [
        t.completion_mask if t.completion_mask is not None else [True] * len(t.completion_ids)
        for t in rows
    ]
    response_mask_BT, _ = right_pad(
        [[False] * len(t.prompt_ids) + list(mask) for t, mask in zip(rows, masks)],
        False,
        dtype=torch.bool,
    )
    old_logprobs_BT, _ = right_pad(
        [[0.0] * len(t.prompt_ids) + list(t.logprobs) for t in rows], 0.0, dtype=torch.float32
    )
    return {
        "input_ids_BT": input_ids_BT,
        "attention_mask_BT": attention_mask_BT,
        "response_mask_BT": response_mask_BT,
        "old_logprobs_BT": old_logprobs_BT,
        "scores_B": torch.tensor([t.reward for t in rows], dtype=torch.float32),
        "group_ids_B": torch.tensor(
            [dense.setdefault(t.group_id, len(dense)) for t in rows], dtype=torch.long
        ),
    }
