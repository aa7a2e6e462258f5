"""The preference objectives the `Trainer` calls: DPO, IPO, SimPO, ORPO on preference batches and
KTO on KTO batches, each registered by name in `posttrain.train.losses` ("dpo", "ipo", "simpo",
"kto", "orpo") when this module is imported (`import posttrain.preference` imports it).

Notation: B = preference pairs, N = KTO rows, K = KTO mismatched pairs for the KL estimate,
T = tokens per sequence; `2B` = chosen and rejected concatenated along B. Log-probabilities are
summed over the response tokens, in nats, fp32.

They run the policy on a `posttrain.data.preference.PreferenceBatch` (chosen and rejected in one
forward, concatenated along B) or `KTOBatch`; reference log-probabilities come precomputed in the
batch (`posttrain.preference.reference.compute_reference_logps`). The losses themselves are the
pure functions of `posttrain.preference.losses`. The normaliser is the number of pairs (KTO: rows)
in the whole optimizer step, so gradient accumulation 1 x 8 equals 8 x 1. Every objective takes
`loss_chunk_tokens` (None, or an int >= 1): the policy's head and log-softmax then run over that
many response tokens at a time (`posttrain.policy.chunked_ce`), without [B, T, V] logits.

Example:
    >>> from posttrain.train.losses import get_loss
    >>> get_loss("dpo", beta=0.2)
    DPOLoss(beta=0.2, label_smoothing=0.0, loss_type='sigmoid')
    >>> get_loss("dpo", loss_type="robust", label_smoothing=0.1)
    DPOLoss(beta=0.1, label_smoothing=0.1, loss_type='robust')
    >>> get_loss("dpo", loss_type="dpop", dpop_lambda=5.0)
    DPOLoss(beta=0.1, label_smoothing=0.0, loss_type='dpop', dpop_lambda=5.0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.policy.chunked_ce import check_chunk_tokens
from posttrain.preference.dpo_family import DPO_OPTION_DEFAULTS, DPOOptions
from posttrain.preference.loss_checks import check_beta
from posttrain.preference.losses import (
    LossTriple,
    dpo_loss,
    ipo_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    simpo_loss,
    step_share,
)
from posttrain.preference.parallel import trains_nothing
from posttrain.preference.reference import response_logps
from posttrain.train.losses import register_loss

__all__ = ["DPOLoss", "IPOLoss", "SimPOLoss", "KTOLoss", "ORPOLoss", "BUILTIN_LOSSES"]


def _row_span(real_BT: Tensor, counted_BT: Tensor) -> Tensor:
    """Sum over rows of (real tokens) x (counted tokens): each counted token attends over its
    row's real length (right-padded rows; int64 scalar)."""
    return (real_BT.sum(-1).to(torch.int64) * counted_BT.sum(-1).to(torch.int64)).sum()


class _PairObjective:
    """Shared parts of the pairwise objectives: one forward over [chosen; rejected]."""

    needs_reference = True
    loss_chunk_tokens: int | None = None

    def num_units(self, batch: Any) -> Tensor:
        """Pairs in `batch` (int64 scalar; 0 for a data-parallel padding batch)."""
        return torch.tensor(
            0 if trains_nothing(batch) else batch.chosen_input_ids.shape[0], dtype=torch.int64
        )

    def num_tokens(self, batch: Any) -> Tensor:
        """Response tokens of the chosen and rejected rows (the tokens the loss covers; int64
        scalar, tokens; 0 for a data-parallel padding batch), for tokens_per_s and mfu."""
        if trains_nothing(batch):
            return torch.tensor(0, dtype=torch.int64)
        return (batch.chosen_response_mask.sum() + batch.rejected_response_mask.sum()).to(
            dtype=torch.int64, device="cpu"
        )

    def attention_span(self, batch: Any) -> Tensor:
        """Sum over the `num_tokens` of the real length of the row each sits in (int64 scalar,
        tokens; 0 for a padding batch), for the attention term of mfu
        (`posttrain.core.timing.step_flops`)."""
        if trains_nothing(batch):
            return torch.tensor(0, dtype=torch.int64)
        return (
            _row_span(batch.chosen_attention_mask, batch.chosen_response_mask)
            + _row_span(batch.rejected_attention_mask, batch.rejected_response_mask)
        ).cpu()

    def __call__(self, model: nn.Module, batch: Any, num_units_in_step: Tensor) -> Tensor:
        losses_B, _, _ = self.pair_losses(model, batch)
        share = step_share(losses_B, num_units_in_step.to(losses_B.device))
        return share * 0.0 if trains_nothing(batch) else share

    def forward_pairs(self, model: nn.Module, batch: Any) -> dict[str, Tensor]:
        """Policy log-probs and lengths of the chosen and rejected responses, one forward."""
        input_ids, attention_mask, response_mask = batch.concatenated()
        logps_2B, lengths_2B = response_logps(
            model, input_ids, attention_mask, response_mask, chunk_tokens=self.loss_chunk_tokens
        )
        chosen_logps_B, rejected_logps_B = logps_2B.chunk(2)
        chosen_lengths_B, rejected_lengths_B = lengths_2B.chunk(2)
        out = {
            "chosen": chosen_logps_B,
            "rejected": rejected_logps_B,
            "chosen_lengths": chosen_lengths_B,
            "rejected_lengths": rejected_lengths_B,
        }
        if self.needs_reference:
            if batch.ref_chosen_logps is None or batch.ref_rejected_logps is None:
                raise ValueError(
                    f"{type(self).__name__} needs reference log-probs in the batch; "
                    "run posttrain.preference.reference.compute_reference_logps("
                    "reference, dataset) before building the loader"
                )
            out["ref_chosen"] = batch.ref_chosen_logps.to(chosen_logps_B.device)
            out["ref_rejected"] = batch.ref_rejected_logps.to(chosen_logps_B.device)
        return out

    def pair_losses(self, model: nn.Module, batch: Any) -> LossTriple:
        raise NotImplementedError

    @torch.no_grad()
    def metrics(self, model: nn.Module, batch: Any) -> dict[str, float]:
        """Mean loss, rewards, margin and reward accuracy (chosen reward > rejected) on `batch`."""
        losses_B, chosen_B, rejected_B = self.pair_losses(model, batch)
        return {
            "loss": float(losses_B.mean()),
            "chosen_reward": float(chosen_B.mean()),
            "rejected_reward": float(rejected_B.mean()),
            "reward_margin": float((chosen_B - rejected_B).mean()),
            "reward_accuracy": float((chosen_B > rejected_B).float().mean()),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_options(self)})"


class DPOLoss(_PairObjective):
    """The DPO family on `PreferenceBatch`es (see `dpo_loss`); pair-normalised over the step.

    One objective for every loss type: `get_loss("dpo", loss_type="robust",
    label_smoothing=0.1)`, `get_loss("dpo", f_divergence_type="alpha_divergence",
    f_alpha_divergence_coef=0.3)`, `get_loss("dpo", loss_type="dpop", dpop_lambda=50.0)`, or
    TRL's list form `loss_type=("sigmoid", "bco_pair", "sft"), loss_weights=(0.8, 0.2, 1.0)`.
    The response lengths of the batch are passed, for ipo, sigmoid_norm and sft. aot,
    aot_unpaired and sft couple the pairs of a micro-batch (as in TRL), so with them gradient
    accumulation does not equal one big batch exactly.

    Args:
        beta: > 0. label_smoothing: e in [0, 0.5) (cDPO with sigmoid; robust, exo_pair, aot).
        loss_type: a name of `DPO_LOSS_TYPES` or a list of them. loss_weights: one per type.
        f_divergence_type: one of `F_DIVERGENCE_TYPES`; f_alpha_divergence_coef: its alpha.
        discopop_tau: DiscoPOP's temperature. dpop_lambda: DPOP's penalty weight.
        loss_chunk_tokens: None or response tokens per chunk of the head (module docstring).

    Raises:
        ValueError: for the options `dpo_loss` rejects, naming the option.
    """

    def __init__(
        self,
        *,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        loss_type: str | Sequence[str] = "sigmoid",
        loss_weights: Sequence[float] | None = None,
        f_divergence_type: str = DPO_OPTION_DEFAULTS["f_divergence_type"],
        f_alpha_divergence_coef: float = DPO_OPTION_DEFAULTS["f_alpha_divergence_coef"],
        discopop_tau: float = DPO_OPTION_DEFAULTS["discopop_tau"],
        dpop_lambda: float = DPO_OPTION_DEFAULTS["dpop_lambda"],
        loss_chunk_tokens: int | None = None,
    ) -> None:
        loss_type = loss_type if isinstance(loss_type, str) else tuple(loss_type)
        loss_weights = None if loss_weights is None else tuple(loss_weights)
        options = DPOOptions(
            label_smoothing=label_smoothing,
            f_divergence_type=f_divergence_type,
            f_alpha_divergence_coef=f_alpha_divergence_coef,
            discopop_tau=discopop_tau,
            dpop_lambda=dpop_lambda,
        )
        one = torch.ones(1)
        dpo_loss(
            0 * one,
            0 * one,
            0 * one,
            0 * one,
            beta=beta,
            loss_type=loss_type,
            loss_weights=loss_weights,
            chosen_lengths_B=one,
            rejected_lengths_B=one,
            **options,
        )  # validates the options
        self.beta, self.label_smoothing, self.loss_type = beta, label_smoothing, loss_type
        self.loss_weights = loss_weights
        self.f_divergence_type = f_divergence_type
        self.f_alpha_divergence_coef = f_alpha_divergence_coef
        self.discopop_tau, self.dpop_lambda = discopop_tau, dpop_lambda
        self.loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)

    def pair_losses(self, model: nn.Module, batch: Any) -> LossTriple:
        lp = self.forward_pairs(model, batch)
        return dpo_loss(
            lp["chosen"],
            lp["rejected"],
            lp["ref_chosen"],
            lp["ref_rejected"],
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            loss_type=self.loss_type,
            loss_weights=self.loss_weights,
            f_divergence_type=self.f_divergence_type,
            f_alpha_divergence_coef=self.f_alpha_divergence_coef,
            discopop_tau=self.discopop_tau,
            dpop_lambda=self.dpop_lambda,
            chosen_lengths_B=lp["chosen_lengths"],
            rejected_lengths_B=lp["rejected_lengths"],
        )

    def __repr__(self) -> str:
        """beta, label_smoothing and loss_type always; the other options where not default."""
        shown: dict[str, object] = {
            "beta": self.beta,
            "label_smoothing": self.label_smoothing,
            "loss_type": self.loss_type,
        }
        if self.loss_weights is not None:
            shown["loss_weights"] = self.loss_weights
        defaults: Mapping[str, object] = DPO_OPTION_DEFAULTS  # looked up by a name held in a str
        for name in ("f_divergence_type", "f_alpha_divergence_coef", "discopop_tau", "dpop_lambda"):
            if getattr(self, name) != defaults[name]:
                shown[name] = getattr(self, name)
        if self.loss_chunk_tokens is not None:
            shown["loss_chunk_tokens"] = self.loss_chunk_tokens
        return f"DPOLoss({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


class IPOLoss(_PairObjective):
    """IPO on `PreferenceBatch`es (see `ipo_loss`); pair-normalised over the step.

    Args:
        beta: > 0 (tau). length_normalize: divide each log-ratio by its response length, as
            TRL does (True), or use the summed log-ratios of eq. 17 (False).
    """

    def __init__(
        self,
        *,
        beta: float = 0.1,
        length_normalize: bool = True,
        loss_chunk_tokens: int | None = None,
    ) -> None:
        check_beta(beta)
        self.beta, self.length_normalize = beta, bool(length_normalize)
        self.loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)

    def pair_losses(self, model: nn.Module, batch: Any) -> LossTriple:
        lp = self.forward_pairs(model, batch)
        lengths = (
            (lp["chosen_lengths"], lp["rejected_lengths"])
            if self.length_normalize
            else (None, None)
        )
        return ipo_loss(
            lp["chosen"],
            lp["rejected"],
            lp["ref_chosen"],
            lp["ref_rejected"],
            beta=self.beta,
            chosen_lengths_B=lengths[0],
            rejected_lengths_B=lengths[1],
        )


class SimPOLoss(_PairObjective):
    """SimPO on `PreferenceBatch`es (see `simpo_loss`); reference-free, pair-normalised.

    Args:
        beta: > 0. gamma: target reward margin >= 0. label_smoothing: e in [0, 0.5).
    """

    needs_reference = False

    def __init__(
        self,
        *,
        beta: float = 2.0,
        gamma: float = 1.0,
        label_smoothing: float = 0.0,
        loss_chunk_tokens: int | None = None,
    ) -> None:
        simpo_loss(
            torch.zeros(1), torch.zeros(1), beta=beta, gamma=gamma, label_smoothing=label_smoothing
        )  # validates the options
        self.beta, self.gamma, self.label_smoothing = beta, gamma, label_smoothing
        self.loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)

    def pair_losses(self, model: nn.Module, batch: Any) -> LossTriple:
        lp = self.forward_pairs(model, batch)
        return simpo_loss(
            lp["chosen"],
            lp["rejected"],
            beta=self.beta,
            gamma=self.gamma,
            label_smoothing=self.label_smoothing,
            chosen_lengths_B=lp["chosen_lengths"],
            rejected_lengths_B=lp["rejected_lengths"],
        )


class ORPOLoss(_PairObjective):
    """ORPO (Hong et al. 2024, eq. 6) on `PreferenceBatch`es: per pair, the chosen response's
    NLL averaged over its tokens (eq. 2) plus `orpo_loss` (beta = lambda); reference-free and
    pair-normalised over the step. TRL averages the NLL over all chosen tokens of a micro-batch
    instead, which weights long responses more and depends on the micro-batching.

    Args:
        beta: > 0, the weight of the odds-ratio term.
    """

    needs_reference = False

    def __init__(self, *, beta: float = 0.1, loss_chunk_tokens: int | None = None) -> None:
        check_beta(beta)
        self.beta = beta
        self.loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)

    def pair_losses(self, model: nn.Module, batch: Any) -> LossTriple:
        lp = self.forward_pairs(model, batch)
        chosen_lengths_B = lp["chosen_lengths"].clamp(min=1)
        losses_B, chosen_B, rejected_B = orpo_loss(
            lp["chosen"],
            lp["rejected"],
            beta=self.beta,
            chosen_lengths_B=chosen_lengths_B,
            rejected_lengths_B=lp["rejected_lengths"],
        )
        return losses_B - lp["chosen"] / chosen_lengths_B, chosen_B, rejected_B


class KTOLoss:
    """KTO on `posttrain.data.preference.KTOBatch`es (see `kto_loss`); row-normalised over the
    step (TRL averages over the rows of a batch the same way).

    The reference point z0 is estimated on each micro-batch from its mismatched pairs (a no-grad
    forward; `kto_reference_point`), as TRL does. Since z0 then depends on the micro-batching,
    gradient accumulation matches one big batch exactly only with `use_kl=False` (z0 = 0), or
    up to the difference in z0.

    Args:
        beta: > 0. desirable_weight, undesirable_weight: lambda_D, lambda_U > 0.
        use_kl: estimate z0 (True) or use z0 = 0 (False).
    """

    needs_reference = True

    def __init__(
        self,
        *,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        use_kl: bool = True,
        loss_chunk_tokens: int | None = None,
    ) -> None:
        kto_loss(
            torch.zeros(1),
            torch.zeros(1),
            torch.ones(1, dtype=torch.bool),
            beta=beta,
            desirable_weight=desirable_weight,
            undesirable_weight=undesirable_weight,
        )
        self.beta, self.use_kl = beta, bool(use_kl)
        self.loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    def num_units(self, batch: Any) -> Tensor:
        """Rows in `batch` (int64 scalar; 0 for a data-parallel padding batch)."""
        return torch.tensor(
            0 if trains_nothing(batch) else batch.input_ids.shape[0], dtype=torch.int64
        )

    def num_tokens(self, batch: Any) -> Tensor:
        """Response tokens of the rows (the tokens the loss trains on; int64 scalar, tokens;
        0 for a data-parallel padding batch), for tokens_per_s and mfu."""
        if trains_nothing(batch):
            return torch.tensor(0, dtype=torch.int64)
        return batch.response_mask.sum().to(dtype=torch.int64, device="cpu")

    def attention_span(self, batch: Any) -> Tensor:
        """Sum over the `num_tokens` of the real length of the row each sits in (int64 scalar,
        tokens; 0 for a padding batch), for the attention term of mfu."""
        if trains_nothing(batch):
            return torch.tensor(0, dtype=torch.int64)
        return _row_span(batch.attention_mask, batch.response_mask).cpu()

    def __call__(self, model: nn.Module, batch: Any, num_units_in_step: Tensor) -> Tensor:
        losses_N, _, _ = self.row_losses(model, batch)
        share = step_share(losses_N, num_units_in_step.to(losses_N.device))
        return share * 0.0 if trains_nothing(batch) else share

    def row_losses(self, model: nn.Module, batch: Any) -> LossTriple:
        """`kto_loss` of the batch's rows, with z0 from its mismatched pairs."""
        if batch.ref_logps is None or (self.use_kl and batch.ref_kl_logps is None):
            raise ValueError(
                "KTOLoss needs reference log-probs in the batch; run posttrain."
                "preference.reference.compute_reference_logps(reference, dataset) "
                "first"
            )
        chunk = self.loss_chunk_tokens
        logps_N, _ = response_logps(
            model, batch.input_ids, batch.attention_mask, batch.response_mask, chunk_tokens=chunk
        )
        z0 = torch.zeros((), device=logps_N.device)
        if self.use_kl:
            with torch.no_grad():
                kl_logps_K, _ = response_logps(
                    model,
                    batch.kl_input_ids,
                    batch.kl_attention_mask,
                    batch.kl_response_mask,
                    chunk_tokens=chunk,
                )
            z0 = kto_reference_point(kl_logps_K, batch.ref_kl_logps.to(logps_N.device))
        return kto_loss(
            logps_N,
            batch.ref_logps.to(logps_N.device),
            batch.desirable.to(logps_N.device),
            reference_point=z0,
            beta=self.beta,
            desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
        )

    @torch.no_grad()
    def metrics(self, model: nn.Module, batch: Any) -> dict[str, float]:
        """Mean loss and mean rewards of the desirable and undesirable rows of `batch`."""
        losses_N, chosen, rejected = self.row_losses(model, batch)
        out = {"loss": float(losses_N.mean())}
        if chosen.numel():
            out["chosen_reward"] = float(chosen.mean())
        if rejected.numel():
            out["rejected_reward"] = float(rejected.mean())
        if chosen.numel() and rejected.numel():
            out["reward_margin"] = out["chosen_reward"] - out["rejected_reward"]
        return out

    def __repr__(self) -> str:
        return f"KTOLoss({_options(self)})"


def _options(loss: object) -> str:
    """`k=v, ...` of the loss's attributes; loss_chunk_tokens only when set."""
    shown = {k: v for k, v in vars(loss).items() if not (k == "loss_chunk_tokens" and v is None)}
    return ", ".join(f"{k}={v!r}" for k, v in shown.items())


BUILTIN_LOSSES = {
    "dpo": DPOLoss,
    "ipo": IPOLoss,
    "simpo": SimPOLoss,
    "kto": KTOLoss,
    "orpo": ORPOLoss,
}
"""The objectives this module registers in `posttrain.train.losses` under these names, in this
order, when it is imported."""

for _name, _factory in BUILTIN_LOSSES.items():
    register_loss(_name)(_factory)
del _name, _factory
