"""The checks of one config field, shared by every recipe `Config` and its sections
(`posttrain.workflows.config`): each raises `fail(name, value, must)`, the one error of a bad
field, `Config.optim.lr=nan; must be a finite number > 0`, with the dotted name `at.field`.
The numeric ones are `posttrain.core.checks.check_fields` with the section's dotted name.

Example:
    >>> from types import SimpleNamespace
    >>> seeds(SimpleNamespace(seed=-1), "Config", ("seed",))
    Traceback (most recent call last):
    ...
    ValueError: Config.seed=-1; must be an integer in [0, 4294967295] (a seed)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from posttrain.core.checks import check_fields, fail

__all__ = [
    "SEED_MAX",
    "fail",
    "ints",
    "positive",
    "finite",
    "seeds",
    "flags",
    "folder_path",
    "run_fields",
    "choice",
]

SEED_MAX = 2**32 - 1
"""Seeds are integers in [0, SEED_MAX] (numpy's and reasoning-gym's seeding accept those)."""


def ints(cfg: Any, at: str, names: Iterable[str], *, minimum: int, optional: bool = False) -> None:
    """Each field of `cfg` in `names` is an int >= `minimum` (None too when `optional`)."""
    check_fields(cfg, names, at=at, integer=True, low=minimum, optional=optional)


def positive(cfg: Any, at: str, names: Iterable[str], *, optional: bool = False) -> None:
    """Each field is a finite number > 0 (or None when `optional`)."""
    check_fields(cfg, names, at=at, above=0, optional=optional)


def finite(
    cfg: Any, at: str, names: Iterable[str], *, low: float = -math.inf, high: float = math.inf
) -> None:
    """Each field is a finite number in [low, high]."""
    check_fields(cfg, names, at=at, low=low, high=high)


def seeds(cfg: Any, at: str, names: Iterable[str]) -> None:
    """Each field is a seed: an int in [0, SEED_MAX]."""
    check_fields(cfg, names, at=at, integer=True, low=0, high=SEED_MAX, note="a seed")


def flags(cfg: Any, at: str, names: Iterable[str]) -> None:
    """Each field is a bool (not 0/1, not a string)."""
    for name in names:
        if not isinstance(getattr(cfg, name), bool):
            raise fail(f"{at}.{name}", getattr(cfg, name), "true or false")


def folder_path(cfg: Any, at: str, name: str, what: str) -> None:
    """Field `name` is a non-empty path (str or Path; `what` says which folder)."""
    value = getattr(cfg, name)
    if not isinstance(value, (str, Path)) or not str(value).strip():
        raise fail(f"{at}.{name}", value, f"a non-empty folder path ({what})")


def run_fields(cfg: Any, at: str) -> None:
    """The fields every recipe has: `seed` (a seed), `out_dir` (a non-empty path), `resume`
    and `progress` (booleans)."""
    seeds(cfg, at, ("seed",))
    folder_path(cfg, at, "out_dir", "the run folder")
    flags(cfg, at, ("resume", "progress"))


def choice(name: str, value: Any, allowed: Iterable[str]) -> None:
    """`value` is one of `allowed`."""
    allowed = list(allowed)
    if value not in allowed:
        raise fail(name, value, f"one of {', '.join(map(str, allowed))}")
