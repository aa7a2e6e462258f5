"""Foundations every other layer stands on: the name registry, argument checks, checkpoint
files, the metrics log, preemption, distributed helpers and version information.
"""

from __future__ import annotations

from posttrain.core.checkpoint import (
    CHECKPOINT_DIR,
    FORMAT_VERSION,
    checkpoint_name,
    list_checkpoints,
    latest_checkpoint,
    save_checkpoint,
    load_checkpoint,
    capture_rng_state,
    restore_rng_state,
)
from posttrain.core.checks import require_int, require_positive, require_finite, require_folder
from posttrain.core.distributed import rank_and_world_size, barrier, flat_collective
from posttrain.core.info import (
    PACKAGES,
    Rule,
    RULES,
    installed_versions,
    check_compatibility,
    device_report,
    format_report,
)
from posttrain.core.metrics import METRICS_FILE, TENSORBOARD_DIR, MetricsLog, read_metrics
from posttrain.core.preemption import install, uninstall, requested, deferring, step_boundary
from posttrain.core.registry import F, Registry

__all__ = [
    "check_int",
    "CHECKPOINT_DIR",
    "FORMAT_VERSION",
    "checkpoint_name",
    "list_checkpoints",
    "latest_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "capture_rng_state",
    "restore_rng_state",
    "require_int",
    "require_positive",
    "require_finite",
    "require_folder",
    "rank_and_world_size",
    "barrier",
    "flat_collective",
    "PACKAGES",
    "Rule",
    "RULES",
    "installed_versions",
    "check_compatibility",
    "device_report",
    "format_report",
    "METRICS_FILE",
    "TENSORBOARD_DIR",
    "MetricsLog",
    "read_metrics",
    "install",
    "uninstall",
    "requested",
    "deferring",
    "step_boundary",
    "F",
    "Registry",
]
