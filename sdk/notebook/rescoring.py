"""Rescore rollouts with an edited verifier and compare rewards and outcomes before and after.

`rescore(source, verifier)` scores every completion of a rollouts source (anything
`posttrain.notebook.inspector.rollouts_frame` reads: groups, a buffer, a `save_rollouts` file, a
frame) again and puts the old and new reward and outcome side by side (`RESCORE_COLUMNS`).
Verifying needs the task items: a saved file carries them, otherwise pass `items=`.

`compare_rewards(rescored)` (or `compare_rewards(before, after)` for two unpaired sets) returns a
summary table (reward mean, accuracy, outcome counts, before / after / change) and a matplotlib
figure of the reward histograms and outcome counts.

Example:
    >>> from posttrain.notebook.inspector import rollouts_frame
    >>> rows = [{"group_id": 0, "text": "7", "reward": 1.0, "outcome": "ok"},
    ...         {"group_id": 0, "text": "7.0", "reward": 0.0, "outcome": "wrong"}]
    >>> frame = rollouts_frame([rows], items=[{"question": "3+4=", "answer": "7"}])
    >>> lenient = lambda completion, item: float(float(completion) == float(item["answer"]))
    >>> rescored = rescore(frame, lenient, timeout_s=None)
    >>> rescored[["old_outcome", "new_outcome", "changed"]].values.tolist()
    [['ok', 'ok', False], ['wrong', 'ok', True]]
    >>> summary, fig = compare_rewards(rescored)
    >>> summary.loc["accuracy"].tolist()
    [0.5, 1.0, 0.5]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from posttrain.notebook.inspector import rollouts_frame
from posttrain.notebook.rollout_records import _OUTCOMES
from posttrain.rewards.verifier import (
    DEFAULT_MAX_WORKERS,
    DEFAULT_TIMEOUT_S,
    Verifier,
    score_batch,
)

if TYPE_CHECKING:
    from posttrain.models.tokenizer import Tokenizer

__all__ = ["rescore", "compare_rewards", "RESCORE_COLUMNS"]

RESCORE_COLUMNS = (
    "group_id",
    "sample",
    "policy_version",
    "prompt",
    "completion",
    "answer",
    "old_reward",
    "old_outcome",
    "new_reward",
    "new_outcome",
    "new_reason",
    "changed",
)
"""Columns of `rescore`'s result."""


def rescore(
    source: Any,
    verifier: Verifier | Callable[[str, Mapping], Any],
    *,
    items: Sequence[Any] | Mapping[Any, Any] | None = None,
    tokenizer: Tokenizer | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    max_workers: int = DEFAULT_MAX_WORKERS,
) -> pd.DataFrame:
    """Score every completion again with `verifier` (e.g. an edited one) and put the old and
    new reward and outcome side by side.

    Each row is `posttrain.rewards.verifier.score_batch(verifier, completions, items)`: a verifier
    that raises gives outcome "error" (reward 0.0, the exception in `new_reason`), one past
    `timeout_s` gives "timeout"; nothing is a silent 0.0. The completion is the stored text, so this
    re-runs the per-trajectory verifier only: a builder's group-level reward hook or a multi-turn
    environment's own scoring is not replayed.

    Args:
        source: as in `rollouts_frame` (a filtered frame rescores just those rows).
        verifier: any `(completion, item) -> VerifierResult | float` callable.
        items, tokenizer: as in `rollouts_frame`, when the source has no items.
        timeout_s, max_workers: as in `score_batch` (None: inline, no budget).

    Returns:
        A DataFrame with `RESCORE_COLUMNS`, the source's index; `changed` is True where the
        reward or the outcome differs.

    Raises:
        ValueError: if a row has no task item (the message says how to give them).
    """
    frame = rollouts_frame(source, items=items, tokenizer=tokenizer)
    no_item = [row for row, item in frame["item"].items() if not isinstance(item, Mapping)]
    if no_item:
        raise ValueError(
            f"rows {no_item[:10]} have no task item to verify against; pass "
            "items=[b.item for b in builders] (one per group) or a dict "
            "group_id -> item, or rescore a file saved with items"
        )
    completions = [c if isinstance(c, str) else "" for c in frame["completion"]]
    results = score_batch(
        verifier, completions, list(frame["item"]), timeout_s=timeout_s, max_workers=max_workers
    )
    out = frame[["group_id", "sample", "policy_version", "prompt", "completion", "answer"]].copy()
    out["old_reward"] = frame["reward"]
    out["old_outcome"] = frame["outcome"]
    out["new_reward"] = [r.score for r in results]
    out["new_outcome"] = [r.outcome.value for r in results]
    out["new_reason"] = [r.reason for r in results]
    out["changed"] = (out["new_reward"] != out["old_reward"]) | (
        out["new_outcome"] != out["old_outcome"]
    )
    return out[list(RESCORE_COLUMNS)]


def compare_rewards(before: Any, after: Any = None, *, bins: int = 20):
    """Summary table and figure of rewards and outcomes before vs after.

    Args:
        before: a `rescore` result (then `after` is None: its old_* vs new_* columns, paired row
            by row), or any rollouts source / frame with reward and outcome columns.
        after: the second rollouts source / frame (unpaired: the two may differ in size).
        bins: histogram bins of the reward panel.

    Returns:
        (summary, figure). `summary` is indexed by metric: rows, reward_mean (over rows the
        verifier judged: error and timeout rows are counted, not averaged in), accuracy
        (fraction of rows with outcome "ok"), outcome_<name> for every outcome (counts), and
        for a rescore result rows_changed; columns before, after, change (= after - before;
        rows_changed has its count under change only). `figure` is a matplotlib Figure:
        reward histograms (shared bins) and outcome counts, before next to after.

    Raises:
        ValueError: if `after` is None and `before` is not a rescore result, or a side is
            empty.
    """
    paired = after is None
    if paired:
        if not isinstance(before, pd.DataFrame) or not {
            "old_reward",
            "new_reward",
            "old_outcome",
            "new_outcome",
        } <= set(before.columns):
            raise ValueError(
                "compare_rewards(x) needs a rescore() result; to compare two sets "
                "of rollouts pass both: compare_rewards(before, after)"
            )
        b_reward, b_outcome = before["old_reward"], before["old_outcome"]
        a_reward, a_outcome = before["new_reward"], before["new_outcome"]
    else:
        b, a = (_rewards_frame(x) for x in (before, after))
        b_reward, b_outcome, a_reward, a_outcome = (
            b["reward"],
            b["outcome"],
            a["reward"],
            a["outcome"],
        )
    if len(b_reward) == 0 or len(a_reward) == 0:
        raise ValueError("nothing to compare: a side has no rollouts")
    stats_b, stats_a = _stats(b_reward, b_outcome), _stats(a_reward, a_outcome)
    summary = pd.DataFrame({"before": stats_b, "after": stats_a})
    summary["change"] = summary["after"] - summary["before"]
    if paired:
        summary.loc["rows_changed"] = [math.nan, math.nan, float(before["changed"].sum())]
    summary.index.name = "metric"
    return summary, _compare_figure(b_reward, b_outcome, a_reward, a_outcome, summary, bins)


def _rewards_frame(source: Any) -> pd.DataFrame:
    if isinstance(source, pd.DataFrame) and {"reward", "outcome"} <= set(source.columns):
        return source
    return rollouts_frame(source)


def _stats(reward: pd.Series, outcome: pd.Series) -> dict[str, float]:
    outcome = outcome.astype(str)
    judged = ~outcome.isin(["error", "timeout"])  # a failure has no reward to average in
    stats = {
        "rows": float(len(reward)),
        "reward_mean": float(reward[judged].astype(float).mean()),
        "accuracy": float((outcome == "ok").mean()),
    }
    for name in _OUTCOMES:
        stats[f"outcome_{name}"] = float((outcome == name).sum())
    return stats


def _compare_figure(b_reward, b_outcome, a_reward, a_outcome, summary: pd.DataFrame, bins: int):
    import numpy as np

    from posttrain.core.figures import new_figure
    from posttrain.notebook.plots import _OUTCOME_COLORS

    fig = new_figure(figsize=(9, 3.2), dpi=100, layout="constrained")
    ax_hist, ax_out = fig.subplots(1, 2)
    values = np.concatenate([np.asarray(b_reward, float), np.asarray(a_reward, float)])
    low, high = float(values.min()), float(values.max())
    if low == high:
        low, high = low - 0.5, high + 0.5
    edges = np.linspace(low, high, bins + 1)
    ax_hist.hist(
        np.asarray(b_reward, float),
        bins=edges,
        histtype="stepfilled",
        alpha=0.35,
        color="#7f7f7f",
        label="before",
    )
    ax_hist.hist(
        np.asarray(a_reward, float), bins=edges, histtype="step", lw=1.5, color="C0", label="after"
    )
    ax_hist.set_xlabel("reward")
    ax_hist.set_ylabel("rollouts")
    ax_hist.set_title(
        f"reward mean {summary.at['reward_mean', 'before']:.3g} -> "
        f"{summary.at['reward_mean', 'after']:.3g}",
        fontsize=9,
    )
    ax_hist.legend(fontsize=8, frameon=False)
    x = np.arange(len(_OUTCOMES))
    counts_b = [summary.at[f"outcome_{o}", "before"] for o in _OUTCOMES]
    counts_a = [summary.at[f"outcome_{o}", "after"] for o in _OUTCOMES]
    colors = [_OUTCOME_COLORS[o] for o in _OUTCOMES]
    ax_out.bar(x - 0.2, counts_b, width=0.4, color=colors, alpha=0.35, label="before")
    ax_out.bar(x + 0.2, counts_a, width=0.4, color=colors, label="after")
    ax_out.set_xticks(x, list(_OUTCOMES), fontsize=8)
    ax_out.set_ylabel("rollouts")
    ax_out.set_title(
        f"accuracy {summary.at['accuracy', 'before']:.3g} -> "
        f"{summary.at['accuracy', 'after']:.3g} (left: before, right: after)",
        fontsize=9,
    )
    for ax in (ax_hist, ax_out):
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    return fig
