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


class _Layers(list):
    """Mappings given for one key by successive layers of changes, applied in order: each sets
    its keys of a section; for a plain dict field a later mapping replaces an earlier one (and
    a `_Node`, dotted keys into it, merges)."""


def _relative(at: str) -> str:
    return at.removeprefix(ROOT).removeprefix(".")


def override(cfg: Any, changes: Mapping[str, Any], *more: Mapping[str, Any]) -> Any:
    """A copy of dataclass `cfg` with `changes` applied, validated once at the end.

    Keys are dotted paths (`"optim.lr"`); a mapping given for a section (`{"optim": {"lr": 1e-4}}`,
    as a YAML preset writes it) sets those of its keys; a mapping given for a plain dict field
    (`task.options`) replaces it, while a dotted key into it (`"task.options.max_terms"`) sets
    one entry (both together merge). Values are used as given (`key=value` strings are typed
    first by `posttrain.workflows.recipes.apply_overrides`).

    `more`: further changes applied after `changes`, in order, in the same construction (a
    YAML preset, then the command line's overrides): a later value of a key wins, and a later
    mapping for a section sets its keys over the earlier ones. The config is built, and
    validated, once.

    Raises:
        ValueError: for an unknown key, naming it and listing the valid keys of its section;
            any error of the new config's validation.
    """
    tree = _Node()
    set_by: dict[int, int] = {}  # id of a mapping in the tree -> the layer of changes that set it
    for n, layer in enumerate((changes, *more)):
        for key, value in layer.items():
            node, parts = tree, str(key).split(".")
            for part in parts[:-1]:
                child = node.get(part)
                if isinstance(child, _Layers) or _earlier(child, n, set_by):
                    # a dotted key after a mapping of an earlier layer: applied after it
                    layers = child if isinstance(child, _Layers) else _Layers([child])
                    if set_by.get(id(layers[-1])) != n or not isinstance(layers[-1], _Node):
                        layers.append(_Node())
                        set_by[id(layers[-1])] = n
                    node[part], child = layers, layers[-1]
                elif child is None or isinstance(child, Mapping):
                    if not isinstance(child, _Node):
                        child = node[part] = _Node(child or {})
                        set_by[id(child)] = n
                else:
                    raise ValueError(
                        f"config key {key!r} goes inside {part!r}, which is set to {child!r}"
                    )
                node = child
            last = parts[-1]
            before = node.get(last)
            if isinstance(value, Mapping) and isinstance(before, _Layers):
                before.append(value)
            elif isinstance(value, Mapping) and _earlier(before, n, set_by):
                node[last] = _Layers([before, value])  # a section: both; a dict field: the last
            elif isinstance(value, Mapping) and isinstance(before, _Node):
                before.update(value)  # "optim.lr" and "optim: {steps: 5}" together
            else:
                node[last] = value
                if isinstance(value, Mapping):
                    set_by[id(value)] = n
    return _apply(cfg, tree, ROOT)


def _earlier(value: Any, n: int, set_by: dict[int, int]) -> bool:
    """Whether `value` is a mapping that a layer of changes before layer `n` set as a whole."""
    return isinstance(value, Mapping) and set_by.get(id(value), n) < n


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
        if isinstance(value, _Layers):
            for layer in value:
                if dataclasses.is_dataclass(current):
                    current = _apply(current, layer, path)
                elif isinstance(current, dict):
                    current = {**current, **layer} if isinstance(layer, _Node) else dict(layer)
                else:
                    raise ValueError(f"config key {_relative(path)!r} has no keys of its own")
            new[name] = current
        elif dataclasses.is_dataclass(current) and isinstance(value, Mapping):
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
