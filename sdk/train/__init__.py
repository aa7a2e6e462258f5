"""The training engine every trainer shares (step loop, accumulation, clipping, schedules,
checkpoints, resume, preemption), the loss registry, parallel plans (FSDP2/HSDP, TP, SP, PP, EP;
`plan.parallelize(model)` returns the `PlanRuntime` the trainers hold; `check_plan` checks a
plan against a job once, as a `CheckedPlan` that `parallelize` takes) and model converters
(LoRA/QLoRA, FP8 training, QAT: `convert_model`).
"""

from __future__ import annotations

from posttrain.train.converters import convert_model, registered_converters
from posttrain.train.distill import GKDLoss, OnPolicyData, generalized_jsd_loss, teacher_generate
from posttrain.train.engine import Engine
from posttrain.train.float8 import Float8Config, apply_float8
from posttrain.train.hooks import evaluate_model, has_state, seed_all, stable_repr
from posttrain.train.losses import (
    IGNORE_INDEX,
    SFTCrossEntropy,
    TrainingLoss,
    get_loss,
    normalize_by_step,
    register_loss,
    registered_losses,
    token_cross_entropy_sum,
)
from posttrain.train.parallel import AXES, MESH_DIMS, ParallelPlan
from posttrain.train.plan_checks import check_plan
from posttrain.train.plan_compat import (
    apply_plan,  # deprecated (one release)
    full_state_dict,
    plan_state,  # deprecated (one release)
)
from posttrain.train.plan_value import CheckedPlan
from posttrain.train.qat import QATConfig, convert_qat, prepare_qat, quantize_post_training
from posttrain.train.runtime import LocalRuntime, PlanRuntime, Runtime
from posttrain.train.schedules import WarmupCosine, warmup_cosine_schedule
from posttrain.train.sharding import parallelize
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
    "GKDLoss",
    "OnPolicyData",
    "generalized_jsd_loss",
    "teacher_generate",
    "AXES",
    "MESH_DIMS",
    "ParallelPlan",
    "check_plan",
    "CheckedPlan",
    "parallelize",
    "Runtime",
    "LocalRuntime",
    "PlanRuntime",
    "full_state_dict",
    "apply_plan",
    "plan_state",
    "convert_model",
    "registered_converters",
    "Float8Config",
    "apply_float8",
    "QATConfig",
    "prepare_qat",
    "convert_qat",
    "quantize_post_training",
]
