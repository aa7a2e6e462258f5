"""The training engine every trainer shares (step loop, accumulation, clipping, schedules,
checkpoints, resume, preemption), the loss registry, and parallel plans (FSDP2/HSDP, TP).
"""

from __future__ import annotations

from posttrain.train.engine import Engine
from posttrain.train.hooks import evaluate_model, seed_all, has_state, stable_repr
from posttrain.train.losses import (
    IGNORE_INDEX,
    token_cross_entropy_sum,
    normalize_by_step,
    TrainingLoss,
    SFTCrossEntropy,
    register_loss,
    get_loss,
    registered_losses,
)
from posttrain.train.parallel import AXES, MESH_DIMS, ParallelPlan
from posttrain.train.sharding import apply_plan, full_state_dict, plan_state
from posttrain.train.schedules import WarmupCosine, warmup_cosine_schedule
from posttrain.train.trainer import Trainer

__all__ = [
    "Engine",
    "evaluate_model",
    "seed_all",
    "has_state",
    "stable_repr",
    "IGNORE_INDEX",
    "token_cross_entropy_sum",
    "normalize_by_step",
    "TrainingLoss",
    "SFTCrossEntropy",
    "register_loss",
    "get_loss",
    "registered_losses",
    "WarmupCosine",
    "warmup_cosine_schedule",
    "Trainer",
    "AXES",
    "MESH_DIMS",
    "ParallelPlan",
    "apply_plan",
    "full_state_dict",
    "plan_state",
]
