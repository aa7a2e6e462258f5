"""The checks of one config field, shared by every recipe `Config` and its sections
(`posttrain.workflows.config`): each raises `fail(name, value, must)`, the one error of a bad
field, `Config.optim.lr=nan; must be a finite number > 0`, with the dotted name `at.field`.

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

from posttrain.core.checks import check_int

__all__ = ["SEED_MAX", "fail", "ints", "positive", "finite", "seeds", "flags", "folder_path",
           "run_fields", "choice"]

SEED_MAX = 2**32 - 1
"""Seeds are integers in [0, SEED_MAX] (numpy's and reasoning-gym's seeding accept those)."""


def fail(name: str, value: Any, must: str) -> ValueError:
    """The one error of a bad field: `name=value; must be ...` (`name` dotted: Config.optim.lr)."""
    return ValueError(f"{name}={value!r}; must be {must}")


def ints(cfg: Any, at: str, names: Iterable[str], *, minimum: int,
         optional: bool = False) -> None:
    """Each field of `cfg` in `names` is an int >= `minimum` (None too when `optional`)."""
    for name in names:
        check_int(f"{at}.{name}", getattr(cfg, name), minimum=minimum, optional=optional)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive(cfg: Any, at: str, names: Iterable[str], *, optional: bool = False) -> None:
    """Each field is a finite number > 0 (or None when `optional`)."""
    for name in names:
        value = getattr(cfg, name)
        if not ((optional and value is None) or (_number(value) and value > 0)):
            raise fail(f"{at}.{name}", value, "a finite number > 0" + " or None" * optional)


def finite(cfg: Any, at: str, names: Iterable[str], *, low: float = -math.inf,
           high: float = math.inf) -> None:
    """Each field is a finite number in [low, high]."""
    for name in names:
        value = getattr(cfg, name)
        if not (_number(value) and low <= value <= high):
            bounds = "" if (low, high) == (-math.inf, math.inf) else f" in [{low}, {high}]"
            raise fail(f"{at}.{name}", value, "a finite number" + bounds)


def seeds(cfg: Any, at: str, names: Iterable[str]) -> None:
    """Each field is a seed: an int in [0, SEED_MAX]."""
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEED_MAX:
            raise fail(f"{at}.{name}", value, f"an integer in [0, {SEED_MAX}] (a seed)")


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
