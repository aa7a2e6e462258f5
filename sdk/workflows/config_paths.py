"""Dotted paths into a nested recipe config: the one validation path that names a bad field
by its dotted name (`validate`), `override`, which applies dotted keys (`{"optim.lr": 1e-4}`)
or nested mappings (a YAML preset) to a nested config, and `config_keys`, its leaf keys. The
sections themselves are in `posttrain.workflows.config`, which exports these names too.

Example:
    >>> from dataclasses import dataclass, field
    >>> from posttrain.workflows.config import BatchOptimConfig
    >>> @dataclass(kw_only=True)
    ... class Config:
    ...     optim: BatchOptimConfig = field(default_factory=BatchOptimConfig)
    ...     def __post_init__(self):
    ...         validate(self)
    >>> override(Config(), {"optim.lr": 1e-4}).optim.lr
    0.0001
    >>> override(Config(), {"optim.lrr": 1.0})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown config key 'optim.lrr'; valid keys of optim: batch_size, ..., lr, ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["ROOT", "validate", "override", "config_keys"]

ROOT = "Config"
"""How messages name the recipe config that holds every section."""


def validate(cfg: Any, at: str = ROOT) -> None:
    """Check `cfg` and every section in it, innermost first: each section's `check(at)` with its
    dotted path, then `cfg.check(at)` for what spans sections.

    Raises:
        TypeError: if a section field holds something other than its section type.
        ValueError: naming the dotted field and what is allowed.
    """
    for f in dataclasses.fields(cfg):
        value, kind = getattr(cfg, f.name), _section_type(f)
        if kind is not None and not isinstance(value, kind):
            raise TypeError(
                f"{at}.{f.name} must be a {kind.__name__} (set its keys as "
                f"{f.name}.KEY=VALUE), got {value!r}"
            )
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            validate(value, f"{at}.{f.name}")
    check = getattr(cfg, "check", None)
    if callable(check):
        check(at)


def _section_type(f: dataclasses.Field) -> type | None:
    """The section class of a field whose default is a section (from its default factory; not
    its annotation, which a Config sent by value to a job cannot always resolve)."""
    if not callable(f.default_factory):  # MISSING (a copy of it, in a Config sent by value)
        return None
    default = f.default_factory()
    return type(default) if dataclasses.is_dataclass(default) else None


class _Node(dict):
    """Changes below one dotted prefix (as opposed to a mapping value set as a whole)."""


def _relative(at: str) -> str:
    return at.removeprefix(ROOT).removeprefix(".")


def override(cfg: Any, changes: Mapping[str, Any]) -> Any:
    """A copy of dataclass `cfg` with `changes` applied, validated once at the end.

    Keys are dotted paths (`"optim.lr"`); a mapping given for a section (`{"optim": {"lr": 1e-4}}`,
    as a YAML preset writes it) sets those of its keys; a mapping given for a plain dict field
    (`task.options`) replaces it, while a dotted key into it (`"task.options.max_terms"`) sets
    one entry (both together merge). Values are used as given (`key=value` strings are typed
    first by `posttrain.workflows.recipes.apply_overrides`).

    Raises:
        ValueError: for an unknown key, naming it and listing the valid keys of its section;
            any error of the new config's validation.
    """
    tree = _Node()
    for key, value in changes.items():
        node, parts = tree, str(key).split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, _Node())
            if not isinstance(child, Mapping):
                raise ValueError(
                    f"config key {key!r} goes inside {part!r}, which is set to {child!r}"
                )
            node[part] = node = child if isinstance(child, _Node) else _Node(child)
        last = parts[-1]
        if isinstance(node.get(last), _Node) and isinstance(value, Mapping):
            node[last].update(value)  # "optim.lr" and "optim: {steps: 5}" together
        else:
            node[last] = value
    return _apply(cfg, tree, ROOT)


def _apply(obj: Any, node: Mapping[str, Any], at: str) -> Any:
    names = [f.name for f in dataclasses.fields(obj)]
    new = {}
    for name, value in node.items():
        path = f"{at}.{name}"
        if name not in names:
            section = _relative(at)
            raise ValueError(
                f"unknown config key {_relative(path)!r}; valid keys"
                f"{' of ' + section if section else ''}: {', '.join(sorted(names))}"
            )
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            new[name] = _apply(current, value, path)
        elif isinstance(value, _Node):
            if not isinstance(current, dict):
                raise ValueError(f"config key {_relative(path)!r} has no keys of its own")
            new[name] = {**current, **value}
        else:
            new[name] = value
    try:
        return dataclasses.replace(obj, **new)
    except (TypeError, ValueError) as e:
        raise _renamed(e, type(obj).__name__, at) from None


def _renamed(error: Exception, cls: str, at: str) -> Exception:
    """The error of a section that checks itself when built (a `ParallelPlan`: "ParallelPlan.tp=0;
    must be ..."), naming the field by its dotted path ("Config.parallel.tp=0; must be ...")."""
    message = str(error)
    if at == ROOT or not message.startswith(f"{cls}."):
        return error
    return type(error)(f"{at}.{message.removeprefix(cls + '.')}")


def config_keys(cfg: Any, at: str = "") -> list[str]:
    """Every leaf key of a nested config, dotted and sorted (`["optim.lr", ..., "seed"]`)."""
    keys = []
    for f in dataclasses.fields(cfg):
        value, path = getattr(cfg, f.name), f"{at}{f.name}"
        keys += config_keys(value, path + ".") if dataclasses.is_dataclass(value) else [path]
    return sorted(keys)
