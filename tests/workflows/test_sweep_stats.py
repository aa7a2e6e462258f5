"""Sweep intervals that respect the metric's range (`posttrain.workflows.sweep_stats`): each
interval is pinned against an independent computation (a loop-by-loop bootstrap on the same
random draws, Wilson's bounds as the roots of its quadratic, Student-t from published tables)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from posttrain.workflows.sweep_stats import (
    TOO_FEW,
    cluster_bootstrap,
    paired_interval,
    seed_interval,
)


def _brute_cluster_bootstrap(groups, seed, num_resamples):
    """The two-stage bootstrap one resample, one drawn seed, one item at a time."""
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, len(groups), size=(num_resamples, len(groups)))
    u = rng.random((num_resamples, len(groups), max(len(g) for g in groups)))
    stats = []
    for r in range(num_resamples):
        cluster_means = []
        for j in range(len(groups)):
            g = groups[drawn[r, j]]
            picks = [g[int(u[r, j, k] * len(g))] for k in range(len(g))]
            cluster_means.append(sum(picks) / len(picks))
        stats.append(sum(cluster_means) / len(cluster_means))
    stats.sort()
    return tuple(np.percentile(stats, [2.5, 97.5]))


def _wilson_by_roots(k, n, z=1.959964):
    """Wilson's bounds: the p with (k/n - p)^2 = z^2 p (1 - p) / n."""
    ph = k / n
    a, b, c = 1 + z * z / n, -(2 * ph + z * z / n), ph * ph
    return tuple(sorted(np.roots([a, b, c]).real))


def test_cluster_bootstrap_matches_a_loop_over_the_same_draws():
    groups = [[1, 0, 1, 1], [0, 0, 1], [1, 1, 1, 1, 0], [0, 1]]  # sizes differ
    got = cluster_bootstrap(groups, seed=3, num_resamples=300)
    assert got == pytest.approx(_brute_cluster_bootstrap(groups, 3, 300), abs=1e-12)


def test_two_seeds_of_an_accuracy_give_the_item_level_wilson_interval_inside_0_1():
    # The t-interval over 2 seeds (0.25, 0.5) was 0.375 +- 12.706 * 0.125 = [-1.21, 1.96].
    items = [[True, False, False, False], [True, True, False, False]]
    got = seed_interval([0.25, 0.5], items)
    assert got["mean"] == 0.375
    assert (got["ci_low"], got["ci_high"]) == pytest.approx(_wilson_by_roots(3, 8), abs=1e-9)
    assert 0 <= got["ci_low"] < got["ci_high"] <= 1
    assert got["interval"].startswith("item-level Wilson over 8 items")
    one = seed_interval([1.0], [[True, True]])  # all correct: the bound is 1, not beyond
    assert one["ci_high"] == 1.0 and one["ci_low"] == pytest.approx(_wilson_by_roots(2, 2)[0])


@pytest.mark.parametrize(
    "items",
    [
        [[1, 1, 1], [1, 1, 1], [1, 1, 1]],
        [[0, 0], [0, 1], [1, 1], [0, 0, 0]],
        [[1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]],
    ],
)
def test_three_or_more_seeds_of_an_accuracy_get_the_cluster_bootstrap_within_the_range(items):
    values = [sum(i) / len(i) for i in items]
    got = seed_interval(values, items)
    assert got["interval"] == "cluster bootstrap, seeds x items"
    assert (got["ci_low"], got["ci_high"]) == pytest.approx(
        _brute_cluster_bootstrap(items, 0, 4000), abs=1e-12
    )
    assert min(min(i) for i in items) <= got["ci_low"] <= got["ci_high"] <= 1


def test_an_unbounded_metric_gets_the_t_interval_from_three_seeds_and_none_below():
    # values 1, 2, 6: mean 3, sd sqrt(7), t_{0.975,2} = 4.303 (NIST/SEMATECH table 1.3.6.7.2)
    got = seed_interval([1.0, 2.0, 6.0], None)
    assert got["interval"] == "t over seeds"
    half = 4.302653 * math.sqrt(7) / math.sqrt(3)
    assert (got["ci_low"], got["ci_high"]) == pytest.approx((3 - half, 3 + half), rel=1e-5)
    for values in ([1.0, 2.0], [5.0]):
        few = seed_interval(values, None)
        assert math.isnan(few["ci_low"]) and math.isnan(few["ci_high"])
        assert few["interval"] == TOO_FEW and few["mean"] == sum(values) / len(values)
    assert seed_interval([], None)["interval"] == "no finished seed"


def test_paired_differences_cluster_by_seed_not_pooled():
    mine = [[1, 1, 0, 1], [1, 0, 0, 1], [1, 1, 1, 1]]
    theirs = [[0, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 1]]
    got = paired_interval(mine, theirs)
    diffs = [np.subtract(a, b).astype(float) for a, b in zip(mine, theirs)]
    assert got["diff"] == pytest.approx((2 / 4 + 1 / 4 + 1 / 4) / 3)
    assert (got["diff_ci_low"], got["diff_ci_high"]) == pytest.approx(
        _brute_cluster_bootstrap(diffs, 0, 4000), abs=1e-12
    )
    assert got["paired_items"] == 12 and got["diff_interval"] == "cluster bootstrap, seeds x items"
    assert -1 <= got["diff_ci_low"] <= got["diff_ci_high"] <= 1
    with pytest.raises(ValueError, match="same items per seed"):
        paired_interval([[1, 0]], [[1]])
    with pytest.raises(ValueError, match="non-empty group"):
        cluster_bootstrap([[1], []])
