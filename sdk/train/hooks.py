"""Small pieces of the training loop that every trainer shares: evaluation that leaves the run
untouched, seeding, whether a data source can be checkpointed and is this rank's shard, and
whether a checkpoint can continue a trainer.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> evaluate_model(model, lambda m: {"weight_sum": m.weight.sum()}).keys()
    dict_keys(['eval/weight_sum'])
    >>> model.training
    True
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from posttrain.core.checkpoint import capture_rng_state, restore_rng_state

__all__ = ["evaluate_model", "seed_all", "has_state", "stable_repr"]


def evaluate_model(
    model: nn.Module, eval_fn: Callable[[nn.Module], Mapping[str, float]]
) -> dict[str, float]:
    """Run `eval_fn(model)` in eval mode under `torch.no_grad()`; training mode and the RNG
    states are restored afterwards, so evaluation does not change the training run.

    Returns:
        {"eval/<name>": value} (a name that already starts with "eval/" is kept as it is).

    Raises:
        ValueError: if `eval_fn` returns something other than a mapping of names to numbers.
    """
    was_training = model.training
    rng_state = capture_rng_state()
    model.eval()
    try:
        with torch.no_grad():
            result = eval_fn(model)
    finally:
        model.train(was_training)
        restore_rng_state(rng_state)
    if not isinstance(result, Mapping):
        raise ValueError(
            f"eval_fn must return a dict of name -> number, got {type(result).__name__}"
        )
    out = {}
    for key, value in result.items():
        try:
            value = float(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"eval_fn returned {key!r}={value!r}; values must be numbers") from exc
        out[key if str(key).startswith("eval/") else f"eval/{key}"] = value
    return out


def seed_all(seed: int) -> None:
    """Seed Python's `random`, numpy and torch's global RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def has_state(data: Any) -> bool:
    """Whether `data` can be checkpointed (has `state_dict()` and `load_state_dict()`)."""
    return callable(getattr(data, "state_dict", None)) and callable(
        getattr(data, "load_state_dict", None)
    )


def stable_repr(obj: Any) -> str:
    """`repr(obj)`, or its class's qualified name when the repr holds a memory address (the
    default object repr), so that the text compares equal across processes (resume checks)."""
    text = repr(obj)
    return type(obj).__qualname__ if " at 0x" in text else text


def check_resumable(
    path: Path,
    train_state: Mapping[str, Any],
    meta: Mapping[str, Any],
    *,
    fixed_settings: Mapping[str, Any],
    has_lr_scheduler: bool,
) -> None:
    """Check that the checkpoint at `path` (its `train_state` and `meta`) can continue a trainer
    with `fixed_settings` (its `_fixed_settings()`), before anything is loaded.

    Raises:
        ValueError: naming the setting saved in `meta` with another value, or when the
            checkpoint was saved with an lr_scheduler and the trainer has none, or the reverse.
    """
    for name, value in fixed_settings.items():
        if name in meta and meta[name] != value:
            raise ValueError(
                f"{path} was saved with {name}={meta[name]!r}; this trainer has "
                f"{name}={value!r}, which cannot change on resume (start a new "
                "run_dir, or resume with the same setting)"
            )
    if (train_state["lr_scheduler"] is None) == has_lr_scheduler:
        was = "without" if train_state["lr_scheduler"] is None else "with"
        has = "one" if has_lr_scheduler else "none"
        raise ValueError(f"{path} was saved {was} an lr_scheduler; this trainer has {has}")


def check_data_shard(data: Any, expected: tuple[int, int], plan: str = "") -> None:
    """Check that `data` (a loader with `rank` and `world_size`, or without: any shard) is the
    shard of data-parallel rank `expected[0]` of `expected[1]`; `plan` names the split in the
    message ("" without one, `Runtime.describe()`).

    Raises:
        ValueError: naming both shardings and how to build the loader for this rank.
    """
    shard = (getattr(data, "rank", expected[0]), getattr(data, "world_size", expected[1]))
    if shard != expected:
        raise ValueError(
            f"data is sharded as rank {shard[0]} of world_size={shard[1]}, but "
            f"this process is rank {expected[0]} of world_size={expected[1]} "
            f"among the data-parallel ranks{plan}; build the "
            "loader after initialising torch.distributed (or pass it rank= and "
            "world_size=: runtime.data_rank and runtime.data_size)"
        )
