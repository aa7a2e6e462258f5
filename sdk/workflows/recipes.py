"""Recipes by name: a file `recipes/NAME.py` (looked up in the current folder, then beside the
installed package source) defining a keyword-only dataclass `Config` and a function `main(cfg)`.
`load_recipe` imports one (`available_recipes` and `available_presets` list them by name, and
`find_preset` finds a YAML preset `recipes/presets/NAME.yaml` by name), and `apply_overrides`
applies dotted `key=value` strings typed by the dataclass annotations, after a YAML preset if
given (`read_config_file`), in one construction of the config (`posttrain run`, `posttrain
launch` and `posttrain.workflows.sweep` share them; `load_config_file` applies a preset alone).
An unknown key is an error listing the valid keys of its section.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

__all__ = [
    "recipe_dirs",
    "find_recipe",
    "available_recipes",
    "available_presets",
    "find_preset",
    "load_recipe",
    "read_config_file",
    "split_overrides",
    "load_config_file",
    "apply_overrides",
    "config_annotation",
]


def recipe_dirs() -> list[Path]:
    return [Path.cwd() / "recipes", Path(__file__).resolve().parents[2] / "recipes"]


def find_recipe(name: str) -> Path:
    """Path of a recipe given as a file path (`recipes/sft.py`) or a name (`sft`).

    Raises ValueError listing the recipes found.
    """
    if name.endswith(".py") or "/" in name:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"recipe file {name!r} does not exist")
        return path
    found = available_recipes()
    if name not in found:
        raise ValueError(
            f"unknown recipe {name!r}; available: {', '.join(sorted(found)) or 'none'}"
            f" (searched {', '.join(str(d) for d in recipe_dirs())})"
        )
    return found[name]


def available_recipes() -> dict[str, Path]:
    """Recipe name -> file, for every `NAME.py` (not starting with "_") in `recipe_dirs()`; a
    name in the current folder's recipes/ hides the package's. Sorted by name."""
    return _first_of_each("*.py", recipe_dirs())


def available_presets() -> dict[str, Path]:
    """Preset name -> file, for every `NAME.yaml` in the `presets/` folder of `recipe_dirs()`
    (the current folder's first). Sorted by name."""
    return _first_of_each("*.yaml", [d / "presets" for d in recipe_dirs()])


def _first_of_each(pattern: str, folders: list[Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in folders:
        for p in sorted(d.glob(pattern)) if d.is_dir() else []:
            if not p.name.startswith("_"):
                found.setdefault(p.stem, p)
    return dict(sorted(found.items()))


def find_preset(name: str) -> str:
    """The YAML file of a preset given as a file path or by name (`sft_lora`: a file of
    `available_presets`). A name with a "/" or a .yaml/.yml suffix, or an existing file, is
    taken as a path as written (`read_config_file` names a missing one).

    Raises ValueError for an unknown name, listing the presets.
    """
    if "/" in name or name.endswith((".yaml", ".yml")) or Path(name).is_file():
        return name
    found = available_presets()
    if name not in found:
        raise ValueError(
            f"unknown preset {name!r}; available: {', '.join(found) or 'none'} "
            "(or pass a YAML file path)"
        )
    return str(found[name])


def load_recipe(name: str) -> ModuleType:
    """The recipe module `name` (see `find_recipe`), imported from its file. Raises ValueError
    for an unknown name or a file Python cannot import (not `.py`).

    The module lives under a made-up name (`posttrain_recipe_sft`) that a job cannot import, so
    it is registered with cloudpickle to travel by value: `posttrain.launch.launch(module.main,
    cfg)` then ships the recipe's own code (its `main`, a `Config` it defines) to the job, while
    what it imports from `posttrain` travels by reference.
    """
    import cloudpickle

    path = find_recipe(name)
    spec = importlib.util.spec_from_file_location(f"posttrain_recipe_{Path(name).stem}", path)
    if spec is None or spec.loader is None:  # a suffix Python does not import (not .py)
        raise ValueError(f"recipe file {str(path)!r} is not a Python file; name it NAME.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


def _coerce(value: str, annotation) -> object:
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin is typing.Union or (
        origin is not None and str(origin) == "<class 'types.UnionType'>"
    ):
        if value.lower() in ("none", "null"):
            return None
        annotation = args[0] if len(args) == 1 else str
    if origin is typing.Literal:  # one of the named values: taken as written
        annotation = type(args[0]) if args and all(type(a) is type(args[0]) for a in args) else str
    if annotation is bool:
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"expected a boolean (true/false), got {value!r}")
    if annotation in (int, float, str):
        return annotation(value)
    import yaml

    return yaml.safe_load(value)


def read_config_file(path: str) -> dict:
    """The mapping of YAML file `path` (a preset: top-level keys, sections as nested mappings
    `optim: {lr: 0.0001}` or dotted keys `optim.lr: 0.0001`; an empty file: no changes). `path`
    may name a preset instead (`find_preset`: `sft_lora`).

    Raises ValueError for an unknown preset name, a file that cannot be read, is not YAML, or
    holds no mapping.
    """
    import yaml

    path = find_preset(path)
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except OSError as e:
        raise ValueError(f"config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold a mapping of key: value")
    return values


def load_config_file(cfg, path: str):
    """A copy of dataclass `cfg` with YAML file `path` applied (`read_config_file`). The
    command line applies a preset and its overrides in one construction instead
    (`apply_overrides(cfg, overrides, config_file=path)`).

    Raises ValueError naming an unknown key and listing the valid keys of its section.
    """
    from posttrain.workflows.config import override

    values = read_config_file(path)
    try:
        return override(cfg, values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def config_annotation(cfg, key: str):
    """The type annotation of dotted `key` in the nested dataclass `cfg` (None inside a dict
    field, whose values are parsed as YAML).

    Raises ValueError for an unknown key, listing the valid keys of its section.
    """
    obj, annotation, parts = cfg, None, key.split(".")
    for i, part in enumerate(parts):
        section = ".".join(parts[:i])
        if dataclasses.is_dataclass(obj):
            names = sorted(f.name for f in dataclasses.fields(obj))
            if part not in names:
                raise ValueError(
                    f"unknown config key {key!r}; valid keys"
                    f"{' of ' + section if section else ''}: {', '.join(names)}"
                )
            annotation, obj = typing.get_type_hints(type(obj))[part], getattr(obj, part)
        elif isinstance(obj, dict):
            return None
        else:
            raise ValueError(f"config key {key!r}: {section!r} has no keys of its own")
    return annotation


def split_overrides(overrides: list[str]) -> list[tuple[str, str]]:
    """The (key, value) of each `key=value` string, split at its first "=" (the value may hold
    more); nothing is typed or checked against a config yet.

    Raises ValueError naming an item without "=" or with an empty key.
    """
    pairs = []
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"override {item!r} is not of the form key=value")
        pairs.append((key, value))
    return pairs


def apply_overrides(
    cfg,
    overrides: list[str],
    *,
    config_file: str | None = None,
    defaults: Mapping[str, object] | None = None,
):
    """A copy of dataclass `cfg` with `key=value` strings applied; keys are dotted for nested
    sections (`optim.lr=1e-4`) and values typed by the field annotations.

    `defaults` (values as given, e.g. a rerun's new `out_dir`) and the YAML preset
    `config_file` (`read_config_file`) apply first, in that order, then `overrides`: all in
    one construction (`config_paths.override`), so the config, and its `parallel` plan's
    check against the model, is validated once however many changes there are.

    Raises ValueError naming an unknown key (and listing the valid keys of its section), a
    malformed override, or the field the new config refuses (`Config.parallel.dp_shard`).
    """
    from posttrain.workflows.config import override

    changes = {}
    for key, value in split_overrides(overrides):
        annotation = config_annotation(cfg, key)
        try:
            changes[key] = _coerce(value, annotation)
        except ValueError as e:
            raise ValueError(f"config key {key!r}: {e}") from None
    preset = read_config_file(config_file) if config_file is not None else {}
    try:
        return override(cfg, dict(defaults or {}), preset, changes)
    except TypeError as e:
        raise ValueError(str(e)) from None
