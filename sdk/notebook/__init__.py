"""The notebook experience: live dashboard, metric plots and the rollout inspector.
Nothing in the SDK imports this package.
"""

from __future__ import annotations

from posttrain.notebook.dashboard import (
    LiveDashboard,
    in_notebook,
)
from posttrain.notebook.inspector import (
    ROLLOUTS_FORMAT,
    load_rollouts,
    rollouts_frame,
    save_rollouts,
    to_groups,
)
from posttrain.notebook.plots import (
    METRIC_LABELS,
    OUTCOMES_PANEL,
    RL_DEFAULT_METRICS,
    SFT_DEFAULT_METRICS,
    metric_label,
    plot_metrics,
)
from posttrain.notebook.replay import (
    replay_step,
)
from posttrain.notebook.rescoring import (
    RESCORE_COLUMNS,
    compare_rewards,
    rescore,
)
from posttrain.notebook.rl_panels import (
    latest_rollouts,
)
from posttrain.notebook.rollout_records import (
    FRAME_COLUMNS,
    TOKEN_COLUMNS,
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
