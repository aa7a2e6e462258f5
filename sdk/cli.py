"""`posttrain` command line: `posttrain info`, `posttrain run RECIPE [--config PRESET.yaml]
[--parent FOLDER ...] [key=value ...]`, `posttrain launch RECIPE [--executor local|slurm|debug]
[resources] [key=value ...]`, `posttrain runs [FOLDER ...]` (the table of runs and their
lineage) and `posttrain rerun FOLDER [out_dir=...] [key=value ...]` (a run again from its
folder's config.json).

A recipe is a file `recipes/NAME.py` (looked up in the current folder, then beside the installed
package source) that defines a keyword-only dataclass `Config` and a function `main(cfg)`. A
`Config` nests sections (`posttrain.workflows.config`); keys are dotted (`optim.lr=1e-4`,
`task.options.max_terms=3`), typed by the dataclass field annotations, and a YAML preset writes
the same sections as nested mappings. An unknown key is an error listing the valid keys of its
section.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import shlex
import sys
import typing
from pathlib import Path


def recipe_dirs() -> list[Path]:
    here = Path(__file__).resolve().parent
    return [Path.cwd() / "recipes", here.parent / "recipes"]


def find_recipe(name: str) -> Path:
    """Path of a recipe given as a file path (`recipes/sft.py`) or a name (`sft`).

    Raises ValueError listing the recipes found.
    """
    if name.endswith(".py") or "/" in name:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"recipe file {name!r} does not exist")
        return path
    found: dict[str, Path] = {}
    for d in recipe_dirs():
        for p in sorted(d.glob("*.py")) if d.is_dir() else []:
            if not p.name.startswith("_"):
                found.setdefault(p.stem, p)
    if name not in found:
        raise ValueError(f"unknown recipe {name!r}; available: {', '.join(sorted(found)) or 'none'}"
                         f" (searched {', '.join(str(d) for d in recipe_dirs())})")
    return found[name]


def load_recipe(name: str):
    """The recipe module `name` (see `find_recipe`), imported from its file.

    The module lives under a made-up name (`posttrain_recipe_sft`) that a job cannot import, so
    it is registered with cloudpickle to travel by value: `posttrain.launch.launch(module.main,
    cfg)` then ships the recipe's own code (its `main`, a `Config` it defines) to the job, while
    what it imports from `posttrain` travels by reference.
    """
    import cloudpickle

    path = find_recipe(name)
    spec = importlib.util.spec_from_file_location(f"posttrain_recipe_{Path(name).stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


def _coerce(value: str, annotation) -> object:
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        if value.lower() in ("none", "null"):
            return None
        annotation = args[0] if len(args) == 1 else str
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


def load_config_file(cfg, path: str):
    """A copy of dataclass `cfg` with YAML file `path` applied: top-level keys, sections as
    nested mappings (`optim: {lr: 0.0001}`) or dotted keys (`optim.lr: 0.0001`).

    Raises ValueError naming an unknown key and listing the valid keys of its section.
    """
    import yaml

    from posttrain.workflows.config import override

    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except OSError as e:
        raise ValueError(f"config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold a mapping of key: value")
    try:
        return override(cfg, values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def _annotation(cfg, key: str):
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
                raise ValueError(f"unknown config key {key!r}; valid keys"
                                 f"{' of ' + section if section else ''}: {', '.join(names)}")
            annotation, obj = typing.get_type_hints(type(obj))[part], getattr(obj, part)
        elif isinstance(obj, dict):
            return None
        else:
            raise ValueError(f"config key {key!r}: {section!r} has no keys of its own")
    return annotation


def apply_overrides(cfg, overrides: list[str]):
    """A copy of dataclass `cfg` with `key=value` strings applied; keys are dotted for nested
    sections (`optim.lr=1e-4`) and values typed by the field annotations.

    Raises ValueError naming an unknown key (and listing the valid keys of its section) or a
    malformed override.
    """
    from posttrain.workflows.config import override

    changes = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        annotation = _annotation(cfg, key)
        try:
            changes[key] = _coerce(value, annotation)
        except ValueError as e:
            raise ValueError(f"config key {key!r}: {e}") from None
    try:
        return override(cfg, changes)
    except TypeError as e:
        raise ValueError(str(e)) from None


def _load_run(folder: str):
    """(recipe module, recipe name, Config) of the run in `folder` (see `load_run_config`)."""
    from posttrain.workflows.config import override
    from posttrain.workflows.lineage import read_lineage

    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} is not a run folder: it has no config.json")
    recipe = read_lineage(folder).get("recipe", {})
    name, file = recipe.get("name"), recipe.get("file")
    if name is None and not (file and Path(file).is_file()):
        raise ValueError(f"{folder}/lineage.json names no recipe that runs config class "
                         f"{recipe.get('config_class')!r}")
    try:
        module = load_recipe(name if name is not None else file)
    except ValueError:
        if not (file and Path(file).is_file()):
            raise
        module = load_recipe(file)
    cls = module.Config
    if f"{cls.__module__}.{cls.__qualname__}" != recipe.get("config_class"):
        raise ValueError(f"{folder} ran config class {recipe.get('config_class')!r}, but recipe "
                         f"{name!r} now defines {cls.__module__}.{cls.__qualname__}")
    try:
        cfg = override(module.Config(), json.loads(path.read_text()))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    return module, name or Path(file).stem, cfg


def load_run_config(folder: str) -> tuple[str, object]:
    """The recipe name and its `Config` as the run in `folder` ran it: the recipe its
    lineage.json names, its `Config()` with the folder's config.json applied (every key, so
    defaults changed since do not leak in; a key the recipe no longer has is an error).

    Raises:
        ValueError: if `folder` has no config.json or lineage.json, the recipe is not found or
            defines another config class now, or config.json does not fit its Config.
    """
    _, name, cfg = _load_run(folder)
    return name, cfg


def _thread_env() -> None:
    """Put the run's thread plan (`posttrain.core.threads.apply_thread_env`) into `os.environ`
    before torch is imported: OpenMP reads its thread count and wait policy once, when torch
    loads, and jobs started from here inherit them (`posttrain.core.threads` imports only the
    standard library, and `posttrain.core` loads its re-exports on first use)."""
    from posttrain.core.threads import apply_thread_env

    apply_thread_env()


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the `posttrain` command itself (a call with argv leaves the process alone)
        try:
            _thread_env()
        except ValueError as e:
            print(f"posttrain: {e}", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, device, threads, compatibility check")
    run = sub.add_parser("run", help="run a recipe: posttrain run RECIPE [key=value ...]")
    run.add_argument("recipe", help="recipe name (sft) or file (recipes/sft.py)")
    run.add_argument("--config", help="YAML preset applied before the key=value overrides")
    run.add_argument("--parent", action="append", default=[], metavar="FOLDER",
                     help="a run this run derives from (recorded in lineage.json; repeatable)")
    run.add_argument("overrides", nargs="*", help="config overrides key=value")
    runs = sub.add_parser("runs", help="table of the runs under FOLDER ... (default: ./runs)")
    runs.add_argument("folders", nargs="*", default=["runs"])
    rerun = sub.add_parser("rerun", help="run again from a run folder's config.json: posttrain "
                           "rerun FOLDER [out_dir=...] [key=value ...] (default out_dir: "
                           "FOLDER-rerun)")
    rerun.add_argument("folder", help="a run folder (config.json + lineage.json)")
    rerun.add_argument("overrides", nargs="*", help="config overrides key=value")
    launch = sub.add_parser("launch", help="submit a recipe as a job (posttrain.launch.submit): "
                            "posttrain launch RECIPE [options] [key=value ...]")
    launch.add_argument("recipe", help="recipe name (sft) or file (recipes/sft.py)")
    launch.add_argument("--config", help="YAML preset applied before the key=value overrides")
    launch.add_argument("--executor", default="local", choices=("local", "slurm", "debug"))
    for flag, default in (("--nodes", 1), ("--tasks-per-node", 1), ("--gpus-per-node", 0),
                          ("--cpus-per-task", 1)):
        launch.add_argument(flag, type=int, default=default)
    launch.add_argument("--timeout-min", type=float, default=60)
    launch.add_argument("--partition")
    launch.add_argument("--folder", help="launch folder (default: <out_dir>/launch)")
    launch.add_argument("--name", help="job name")
    launch.add_argument("--wait", action="store_true", help="wait for the job and print its result")
    launch.add_argument("overrides", nargs="*", help="config overrides key=value")
    args, rest = parser.parse_known_args(argv)  # overrides may come before and after --config
    if args.command not in ("run", "launch", "rerun") and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in ("run", "launch", "rerun"):
        if any(r.startswith("-") for r in rest):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides += rest

    if args.command == "info":
        from posttrain.core.info import format_report

        text, ok = format_report()
        print(text)
        return 0 if ok else 1
    if args.command == "runs":
        return _runs(parser, args.folders)
    origin = {"command": "posttrain " + shlex.join(sys.argv[1:] if argv is None else argv)}
    try:
        if args.command == "rerun":
            module, name, cfg = _load_run(args.folder)
            defaults = {"out_dir": f"{args.folder.rstrip('/')}-rerun"}
            if any(f.name == "resume" for f in dataclasses.fields(cfg)):
                defaults["resume"] = False
            from posttrain.workflows.config import override

            cfg = apply_overrides(override(cfg, defaults), args.overrides)
            origin.update(recipe=name, recipe_file=_source_file(module), rerun_of=args.folder)
        else:
            module = load_recipe(args.recipe)
            cfg = module.Config()
            if args.config:
                cfg = load_config_file(cfg, args.config)
            cfg = apply_overrides(cfg, args.overrides)
            origin.update(recipe=Path(args.recipe).stem, recipe_file=_source_file(module),
                          parents=getattr(args, "parent", []))
    except ValueError as e:
        parser.error(str(e))
    if args.command == "launch":
        return _launch(args, module, cfg)
    from posttrain.workflows.lineage import run_origin

    out_dir = getattr(cfg, "out_dir", None)
    try:
        with run_origin(out_dir, **origin) if out_dir else contextlib.nullcontext():
            module.main(cfg)
    except KeyboardInterrupt as e:  # Ctrl-C: the stage stopped at a whole step (RunInterrupted)
        label = args.folder if args.command == "rerun" else args.recipe
        print(f"posttrain {args.command} {label}: interrupted. {e}".rstrip(), file=sys.stderr)
        return 130
    return 0


def _source_file(module) -> str | None:
    return str(Path(module.__file__).resolve()) if getattr(module, "__file__", None) else None


def _runs(parser, folders: list[str]) -> int:
    """Print `posttrain.workflows.lineage.runs_table(*folders)`."""
    import pandas as pd

    from posttrain.workflows.lineage import runs_table

    try:
        table = runs_table(*folders)
    except ValueError as e:
        parser.error(str(e))
    if table.empty:
        print(f"no runs (folders with config.json and lineage.json) under {', '.join(folders)}")
        return 0
    with pd.option_context("display.width", 200, "display.max_colwidth", 60):
        print(table.to_string(index=False))
    return 0


def _launch(args, module, cfg) -> int:
    """Submit `module.main(cfg)`; print the Run and how to reattach (and the result with --wait)."""
    from posttrain.launch.run import JobFailedError
    from posttrain.launch.submit import launch

    try:  # load_recipe registered the recipe module to travel by value
        run = launch(module.main, cfg, executor=args.executor, nodes=args.nodes,
                     tasks_per_node=args.tasks_per_node, gpus_per_node=args.gpus_per_node,
                     cpus_per_task=args.cpus_per_task, timeout_min=args.timeout_min,
                     partition=args.partition, folder=args.folder, name=args.name)
    except (RuntimeError, TypeError, ValueError) as e:  # bad resources, unpicklable, sbatch
        print(f"posttrain launch: {e}", file=sys.stderr)
        return 1
    print(run)
    if run.folder is not None:
        print(f"reattach: Run.attach({str(run.folder)!r})  (from posttrain.launch import Run)")
    if not args.wait and args.executor != "debug":
        return 0
    try:
        print(run.result())
    except JobFailedError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
