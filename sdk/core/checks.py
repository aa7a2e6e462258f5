"""Argument and field checks: one checker of "a number of the right kind in a range"
(`check_number`, and `check_fields` for the fields of a dataclass), so a bad value fails where
it is given (a config's or a settings object's `__post_init__`, a function's arguments) with
one message that names the field, shows the value and says what is allowed:

    Config.optim.lr=nan; must be a finite number > 0
    SandboxLimits.memory_mb=8; must be an integer in [16, 1048576]

The kinds: an integer (an `int`, not a bool, not a float such as 2.0) or a finite number
(an `int` or a `float`, not a bool, neither NaN nor infinite). A value of the wrong kind raises
`FieldTypeError`, which is both a TypeError and a ValueError (callers that catch either keep
working); a number outside its range raises ValueError. `check_int`, `require_int`,
`require_positive` and `require_finite` are the common cases of the one checker.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Config:
    ...     steps: int = 0
    ...     lr: float = float("inf")
    ...     top_p: object = "1"
    >>> require_int(Config(), ("steps",), minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: Config.steps=0; must be an integer >= 1
    >>> require_positive(Config(), ("lr",))
    Traceback (most recent call last):
    ...
    ValueError: Config.lr=inf; must be a finite number > 0
    >>> check_fields(Config(), ("top_p",), above=0, high=1)
    Traceback (most recent call last):
    ...
    posttrain.core.checks.FieldTypeError: Config.top_p='1'; must be a finite number in (0, 1]
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

__all__ = [
    "FieldTypeError",
    "check_number",
    "check_fields",
    "fail",
    "check_int",
    "require_int",
    "require_positive",
    "require_finite",
    "require_folder",
]

_SHOWN_CHARS = 80
"""Longest value shown in a message (a longer repr is cut, with how long it was)."""


class FieldTypeError(TypeError, ValueError):
    """A value of the wrong kind for its field or argument (a str or a bool where a number
    belongs, a float where an integer does). Both a TypeError and a ValueError."""


def _shown(value: Any) -> str:
    """`repr(value)`, cut to `_SHOWN_CHARS` characters (an int too long for `repr`, or an
    object whose repr raises, is named by its type)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - an int past Python's digit limit, a broken __repr__
        size = f" of {value.bit_length()} bits" if isinstance(value, int) else ""
        return f"<{type(value).__name__}{size}>"
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[: _SHOWN_CHARS - 20]}... ({len(text):,} characters)"


def fail(name: str, value: Any, must: str, error: type[ValueError] = ValueError) -> ValueError:
    """The one error of a bad field or argument: `name=value; must be <must>` (`name` may be
    dotted: Config.optim.lr)."""
    return error(f"{name}={_shown(value)}; must be {must}")


def _allowed(
    integer: bool,
    low: float | None,
    high: float | None,
    above: float | None,
    optional: bool,
    note: str,
) -> str:
    """What `check_number` allows, in words: `an integer in [16, 1048576] or None (note)`."""
    kind = "an integer" if integer else "a finite number"
    start = ("(", above) if above is not None else ("[", low) if low is not None else None
    if start is not None and high is not None:
        words = f"{kind} in {start[0]}{start[1]}, {high}]"
    elif start is not None:
        words = f"{kind} {'>' if above is not None else '>='} {start[1]}"
    elif high is not None:
        words = f"{kind} <= {high}"
    else:
        words = kind
    return words + " or None" * optional + (f" ({note})" if note else "")


def check_number(
    name: str,
    value: Any,
    *,
    integer: bool = False,
    low: float | None = None,
    high: float | None = None,
    above: float | None = None,
    optional: bool = False,
    note: str = "",
) -> None:
    """Raise unless `value` is a number of the right kind in its range (or None if `optional`).

    Args:
        name: what the message calls it (`Config.optim.lr`, `SandboxLimits.cpu_s`, `timeout_s`).
        value: the value to check.
        integer: True: an `int`; False: an `int` or `float` that is finite. Bools are refused.
        low: smallest allowed value (inclusive); None or -inf: no lower bound.
        high: largest allowed value (inclusive); None or inf: no upper bound.
        above: an exclusive lower bound instead of `low` (`above=0`: "> 0").
        optional: None is allowed too.
        note: words added in brackets after the range (a unit, what None means).

    Raises:
        FieldTypeError: (a TypeError and a ValueError) for a value of the wrong kind.
        ValueError: for NaN, an infinity, or a number outside the range. Both name the field,
            show the value and say what is allowed.
    """
    low = None if low is not None and low == -math.inf else low
    high = None if high is not None and high == math.inf else high
    if low is not None and above is not None:
        raise ValueError("check_number takes low= or above=, not both")
    if optional and value is None:
        return
    is_number = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not is_number:
        raise fail(name, value, _allowed(integer, low, high, above, optional, note), FieldTypeError)
    # an int is finite (and math.isfinite of one past the float range raises OverflowError)
    if not (
        (isinstance(value, int) or math.isfinite(value))
        and (low is None or value >= low)
        and (above is None or value > above)
        and (high is None or value <= high)
    ):
        raise fail(name, value, _allowed(integer, low, high, above, optional, note))


def check_fields(obj: Any, names: Iterable[str], *, at: str | None = None, **bounds: Any) -> None:
    """`check_number` on each field of `obj` in `names`, named `at.field` (`at` defaults to
    the class name: `ServerSettings.max_queue`); `bounds` are `check_number`'s keywords."""
    at = type(obj).__name__ if at is None else at
    for name in names:
        check_number(f"{at}.{name}", getattr(obj, name), **bounds)


def check_int(name: str, value: Any, *, minimum: int, optional: bool = False) -> None:
    """Raise ValueError unless `value` is an int (not a bool) >= `minimum` (or None if
    `optional`)."""
    check_number(name, value, integer=True, low=minimum, optional=optional)


def require_int(cfg: Any, names: Iterable[str], *, minimum: int) -> None:
    """Each field is an int (not a bool) >= `minimum`."""
    check_fields(cfg, names, integer=True, low=minimum)


def require_positive(cfg: Any, names: Iterable[str], *, optional: bool = False) -> None:
    """Each field is a finite number > 0 (or None when `optional`)."""
    check_fields(cfg, names, above=0, optional=optional)


def require_finite(cfg: Any, names: Iterable[str]) -> None:
    """Each field is a finite number."""
    check_fields(cfg, names)


def require_folder(cfg: Any, name: str) -> None:
    """The field is None or an existing folder (e.g. a Hugging Face policy folder)."""
    value = getattr(cfg, name)
    if value is not None and not Path(value).is_dir():
        raise fail(
            f"{type(cfg).__name__}.{name}", value, "None or an existing folder (a saved policy)"
        )
