"""The figure of a sweep (`posttrain.workflows.sweep.Sweep.plot`): per arm, the headline metric
of each finished seed (dots), the mean with its 95% interval and the baseline's mean as a dashed
line; with a baseline, a second panel of the paired differences with their intervals and zero.
The intervals are `Sweep.summary()`'s (`posttrain.workflows.sweep_stats`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_sweep"]


def plot_sweep(
    summary: pd.DataFrame, table: pd.DataFrame, arms: Sequence[str], baseline: str | None
) -> Figure:
    """The sweep's figure, made outside pyplot (`posttrain.core.figures.new_figure`).

    Args:
        summary: `Sweep.summary()`: one row per arm (arm, metric, mean, ci_low, ci_high and,
            with a baseline, diff, diff_ci_low, diff_ci_high), in the order of `arms`.
        table: `Sweep.table()`: one row per run (arm, status, value).
        arms: the arm names, top to bottom.
        baseline: the baseline arm's name, or None (one panel only).

    Returns:
        A `matplotlib.figure.Figure` with one panel, or two with a baseline.
    """
    from posttrain.core.figures import new_figure

    panels = 2 if baseline is not None else 1
    fig = new_figure(figsize=(5 * panels, 0.6 * len(arms) + 2), layout="tight")
    axes = fig.subplots(1, panels, squeeze=False)
    ax, y = axes[0][0], range(len(arms))
    for i, arm in enumerate(arms):
        dots = table[(table.arm == arm) & (table.status == "finished")]["value"]
        ax.plot(dots.astype(float), [i] * len(dots), "o", color="0.6", ms=4)
    s = summary
    ax.errorbar(
        s["mean"],
        y,
        xerr=[s["mean"] - s["ci_low"], s["ci_high"] - s["mean"]],
        fmt="s",
        color="C0",
        capsize=3,
    )
    if baseline is not None:
        ax.axvline(float(s.loc[s.arm == baseline, "mean"].iloc[0]), ls="--", color="0.5")
    ax.set_yticks(list(y), s["arm"])
    ax.set_xlabel(str(s["metric"].dropna().iloc[0]) if s["metric"].notna().any() else "metric")
    ax.set_title("per arm: seeds (dots), mean and 95% interval")
    if baseline is not None:
        ax2 = axes[0][1]
        ax2.errorbar(
            s["diff"],
            y,
            xerr=[s["diff"] - s["diff_ci_low"], s["diff_ci_high"] - s["diff"]],
            fmt="o",
            color="C1",
            capsize=3,
        )
        ax2.axvline(0, color="0.5", lw=1)
        ax2.set_yticks(list(y), [""] * len(arms))
        ax2.set_xlabel(f"minus {baseline} (paired, 95% CI)")
    return fig
