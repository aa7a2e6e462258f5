"""The checks the preference losses (`posttrain.preference.losses`) run on their inputs: tensors
of one 1-D shape [B] (finite where they are log-probabilities), response lengths >= 0 given both
or neither, beta > 0 and label smoothing in [0, 0.5). Each raises ValueError (TypeError for a
non-tensor) naming the argument and what it must be.

Notation: B = preference pairs (KTO: rows); `logps_B` are summed response log-probabilities and
`lengths_B` response token counts.

    >>> import torch
    >>> check_pairs(chosen_B=torch.zeros(2), rejected_B=torch.zeros(3))
    Traceback (most recent call last):
    ...
    ValueError: expected 1-D tensors of one shape [B]; got {'chosen_B': (2,), 'rejected_B': (3,)}
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["check_pairs", "check_beta", "check_label_smoothing", "check_lengths"]


def check_pairs(*, finite: bool = True, **tensors: Tensor) -> None:
    """The named inputs are tensors of one 1-D shape and, with `finite`, hold no NaN or inf
    (one host sync for all of them).

    Raises:
        TypeError: for an input that is not a tensor. ValueError: for shapes that differ or are
            not 1-D, or (with `finite`) NaN or inf, naming the inputs.
    """
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} is a {type(t).__name__}; expected a 1-D torch.Tensor")
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"expected 1-D tensors of one shape [B]; got {shapes}")
    if not finite:
        return
    device = next(iter(tensors.values())).device
    finite_flags = torch.stack([torch.isfinite(t).all().to(device) for t in tensors.values()])
    if not bool(finite_flags.all()):
        bad = [name for name, ok in zip(tensors, finite_flags.tolist()) if not ok]
        raise ValueError(
            f"{', '.join(bad)} must be finite; got NaN or inf (a log-prob of -inf "
            "is a probability of 0, which these losses cannot train on)"
        )


def check_beta(beta: float) -> None:
    """Raises ValueError unless `beta` is a finite number > 0 (a bool is not a number here)."""
    if (
        isinstance(beta, bool)
        or not isinstance(beta, (int, float))
        or not (math.isfinite(beta) and beta > 0)
    ):
        raise ValueError(f"beta={beta!r}; must be a finite number > 0")


def check_label_smoothing(label_smoothing: float) -> None:
    """Raises ValueError unless `label_smoothing` is a number in [0, 0.5)."""
    if not (isinstance(label_smoothing, (int, float)) and 0 <= label_smoothing < 0.5):
        raise ValueError(
            f"label_smoothing={label_smoothing!r}; must be in [0, 0.5) (the "
            "probability that a preference label is flipped)"
        )


def check_lengths(
    logps_B: Tensor, chosen_lengths_B: Tensor | None, rejected_lengths_B: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Both lengths are given, shaped like `logps_B`, and >= 0; returns them. Called when at
    least one is given.

    Raises:
        ValueError: for one length given without the other, a shape other than `logps_B`'s, or
            a negative length. TypeError: for a length that is not a tensor.
    """
    if chosen_lengths_B is None or rejected_lengths_B is None:
        raise ValueError("pass both chosen_lengths_B and rejected_lengths_B, or neither")
    check_pairs(
        finite=False,
        logps_B=logps_B,
        chosen_lengths_B=chosen_lengths_B,
        rejected_lengths_B=rejected_lengths_B,
    )
    if not bool(((chosen_lengths_B >= 0) & (rejected_lengths_B >= 0)).all()):
        raise ValueError(
            f"response lengths must be >= 0; got chosen_lengths_B "
            f"{chosen_lengths_B.tolist()}, rejected_lengths_B "
            f"{rejected_lengths_B.tolist()}"
        )
    return chosen_lengths_B, rejected_lengths_B
