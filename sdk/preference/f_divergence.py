"""f-divergences of the DPO family: the scores s of the policy/reference log-ratios that DPO's
loss types compare in place of the log-ratios themselves (`f_divergence_type`).

Notation: B = preference pairs; rho = log pi(y|x) - log ref(y|x) a response's log-ratio [B].

f-divergences (f-DPO: Wang et al. 2023, "Beyond Reverse KL: Generalizing Direct Preference
Optimization with Diverse Divergence Constraints"; s = f'(pi/ref) as TRL 1.16 writes it), allowed
only with the loss types of `F_DIVERGENCE_LOSS_TYPES` (TRL's list; the others raise ValueError):

    reverse_kl        s = rho (DPO)
    forward_kl        s = 1 - exp(-rho)
    js_divergence     s = log 2 + log s(rho)
    alpha_divergence  s = (exp((alpha-1) rho) - 1) / (alpha-1), the exponent clamped at 80
                      (11 in fp16) as TRL does; |alpha - 1| < 1e-6 gives s = rho

    >>> import torch
    >>> rho_B = torch.tensor([0.0, 1.0])
    >>> [round(x, 4) for x in f_divergence_scores(rho_B, "forward_kl", 0.5).tolist()]
    [0.0, 0.6321]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["F_DIVERGENCE_TYPES", "F_DIVERGENCE_LOSS_TYPES", "f_divergence_scores"]

F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
"""`f_divergence_type=...` values (TRL 1.16 `DPOConfig.f_divergence_type`)."""

F_DIVERGENCE_LOSS_TYPES = frozenset(
    {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
)
"""The loss types that accept an f_divergence_type other than reverse_kl (TRL's list: the
others have no valid f-divergence form)."""


def f_divergence_scores(logratios_B: Tensor, f_divergence_type: str, alpha: float) -> Tensor:
    """s = f'(pi/ref) of the log-ratios [B] (any float dtype), as TRL 1.16 computes it; the
    same shape and dtype. `f_divergence_type` is one of `F_DIVERGENCE_TYPES` (checked by
    `posttrain.preference.dpo_family.check_dpo_options`, not here: an unknown name gives the
    reverse_kl scores); `alpha` is alpha_divergence's coefficient."""
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratios_B)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios_B)
    if f_divergence_type == "alpha_divergence" and abs(alpha - 1.0) >= 1e-6:
        t_B = (alpha - 1.0) * logratios_B
        clamp_max = 11.0 if t_B.dtype == torch.float16 else 80.0
        return (torch.exp(torch.clamp(t_B.float(), max=clamp_max)) - 1.0).to(t_B.dtype) * (
            1.0 / (alpha - 1.0)
        )
    return logratios_B
