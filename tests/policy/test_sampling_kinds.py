"""The nucleus (top-p) rule as a kind: hand-built boundary cases, an exact-arithmetic reference
and transformers' `TopPLogitsWarper`, on float32 and float64 logits, batched.

The rule (`posttrain.policy.sampling.nucleus_removed`): keep the smallest prefix of the tokens
sorted by probability (most likely first, ties lower index first) whose mass reaches p; a prefix
whose float32 mass is short of p by rounding only counts as reaching p.

The reference below works on the float32 probabilities as exact fractions: the kept prefix is the
smallest k with sum_{i<k} q_i >= p - tol. With tol = 0 and with tol = TOL (a bound on float32
summation error over V terms) it gives k_hi >= k_lo; a row whose boundary lies within rounding (k_lo
!= k_hi) accepts either, every other row must match exactly.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from transformers.generation.logits_process import TopPLogitsWarper

from posttrain.policy.sampling import nucleus_removed, sampling_logprobs


def _kept(logits: torch.Tensor, top_p: float) -> list[bool]:
    return torch.isfinite(sampling_logprobs(logits, top_p=top_p)).tolist()


def _reference_kept_counts(probs_V: torch.Tensor, top_p: float) -> tuple[int, int, list[int]]:
    """(k_lo, k_hi, order): exact-fraction prefix lengths with and without the rounding
    tolerance, and the stable descending order of the tokens."""
    values = probs_V.tolist()
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    tol = Fraction(4 * len(values), 2**24)
    target = Fraction(top_p)

    def smallest_prefix(threshold: Fraction) -> int:
        mass = Fraction(0)
        for k, i in enumerate(order, start=1):
            mass += Fraction(values[i])
            if mass >= threshold:
                return k
        return len(order)

    return smallest_prefix(target - tol), smallest_prefix(target), order


def test_hand_built_boundaries():
    """probs [0.5, 0.3, 0.2]: p = 0.8 keeps {0.5, 0.3} (log(.5/.8) = -0.470004, log(.3/.8) =
    -0.980829); p = 0.5 keeps {0.5}; p = float32(0.3) + float32(0.5) = 0.800000011920929 keeps
    {0.5, 0.3} (their float32 mass is that exact value). probs [0.3, 0.1, 0.1, 0.5], p = 0.8
    keeps {0.5, 0.3}: 0.5 + 0.3 reaches 0.8 exactly."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    at_08 = sampling_logprobs(logits, top_p=0.8)
    assert at_08[:2].tolist() == pytest.approx([-0.470004, -0.980829], abs=1e-6)
    assert at_08[2].item() == -math.inf
    assert _kept(logits, 0.5) == [True, False, False]
    p32 = float(torch.tensor(0.3) + torch.tensor(0.5))
    assert p32 == 0.800000011920929
    assert _kept(logits, p32) == [True, True, False]
    assert _kept(logits, 0.81) == [True, True, True]
    assert _kept(torch.tensor([0.3, 0.1, 0.1, 0.5]).log(), 0.8) == [True, False, False, True]
    assert _kept(torch.tensor([0.3, 0.1, 0.1, 0.5]).log(), 0.9) == [True, True, False, True]


def test_ties_single_token_p_one_and_tiny_p():
    """Ties at the boundary keep the lower index; p = 1 keeps every token, even one whose
    probability underflows to 0 in float32; a single token is always kept with log-prob 0; a
    tiny p keeps only the most likely token."""
    ties = torch.tensor([0.4, 0.3, 0.3]).log()
    assert _kept(ties, 0.5) == [True, True, False]  # 0.4 < 0.5 <= 0.4 + 0.3
    assert _kept(ties, 0.75) == [True, True, True]
    equal = torch.zeros(4)
    assert _kept(equal, 0.5) == [True, True, False, False]
    assert _kept(equal, 0.3) == [True, True, False, False]  # 0.25 < 0.3
    assert _kept(equal, 0.25) == [True, False, False, False]
    underflow = torch.tensor([0.0, -200.0])
    assert torch.softmax(underflow, -1)[1].item() == 0.0
    assert sampling_logprobs(underflow, top_p=1.0).tolist() == pytest.approx([0.0, -200.0])
    for p in (1e-9, 0.5, 1.0):
        assert sampling_logprobs(torch.tensor([3.0]), top_p=p).tolist() == [0.0]
    assert _kept(torch.tensor([1.0, 2.0, 0.5]), 1e-9) == [False, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_logits_match_exact_reference(dtype):
    """200 rows of random logits (varied scales, so masses near p arise), several p: the kept
    set is the reference's prefix; rows on a rounding boundary accept either neighbour."""
    gen = torch.Generator().manual_seed(0)
    B, V = 200, 17
    scales_B1 = torch.rand(B, 1, generator=gen, dtype=torch.float64) * 6
    logits_BV = (torch.randn(B, V, generator=gen, dtype=torch.float64) * scales_B1).to(dtype)
    for top_p in (0.1, 0.5, 0.8, 0.9, 0.95, 0.999):
        kept_BV = torch.isfinite(sampling_logprobs(logits_BV, top_p=top_p))
        probs_BV = torch.softmax(logits_BV.float(), dim=-1)  # what the function works on
        exact_rows = 0
        for b in range(B):
            k_lo, k_hi, order = _reference_kept_counts(probs_BV[b], top_p)
            got = kept_BV[b].tolist()
            k = sum(got)
            assert all(got[i] for i in order[:k]) and not any(got[i] for i in order[k:]), (
                f"row {b}: kept set is not a prefix of the sorted order"
            )
            assert k_lo <= k <= k_hi, (b, top_p, k_lo, k, k_hi)
            exact_rows += k_lo == k_hi
        assert exact_rows >= B - 2  # boundaries within rounding are rare on random logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_logits_match_transformers_warper(dtype):
    """Same kept set as transformers' `TopPLogitsWarper` on the same logits, row by row (no
    ties in random logits); float64 logits are compared where the warper's own float64
    masses are not within float32 rounding of the boundary."""
    gen = torch.Generator().manual_seed(1)
    B, V = 64, 50
    scales_B1 = torch.rand(B, 1, generator=gen, dtype=torch.float64) * 5 + 0.1
    logits_BV = (torch.randn(B, V, generator=gen, dtype=torch.float64) * scales_B1).to(dtype)
    for top_p in (0.3, 0.7, 0.9, 0.99):
        ours_BV = nucleus_removed(logits_BV.float(), top_p)
        theirs_BV = torch.isinf(TopPLogitsWarper(top_p)(None, logits_BV.clone()))
        if dtype == torch.float32:
            assert torch.equal(ours_BV, theirs_BV)
            continue
        sorted_BV = torch.sort(torch.softmax(logits_BV, -1), -1).values.cumsum(-1)
        near_B = ((sorted_BV - (1 - top_p)).abs() < 1e-5).any(-1)
        assert int(near_B.sum()) <= 3
        assert torch.equal(ours_BV[~near_B], theirs_BV[~near_B])


def test_top_k_then_top_p_and_temperature_rows_independent():
    """Top-k removes first (top-k -inf tokens never come back), temperature applies before the
    nucleus, and each row of a batch is filtered on its own: row 1 = row 0 permuted."""
    logits_V = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    perm = torch.tensor([2, 0, 3, 1])
    both = sampling_logprobs(torch.stack([logits_V, logits_V[perm]]), top_k=3, top_p=0.9)
    # top-k keeps [.5, .3, .15] -> renormalised [.526, .316, .158]: .842 < .9, all three kept
    assert torch.isfinite(both[0]).tolist() == [True, True, True, False]
    assert torch.isfinite(both[1]).tolist() == torch.isfinite(both[0][perm]).tolist()
    assert torch.allclose(both[1], both[0][perm], atol=1e-6)
    # T = 0.5 squares and renormalises: [.25, .09, .0225, .0025]/.365 = [.685, .247, ...]
    assert (
        _kept(logits_V / 0.5, 0.9)
        == torch.isfinite(sampling_logprobs(logits_V, temperature=0.5, top_p=0.9)).tolist()
        == [True, True, False, False]
    )


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), True, "0.9", None])
def test_bad_top_p_is_named(bad):
    with pytest.raises(ValueError, match="top_p="):
        nucleus_removed(torch.zeros(3), bad)
    with pytest.raises(ValueError, match="top_p="):
        sampling_logprobs(torch.zeros(3), top_p=bad)
