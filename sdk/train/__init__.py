"""The training engine every trainer shares (step loop, accumulation, clipping, schedules,
checkpoints, resume, preemption) and the loss registry.
"""

from __future__ import annotations

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
from posttrain.train.trainer import Trainer, warmup_cosine_schedule, WarmupCosine, check_new_run_dir

__all__ = [
    "IGNORE_INDEX",
    "token_cross_entropy_sum",
    "normalize_by_step",
    "TrainingLoss",
    "SFTCrossEntropy",
    "register_loss",
    "get_loss",
    "registered_losses",
    "Trainer",
    "warmup_cosine_schedule",
    "WarmupCosine",
    "check_new_run_dir",
]
