"""The distillation objective of `posttrain.train.distill`: the generalised Jensen-Shannon
divergence JSD(beta) of GKD (Agarwal et al. 2024, eq. (1)) as a pure function, and `GKDLoss`,
the `Trainer` objective registered as "gkd" that computes it against a frozen teacher.

Notation: B = rows in a batch, T = tokens per row, V = vocabulary (shared by student and teacher),
N = trained positions (labels != -100). Divergences are in nats.

Example (beta = 0: KL(teacher || student) = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.1308 nats for a
uniform student and a teacher at [1/4, 3/4]):
    >>> import math, torch
    >>> student, teacher = torch.tensor([[[0.0, 0.0]]]), torch.tensor([[[0.0, math.log(3)]]])
    >>> round(float(generalized_jsd_loss(student, teacher, beta=0.0)), 4)
    0.1308
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.core.distributed import device_of
from posttrain.core.masked import keep_selected
from posttrain.data.loader import IGNORE_INDEX
from posttrain.models.attention_masks import device_mask
from posttrain.models.moe import moe_aux_loss
from posttrain.policy.chunked_ce import check_chunk_tokens, map_token_chunks, model_hidden
from posttrain.policy.policy import Policy
from posttrain.train.losses import normalize_by_step, register_loss

__all__ = ["REDUCTIONS", "generalized_jsd_loss", "GKDLoss"]

REDUCTIONS = ("batchmean", "sum", "mean", "none")
"""Reductions of `generalized_jsd_loss`, as TRL names them."""


# --------------------------------------------------------------------------------------------
# The divergence
# --------------------------------------------------------------------------------------------


def _check_fraction(name: str, value: Any, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value!r}; must be a number in [0, 1] ({meaning})")


def generalized_jsd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
) -> Tensor:
    """Generalised Jensen-Shannon divergence JSD(beta) of GKD (paper eq. (1)), per token.

    With p_S = softmax(student_logits / temperature), p_T = softmax(teacher_logits / temperature)
    and the mixture m = beta p_T + (1 - beta) p_S, the divergence at each position is

        JSD(beta) = beta KL(p_T || m) + (1 - beta) KL(p_S || m)

    and, as in TRL, beta = 0 is KL(p_T || p_S) (forward KL) and beta = 1 KL(p_S || p_T) (reverse
    KL). Equal to TRL 1.16's `GKDTrainer.generalized_jsd_loss` on the same inputs (tests/
    test_distill.py), except that (a) fp16/bf16 logits are computed in fp32, (b) masked
    positions are replaced by 0 before any arithmetic (`posttrain.core.masked.keep_selected`), so
    NaN/inf there reach neither the value nor the gradient (TRL's value drops them too, but the
    log-softmax backward turns them into NaN gradients on those rows), and (c) "mean" over no
    trained position is 0, not NaN.

    Args:
        student_logits: [B, T, V] float; differentiable.
        teacher_logits: [B, T, V] float, same shape (no gradient is needed).
        labels: [B, T] int64 already aligned with the logits (position t scored where
            `labels[b, t] != -100`), or None to score every position.
        beta: weight of the teacher in the mixture, in [0, 1].
        temperature: softmax temperature, > 0, applied to both logits.
        reduction: "batchmean" (sum / trained positions, or / B without labels), "sum",
            "mean" (mean over the N x V per-vocabulary terms; B x T x V without labels) or
            "none" (the per-vocabulary terms, [N, V] with labels, [B, T, V] without).

    Returns:
        A scalar (fp32 or wider) for "batchmean", "sum" and "mean"; the terms for "none".

    Raises:
        ValueError: naming the argument and what is allowed, for beta outside [0, 1],
            temperature <= 0 (or not finite), logits that are not [B, T, V] of one shape, labels
            not [B, T], or a reduction not in `REDUCTIONS`.
    """
    _check_fraction(
        "beta", beta, "the teacher's weight in the mixture: 0 is forward KL, 1 reverse KL"
    )
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise ValueError(f"temperature={temperature!r}; must be a finite number > 0")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; allowed: {', '.join(map(repr, REDUCTIONS))}")
    if student_logits.dim() != 3 or teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"student_logits and teacher_logits must both be [B, T, V] of one shape; "
            f"got student_logits {tuple(student_logits.shape)} and teacher_logits "
            f"{tuple(teacher_logits.shape)}"
        )
    if labels is not None and labels.shape != student_logits.shape[:2]:
        raise ValueError(
            f"labels must be [B, T] = {tuple(student_logits.shape[:2])} like the "
            f"logits; got labels {tuple(labels.shape)}"
        )
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student, teacher = student_logits.to(dtype), teacher_logits.to(dtype)
    mask_BT = None
    if labels is not None:
        mask_BT = labels != IGNORE_INDEX
        student = keep_selected(student, mask_BT[..., None])
        teacher = keep_selected(teacher, mask_BT[..., None])
    student_logp = F.log_softmax(student / temperature, dim=-1)
    teacher_logp = F.log_softmax(teacher / temperature, dim=-1)
    # Mirrors TRL's formula term by term (F.kl_div(input, target) = KL(target || input)).
    if beta == 0:
        jsd = F.kl_div(student_logp, teacher_logp, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_logp, student_logp, reduction="none", log_target=True)
    else:
        beta_t = torch.tensor(beta, dtype=dtype, device=student_logp.device)
        mixture_logp = torch.logsumexp(
            torch.stack([student_logp + torch.log1p(-beta_t), teacher_logp + torch.log(beta_t)]),
            dim=0,
        )
        kl_teacher = F.kl_div(mixture_logp, teacher_logp, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_logp, student_logp, reduction="none", log_target=True)
        jsd = beta_t * kl_teacher + (1 - beta_t) * kl_student
    if mask_BT is not None:
        jsd = jsd[mask_BT]
    if reduction == "batchmean":
        denom = mask_BT.sum().clamp_min(1) if mask_BT is not None else max(jsd.size(0), 1)
        return jsd.sum() / denom
    if reduction == "sum":
        return jsd.sum()
    if reduction == "mean":
        return jsd.sum() / max(jsd.numel(), 1)
    return jsd


# --------------------------------------------------------------------------------------------
# The objective
# --------------------------------------------------------------------------------------------


def _check_shared_vocabulary(student: Policy, teacher: Policy) -> None:
    for name, value in (("student", student), ("teacher", teacher)):
        if not isinstance(value, Policy):
            raise TypeError(
                f"{name} must be a posttrain.policy.Policy (model + tokenizer); got "
                f"{type(value).__name__}"
            )
    pairs = (
        ("vocab_size", student.spec.vocab_size, teacher.spec.vocab_size),
        ("tokenizer vocab_size", student.tokenizer.vocab_size, teacher.tokenizer.vocab_size),
    )
    for what, s, t in pairs:
        if s != t:
            raise ValueError(
                f"GKD needs a shared vocabulary: the student's {what} is {s} but the "
                f"teacher's is {t}; it compares the two full next-token "
                "distributions token id by token id, so pick a teacher with the "
                "student's tokenizer"
            )


@register_loss("gkd")
class GKDLoss:
    """Distillation objective: JSD(beta) between the student and a frozen teacher on the
    completion tokens of each batch, token-normalised over the whole optimizer step.

    Batches are `posttrain.data.loader.Batch` (SFT batches, packed or not; on-policy batches from
    `OnPolicyData`); a packed batch's mask reaches both models as a FlexAttention `BlockMask` on
    CUDA, dense elsewhere (`posttrain.models.attention_masks.device_mask`). Per micro-batch:

        student_BTV = model(input_ids, mask=attention_mask, input_pos=position_ids)
        with no_grad: teacher_BTV = teacher.model(same inputs)          # eval mode, frozen
        share = generalized_jsd_loss(student_BTV, teacher_BTV, labels, beta, temperature,
                                     reduction="sum") / num_units_in_step

    so the step loss is the mean JSD per trained token (TRL's GKD loss with
    `num_items_in_batch`). With fixed completions (lmbda = 0) this is supervised KD on them. An
    MoE student also gets its load-balancing loss, weighted exactly as in `SFTCrossEntropy`
    (`share += moe_aux_loss(model, scaled=True) * num_units(batch) / num_units_in_step`); TRL's
    GKD leaves it out.

    Args:
        teacher: the teacher `Policy`; its parameters are frozen (`requires_grad_(False)`) and
            its model put in eval mode here.
        student: the student `Policy` whose model the `Trainer` trains (checked for a shared
            vocabulary with the teacher; the batch is moved to the trained model's device, the
            teacher's logits to it too).
        beta: teacher weight of the JSD mixture in [0, 1] (0: forward KL, 1: reverse KL).
        temperature: softmax temperature of the divergence (> 0); TRL's GKD uses 1.
        ignore_index: label of untrained positions.
        loss_chunk_tokens: None (full [B, T, V] logits of both models) or trained tokens per
            chunk: both models stop at their final norm and the two heads and the divergence
            run over that many positions at a time, recomputed in backward
            (`posttrain.policy.chunked_ce.map_token_chunks`); equal up to float rounding.

    Raises:
        TypeError: if teacher or student is not a `Policy`.
        ValueError: if their vocabularies differ (naming both sizes), or for beta / temperature
            out of range.
    """

    def __init__(
        self,
        *,
        teacher: Policy,
        student: Policy,
        beta: float = 0.5,
        temperature: float = 1.0,
        ignore_index: int = IGNORE_INDEX,
        loss_chunk_tokens: int | None = None,
    ) -> None:
        _check_shared_vocabulary(student, teacher)
        generalized_jsd_loss(
            torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), beta=beta, temperature=temperature
        )  # checks beta and temperature
        teacher.model.requires_grad_(False)
        teacher.model.eval()
        self.teacher, self.student = teacher, student
        self.beta, self.temperature, self.ignore_index = beta, temperature, ignore_index
        self.loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)

    def num_units(self, batch: Any) -> Tensor:
        """Trained tokens of `batch` (int64 scalar on the labels' device)."""
        return (batch.labels != self.ignore_index).sum()

    def __call__(self, model: nn.Module, batch: Any, num_units_in_step: Tensor) -> Tensor:
        device = device_of(model)
        if self.loss_chunk_tokens is not None:
            units = num_units_in_step.to(device)
            return self._chunked(model, batch, units, device, self.loss_chunk_tokens)
        student_BTV = model(
            batch.input_ids.to(device),
            mask=device_mask(batch.attention_mask, device),
            input_pos=batch.position_ids.to(device),
        )
        if not isinstance(student_BTV, Tensor):
            raise TypeError(
                f"the model returned {type(student_BTV).__name__}; GKDLoss needs "
                "logits [B, T, V] (build it without output chunks or hidden states)"
            )
        teacher_BTV = self.teacher_logits(batch).to(device)
        labels_BT = batch.labels.to(device)
        labels_BT = torch.where(labels_BT == self.ignore_index, IGNORE_INDEX, labels_BT)
        jsd_sum = generalized_jsd_loss(
            student_BTV,
            teacher_BTV,
            labels_BT,
            beta=self.beta,
            temperature=self.temperature,
            reduction="sum",
        )
        share = normalize_by_step(jsd_sum, num_units_in_step.to(device))
        aux = moe_aux_loss(model, scaled=True)
        if aux is not None:  # as SFTCrossEntropy: the student's MoE load-balancing loss
            share = share + aux * normalize_by_step(
                self.num_units(batch).to(device), num_units_in_step.to(device)
            )
        return share

    def _chunked(
        self, model: nn.Module, batch: Any, units: Tensor, device: torch.device, chunk: int
    ) -> Tensor:
        """`__call__` with the heads and the divergence over chunks of trained positions."""
        hidden_BTD, head = model_hidden(
            model,
            batch.input_ids.to(device),
            mask=device_mask(batch.attention_mask, device),
            input_pos=batch.position_ids.to(device),
        )
        teacher, teacher_device = self.teacher.model, self.teacher.device
        teacher.eval()
        with torch.no_grad():
            teacher_BTD, teacher_head = model_hidden(
                teacher,
                batch.input_ids.to(teacher_device),
                mask=device_mask(batch.attention_mask, teacher_device),
                input_pos=batch.position_ids.to(teacher_device),
            )
        trained_BT = batch.labels.to(device) != self.ignore_index

        def jsd(h_CD: Tensor, t_CD: Tensor) -> tuple[Tensor]:
            teacher_CV = teacher_head(t_CD.to(teacher_device)).float().to(h_CD.device)
            value = generalized_jsd_loss(
                head(h_CD).float()[None],
                teacher_CV[None],
                beta=self.beta,
                temperature=self.temperature,
                reduction="sum",
            )
            return (value[None],)

        (sums,) = map_token_chunks(
            jsd,
            hidden_BTD[trained_BT],
            teacher_BTD.to(device)[trained_BT],
            chunk_tokens=chunk,
        )
        share = normalize_by_step(sums.sum(), units)
        aux = moe_aux_loss(model, scaled=True)
        if aux is not None:
            share = share + aux * normalize_by_step(trained_BT.sum(), units)
        return share

    def teacher_logits(self, batch: Any) -> Tensor:
        """The teacher's logits [B, T, V] on `batch` (eval mode, no gradient), on its device."""
        teacher, device = self.teacher.model, self.teacher.device
        teacher.eval()
        with torch.no_grad():
            return teacher(
                batch.input_ids.to(device),
                mask=device_mask(batch.attention_mask, device),
                input_pos=batch.position_ids.to(device),
            )

    def __repr__(self) -> str:
        return (
            f"GKDLoss(beta={self.beta}, temperature={self.temperature}, teacher={self.teacher!r})"
        )
