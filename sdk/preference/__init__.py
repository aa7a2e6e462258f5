"""Preference optimisation: the DPO family, KTO and ORPO losses, reference log-probabilities,
rejection-sampled pairs and the Bradley-Terry reward-model objective.
"""

from __future__ import annotations

from posttrain.preference.losses import (
    dpo_loss,
    ipo_loss,
    simpo_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    step_share,
    response_logps,
    DPOLoss,
    IPOLoss,
    SimPOLoss,
    KTOLoss,
    ORPOLoss,
    DPO_LOSS_TYPES,
    BUILTIN_LOSSES,
)

__all__ = [
    "dpo_loss",
    "ipo_loss",
    "simpo_loss",
    "kto_loss",
    "kto_reference_point",
    "orpo_loss",
    "step_share",
    "response_logps",
    "DPOLoss",
    "IPOLoss",
    "SimPOLoss",
    "KTOLoss",
    "ORPOLoss",
    "DPO_LOSS_TYPES",
    "BUILTIN_LOSSES",
]
