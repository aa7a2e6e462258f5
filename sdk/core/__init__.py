"""Foundations every other layer stands on: the name registry, argument checks, checkpoint
files, stage files (checked on resume), the metrics log, preemption, distributed helpers and
version information.

The names below load on first use (`posttrain.core.lazy`): importing the package or one of
its submodules does not import the others (nor torch).
"""

from __future__ import annotations

from posttrain.core.lazy import lazy_exports

# submodule -> the names it exports; each is imported on first use.
_EXPORTS = {
    "checkpoint": [
        "CHECKPOINT_DIR",
        "FORMAT_VERSION",
        "MANIFEST_FILE",
        "CheckpointCorruptError",
        "UnsafeCheckpointError",
        "check_new_run_dir",
        "checkpoint_name",
        "list_checkpoints",
        "latest_checkpoint",
        "resolve_checkpoint",
        "verify_checkpoint",
        "save_checkpoint",
        "load_checkpoint",
        "capture_rng_state",
        "restore_rng_state",
    ],
    "checkpoint_files": [
        "FILE_MODE",
        "DIR_MODE",
        "make_private_dir",
        "write_bytes",
        "write_text_atomic",
        "write_torch",
        "sha256_file",
        "write_manifest",
        "verify_manifest",
        "check_weights_only",
        "read_weights_only",
        "is_disk_full",
        "free_bytes",
        "no_space_error",
        "state_bytes",
    ],
    "checks": [
        "FieldTypeError",
        "check_number",
        "check_fields",
        "fail",
        "check_int",
        "require_int",
        "require_positive",
        "require_finite",
        "require_folder",
    ],
    "distributed": ["rank_and_world_size", "barrier", "flat_collective", "device_of"],
    "info": [
        "Rule",
        "installed_versions",
        "check_compatibility",
        "device_report",
        "format_report",
        "PACKAGES",
        "RULES",
    ],
    "metrics": ["METRICS_FILE", "TENSORBOARD_DIR", "MetricsLog", "read_metrics"],
    "preemption": [
        "install",
        "uninstall",
        "requested",
        "deferring",
        "step_boundary",
        "sigint_held",
    ],
    "registry": ["Registry"],
    "run_lock": ["LOCK_FILE", "RunDirInUseError", "claim_run_dir"],
    "stage_files": [
        "RECORD_FILE",
        "StageFileError",
        "write_stage_file",
        "read_stage_file",
        "count_lines",
    ],
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
