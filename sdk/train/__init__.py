"""The training engine every trainer shares (step loop, accumulation, clipping, schedules,
checkpoints, resume, preemption), the loss registry, parallel plans (FSDP2/HSDP, TP, SP, PP, EP;
`plan.parallelize(model)` returns the `PlanRuntime` the trainers hold; `check_plan` checks a
plan against a job once, as a `CheckedPlan` that `parallelize` takes) and model converters
(LoRA/QLoRA, FP8 training, QAT: `convert_model`).

The names are imported from their modules on first use (`posttrain.core.lazy`): a recipe's
config, whose `parallel` section is a `ParallelPlan`, imports `posttrain.train.parallel`
without the trainer, the converters and torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from posttrain.core.lazy import lazy_exports

EXPORTS: dict[str, list[str]] = {
    "converters": ["convert_model", "registered_converters"],
    "distill": ["GKDLoss", "OnPolicyData", "generalized_jsd_loss", "teacher_generate"],
    "engine": ["Engine"],
    "float8": ["Float8Config", "apply_float8"],
    "hooks": ["evaluate_model", "has_state", "seed_all", "stable_repr"],
    "losses": [
        "IGNORE_INDEX",
        "SFTCrossEntropy",
        "TrainingLoss",
        "get_loss",
        "normalize_by_step",
        "register_loss",
        "registered_losses",
        "token_cross_entropy_sum",
    ],
    "parallel": ["AXES", "MESH_DIMS", "ParallelPlan"],
    "plan_checks": ["check_plan"],
    "plan_compat": [
        "apply_plan",  # deprecated (one release)
        "full_state_dict",
        "plan_state",  # deprecated (one release)
    ],
    "plan_value": ["CheckedPlan"],
    "qat": ["QATConfig", "convert_qat", "prepare_qat", "quantize_post_training"],
    "runtime": ["LocalRuntime", "PlanRuntime", "Runtime"],
    "schedules": ["WarmupCosine", "warmup_cosine_schedule"],
    "sharding": ["parallelize"],
    "trainer": ["Trainer"],
}
"""The package's names -> the module that holds each."""

_lookup, __all__ = lazy_exports(__name__, EXPORTS)

_REGISTRY_NAMES = ("get_loss", "registered_losses")
"""Names whose registry holds the losses of the package's own modules: "gkd" registers when
`posttrain.train.distill_loss` imports, which asking for one of these from the package does."""


def __getattr__(name: str) -> Any:
    if name in _REGISTRY_NAMES:
        importlib.import_module("posttrain.train.distill_loss")
    return _lookup(name)
