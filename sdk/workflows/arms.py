"""The arms of a sweep: a grid of dotted config keys -> values becomes one `Arm` per combination,
named for its folder (`key=value` pairs, values percent-encoded so that two values never share
a name), with values that are equal as config values (1 and 1.0; never True and 1) counted once.

Example:
    >>> from posttrain.workflows import RLRunConfig
    >>> [a.name for a in arms_of_grid(RLRunConfig(), {"optim.lr": [1e-4, 2e-4]})]
    ['optim.lr=0.0001', 'optim.lr=0.0002']
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.workflows.config import override
from posttrain.workflows.recipes import config_annotation

__all__ = ["Arm", "NEEDED", "TABLE_COLUMNS", "arms_of_grid", "baseline_arm", "plain_value"]

NEEDED = ("out_dir", "seed", "resume")
"""Config fields a sweep sets itself (never grid keys)."""
TABLE_COLUMNS = ("arm", "seed", "status", "step", "metric", "value", "error", "out_dir")
"""The columns of `Sweep.table()` besides the grid keys (never grid keys either)."""


@dataclasses.dataclass(frozen=True)
class Arm:
    """One grid point: `values` maps dotted config keys to values; `name`, its folder name, is
    `key=value` pairs joined by "," in grid order (values percent-encoded: `_show`)."""

    name: str
    values: dict[str, Any]


def plain_value(value: Any) -> Any:
    """`value` with numpy scalars as Python ones and tuples as lists (nested), for JSON."""
    if isinstance(value, Mapping):
        return {str(k): plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    return value.item() if type(value).__module__ == "numpy" and hasattr(value, "item") else value


def _key(value: Any) -> str:
    """Equal config values give one key: 1 and 1.0 alike, True and 1 not (bools are tagged)."""

    def norm(v: Any) -> Any:  # None, str: as is
        if isinstance(v, (int, float)):
            return ["bool", v] if isinstance(v, bool) else ["num", float(v)]
        if isinstance(v, Mapping):
            return {k: norm(x) for k, x in v.items()}
        return [norm(x) for x in v] if isinstance(v, list) else v

    return json.dumps(norm(plain_value(value)), sort_keys=True, default=repr)


def _show(value: Any) -> str:
    """A value in an arm name: a string as is unless it reads as JSON (then quoted: "1" is not 1),
    else compact JSON; percent-encoded, so two values never share a valid folder name."""
    text = json.dumps(
        value := plain_value(value), sort_keys=True, separators=(",", ":"), default=repr
    )
    if isinstance(value, str) and value:
        try:
            json.loads(value)
        except ValueError:
            text = value
    return "".join(
        "".join(f"%{b:02X}" for b in c.encode()) if c in "%/\\,= " or not c.isprintable() else c
        for c in text
    )


def _arm_name(values: Mapping[str, Any]) -> str:
    name = ",".join(f"{k}={_show(v)}" for k, v in values.items()) or "default"
    if len(name.encode()) > 200:  # a folder name has at most 255 bytes
        import hashlib

        name = (
            name.encode()[:150].decode(errors="ignore")
            + "~"
            + hashlib.sha1(name.encode()).hexdigest()[:16]
        )
    return name


def arms_of_grid(cfg: Any, grid: Mapping[str, Sequence[Any]]) -> list[Arm]:
    if not isinstance(grid, Mapping) or not grid:
        raise ValueError(
            "sweep: grid must be a non-empty mapping of dotted config key -> list "
            "of values, e.g. {'optim.lr': [1e-3, 3e-3]}"
        )
    grid = {k: list(v) if type(v).__module__ == "numpy" else v for k, v in grid.items()}  # arrays
    for key, values in grid.items():
        if not isinstance(key, str):
            raise ValueError(
                f"sweep: grid key {key!r} must be a dotted config key (a str), e.g. 'optim.lr'"
            )
        config_annotation(cfg, key)  # ValueError naming the key and the valid keys of its section
        if key in NEEDED:
            raise ValueError(
                f"sweep: grid key {key!r} is set by the sweep itself"
                + (" (pass seeds=[...])" if key == "seed" else "")
            )
        if key in TABLE_COLUMNS:
            raise ValueError(
                f"sweep: grid key {key!r} would hide the sweep table's column of "
                f"that name; the table's columns are {', '.join(TABLE_COLUMNS)}"
            )
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ValueError(
                f"sweep: grid[{key!r}] must be a non-empty list of values, got {values!r}"
            )
        keys = [_key(v) for v in values]
        if len(set(keys)) != len(keys):
            twice = [v for v, k in zip(values, keys) if keys.count(k) > 1]
            raise ValueError(f"sweep: grid[{key!r}] lists a value twice: {twice} are one value")
    grid = {
        k: [v.item() if type(v).__module__ == "numpy" and hasattr(v, "item") else v for v in vs]
        for k, vs in grid.items()
    }
    arms = [
        Arm(_arm_name(dict(zip(grid, combo))), dict(zip(grid, combo)))
        for combo in itertools.product(*grid.values())
    ]
    if len({a.name for a in arms}) != len(arms):  # values of one repr, or a hash clash
        raise ValueError(f"sweep: two arms get one folder name: {[a.name for a in arms]}")
    for arm in arms:
        try:
            override(cfg, arm.values)
        except (TypeError, ValueError) as e:
            raise ValueError(f"sweep: arm {arm.name}: {e}") from None
    return arms


def baseline_arm(baseline: str | Mapping[str, Any] | None, arms: list[Arm]) -> Arm | None:
    if baseline is None:
        return None
    for arm in arms:
        if baseline == arm.name or (
            isinstance(baseline, Mapping)
            and set(baseline) == set(arm.values)
            and all(_key(baseline[k]) == _key(v) for k, v in arm.values.items())
        ):
            return arm
    raise ValueError(
        f"sweep: baseline {baseline!r} is not an arm of the grid; give an arm's "
        f"name or its values as a mapping, e.g. {arms[0].values!r}; arms: "
        f"{', '.join(a.name for a in arms)}"
    )
