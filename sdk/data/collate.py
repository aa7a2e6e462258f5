"""Right-padding: the one function that turns variable-length sequences into a [B, T] tensor and
its mask. SFT batches (`posttrain.data.loader.collate_padded`), preference and KTO batches
(`posttrain.data.preference`), the reward model (`posttrain.rewards.reward_model`) and the RL
batch (`posttrain.rl.trainer.make_batch`) all pad with it.

Notation: B = sequences, T = the longest sequence's length.

Example:
    >>> import torch
    >>> ids_BT, mask_BT = right_pad([[5, 6, 7], [8]], pad_id=0)
    >>> ids_BT.tolist(), mask_BT.tolist()
    ([[5, 6, 7], [8, 0, 0]], [[True, True, True], [True, False, False]])
    >>> right_pad([[True], [False, True]], False, dtype=torch.bool)[0].tolist()
    [[True, False], [False, True]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["right_pad"]


def right_pad(
    sequences: Sequence[Sequence[Any] | Tensor], pad_id: Any, *, dtype: torch.dtype = torch.int64
) -> tuple[Tensor, Tensor]:
    """Right-pad sequences to the longest one.

    Args:
        sequences: B lists or 1-D tensors of values (token ids, labels, mask bits, log-probs).
        pad_id: the value after each sequence's end.
        dtype: of the padded values (int64 for ids, bool for masks, float32 for log-probs).

    Returns:
        (values_BT of `dtype`, mask_BT bool): mask_BT is True on each sequence's own positions.

    Raises:
        ValueError: if `sequences` is empty.
    """
    if not sequences:
        raise ValueError("right_pad needs at least one sequence")
    B, T = len(sequences), max(len(s) for s in sequences)
    values_BT = torch.full((B, T), pad_id, dtype=dtype)
    mask_BT = torch.zeros(B, T, dtype=torch.bool)
    for b, s in enumerate(sequences):
        values_BT[b, : len(s)] = torch.as_tensor(s, dtype=dtype)
        mask_BT[b, : len(s)] = True
    return values_BT, mask_BT
