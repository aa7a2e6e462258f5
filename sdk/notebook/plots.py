"""Metric plots: one-call figures of a run's per-step metrics after it, and the figure helpers
that the live dashboard (`posttrain.notebook.dashboard`) and the reward comparison
(`posttrain.notebook.rescoring`) share.

`plot_metrics(run_dir_or_frame, metrics=[...])` draws the same panels as `LiveDashboard` after a
run and returns a matplotlib `Figure` (no pyplot state: it displays once in a notebook and never
opens a window). Panels are titled with units (`METRIC_LABELS`, `metric_label`); the pseudo-metric
`OUTCOMES_PANEL` stacks the outcome counts of RL rows in one panel. Every panel shares one step
axis (zoom one, all follow; held-out `eval/...` points line up with the training curves),
`logy=["loss"]` puts a panel on a log y axis, and with `smooth` the raw points stay drawn under
the smoothed curve (an EMA of an accuracy passes through values no step had).

Example:
    >>> import pandas as pd
    >>> frame = pd.DataFrame({"step": [1, 2, 3], "loss": [2.0, 1.5, 1.2]})
    >>> fig = plot_metrics(frame, ["loss"], smooth=0.5)
    >>> [ax.get_title() for ax in fig.axes], fig.axes[0].get_xlabel()
    (['loss (nats/token)'], 'step')
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import pandas as pd

from posttrain.core.figures import new_figure

__all__ = [
    "plot_metrics",
    "metric_label",
    "SFT_DEFAULT_METRICS",
    "RL_DEFAULT_METRICS",
    "OUTCOMES_PANEL",
    "METRIC_LABELS",
]

OUTCOMES_PANEL = "outcomes"
"""Pseudo-metric: the `outcome_<name>` count columns of RL rows, stacked, in one panel."""

SFT_DEFAULT_METRICS = ("loss", "tokens_per_s")
"""Panels when a run has no `reward_mean` column (those present, plus any `eval/...` column);
the throughput panel's title carries the last step's MFU when rows have an `mfu` column."""

RL_DEFAULT_METRICS = ("loss", "reward_mean", "kl", "accuracy", OUTCOMES_PANEL)
"""Panels when a run has a `reward_mean` column (those present, plus any `eval/...` column)."""

METRIC_LABELS = {
    "loss": "loss (nats/token)",
    "lr": "learning rate",
    "grad_norm": "grad norm (L2, before clipping)",
    "trained_tokens": "trained tokens per step",
    "tokens_per_s": "throughput (tokens/s)",
    "step_time_s": "step time (s)",
    "rollout_s": "rollout time (s)",
    "weight_sync_s": "weight sync before the rollout (s)",
    "reward_mean": "reward (mean)",
    "accuracy": "accuracy (fraction ok)",
    "kl": "KL to reference (nats/token)",
    "kl_loss": "KL loss term",
    "ppo_kl": "KL old -> new (nats/token)",
    "entropy": "entropy (nats/token)",
    "pg_loss": "policy-gradient loss",
    "vf_loss": "value loss",
    "clipfrac": "clipped fraction",
    "ratio_mean": "importance ratio (mean)",
    "response_length": "response length (tokens)",
    "sampled_tokens": "sampled tokens per step",
    "finish_length_frac": "fraction cut at max tokens",
    "groups_zero_signal": "groups with equal rewards",
    OUTCOMES_PANEL: "outcomes (trajectories per step)",
}
"""Axis titles with units for known columns; others are titled by their name."""

_OUTCOME_COLORS = {
    "ok": "#2ca02c",
    "wrong": "#7f7f7f",
    "format_error": "#ff7f0e",
    "timeout": "#9467bd",
    "error": "#d62728",
}


def metric_label(name: str) -> str:
    """Panel title for a metrics column: `METRIC_LABELS`, 'held-out X' for 'eval/X', 'reward X
    (mean)' for one reward function's 'reward/X', else it."""
    if name in METRIC_LABELS:
        return METRIC_LABELS[name]
    if name.startswith("eval/"):
        return f"held-out {name[len('eval/') :]}"
    if name.startswith("reward/"):  # one reward function's mean (posttrain.rl.rollout)
        return f"reward {name[len('reward/') :]} (mean)"
    return name


def _default_metrics(columns: Sequence[str]) -> list[str]:
    columns = list(columns)
    rl = "reward_mean" in columns
    base = RL_DEFAULT_METRICS if rl else SFT_DEFAULT_METRICS
    has_outcomes = bool(_outcome_columns(columns))
    chosen = [m for m in base if m in columns or (m == OUTCOMES_PANEL and has_outcomes)]
    terms = [c for c in columns if c.startswith("reward/") and not c.endswith("/failures")]
    return chosen + terms + sorted(c for c in columns if c.startswith("eval/"))


def _outcome_columns(columns: Sequence[str]) -> list[str]:
    """`outcome_*` columns, in `_OUTCOME_COLORS` order first."""
    present = [c for c in columns if str(c).startswith("outcome_")]
    order = [f"outcome_{k}" for k in _OUTCOME_COLORS]
    return [c for c in order if c in present] + [c for c in present if c not in order]


def _smoothed(values: pd.Series, weight: float) -> pd.Series:
    """TensorBoard-style debiased exponential moving average (weight 0: none, 0.9: heavy)."""
    return values.ewm(alpha=1.0 - weight, adjust=True, ignore_na=True).mean()


def _draw(
    fig,
    frame: pd.DataFrame,
    metrics: Sequence[str],
    *,
    smooth: float,
    ncols: int,
    xlabel: str = "step",
    logy: Sequence[str] = (),
) -> None:
    """Draw one panel per metric into `fig` (cleared first), all panels on one shared x axis
    (zooming one zooms all; x tick labels under the lowest panel of each column). `logy`
    panels get a log y axis when all their values are > 0, else a linear one titled so."""
    fig.clear()
    n = max(len(metrics), 1)
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True).ravel()
    steps = frame["step"] if "step" in frame else pd.Series(range(1, len(frame) + 1))
    for k, (ax, name) in enumerate(zip(axes, metrics)):
        ax.set_title(metric_label(name) + _mfu_suffix(frame, name), fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if k >= len(metrics) - ncols:  # the lowest panel of its column: the panel below is unused
            ax.set_xlabel(xlabel, fontsize=8)
            ax.xaxis.set_tick_params(labelbottom=True)
        if name == OUTCOMES_PANEL:
            _draw_outcomes(ax, frame, steps)
            continue
        values = pd.to_numeric(frame[name], errors="coerce") if name in frame else None
        if values is None or values.notna().sum() == 0:
            ax.text(
                0.5,
                0.5,
                "no data yet",
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=8,
                color="#777777",
            )
            continue
        keep = values.notna()
        x, y = steps[keep], values[keep]
        if smooth > 0 and len(y) > 1:
            # every raw point stays visible under the smoothed curve: an EMA of a bounded or
            # discrete metric (an accuracy) passes through values no step had
            ax.plot(x, y, lw=0.6, alpha=0.45, color="C0", marker="o", ms=2.5, label="raw")
            ax.plot(x, _smoothed(y, smooth), lw=1.5, color="C0", label=f"EMA {smooth:g}")
            ax.legend(fontsize=7, frameon=False)
        else:
            ax.plot(x, y, lw=1.2, color="C0", marker="o" if len(y) <= 20 else None, ms=3)
        if name in logy:
            if (y > 0).all():
                ax.set_yscale("log")
            else:
                ax.set_title(f"{ax.get_title()} (linear: values <= 0)", fontsize=9)
        if name == "lr" and ax.get_yscale() == "linear":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for ax in axes[len(metrics) :]:
        ax.set_visible(False)


def _check_logy(logy: str | Sequence[str], panels: Sequence[str]) -> list[str]:
    """`logy` as a list of names, each one of `panels` (the plotted metrics).

    Raises:
        ValueError: a name that is not one of `panels`, naming the allowed ones.
    """
    names = [logy] if isinstance(logy, str) else list(logy)
    unknown = [n for n in names if n not in panels]
    if unknown:
        raise ValueError(f"logy={unknown}: not a plotted metric; allowed: {list(panels)}")
    return names


def _mfu_suffix(frame: pd.DataFrame, name: str) -> str:
    """ ", MFU 1.23%" (the last row's `mfu`) for the throughput panel, else ""."""
    if name != "tokens_per_s" or "mfu" not in frame:
        return ""
    mfu = pd.to_numeric(frame["mfu"], errors="coerce").dropna()
    return f", MFU {mfu.iloc[-1]:.2%}" if len(mfu) else ""


def _draw_outcomes(ax, frame: pd.DataFrame, steps: pd.Series) -> None:
    columns = _outcome_columns(frame.columns)
    if not columns:
        ax.text(
            0.5,
            0.5,
            "no outcome_* columns",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=8,
            color="#777777",
        )
        return
    counts = frame[columns].apply(pd.to_numeric, errors="coerce").fillna(0.0)
    labels = [c[len("outcome_") :] for c in columns]
    colors = [_OUTCOME_COLORS.get(label) for label in labels]
    if len(frame) <= 50:
        bottom = pd.Series(0.0, index=frame.index)
        for column, label, color in zip(columns, labels, colors):
            ax.bar(steps, counts[column], bottom=bottom, label=label, color=color, width=0.8)
            bottom = bottom + counts[column]
    else:
        ax.stackplot(steps, *[counts[c] for c in columns], labels=labels, colors=colors)
    ax.legend(fontsize=7, loc="upper left", ncols=2, frameon=False)


def _new_figure(n: int, ncols: int, figsize: tuple[float, float] | None, dpi: int):
    """A Figure outside pyplot (`posttrain.core.figures`): nothing global, shown once inline."""
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(max(n, 1) / ncols)
    if figsize is None:
        figsize = (3.3 * ncols, 2.5 * nrows)
    return new_figure(figsize=figsize, dpi=dpi, layout="constrained")


def plot_metrics(
    source: pd.DataFrame | str | os.PathLike,
    metrics: Sequence[str] | None = None,
    *,
    smooth: float = 0.0,
    ncols: int = 3,
    figsize: tuple[float, float] | None = None,
    dpi: int = 100,
    title: str | None = None,
    logy: str | Sequence[str] = (),
):
    """One figure of per-step metrics, one panel per metric, on one shared x axis (step).

    Args:
        source: a metrics DataFrame (`trainer.metrics`) or a run folder / `metrics.jsonl` path
            (read with `posttrain.core.metrics.read_metrics`).
        metrics: column names to plot, plus the pseudo-metric "outcomes" (`OUTCOMES_PANEL`: the
            outcome_* counts of RL rows as stacked bars, or a stacked area past 50 steps). None:
            `RL_DEFAULT_METRICS` for runs with a `reward_mean` column, else
            `SFT_DEFAULT_METRICS`, keeping those present, plus every `eval/...` column.
        smooth: exponential-moving-average weight in [0, 1) (TensorBoard's slider, debiased):
            0 plots the raw values; otherwise every raw point stays drawn (faint markers)
            under the smoothed curve, so a smoothed value no step had is told apart.
            Rows where a metric is NaN (e.g. eval columns between evaluations) are skipped.
        ncols: panels per row.
        figsize: inches; default 3.3 x 2.5 per panel. dpi: dots per inch.
        title: optional figure title.
        logy: panels (metric names among those plotted, e.g. "loss") drawn on a log y axis.

    Returns:
        A `matplotlib.figure.Figure` (not registered with pyplot; `fig.savefig(path)` writes
        it, and as a notebook cell's value it displays once). Panel titles carry units.

    Raises:
        FileNotFoundError: if `source` is a path without a metrics.jsonl.
        ValueError: for an empty frame, a requested column that the run does not have (the
            message lists the available ones), `smooth` outside [0, 1), or a `logy` name that
            is not a plotted metric or has values <= 0 (a log axis cannot show them).
    """
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth={smooth!r}; must be in [0, 1) (0: raw values)")
    if not isinstance(source, pd.DataFrame):
        from posttrain.core.metrics import read_metrics

        source = read_metrics(source)
    frame = source
    if frame.empty:
        raise ValueError("the metrics frame is empty: the run has no step yet")
    if metrics is None:
        metrics = _default_metrics(frame.columns)
    else:
        metrics = [metrics] if isinstance(metrics, str) else list(metrics)
        missing = [
            m
            for m in metrics
            if m not in frame.columns
            and not (m == OUTCOMES_PANEL and _outcome_columns(frame.columns))
        ]
        if missing:
            available = sorted(c for c in frame.columns if c != "step")
            if _outcome_columns(frame.columns):
                available.append(OUTCOMES_PANEL)
            raise ValueError(f"no column {missing} in this run's metrics; available: {available}")
    if not metrics:
        raise ValueError("nothing to plot: pass metrics=[...] (columns of the run's metrics)")
    logy = _check_logy(logy, [m for m in metrics if m != OUTCOMES_PANEL])
    for name in logy:
        values = pd.to_numeric(frame[name], errors="coerce").dropna()
        if (values <= 0).any():
            raise ValueError(
                f"logy: {name!r} has values <= 0 (min {values.min():.4g}), which a log axis "
                "cannot show; plot it without logy"
            )
    fig = _new_figure(len(metrics), ncols, figsize, dpi)
    _draw(fig, frame, metrics, smooth=smooth, ncols=ncols, logy=logy)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
