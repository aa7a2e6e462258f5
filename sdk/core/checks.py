"""Argument checks: `check_int` for a function's keyword arguments, and `require_*` for recipe
`Config` dataclasses, so a bad value fails in `__post_init__` with the field's name and what is
allowed, before a run spends minutes on an earlier stage.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Config:
    ...     steps: int = 0
    ...     lr: float = float("inf")
    >>> require_int(Config(), ("steps",), minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: Config.steps=0; must be an integer >= 1
    >>> require_positive(Config(), ("lr",))
    Traceback (most recent call last):
    ...
    ValueError: Config.lr=inf; must be a finite number > 0
    >>> check_int("group_size", 0, minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: group_size=0; must be an integer >= 1
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["check_int", "require_int", "require_positive", "require_finite", "require_folder"]


def check_int(name: str, value: Any, *, minimum: int, optional: bool = False) -> None:
    """Raise ValueError unless `value` is an int (not a bool) >= `minimum` (or None if `optional`)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}; must be an integer >= {minimum}"
                         + (" or None" if optional else ""))


def _fail(cfg: Any, name: str, must: str) -> ValueError:
    return ValueError(f"{type(cfg).__name__}.{name}={getattr(cfg, name)!r}; must be {must}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_int(cfg: Any, names: Iterable[str], *, minimum: int) -> None:
    """Each field is an int (not a bool) >= `minimum`."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise _fail(cfg, name, f"an integer >= {minimum}")


def require_positive(cfg: Any, names: Iterable[str], *, optional: bool = False) -> None:
    """Each field is a finite number > 0 (or None when `optional`)."""
    for name in names:
        value = getattr(cfg, name)
        if optional and value is None:
            continue
        if not (_number(value) and math.isfinite(value) and value > 0):
            raise _fail(cfg, name, "a finite number > 0" + (" or None" if optional else ""))


def require_finite(cfg: Any, names: Iterable[str]) -> None:
    """Each field is a finite number."""
    for name in names:
        value = getattr(cfg, name)
        if not (_number(value) and math.isfinite(value)):
            raise _fail(cfg, name, "a finite number")


def require_folder(cfg: Any, name: str) -> None:
    """The field is None or an existing folder (e.g. a Hugging Face policy folder)."""
    value = getattr(cfg, name)
    if value is not None and not Path(value).is_dir():
        raise _fail(cfg, name, "None or an existing folder (a saved policy)")
