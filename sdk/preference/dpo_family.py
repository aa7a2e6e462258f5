"""The DPO family: every `loss_type` and `f_divergence_type` of TRL 1.16's `DPOTrainer`, plus
DPOP, as one registry of per-pair formulas over summed response log-probabilities.

Notation: B = preference pairs. rho_c = log pi(y_c|x) - log ref(y_c|x) and rho_r (the same for
the rejected response) are the log-ratios; r = beta * rho are the implicit rewards; s_c, s_r are
the f-divergence scores of the log-ratios (below; s = rho for reverse_kl) and h = s_c - s_r;
|y| is a response's token count (clamped at 1); e = label_smoothing; s(.) = sigmoid. Every
tensor is [B], fp32 in practice, log-probs in nats summed over the response tokens.

    ============  ==============================================================  ============
    loss_type     loss per pair                                                   source
    ============  ==============================================================  ============
    sigmoid       -log s(beta h)                                                  DPO eq. 7
                  e > 0: -(1-e) log s(beta h) - e log s(-beta h) (cDPO; TRL 1.16's  cDPO note
                  "sigmoid" ignores e, its "aot" on one pair equals this)
    hinge         max(0, 1 - beta h)                                              SLiC-HF [1]
    ipo           (s_c/|y_c| - s_r/|y_r| - 1/(2 beta))^2 (per token, as TRL)      IPO eq. 17
    exo_pair      q_w (log q_w - log(1-e)) + q_l (log q_l - log e),               EXO eq. 16
                  q_w = s(beta h), q_l = s(-beta h); needs e > 0
    nca_pair      -log s(r_c) - 0.5 log s(-r_c) - 0.5 log s(-r_r)                 NCA [1]
    robust        ((1-e)(-log s(beta h)) + e log s(-beta h)) / (1 - 2e)           rDPO [1]
    bco_pair      -log s(r_c) - log s(-r_r)                                       BCO [1]
    sppo_hard     (rho_c - 1/(2 beta))^2 + (rho_r + 1/(2 beta))^2                 SPPO eq. 4.7,
                                                                                  P = 1 / 0
    aot           cDPO of beta * (sort_B(lpi_c - lpi_r) - sort_B(lref_c - lref_r))  AOT [1] [2]
    aot_unpaired  cDPO of beta * (sort_B(rho_c) - sort_B(rho_r))                  AOT [1] [2]
    apo_zero      (1 - s(r_c)) + s(r_r)                                           APO eq. 7
    apo_down      s(r_c) + (1 - s(beta (rho_c - rho_r)))                          APO eq. 8
    discopop      (1 - m) (-log s(beta h)) + m exp(-beta h), m = s(beta h / tau)  DiscoPOP eq. 5
    sft           -(sum_B log pi(y_c)) / (sum_B |y_c|) for every pair [2]         (TRL, MPO)
    sigmoid_norm  -log s(beta (s_c/|y_c| - s_r/|y_r|))                            (TRL) [1]
    dpop          -log s(beta (rho_c - rho_r - lambda max(0, lref_c - lpi_c)))    DPOP eq. 3
    ============  ==============================================================  ============

    [1] no equation number checked here; TRL 1.16's formula is the reference (the equation
        numbers given are those TRL's comments cite, and DPOP's eq. 3 of its paper).
    [2] batch-coupled: the sort (aot) or the mean over the batch's chosen tokens (sft) mixes the
        pairs of one call, so the per-pair values are not those of each pair alone, only their
        mean is TRL's, and gradient accumulation does not equal one big batch exactly.

    Papers: DPO, Rafailov et al. 2023; cDPO, Mitchell 2023, "A note on DPO with noisy preferences
    & relationship to IPO"; SLiC-HF, Zhao et al. 2023; IPO, Azar et al. 2023 (tau = beta); EXO,
    Ji et al. 2024, "Towards Efficient Exact Optimization of Language Model Alignment"; NCA, Chen
    et al. 2024, "Noise Contrastive Alignment of Language Models with Explicit Rewards"; rDPO,
    Chowdhury et al. 2024, "Provably Robust DPO"; BCO, Jung et al. 2024, "Binary Classifier
    Optimization for Large Language Model Alignment"; SPPO, Wu et al. 2024, "Self-Play
    Preference Optimization for Language Model Alignment"; AOT, Melnyk et al. 2024,
    "Distributional Preference Alignment of LLMs via Optimal Transport"; APO, D'Oosterlinck et
    al. 2024, "Anchored Preference Optimization and Contrastive Revisions"; DiscoPOP, Lu et al.
    2024, "Discovering Preference Optimization Algorithms with and for Large Language Models";
    MPO, Wang et al. 2024 (weighted sigmoid + bco_pair + sft); DPOP, Pal et al. 2024, "Smaug:
    Fixing Failure Modes of Preference Optimisation with DPO-Positive" (not in TRL).

f-divergences (f-DPO, `f_divergence_type`: the scores s of the log-ratios, and the loss types
that allow one other than reverse_kl) are in `posttrain.preference.f_divergence`.

Overflow, as in TRL: discopop's exp(-beta h) is inf for beta h below about -88 (fp32), where
its weight m is 0, so the loss is 0 * inf = NaN. With reverse_kl that needs h < -88 / beta;
with forward_kl or alpha_divergence the scores grow exponentially in the log-ratios, so it
happens at moderate ones (forward_kl, beta 0.1: a chosen log-ratio below about -6.8). ipo's
square of such scores overflows to inf in the same way. Prefer another loss type with them.

Several loss types combine as TRL's list form does: `loss_type=("sigmoid", "bco_pair", "sft")`,
`loss_weights=(0.8, 0.2, 1.0)` (MPO) gives per pair sum_i w_i loss_i, whose mean over the batch
is TRL's loss. Rewards are always r_c = beta rho_c and r_r = beta rho_r, detached, as TRL logs
them whatever the loss. An option that no selected loss reads (label_smoothing, discopop_tau,
dpop_lambda, f_alpha_divergence_coef) must keep its default: a ValueError says so, where TRL
would silently ignore it.

tests/preference/test_dpo_family.py checks every loss type and f-divergence against TRL 1.16's own
`DPOTrainer._compute_loss` on the same log-probabilities (losses, per-pair where not
batch-coupled, rewards and gradients), and DPOP against a hand computation of eq. 3.
`posttrain.preference.losses.dpo_loss` is the entry point (it validates the tensors, then calls
`dpo_family_losses`); `DPOLoss` (registry name "dpo") takes the same options.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.preference.f_divergence import (  # importable from here too
    F_DIVERGENCE_LOSS_TYPES,
    F_DIVERGENCE_TYPES,
    f_divergence_scores,
)

__all__ = [
    "DPO_LOSS_TYPES",
    "F_DIVERGENCE_TYPES",
    "F_DIVERGENCE_LOSS_TYPES",
    "LENGTH_LOSS_TYPES",
    "DPOOptions",
    "DPO_OPTION_DEFAULTS",
    "check_dpo_options",
    "dpo_family_losses",
]

LENGTH_LOSS_TYPES = ("ipo", "sigmoid_norm", "sft")
"""The loss types that need chosen_lengths_B and rejected_lengths_B."""


class DPOOptions(TypedDict):
    """The options of the DPO family that have a default, by name and type."""

    label_smoothing: float
    f_divergence_type: str
    f_alpha_divergence_coef: float
    discopop_tau: float
    dpop_lambda: float


DPO_OPTION_DEFAULTS: DPOOptions = {
    "label_smoothing": 0.0,
    "f_divergence_type": "reverse_kl",
    "f_alpha_divergence_coef": 0.5,
    "discopop_tau": 0.05,
    "dpop_lambda": 50.0,
}
"""The defaults of the options (TRL 1.16's, for those TRL has). dpop_lambda = 50 is the value
the Smaug paper's experiments use, as recalled here (not rechecked against the paper)."""


@dataclass(frozen=True)
class _Pairs:
    """What the loss formulas read, computed once per call ([B] tensors)."""

    beta: float
    label_smoothing: float
    discopop_tau: float
    dpop_lambda: float
    policy_chosen: Tensor
    policy_rejected: Tensor
    ref_chosen: Tensor
    ref_rejected: Tensor
    chosen_logratios: Tensor
    rejected_logratios: Tensor
    chosen_scores: Tensor
    rejected_scores: Tensor
    delta: Tensor
    chosen_lengths: Tensor | None
    rejected_lengths: Tensor | None


_LOSSES: dict[str, Callable[[_Pairs], Tensor]] = {}
_USES: dict[str, frozenset[str]] = {}


def _register(name: str, *, uses: Sequence[str] = ()) -> Callable:
    """Register the formula of loss_type `name`; `uses` names the options it reads."""

    def add(fn: Callable[[_Pairs], Tensor]) -> Callable[[_Pairs], Tensor]:
        if name in _LOSSES:
            raise ValueError(f"DPO loss_type {name!r} is registered twice")
        _LOSSES[name], _USES[name] = fn, frozenset(uses)
        return fn

    return add


def _smoothed(logits_B: Tensor, e: float) -> Tensor:
    """-(1-e) log s(x) - e log s(-x), written as TRL's aot writes it."""
    return -F.logsigmoid(logits_B) * (1 - e) - F.logsigmoid(-logits_B) * e


def _per_token(scores_B: Tensor, lengths_B: Tensor | None) -> Tensor:
    assert lengths_B is not None, "dpo_family_losses refuses a length loss type without lengths"
    return scores_B / lengths_B.to(scores_B.dtype).clamp(min=1.0)


@_register("sigmoid", uses=("label_smoothing",))
def _sigmoid(p: _Pairs) -> Tensor:
    logits_B = p.beta * p.delta
    losses_B = -F.logsigmoid(logits_B)
    if p.label_smoothing:  # cDPO; e = 0 keeps the one-term form, bit for bit
        e = p.label_smoothing
        losses_B = (1 - e) * losses_B - e * F.logsigmoid(-logits_B)
    return losses_B


@_register("hinge")
def _hinge(p: _Pairs) -> Tensor:
    return torch.relu(1 - p.beta * p.delta)


@_register("ipo", uses=("lengths",))
def _ipo(p: _Pairs) -> Tensor:
    ipo_delta = _per_token(p.chosen_scores, p.chosen_lengths) - _per_token(
        p.rejected_scores, p.rejected_lengths
    )
    return (ipo_delta - 1 / (2 * p.beta)) ** 2


@_register("exo_pair", uses=("label_smoothing",))
def _exo_pair(p: _Pairs) -> Tensor:
    epsilon = torch.tensor(p.label_smoothing, device=p.delta.device)
    logits_B = p.beta * p.delta
    qw, log_qw = torch.sigmoid(logits_B), F.logsigmoid(logits_B)
    ql, log_ql = torch.sigmoid(-logits_B), F.logsigmoid(-logits_B)
    return qw * (log_qw - torch.log1p(-epsilon)) + ql * (log_ql - torch.log(epsilon))


@_register("nca_pair")
def _nca_pair(p: _Pairs) -> Tensor:
    chosen_B, rejected_B = p.beta * p.chosen_logratios, p.beta * p.rejected_logratios
    return -F.logsigmoid(chosen_B) - 0.5 * F.logsigmoid(-chosen_B) - 0.5 * F.logsigmoid(-rejected_B)


@_register("robust", uses=("label_smoothing",))
def _robust(p: _Pairs) -> Tensor:
    e = p.label_smoothing
    clean_B = -(1 - e) * F.logsigmoid(p.beta * p.delta)
    flipped_B = -e * F.logsigmoid(-p.beta * p.delta)
    return (clean_B - flipped_B) / (1 - 2 * e)


@_register("bco_pair")
def _bco_pair(p: _Pairs) -> Tensor:
    return -F.logsigmoid(p.beta * p.chosen_logratios) - F.logsigmoid(-p.beta * p.rejected_logratios)


@_register("sppo_hard")
def _sppo_hard(p: _Pairs) -> Tensor:
    return (p.chosen_logratios - 0.5 / p.beta) ** 2 + (p.rejected_logratios + 0.5 / p.beta) ** 2


@_register("aot", uses=("label_smoothing",))
def _aot(p: _Pairs) -> Tensor:
    logratios_B, _ = torch.sort(p.policy_chosen - p.policy_rejected, dim=0)
    ref_logratios_B, _ = torch.sort(p.ref_chosen - p.ref_rejected, dim=0)
    return _smoothed(p.beta * (logratios_B - ref_logratios_B), p.label_smoothing)


@_register("aot_unpaired", uses=("label_smoothing",))
def _aot_unpaired(p: _Pairs) -> Tensor:
    chosen_B, _ = torch.sort(p.chosen_logratios, dim=0)
    rejected_B, _ = torch.sort(p.rejected_logratios, dim=0)
    return _smoothed(p.beta * (chosen_B - rejected_B), p.label_smoothing)


@_register("apo_zero")
def _apo_zero(p: _Pairs) -> Tensor:
    return (1 - torch.sigmoid(p.beta * p.chosen_logratios)) + torch.sigmoid(
        p.beta * p.rejected_logratios
    )


@_register("apo_down")
def _apo_down(p: _Pairs) -> Tensor:
    return torch.sigmoid(p.beta * p.chosen_logratios) + (
        1 - torch.sigmoid(p.beta * (p.chosen_logratios - p.rejected_logratios))
    )


@_register("discopop", uses=("discopop_tau",))
def _discopop(p: _Pairs) -> Tensor:
    logits_B = p.delta * p.beta
    modulation_B = torch.sigmoid(logits_B / p.discopop_tau)
    return -F.logsigmoid(logits_B) * (1 - modulation_B) + torch.exp(-logits_B) * modulation_B


@_register("sft", uses=("lengths",))
def _sft(p: _Pairs) -> Tensor:
    assert p.chosen_lengths is not None, "dpo_family_losses refuses sft without lengths"
    tokens = p.chosen_lengths.to(p.policy_chosen.dtype).sum().clamp(min=1.0)
    return (-p.policy_chosen.sum() / tokens).expand(p.policy_chosen.shape[0])


@_register("sigmoid_norm", uses=("lengths",))
def _sigmoid_norm(p: _Pairs) -> Tensor:
    delta_B = _per_token(p.chosen_scores, p.chosen_lengths) - _per_token(
        p.rejected_scores, p.rejected_lengths
    )
    return -F.logsigmoid(p.beta * delta_B)


@_register("dpop", uses=("dpop_lambda",))
def _dpop(p: _Pairs) -> Tensor:
    penalty_B = torch.clamp(p.ref_chosen - p.policy_chosen, min=0)
    return -F.logsigmoid(p.beta * (p.delta - p.dpop_lambda * penalty_B))


DPO_LOSS_TYPES = tuple(_LOSSES)
"""`loss_type=...` values: TRL 1.16 `DPOConfig.loss_type`'s, in its order, then "dpop"."""


def check_dpo_options(
    *,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    dpop_lambda: float = 50.0,
) -> tuple[tuple[str, ...], tuple[float, ...] | None]:
    """Validate the options of `dpo_family_losses`; returns (loss types, weights or None).

    Raises:
        ValueError: naming the option, for beta <= 0, an unknown loss_type or f_divergence_type
            (the message lists the allowed values), an empty or repeated loss_type list,
            loss_weights of another length or not finite, label_smoothing outside [0, 0.5) (or
            0 with exo_pair), discopop_tau <= 0, dpop_lambda < 0, a non-finite
            f_alpha_divergence_coef, an f_divergence_type other than reverse_kl with a loss type
            outside `F_DIVERGENCE_LOSS_TYPES`, or an option changed from its default that no
            selected loss type reads.
    """
    if (
        isinstance(beta, bool)
        or not isinstance(beta, (int, float))
        or not (math.isfinite(beta) and beta > 0)
    ):
        raise ValueError(f"beta={beta!r}; must be a finite number > 0")
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    if not types or len(set(types)) != len(types):
        raise ValueError(
            f"loss_type={loss_type!r}; must be one name or a list of distinct names "
            f"from: {', '.join(DPO_LOSS_TYPES)}"
        )
    for name in types:
        if name not in _LOSSES:
            raise ValueError(f"loss_type={name!r}; allowed: {', '.join(DPO_LOSS_TYPES)}")
    weights = None
    if loss_weights is not None:
        weights = tuple(loss_weights)
        if len(weights) != len(types) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
            for w in weights
        ):
            raise ValueError(
                f"loss_weights={loss_weights!r}; must be {len(types)} finite "
                f"number(s), one per loss_type {list(types)}"
            )
    if f_divergence_type not in F_DIVERGENCE_TYPES:
        raise ValueError(
            f"f_divergence_type={f_divergence_type!r}; allowed: {', '.join(F_DIVERGENCE_TYPES)}"
        )
    if f_divergence_type != "reverse_kl" and not set(types) <= F_DIVERGENCE_LOSS_TYPES:
        raise ValueError(
            f"f_divergence_type={f_divergence_type!r} works only with the loss types "
            f"{', '.join(sorted(F_DIVERGENCE_LOSS_TYPES))}; got loss_type "
            f"{list(types)} (use f_divergence_type='reverse_kl' with these)"
        )
    if not (isinstance(label_smoothing, (int, float)) and 0 <= label_smoothing < 0.5):
        raise ValueError(
            f"label_smoothing={label_smoothing!r}; must be in [0, 0.5) (the "
            "probability that a preference label is flipped)"
        )
    if "exo_pair" in types and label_smoothing == 0:
        raise ValueError(
            "label_smoothing=0 with loss_type 'exo_pair'; must be > 0 (EXO's "
            "epsilon; the EXO paper recommends 1e-3)"
        )
    for name, value, ok, must in (
        ("discopop_tau", discopop_tau, lambda v: v > 0, "a finite number > 0"),
        ("dpop_lambda", dpop_lambda, lambda v: v >= 0, "a finite number >= 0"),
        ("f_alpha_divergence_coef", f_alpha_divergence_coef, lambda v: True, "a finite number"),
    ):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and ok(value))
        ):
            raise ValueError(f"{name}={value!r}; must be {must}")
    used = set().union(*(_USES[name] for name in types))
    if f_divergence_type == "alpha_divergence":
        used.add("f_alpha_divergence_coef")
    given = {
        "label_smoothing": label_smoothing,
        "discopop_tau": discopop_tau,
        "dpop_lambda": dpop_lambda,
        "f_alpha_divergence_coef": f_alpha_divergence_coef,
    }
    defaults: Mapping[str, object] = DPO_OPTION_DEFAULTS  # looked up by a name held in a str
    for name, value in given.items():
        if name not in used and value != defaults[name]:
            readers = sorted(t for t in DPO_LOSS_TYPES if name in _USES[t])
            where = (
                f"loss_type {', '.join(readers)}"
                if readers
                else "f_divergence_type='alpha_divergence'"
            )
            raise ValueError(
                f"{name}={value!r} is read only by {where}; with loss_type "
                f"{list(types)} and f_divergence_type={f_divergence_type!r} it "
                f"would be ignored: leave it at {defaults[name]!r}"
            )
    return types, weights


def dpo_family_losses(
    policy_chosen_logps_B: Tensor,
    policy_rejected_logps_B: Tensor,
    ref_chosen_logps_B: Tensor,
    ref_rejected_logps_B: Tensor,
    *,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    dpop_lambda: float = 50.0,
    chosen_lengths_B: Tensor | None = None,
    rejected_lengths_B: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Losses of the DPO family per pair (module docstring: the formulas and their sources).

    This validates the options, not the tensors: call it through
    `posttrain.preference.losses.dpo_loss`, which checks the shapes and finiteness first.

    Args:
        policy_chosen_logps_B, policy_rejected_logps_B: [B] float summed response log-probs of
            the policy (differentiable).
        ref_chosen_logps_B, ref_rejected_logps_B: [B] float, the same under the reference.
        beta: > 0. loss_type: a name of `DPO_LOSS_TYPES` or a list of them. loss_weights: one
            weight per loss type (default 1 each). label_smoothing: e in [0, 0.5).
        f_divergence_type: one of `F_DIVERGENCE_TYPES`. f_alpha_divergence_coef: alpha.
        discopop_tau: > 0. dpop_lambda: >= 0.
        chosen_lengths_B, rejected_lengths_B: [B] response token counts; needed by
            `LENGTH_LOSS_TYPES`, ignored by the others.

    Returns:
        losses [B] (sum_i w_i loss_i); chosen_rewards, rejected_rewards [B] = beta * log-ratio,
        detached.

    Raises:
        ValueError: as `check_dpo_options`, and for a length loss type without both lengths.
    """
    types, weights = check_dpo_options(
        beta=beta,
        loss_type=loss_type,
        loss_weights=loss_weights,
        label_smoothing=label_smoothing,
        f_divergence_type=f_divergence_type,
        f_alpha_divergence_coef=f_alpha_divergence_coef,
        discopop_tau=discopop_tau,
        dpop_lambda=dpop_lambda,
    )
    if chosen_lengths_B is None or rejected_lengths_B is None:
        for name in types:
            if name in LENGTH_LOSS_TYPES:
                without = [t for t in DPO_LOSS_TYPES if t not in LENGTH_LOSS_TYPES]
                raise ValueError(
                    f"loss_type={name!r}; allowed: {', '.join(without)} without "
                    f"response lengths ({', '.join(LENGTH_LOSS_TYPES)} divide by "
                    "them: pass chosen_lengths_B and rejected_lengths_B)"
                )
    chosen_logratios_B = policy_chosen_logps_B - ref_chosen_logps_B
    rejected_logratios_B = policy_rejected_logps_B - ref_rejected_logps_B
    alpha = f_alpha_divergence_coef
    chosen_scores_B = f_divergence_scores(chosen_logratios_B, f_divergence_type, alpha)
    rejected_scores_B = f_divergence_scores(rejected_logratios_B, f_divergence_type, alpha)
    pairs = _Pairs(
        beta=beta,
        label_smoothing=label_smoothing,
        discopop_tau=discopop_tau,
        dpop_lambda=dpop_lambda,
        policy_chosen=policy_chosen_logps_B,
        policy_rejected=policy_rejected_logps_B,
        ref_chosen=ref_chosen_logps_B,
        ref_rejected=ref_rejected_logps_B,
        chosen_logratios=chosen_logratios_B,
        rejected_logratios=rejected_logratios_B,
        chosen_scores=chosen_scores_B,
        rejected_scores=rejected_scores_B,
        delta=chosen_scores_B - rejected_scores_B,
        chosen_lengths=chosen_lengths_B,
        rejected_lengths=rejected_lengths_B,
    )
    terms_B = [_LOSSES[name](pairs) for name in types]
    if weights is not None:
        terms_B = [w * term_B for w, term_B in zip(weights, terms_B)]
    losses_B = terms_B[0]  # check_dpo_options refuses an empty loss_type list
    for term_B in terms_B[1:]:
        losses_B = losses_B + term_B
    return losses_B, beta * chosen_logratios_B.detach(), beta * rejected_logratios_B.detach()
