"""The notebook experience: live dashboard, metric plots and the rollout inspector.
Nothing in the SDK imports this package.
"""

from __future__ import annotations

from posttrain.notebook.plots import (
    plot_metrics,
    metric_label,
    SFT_DEFAULT_METRICS,
    RL_DEFAULT_METRICS,
    OUTCOMES_PANEL,
    METRIC_LABELS,
)
from posttrain.notebook.dashboard import (
    LiveDashboard,
    latest_rollouts,
    in_notebook,
)
from posttrain.notebook.inspector import (
    rollouts_frame,
    save_rollouts,
    load_rollouts,
    to_groups,
    FRAME_COLUMNS,
    TOKEN_COLUMNS,
    ROLLOUTS_FORMAT,
)
from posttrain.notebook.rescoring import (
    rescore,
    compare_rewards,
    RESCORE_COLUMNS,
)
from posttrain.notebook.replay import (
    replay_step,
)

__all__ = [
    "LiveDashboard",
    "plot_metrics",
    "latest_rollouts",
    "in_notebook",
    "metric_label",
    "SFT_DEFAULT_METRICS",
    "RL_DEFAULT_METRICS",
    "OUTCOMES_PANEL",
    "METRIC_LABELS",
    "rollouts_frame",
    "save_rollouts",
    "load_rollouts",
    "to_groups",
    "rescore",
    "compare_rewards",
    "replay_step",
    "FRAME_COLUMNS",
    "TOKEN_COLUMNS",
    "RESCORE_COLUMNS",
    "ROLLOUTS_FORMAT",
]
