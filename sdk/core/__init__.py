"""Foundations every other layer stands on: the name registry, argument checks, checkpoint
files, the metrics log, preemption, distributed helpers and version information.
"""

from __future__ import annotations

from posttrain.core.checkpoint import (
    CHECKPOINT_DIR,
    FORMAT_VERSION,
    check_new_run_dir,
    checkpoint_name,
    list_checkpoints,
    latest_checkpoint,
    save_checkpoint,
    load_checkpoint,
    capture_rng_state,
    restore_rng_state,
)
from posttrain.core.checks import (
    check_int,
    require_int,
    require_positive,
    require_finite,
    require_folder,
)
from posttrain.core.distributed import rank_and_world_size, barrier, flat_collective, device_of
from posttrain.core.info import (
    Rule,
    installed_versions,
    check_compatibility,
    device_report,
    format_report,
    PACKAGES,
    RULES,
)
from posttrain.core.metrics import METRICS_FILE, TENSORBOARD_DIR, MetricsLog, read_metrics
from posttrain.core.preemption import (
    install,
    uninstall,
    requested,
    deferring,
    step_boundary,
    sigint_held,
)
from posttrain.core.registry import Registry, F

__all__ = [
    "CHECKPOINT_DIR",
    "FORMAT_VERSION",
    "check_new_run_dir",
    "checkpoint_name",
    "list_checkpoints",
    "latest_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "capture_rng_state",
    "restore_rng_state",
    "check_int",
    "require_int",
    "require_positive",
    "require_finite",
    "require_folder",
    "rank_and_world_size",
    "barrier",
    "flat_collective",
    "device_of",
    "Rule",
    "installed_versions",
    "check_compatibility",
    "device_report",
    "format_report",
    "PACKAGES",
    "RULES",
    "METRICS_FILE",
    "TENSORBOARD_DIR",
    "MetricsLog",
    "read_metrics",
    "install",
    "uninstall",
    "requested",
    "deferring",
    "step_boundary",
    "sigint_held",
    "Registry",
    "F",
]
