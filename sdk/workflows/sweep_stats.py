"""Intervals for `Sweep.summary` that respect the metric's range.

An accuracy (the headline is the mean of per-item correctness, and each run's per-item table is
there) gets an interval over seeds x items: a two-stage cluster bootstrap (seeds resampled with
replacement, then items within each drawn seed; Davison & Hinkley 1997, sec. 3.8) once there
are 3 or more seeds, else the Wilson score interval over the pooled items, labelled as an
item-level interval. Both lie inside [0, 1] by construction (a percentile of means of values in
[0, 1], and Wilson's bounds). A metric without per-item values gets the Student-t interval over
seeds from 3 seeds on, and no interval (NaN, "too few seeds for an interval") below that: with
two seeds t_{0.975,1} = 12.7 makes the interval many times the metric's range.

Paired differences against a baseline follow the same rule on the per-item differences (values
in [-1, 1]): cluster bootstrap over seeds from 3 seeds on, else the paired item bootstrap over
the pooled items (`posttrain.rewards.evaluation.paired_bootstrap_diff`), labelled item-level.
Every row names its method in `interval` / `diff_interval`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from posttrain.rewards.evaluation import paired_bootstrap_diff, wilson_interval

__all__ = ["MIN_SEEDS", "cluster_bootstrap", "paired_interval", "seed_interval"]

MIN_SEEDS = 3  # fewer seeds than this give no interval over seeds
NUM_RESAMPLES = 4000
TOO_FEW = f"too few seeds for an interval (< {MIN_SEEDS})"


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t distribution with `df` degrees of freedom, found by
    bisection on its CDF, 1 - I_{df / (df + t^2)}(df / 2, 1 / 2) / 2 for t > 0 (regularised
    incomplete beta from mpmath), to 1e-10.

    Raises:
        ValueError: for p outside (0.5, 1) or df < 1.
    """
    import mpmath

    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")

    def cdf(t: float) -> float:
        return 1 - 0.5 * float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))

    low, high = 0.0, 1.0
    while cdf(high) < p:
        high *= 2
    while high - low > 1e-10:
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def cluster_bootstrap(
    groups: Sequence[Sequence[float] | np.ndarray],
    *,
    seed: int = 0,
    num_resamples: int = NUM_RESAMPLES,
) -> tuple[float, float]:
    """95% percentile interval of the mean of per-group means, by a two-stage bootstrap: each
    resample draws len(groups) groups with replacement, then within each drawn group as many
    items as it has, with replacement. The bounds lie within [min, max] of the values.

    Draws, in order, from `numpy.random.default_rng(seed)`: integers(0, G, (R, G)) for the
    groups, then random((R, G, max group size)) for the items (item = floor(u * size)).

    Shapes: groups = G sequences of floats (sizes may differ). Raises ValueError when there is
    no group or a group is empty.
    """
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError(
            f"cluster_bootstrap needs >= 1 non-empty group; sizes {[len(g) for g in groups]}"
        )
    sizes = np.array([len(g) for g in groups])
    width = int(sizes.max())
    padded = np.zeros((len(groups), width))
    for i, g in enumerate(groups):
        padded[i, : len(g)] = np.asarray(g, dtype=float)
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, len(groups), size=(num_resamples, len(groups)))
    u = rng.random((num_resamples, len(groups), width))
    n = sizes[drawn]
    items = (u * n[..., None]).astype(np.int64)
    valid = np.arange(width) < n[..., None]
    values = np.where(valid, padded[drawn[..., None], items], 0.0)
    means = (values.sum(axis=-1) / n).mean(axis=-1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def seed_interval(values: Sequence[float], items: Sequence[Sequence[bool]] | None) -> dict:
    """mean (of `values`, one per seed), ci_low, ci_high (95%) and interval (the method, or why
    there is none). `items`: per seed, the per-item correctness behind that seed's value (an
    accuracy), or None for a metric without per-item values."""
    n = len(values)
    mean = sum(values) / n if n else math.nan
    out = {"mean": mean, "ci_low": math.nan, "ci_high": math.nan}
    if n == 0:
        return {**out, "interval": "no finished seed"}
    if items is not None and len(items) == n and all(len(i) for i in items):
        if n >= MIN_SEEDS:
            low, high = cluster_bootstrap([np.asarray(i, dtype=float) for i in items])
            return {
                **out,
                "ci_low": low,
                "ci_high": high,
                "interval": "cluster bootstrap, seeds x items",
            }
        pooled = [bool(v) for i in items for v in i]
        low, high = wilson_interval(sum(pooled), len(pooled))
        return {
            **out,
            "ci_low": low,
            "ci_high": high,
            "interval": f"item-level Wilson over {len(pooled)} items ({TOO_FEW} over seeds)",
        }
    if n < MIN_SEEDS:
        return {**out, "interval": TOO_FEW}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return {**out, "ci_low": mean - half, "ci_high": mean + half, "interval": "t over seeds"}


def paired_interval(mine: Sequence[Sequence[bool]], theirs: Sequence[Sequence[bool]]) -> dict:
    """diff (mean over seeds of this arm's accuracy minus the baseline's on the same items),
    diff_ci_low, diff_ci_high (95%), paired_items and diff_interval (the method). `mine` and
    `theirs`: per seed, per-item correctness, item for item (equal lengths; ValueError else)."""
    if len(mine) != len(theirs) or any(len(a) != len(b) for a, b in zip(mine, theirs)):
        raise ValueError("paired_interval needs the same items per seed in both arms")
    diffs = [np.asarray(a, dtype=float) - np.asarray(b, dtype=float) for a, b in zip(mine, theirs)]
    out = {"diff": float(np.mean([d.mean() for d in diffs])), "paired_items": sum(map(len, diffs))}
    if len(diffs) >= MIN_SEEDS:
        low, high = cluster_bootstrap(diffs)
        return {
            **out,
            "diff_ci_low": low,
            "diff_ci_high": high,
            "diff_interval": "cluster bootstrap, seeds x items",
        }
    d = paired_bootstrap_diff([v for a in mine for v in a], [v for b in theirs for v in b])
    return {
        **out,
        "diff_ci_low": d["ci_low"],
        "diff_ci_high": d["ci_high"],
        "diff_interval": f"item-level paired bootstrap ({TOO_FEW} over seeds)",
    }
