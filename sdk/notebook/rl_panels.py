"""What the live dashboard shows of an RL step besides its metric curves: the table of the latest
sampled rollouts and the step time split panel.

Both read a trainer or its metrics frame and return what the dashboard displays (HTML, or a
matplotlib axes redrawn in place); when and where they are displayed is
`posttrain.notebook.dashboard.LiveDashboard`'s business.

    latest_rollouts      the rollouts of the trainer's latest step, as a rollouts frame
    rollouts table       prompt, completion, reward and outcome of a few of them, one per group
                         first, as an HTML table
    TIME_PANEL           where each step's seconds went (`time_<phase>_s` columns), stacked by
                         phase, with the step's MFU in the title; the weight sync of an engine
                         apart from the policy (`weight_sync_s`, a part of the scoring phase)
                         stacked apart as "weight_sync"

Example:
    >>> from types import SimpleNamespace
    >>> from posttrain.rl import Group, Trajectory
    >>> seven = Trajectory(group_id=0, prompt_ids=[1], completion_ids=[55], logprobs=[-1.0],
    ...                    reward=1.0, outcome="ok", finish_reason="stop", text="7")
    >>> trainer = SimpleNamespace(last_groups=[Group([seven])],
    ...                           last_builders=[SimpleNamespace(item={"question": "3+4="})])
    >>> latest_rollouts(trainer)[["prompt", "completion", "reward", "outcome"]].values.tolist()
    [['3+4=', '7', 1.0, 'ok']]
"""

from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd

from posttrain.notebook.plots import _OUTCOME_COLORS

__all__ = ["latest_rollouts", "TIME_PANEL"]

TIME_PANEL = "time_split"
"""Pseudo-metric: the `time_<phase>_s` columns of RL rows (`posttrain.rl.step_timing`: rollout,
scoring, logprobs, update, other), stacked per step, in one panel; shown by default once a row has
them, with the step's MFU in the panel title."""

_TIME_COLUMNS = (
    "time_rollout_s",
    "time_scoring_s",
    "time_logprobs_s",
    "time_update_s",
    "time_other_s",
)


def latest_rollouts(trainer) -> pd.DataFrame | None:
    """The rollouts of the trainer's latest step as a `posttrain.notebook.inspector.rollouts_frame`,
    or None when the trainer exposes none.

    Read defensively: `trainer.last_groups` (with `trainer.last_builders` for the task items
    when they line up), else a non-empty `trainer.buffer` (RLTrainer's on-policy buffer is
    drained inside the step, so that one is empty between steps).
    """
    from posttrain.notebook.inspector import rollouts_frame

    tokenizer = getattr(getattr(trainer, "policy", None), "tokenizer", None)
    groups = getattr(trainer, "last_groups", None)
    if groups:
        builders = getattr(trainer, "last_builders", None)
        items = None
        if builders is not None and len(builders) == len(groups):
            items = [getattr(b, "item", None) for b in builders]
        return rollouts_frame(groups, items=items, tokenizer=tokenizer)
    buffer = getattr(trainer, "buffer", None)
    if buffer is not None and hasattr(buffer, "state_dict"):
        try:
            size = len(buffer)
        except TypeError:
            return None
        if size:
            return rollouts_frame(buffer, tokenizer=tokenizer)
    return None


def _rollouts_table_html(trainer, max_rows: int) -> str:
    """An HTML table of at most `max_rows` rollouts of the trainer's latest step (one per group
    first), or '' when there are none or `max_rows` is 0."""
    if max_rows == 0:
        return ""
    frame = latest_rollouts(trainer)
    if frame is None or frame.empty:
        return ""
    firsts = frame.drop_duplicates(subset=["policy_version", "group_id"])
    rows = pd.concat([firsts, frame.drop(firsts.index)]).head(max_rows)
    cells = []
    for _, r in rows.iterrows():
        color = _OUTCOME_COLORS.get(str(r["outcome"]), "#000000")
        cells.append(
            "<tr>" + f"<td>{_short(r['prompt'])}</td><td>{_short(r['completion'])}</td>"
            f"<td style='text-align:right'>{r['reward']:.3g}</td>"
            f"<td style='color:{color}'>{html.escape(str(r['outcome']))}</td></tr>"
        )
    head = "<tr><th>prompt</th><th>completion</th><th>reward</th><th>outcome</th></tr>"
    caption = f"latest rollouts ({len(rows)} of {len(frame)})"
    return (
        f"<table style='font-family:monospace;font-size:11px'><caption "
        f"style='text-align:left'>{caption}</caption>{head}{''.join(cells)}</table>"
    )


def _short(text: Any, limit: int = 80) -> str:
    if text is None or (isinstance(text, float) and math.isnan(text)):
        return ""
    text = str(text).replace("\n", " \u21b5 ")
    if len(text) > limit:
        text = text[: limit - 1] + "\u2026"
    return html.escape(text)


def _time_columns(columns) -> list[str]:
    return [c for c in _TIME_COLUMNS if c in columns]


def _draw_time_split(ax, frame: pd.DataFrame) -> None:
    """Redraw `ax` as the step time split: stacked bars of the time columns per step (a
    stacked area past 50 steps); the title carries the latest MFU when the rows have one."""
    xlabel = ax.get_xlabel()
    ax.clear()
    columns = _time_columns(frame.columns)
    mfu = (
        pd.to_numeric(frame["mfu"], errors="coerce").dropna()
        if "mfu" in frame
        else pd.Series(dtype=float)
    )
    title = "step time split (s)" + (f", MFU {mfu.iloc[-1]:.2%}" if len(mfu) else "")
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.set_xlabel(xlabel, fontsize=8)
    if not columns:
        ax.text(
            0.5,
            0.5,
            "no time_*_s columns",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=8,
            color="#777777",
        )
        return
    steps = frame["step"] if "step" in frame else pd.Series(range(1, len(frame) + 1))
    seconds = frame[columns].apply(pd.to_numeric, errors="coerce").fillna(0.0)
    sync = pd.to_numeric(frame.get("weight_sync_s", pd.Series(dtype=float)), errors="coerce")
    if "time_scoring_s" in columns and (sync > 0).any():  # a part of scoring, shown apart
        sync = sync.reindex(frame.index).fillna(0.0)
        seconds["time_scoring_s"] = (seconds["time_scoring_s"] - sync).clip(lower=0.0)
        seconds.insert(0, "time_weight_sync_s", sync)  # (before the rollout)
        columns = list(seconds.columns)
    labels = [c[len("time_") : -len("_s")] for c in columns]
    if len(frame) <= 50:
        bottom = pd.Series(0.0, index=frame.index)
        for column, label in zip(columns, labels):
            ax.bar(steps, seconds[column], bottom=bottom, label=label, width=0.8)
            bottom = bottom + seconds[column]
    else:
        ax.stackplot(steps, *[seconds[c] for c in columns], labels=labels)
    ax.legend(fontsize=7, loc="upper left", ncols=2, frameon=False)
