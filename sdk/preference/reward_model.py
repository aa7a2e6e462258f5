"""The Bradley-Terry reward-model objective: `BradleyTerryLoss`, registered as "bradley_terry".

Notation: B = pairs in a micro-batch, T = tokens per row.

The model side (`RewardModel`, `render_pair`, the per-pair `bradley_terry_loss`, held-out
`pairwise_accuracy`, save/load) is `posttrain.rewards.reward_model`; this module is the
`TrainingLoss` the `Trainer` optimises with it (Bradley & Terry 1952; Ouyang et al. 2022, eq. 1):

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected) - margin)

with the optional margin of Touvron et al. 2023 (Llama 2, eq. 2), normalising by the pairs of the
whole optimizer step (so gradient accumulation is exact). It registers on import (`import
posttrain.preference`), after which `get_loss("bradley_terry", margin=...)` builds it.

Example:
    >>> from posttrain.train.losses import get_loss
    >>> get_loss("bradley_terry", margin=0.5)
    BradleyTerryLoss(margin=0.5)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.preference.parallel import trains_nothing
from posttrain.rewards.reward_model import bradley_terry_loss
from posttrain.train.losses import register_loss

__all__ = ["pair_tensors", "BradleyTerryLoss"]


def pair_tensors(batch: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(chosen ids, chosen mask, rejected ids, rejected mask), each `[B, T]`, from a preference
    batch: `posttrain.data.preference.PreferenceBatch`, or any object with attributes
    `chosen_input_ids`, `chosen_attention_mask`, `rejected_input_ids`,
    `rejected_attention_mask` (the masks are 1 on real tokens).

    Raises:
        TypeError: if the batch has none of these layouts.
    """
    try:
        return (
            batch.chosen_input_ids,
            batch.chosen_attention_mask,
            batch.rejected_input_ids,
            batch.rejected_attention_mask,
        )
    except AttributeError:
        raise TypeError(
            f"{type(batch).__name__} is not a preference batch: it needs "
            "chosen_input_ids, chosen_attention_mask, rejected_input_ids and "
            "rejected_attention_mask"
        ) from None


@register_loss("bradley_terry")
class BradleyTerryLoss:
    """The Bradley-Terry reward-model objective as a `TrainingLoss`, normalised by pairs.

    Per micro-batch: one forward of the chosen and rejected rows together (`[2B, T]`, right
    padded to the longer), `share = sum_b bradley_terry_loss(r_c, r_r)_b / pairs_in_step`, so
    the shares of a step add up to the mean over all its pairs, whatever the micro-batching.

    Args:
        margin: constant margin (Touvron et al. 2023, eq. 2); 0 is the plain loss.

    Example (one `Trainer` step on two pairs):
        >>> import torch
        >>> from posttrain.data import PreferenceDataset, PreferenceLoader
        >>> from posttrain.models import ByteTokenizer
        >>> from posttrain.train import Trainer
        >>> from posttrain.rewards.reward_model import RewardModel
        >>> rows = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"},
        ...         {"prompt": "1+1=", "chosen": "2", "rejected": "11"}]
        >>> loader = PreferenceLoader(PreferenceDataset(rows, ByteTokenizer(), max_seq_len=32),
        ...                           batch_size=2)
        >>> rm = RewardModel.from_spec("tiny-1m", seed=0)
        >>> trainer = Trainer(rm, torch.optim.AdamW(rm.parameters(), lr=1e-3), data=loader,
        ...                   loss=BradleyTerryLoss(), progress=False)
        >>> row = trainer.step()
        >>> row["trained_tokens"], abs(row["loss"] - 0.693) < 0.01   # pairs; ~log 2 at the start
        (2, True)
    """

    def __init__(self, *, margin: float = 0.0) -> None:
        if not math.isfinite(margin):
            raise ValueError(f"margin={margin!r}; must be finite")
        self.margin = float(margin)

    def num_units(self, batch: Any) -> Tensor:
        """Pairs in `batch` (int64 scalar; 0 for a data-parallel padding batch)."""
        return torch.tensor(
            0 if trains_nothing(batch) else pair_tensors(batch)[0].shape[0], dtype=torch.long
        )

    def num_tokens(self, batch: Any) -> Tensor:
        """Real (non-padding) tokens of the chosen and rejected rows, prompt included: the
        reward head reads the last one, so the forward and backward pass cover them all (int64
        scalar, tokens; 0 for a data-parallel padding batch), for tokens_per_s and mfu."""
        if trains_nothing(batch):
            return torch.tensor(0, dtype=torch.int64)
        _, c_mask, _, r_mask = pair_tensors(batch)
        return (c_mask.sum() + r_mask.sum()).to(dtype=torch.int64, device="cpu")

    def attention_span(self, batch: Any) -> Tensor:
        """Sum over the `num_tokens` of the real length of the row each sits in: n^2 per row
        of n real tokens (int64 scalar, tokens; 0 for a padding batch), for mfu's attention
        term."""
        if trains_nothing(batch):
            return torch.tensor(0, dtype=torch.int64)
        _, c_mask, _, r_mask = pair_tensors(batch)
        rows_B = torch.cat([c_mask.sum(-1), r_mask.sum(-1)]).to(torch.int64)
        return (rows_B * rows_B).sum().cpu()

    def rewards(self, model: nn.Module, batch: Any) -> tuple[Tensor, Tensor]:
        """(r_chosen `[B]`, r_rejected `[B]`) from one forward pass of `model`."""
        c_ids, c_mask, r_ids, r_mask = pair_tensors(batch)
        B, T = c_ids.shape[0], max(c_ids.shape[1], r_ids.shape[1])
        ids = torch.cat(
            [F.pad(c_ids, (0, T - c_ids.shape[1])), F.pad(r_ids, (0, T - r_ids.shape[1]))]
        )
        mask = torch.cat(
            [
                F.pad(c_mask.bool(), (0, T - c_mask.shape[1])),
                F.pad(r_mask.bool(), (0, T - r_mask.shape[1])),
            ]
        )
        device = next(model.parameters()).device
        rewards_2B = model(ids.to(device), mask.to(device))
        return rewards_2B[:B], rewards_2B[B:]

    def __call__(self, model: nn.Module, batch: Any, num_units_in_step: Tensor) -> Tensor:
        chosen_B, rejected_B = self.rewards(model, batch)
        loss_sum = bradley_terry_loss(chosen_B, rejected_B, margin=self.margin).sum()
        share = loss_sum / num_units_in_step.to(loss_sum.device)
        return share * 0.0 if trains_nothing(batch) else share

    def __repr__(self) -> str:
        return f"BradleyTerryLoss(margin={self.margin})"
