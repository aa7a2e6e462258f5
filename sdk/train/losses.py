"""Training losses: pure tensor functions, and a registry of the objectives the `Trainer` calls.

Notation: B = rows in a micro-batch, T = tokens per row, V = vocabulary size.

The normaliser of a step is counted over the whole optimizer step: every micro-batch of gradient
accumulation (and, with data parallelism, every rank). Each micro-batch contributes
`loss_sum / num_tokens_in_step`; the contributions add up to the token mean of the one big batch,
which is what the step's gradient must be (a mean of per-micro-batch means weights the tokens of
short micro-batches more; TRL `tests/invariant/README.md`, and the gradient-accumulation fix in
transformers 4.46).

Worked case: micro-batch A has 1 trained token with loss 2.0, micro-batch B 3 tokens with loss 1.0
each. Step loss = (2.0 + 3.0) / 4 = 1.25, not (2.0 + 1.0) / 2 = 1.5.

Registry: an objective is chosen by name (`get_loss("sft_ce")`) and has one signature, one call
site in the trainer (`TrainingLoss`). Registering a name twice raises; an unknown name raises
ValueError listing the valid names. The preference objectives (dpo, ipo, simpo, kto, orpo,
bradley_terry) live in the higher `posttrain.preference` layer and register when it is imported.

Example:
    >>> import torch
    >>> logits_BTV = torch.zeros(1, 3, 4)            # uniform over 4 tokens: CE = log 4 per token
    >>> labels_BT = torch.tensor([[2, -100, 1]])
    >>> loss_sum, n = token_cross_entropy_sum(logits_BTV, labels_BT)
    >>> round(float(loss_sum / n), 6), int(n)
    (1.386294, 2)
    >>> "sft_ce" in registered_losses()
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.core.distributed import device_of
from posttrain.core.masked import keep_selected
from posttrain.core.registry import Registry
from posttrain.core.timing import attention_span
from posttrain.data.loader import IGNORE_INDEX
from posttrain.models.attention_masks import device_mask
from posttrain.models.moe import moe_aux_loss
from posttrain.policy.chunked_ce import (
    check_chunk_tokens,
    chunked_cross_entropy_sum,
    model_hidden,
)

__all__ = [
    "IGNORE_INDEX",
    "token_cross_entropy_sum",
    "normalize_by_step",
    "TrainingLoss",
    "SFTCrossEntropy",
    "register_loss",
    "get_loss",
    "registered_losses",
]

# --------------------------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------------------------


def token_cross_entropy_sum(
    logits_BTV: Tensor, labels_BT: Tensor, *, ignore_index: int = IGNORE_INDEX
) -> tuple[Tensor, Tensor]:
    """Cross-entropy summed over trained tokens, and how many tokens were trained.

    Args:
        logits_BTV: [B, T, V] float logits; computed in fp32 whatever their dtype.
        labels_BT: [B, T] int64, already shifted: `labels_BT[b, t]` is the token to predict at
            position t, or `ignore_index` where nothing is trained.
        ignore_index: label value of untrained positions.

    Returns:
        (loss_sum, num_tokens): fp32 scalar `sum_t -log softmax(logits_t)[labels_t]` over trained
        positions (0.0 with a zero gradient when none is trained), and an int64 scalar count.
        No host sync: both stay on the logits' device. Logits of untrained positions are
        replaced by 0 first (`posttrain.core.masked.keep_selected`), so NaN or inf there reach
        neither the loss nor the gradient (`F.cross_entropy`'s ignore_index alone keeps the loss
        but its log-softmax backward turns them into NaN gradients); this costs one fp32 copy
        of the logits.

    Raises:
        ValueError: if the shapes disagree.
    """
    if logits_BTV.dim() != 3 or labels_BT.shape != logits_BTV.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and labels [B, T]; got logits "
            f"{tuple(logits_BTV.shape)} and labels {tuple(labels_BT.shape)}"
        )
    trained_BT1 = (labels_BT != ignore_index)[..., None]
    loss_sum = F.cross_entropy(
        keep_selected(logits_BTV.float(), trained_BT1).flatten(0, 1),
        labels_BT.flatten(),
        ignore_index=ignore_index,
        reduction="sum",
    )
    num_tokens = (labels_BT != ignore_index).sum()
    return loss_sum, num_tokens


def normalize_by_step(loss_sum: Tensor, num_tokens_in_step: Tensor | int) -> Tensor:
    """This micro-batch's share of the step loss: `loss_sum / num_tokens_in_step`.

    `num_tokens_in_step` counts the trained tokens of every micro-batch of the optimizer step (and
    of every data-parallel rank, once all-reduced), so the shares add up to the token mean of the
    whole step. See the module docstring for the worked case.

    Raises:
        ValueError: if `num_tokens_in_step` is a Python int below 1 (a tensor is not checked, to
            avoid a host sync; the trainer checks it once per step).
    """
    if isinstance(num_tokens_in_step, int) and num_tokens_in_step < 1:
        raise ValueError(
            f"num_tokens_in_step={num_tokens_in_step}; a step must train at least one token"
        )
    return loss_sum / num_tokens_in_step


# --------------------------------------------------------------------------------------------
# Objectives the trainer calls, and their registry
# --------------------------------------------------------------------------------------------


@runtime_checkable
class TrainingLoss(Protocol):
    """What the `Trainer` calls once per micro-batch. One signature for every objective.

    `num_units(batch)` is the micro-batch's share of the step normaliser (trained tokens for
    token-level losses; pairs or sequences for others), counted before any forward pass. The
    trainer adds it up over the step (int64 scalar tensor, ready for an all-reduce) and passes
    the total to `__call__`, which runs the model and returns this micro-batch's share of the
    step loss (fp32 scalar, differentiable). The shares of one step add up to the step loss.

    Optional: `num_tokens(batch)` (int64 scalar), the non-padding tokens the loss trains on in
    the micro-batch, for the step's `tokens_per_s` and `mfu` columns; a loss without it has its
    `num_units` counted as tokens (right for token-level losses such as SFT). Optional too:
    `attention_span(batch)` (int64 scalar), the sum over those tokens of the length of the
    sequence each sits in (`posttrain.core.timing.attention_span`), for the attention term of
    `mfu`; a loss without it has its `mfu` counted without attention (6 N per token only).
    """

    def num_units(self, batch: Any) -> Tensor: ...

    def __call__(self, model: nn.Module, batch: Any, num_units_in_step: Tensor) -> Tensor: ...


LossFactory = Callable[..., TrainingLoss]
"""Builds a `TrainingLoss` from keyword options (usually the loss class itself)."""


LOSSES: Registry[LossFactory] = Registry(
    "loss",
    builtins_hint="dpo, ipo, simpo, kto, orpo and bradley_terry register on "
    "`import posttrain.preference`",
)

register_loss = LOSSES.register
"""Decorator registering a `TrainingLoss` factory (usually its class) under a name; registering
another definition under a taken name raises ValueError (`posttrain.core.registry.Registry`)."""


def get_loss(name: str, **options: Any) -> TrainingLoss:
    """Build the loss registered under `name` with `options` (its constructor's keywords).

    Raises:
        ValueError: if `name` is unknown; the message lists the registered names.
    """
    return LOSSES.build(name, **options)


def registered_losses() -> tuple[str, ...]:
    """Names `get_loss` accepts ("sft_ce"; the preference losses once `posttrain.preference` is
    imported)."""
    return LOSSES.names()


@register_loss("sft_ce")
class SFTCrossEntropy:
    """Masked next-token cross-entropy for SFT and continued pretraining, token-normalised over
    the whole optimizer step.

    Batches are `posttrain.data.loader.Batch` (input_ids, labels already shifted, position_ids,
    attention_mask or None for plain causal; a packed batch's mask reaches the model as a
    FlexAttention `BlockMask` on CUDA, dense elsewhere:
    `posttrain.models.attention_masks.device_mask`). Per micro-batch:

        logits_BTV = model(input_ids, mask=attention_mask, input_pos=position_ids)
        share = token_cross_entropy_sum(logits_BTV, labels_BT)[0] / num_units_in_step

    An MoE model (`posttrain.models.moe.MoEFeedForward` layers) also gets its load-balancing
    loss, each layer's weighted by the `router_aux_loss_coef` it was built with:

        share += moe_aux_loss(model, scaled=True) * num_units(batch) / num_units_in_step

    so the shares of a step add up to CE token mean + the token-weighted mean over micro-batches
    of the coefficient-weighted aux loss (HF `Qwen2MoeForCausalLM` adds
    `router_aux_loss_coef * aux_loss` to its loss likewise). A dense model gets nothing added.

    With `loss_chunk_tokens` the model stops at its final norm and the head and log-softmax run
    over that many trained tokens at a time (`posttrain.policy.chunked_ce`): no [B, T, V] logits
    are held, the loss equals the unchunked one up to float rounding (~1e-7 relative in fp32).

    Args:
        ignore_index: label of untrained positions.
        loss_chunk_tokens: None (default; full [B, T, V] logits, bitwise as before) or the
            trained tokens per chunk (an int >= 1; e.g. 1024 at a 151,936-token vocabulary).

    Raises:
        ValueError: if loss_chunk_tokens is not None or an int >= 1.
    """

    def __init__(
        self, *, ignore_index: int = IGNORE_INDEX, loss_chunk_tokens: int | None = None
    ) -> None:
        self.ignore_index = ignore_index
        self.loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)

    def num_units(self, batch: Any) -> Tensor:
        """Trained tokens of `batch` (int64 scalar on the labels' device)."""
        return (batch.labels != self.ignore_index).sum()

    def attention_span(self, batch: Any) -> Tensor:
        """Sum over the trained tokens of their sequence's length (int64 scalar, tokens): the
        document's in packed rows (position ids restart at 0), the row length T (padding
        included) in unpacked ones (`posttrain.core.timing.attention_span`)."""
        return attention_span(batch.position_ids, batch.labels != self.ignore_index)

    def __call__(self, model: nn.Module, batch: Any, num_units_in_step: Tensor) -> Tensor:
        device = device_of(model)
        mask = device_mask(batch.attention_mask, device)  # a BlockMask on CUDA, else dense
        labels_BT = batch.labels.to(device)
        if self.loss_chunk_tokens is not None:
            hidden_BTD, head = model_hidden(
                model,
                batch.input_ids.to(device),
                mask=mask,
                input_pos=batch.position_ids.to(device),
            )
            loss_sum, num_tokens = chunked_cross_entropy_sum(
                hidden_BTD,
                head,
                labels_BT,
                chunk_tokens=self.loss_chunk_tokens,
                ignore_index=self.ignore_index,
            )
        else:
            logits_BTV = model(
                batch.input_ids.to(device), mask=mask, input_pos=batch.position_ids.to(device)
            )
            if not isinstance(logits_BTV, Tensor):
                raise TypeError(
                    f"the model returned {type(logits_BTV).__name__}; SFTCrossEntropy "
                    "needs logits [B, T, V] (build it without output chunks or hidden "
                    "states)"
                )
            loss_sum, num_tokens = token_cross_entropy_sum(
                logits_BTV, labels_BT, ignore_index=self.ignore_index
            )
        share = normalize_by_step(loss_sum, num_units_in_step.to(device))
        aux = moe_aux_loss(model, scaled=True)
        if aux is not None:
            share = share + aux * normalize_by_step(num_tokens, num_units_in_step.to(device))
        return share

    def __repr__(self) -> str:
        chunk = (
            ""
            if self.loss_chunk_tokens is None
            else f", loss_chunk_tokens={self.loss_chunk_tokens}"
        )
        return f"SFTCrossEntropy(ignore_index={self.ignore_index}{chunk})"


class NonFiniteLossError(FloatingPointError):
    """A step's loss or gradient norm is NaN/inf; the update was not applied (see
    `check_finite_update`)."""


def check_finite_update(step: int, loss: Tensor, grad_norm: Tensor) -> None:
    """Raise `NonFiniteLossError` before an optimizer step whose loss or gradient norm is not
    finite, so NaN never reaches the parameters or a checkpoint.

    Args:
        step: the 1-based number of the step being taken (for the message).
        loss: scalar loss of the step (any dtype).
        grad_norm: scalar global gradient norm before clipping.

    Raises:
        NonFiniteLossError: naming the step and both values; the caller discards the gradients,
            so the parameters stay those of the last completed step.
    """
    if not (bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))):
        raise NonFiniteLossError(
            f"step {step}: loss={float(loss)} grad_norm={float(grad_norm)} is not finite; the "
            "update was not applied and nothing was checkpointed, so the parameters are those "
            "of the previous step. Lower the learning rate, check the data, or resume from the "
            "last checkpoint."
        )
