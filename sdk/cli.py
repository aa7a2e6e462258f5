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
import json
import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_RECIPES = ("recipe_dirs", "find_recipe", "load_recipe", "load_config_file", "apply_overrides")
"""Names that live in `posttrain.workflows.recipes`, reachable here too; imported on first use,
because importing `posttrain.workflows` loads torch, and `main` must set the thread plan first."""


def __getattr__(name: str):
    if name in _RECIPES:
        from posttrain.workflows import recipes

        return getattr(recipes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _load_run(folder: str) -> tuple[ModuleType, str, DataclassInstance]:
    """(recipe module, recipe name, Config) of the run in `folder` (see `load_run_config`)."""
    from posttrain.workflows.config import override
    from posttrain.workflows.lineage import read_lineage
    from posttrain.workflows.recipes import load_recipe

    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} is not a run folder: it has no config.json")
    recipe = read_lineage(folder).get("recipe", {})
    name, file = recipe.get("name"), recipe.get("file")
    if name is None and not (file and Path(file).is_file()):
        raise ValueError(
            f"{folder}/lineage.json names no recipe that runs config class "
            f"{recipe.get('config_class')!r}"
        )
    try:
        module = load_recipe(name if name is not None else file)
    except ValueError:
        if not (file and Path(file).is_file()):
            raise
        module = load_recipe(file)
    cls = module.Config
    if f"{cls.__module__}.{cls.__qualname__}" != recipe.get("config_class"):
        raise ValueError(
            f"{folder} ran config class {recipe.get('config_class')!r}, but recipe "
            f"{name!r} now defines {cls.__module__}.{cls.__qualname__}"
        )
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
    run.add_argument(
        "--parent",
        action="append",
        default=[],
        metavar="FOLDER",
        help="a run this run derives from (recorded in lineage.json; repeatable)",
    )
    run.add_argument("overrides", nargs="*", help="config overrides key=value")
    runs = sub.add_parser("runs", help="table of the runs under FOLDER ... (default: ./runs)")
    runs.add_argument("folders", nargs="*", default=["runs"])
    rerun = sub.add_parser(
        "rerun",
        help="run again from a run folder's config.json: posttrain "
        "rerun FOLDER [out_dir=...] [key=value ...] (default out_dir: "
        "FOLDER-rerun)",
    )
    rerun.add_argument("folder", help="a run folder (config.json + lineage.json)")
    rerun.add_argument("overrides", nargs="*", help="config overrides key=value")
    launch = sub.add_parser(
        "launch",
        help="submit a recipe as a job (posttrain.launch.submit): "
        "posttrain launch RECIPE [options] [key=value ...]",
    )
    launch.add_argument("recipe", help="recipe name (sft) or file (recipes/sft.py)")
    launch.add_argument("--config", help="YAML preset applied before the key=value overrides")
    launch.add_argument("--executor", default="local", choices=("local", "slurm", "debug"))
    for flag, default in (
        ("--nodes", 1),
        ("--tasks-per-node", 1),
        ("--gpus-per-node", 0),
        ("--cpus-per-task", 1),
    ):
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
    from posttrain.workflows.recipes import apply_overrides, load_recipe

    command = "posttrain " + shlex.join(sys.argv[1:] if argv is None else argv)
    origin: dict[str, object] = {"command": command}
    try:
        if args.command == "rerun":
            module, name, cfg = _load_run(args.folder)
            defaults: dict[str, object] = {"out_dir": f"{args.folder.rstrip('/')}-rerun"}
            if any(f.name == "resume" for f in dataclasses.fields(cfg)):
                defaults["resume"] = False
            cfg = apply_overrides(cfg, args.overrides, defaults=defaults)
            origin.update(recipe=name, recipe_file=_source_file(module), rerun_of=args.folder)
        else:
            module = load_recipe(args.recipe)
            cfg = apply_overrides(module.Config(), args.overrides, config_file=args.config or None)
            origin.update(
                recipe=Path(args.recipe).stem,
                recipe_file=_source_file(module),
                parents=getattr(args, "parent", []),
            )
    except ValueError as e:
        parser.error(str(e))
    if args.command == "launch":
        return _launch(args, module, cfg)
    from posttrain.core.run_lock import run_outcome
    from posttrain.workflows.lineage import run_origin

    out_dir = getattr(cfg, "out_dir", None)
    try:
        with (
            run_origin(out_dir, **origin) if out_dir else contextlib.nullcontext(),
            run_outcome(out_dir),
        ):  # a run that raises records it (`posttrain runs`)
            module.main(cfg)
    except KeyboardInterrupt as e:  # Ctrl-C: the stage stopped at a whole step (RunInterrupted)
        label = args.folder if args.command == "rerun" else args.recipe
        print(f"posttrain {args.command} {label}: interrupted. {e}".rstrip(), file=sys.stderr)
        return 130
    return 0


def _source_file(module: ModuleType) -> str | None:
    file = getattr(module, "__file__", None)
    return str(Path(file).resolve()) if file else None


def _runs(parser: argparse.ArgumentParser, folders: list[str]) -> int:
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


def _launch(args: argparse.Namespace, module: ModuleType, cfg: object) -> int:
    """Submit `module.main(cfg)`; print the Run and how to reattach (and the result with --wait)."""
    from posttrain.launch.run import JobFailedError
    from posttrain.launch.submit import launch

    try:  # load_recipe registered the recipe module to travel by value
        run = launch(
            module.main,
            cfg,
            executor=args.executor,
            nodes=args.nodes,
            tasks_per_node=args.tasks_per_node,
            gpus_per_node=args.gpus_per_node,
            cpus_per_task=args.cpus_per_task,
            timeout_min=args.timeout_min,
            partition=args.partition,
            folder=args.folder,
            name=args.name,
        )
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
