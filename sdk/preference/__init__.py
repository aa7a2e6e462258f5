"""Preference optimisation: the DPO family, KTO and ORPO losses, reference log-probabilities,
rejection-sampled pairs, the Bradley-Terry reward-model objective, and what preference training
needs under a ParallelPlan (`posttrain.preference.parallel`).

Importing this package registers dpo, ipo, simpo, kto, orpo and bradley_terry in the loss
registry of `posttrain.train.losses`; `get_loss` / `registered_losses` are re-exported here so
that a lookup through this package always sees them.
"""

from __future__ import annotations

from posttrain.preference.losses import (
    DPO_LOSS_TYPES,
    dpo_loss,
    ipo_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    simpo_loss,
    step_share,
)
from posttrain.preference.objectives import (  # importing it registers dpo, ipo, simpo, kto, orpo
    BUILTIN_LOSSES,
    DPOLoss,
    IPOLoss,
    KTOLoss,
    ORPOLoss,
    SimPOLoss,
)
from posttrain.preference.pairs import (
    PairStats,
    make_preference_pairs,
)
from posttrain.preference.parallel import (
    ShardedPreferenceLoader,
    apply_plan_to_reward_model,
    gathered_reward_model,
    parallelize_reward_model,
    trains_nothing,
)
from posttrain.preference.reference import (
    ReferenceLogps,
    compute_reference_logps,
    reference_fingerprint,
    response_logps,
)
from posttrain.preference.reward_model import (
    BradleyTerryLoss,
    pair_tensors,
)
from posttrain.train.losses import get_loss, registered_losses

__all__ = [
    "get_loss",
    "registered_losses",
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
    "ReferenceLogps",
    "reference_fingerprint",
    "compute_reference_logps",
    "PairStats",
    "make_preference_pairs",
    "pair_tensors",
    "BradleyTerryLoss",
    "ShardedPreferenceLoader",
    "parallelize_reward_model",
    "apply_plan_to_reward_model",
    "gathered_reward_model",
    "trains_nothing",
]
