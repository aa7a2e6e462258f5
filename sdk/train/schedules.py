"""Learning-rate schedules for the trainers: linear warmup then cosine decay to a floor.

Example:
    >>> import torch
    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    >>> sched = warmup_cosine_schedule(opt, warmup_steps=2, total_steps=4)
    >>> [round(WarmupCosine(2, 4)(k), 3) for k in range(6)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
"""

from __future__ import annotations

import math

import torch

__all__ = ["WarmupCosine", "warmup_cosine_schedule"]


class WarmupCosine:
    """Learning-rate multiplier: linear warmup from 0, then half a cosine down to
    `min_lr_ratio`, constant after `total_steps`.

        step < warmup:           step / warmup
        warmup <= step < total:  r + (1 - r) * 0.5 * (1 + cos(pi * p)),
                                 p = (step - warmup) / (total - warmup)
        step >= total:           r

    With r = 0 and step <= total this is torchtune's `get_cosine_schedule_with_warmup` (from
    transformers' `get_cosine_schedule_with_warmup`), which has no floor and climbs back up after
    `total_steps`. A callable object rather than a closure, so the scheduler pickles.
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> None:
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / self.warmup_steps
        if step >= self.total_steps:
            return self.min_lr_ratio
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` applying `WarmupCosine` to every parameter group's lr.

    Step k of training (k = 0, 1, ...) runs with `lr * WarmupCosine(k)`: the first step of a
    warmup runs with lr 0, as in transformers and torchtune. The schedule's numbers are part of
    the scheduler's `state_dict()`, so a resumed run keeps the schedule it was saved with.

    Args:
        optimizer: its groups' current `lr` is the peak.
        warmup_steps: steps of linear warmup (0 for none); at most `total_steps`.
        total_steps: the step at which the cosine reaches `min_lr_ratio * lr`.
        min_lr_ratio: floor of the decay, as a fraction of the peak, in [0, 1].

    Raises:
        ValueError: for out-of-range arguments.
    """
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps={total_steps!r}; must be a positive integer")
    if not isinstance(warmup_steps, int) or not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"warmup_steps={warmup_steps!r}; must be an integer in 0..total_steps ({total_steps})"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_lr_ratio!r}; must be in [0, 1]")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(warmup_steps, total_steps, float(min_lr_ratio))
    )
