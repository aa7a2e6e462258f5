"""The `logging:` section every recipe config has: which experiment trackers mirror the run
(`posttrain.core.trackers`) and their options. Off by default (no trackers).

    logging:
      trackers: [tensorboard, wandb]   # any of: tensorboard, wandb, mlflow
      experiment: chain_sum            # the W&B project, the MLflow experiment
      wandb_mode: offline              # offline (default) | online | disabled
      wandb_dir: null                  # null -> the run folder (<out_dir>/wandb/offline-run-*)
      mlflow_tracking_uri: null        # null -> sqlite:///<out_dir>/mlflow/mlflow.db

Example:
    >>> LoggingConfig(trackers=["tb"]).check("logging")
    Traceback (most recent call last):
    ...
    ValueError: logging.trackers=['tb']; must be distinct names in [mlflow, tensorboard, wandb]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.core.trackers import TRACKERS, WANDB_MODES, Trackers
from posttrain.workflows.field_checks import choice, fail

__all__ = ["LoggingConfig"]


@dataclass(kw_only=True)
class LoggingConfig:
    """Experiment trackers of a run (see the module docstring for the keys)."""

    trackers: list[str] = field(default_factory=list)
    experiment: str = "posttrain"
    wandb_mode: str = "offline"
    wandb_dir: str | None = None
    mlflow_tracking_uri: str | None = None

    def check(self, at: str) -> None:
        names = self.trackers
        allowed = ", ".join(sorted(TRACKERS))
        if (
            not isinstance(names, list | tuple)
            or any(not isinstance(n, str) or n not in TRACKERS for n in names)
            or len(set(names)) != len(names)
        ):
            raise fail(f"{at}.trackers", names, f"distinct names in [{allowed}]")
        if not isinstance(self.experiment, str) or not self.experiment.strip():
            raise fail(f"{at}.experiment", self.experiment, "a non-empty name")
        choice(f"{at}.wandb_mode", self.wandb_mode, WANDB_MODES)
        for key, meaning in (
            ("wandb_dir", "a folder path (null: the run folder)"),
            ("mlflow_tracking_uri", "a store path or URI (null: a store in the run folder)"),
        ):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise fail(f"{at}.{key}", value, meaning)

    def build(self, run_dir: Path) -> Trackers:
        """The `Trackers` of a run in `run_dir` (none named: a no-op set)."""
        options: dict[str, dict[str, Any]] = {
            "wandb": {
                "project": self.experiment,
                "mode": self.wandb_mode,
                "dir": self.wandb_dir or None,
            },
            "mlflow": {
                "experiment": self.experiment,
                "tracking_uri": self.mlflow_tracking_uri or None,
            },
        }
        return Trackers(self.trackers, run_dir, options)
