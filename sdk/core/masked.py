"""Masked reductions that a masked position can never poison: `keep_selected`, `masked_sum`,
`masked_mean`, `masked_max`.

Notation: `x` = any shape; `mask` broadcasts to it; a position is selected where `mask != 0`
(a float mask's values are weights in `masked_sum` / `masked_mean`).

Padding holds anything: -inf log-probs of tokens outside the nucleus, NaN from a fully masked
attention row, 1e30 that overflows once exponentiated. Two classic ways it leaks:

* `(x * mask).sum()` with x = inf or NaN at a masked position is NaN (0 * inf = NaN);
* `torch.where(mask, f(x), 0)` is right in the forward, but its backward multiplies the zero
  gradient of the unselected branch by f'(x) there, and 0 * inf = NaN again.

So the inputs are sanitised first: `keep_selected(x, mask)` replaces the unselected positions by
0 before any arithmetic. Its gradient there is exactly 0 (torch.where routes the incoming
gradient to the selected branch only), and everything computed from it is finite wherever the
selected values are. Every masked reduction in posttrain's losses and metrics goes through these
functions; tests/rl/test_masked_kinds.py puts NaN, +-inf and 1e30 on masked positions of every
input of every registered loss, estimator and metric and checks losses, gradients and metrics
against zeros there.

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]])
    >>> mask = torch.tensor([[1, 0], [1, 0]])
    >>> float(masked_mean(x, mask)), float(masked_max(x, mask)), (x * mask).sum().isnan().item()
    (2.0, 3.0, True)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["keep_selected", "masked_sum", "masked_mean", "masked_max"]


def keep_selected(x: Tensor, mask: Tensor, fill: float = 0.0) -> Tensor:
    """`x` where `mask != 0`, `fill` elsewhere: the sanitised input of any masked computation.

    Args:
        x: any float tensor.
        mask: bool/int/float, broadcastable to `x`.
        fill: value put on the unselected positions (a finite float).

    Returns:
        A tensor shaped like `x` (broadcast with `mask`), `x`'s dtype; differentiable, with a
        gradient of exactly 0 on unselected positions.
    """
    return torch.where(mask != 0, x, torch.as_tensor(fill, dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of `x * mask` over `dim` (all dims if None), the unselected positions contributing
    exactly 0 whatever they hold.

    Args:
        x: any float tensor; mask: broadcastable to it, 0 on unselected positions.
        dim: dimension(s) reduced; None reduces all.

    Returns:
        `x`'s dtype; 0 where nothing is selected.
    """
    weighted = keep_selected(x, mask) * mask.to(x.dtype)
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """`masked_sum(x, mask, dim) / masked_sum(1, mask, dim)`, the denominator clamped at 1 so
    a slice with nothing selected gives 0 (no host sync to check it).

    Args:
        x: any float tensor; mask: broadcastable to it (0/1 or weights).
        dim: dimension(s) reduced; None reduces all.

    Returns:
        `x`'s dtype.
    """
    weights = torch.broadcast_to(mask.to(x.dtype), torch.broadcast_shapes(x.shape, mask.shape))
    count = weights.sum() if dim is None else weights.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_max(x: Tensor, mask: Tensor, empty: float = 0.0) -> Tensor:
    """Maximum of `x` over the selected positions (all dims), ignoring the unselected ones
    whatever they hold (NaN and +inf included); `empty` if nothing is selected.

    Args:
        x: any float tensor; mask: broadcastable to it.
        empty: the value returned when the mask selects nothing.

    Returns:
        A 0-dim tensor in `x`'s dtype (NaN only if a selected value is NaN).
    """
    selected = mask != 0
    best = keep_selected(x, selected, -torch.inf).max()
    return torch.where(selected.any(), best, torch.as_tensor(empty, dtype=x.dtype, device=x.device))
