"""`posttrain` command line: `posttrain info`, `posttrain ls` (the recipes and presets),
`posttrain run RECIPE [--config PRESET] [--parent FOLDER ...] [key=value ...]`, `posttrain
launch RECIPE [--executor local|slurm|debug] [resources] [key=value ...]`, `posttrain runs
[FOLDER ...]` (the table of runs and their lineage), `posttrain resume RUN [key=value ...]` (a
stopped run continued with its own saved config) and `posttrain rerun RUN [out_dir=...]
[key=value ...]` (a run again from its folder's config.json).

A recipe is a file `recipes/NAME.py` (looked up in the current folder, then beside the installed
package source) that defines a keyword-only dataclass `Config` and a function `main(cfg)`. A
`Config` nests sections (`posttrain.workflows.config`); keys are dotted (`optim.lr=1e-4`,
`task.options.max_terms=3`), typed by the dataclass field annotations, and a YAML preset (a file,
or a name from `recipes/presets/`) writes the same sections as nested mappings.

A mistake in what was typed (an unknown recipe, preset, run or key, a bad value, a missing data
file, a used out_dir, a resume whose config differs, a plan that needs more ranks than launched:
`posttrain.workflows.recipe_run.RunRefused`) is one line on stderr naming the field and the fix,
`posttrain CMD: error: ...`, with exit code 2; a malformed command line prints its subcommand's
usage. `--help`, `ls`, `runs` and the mistakes found before a recipe is loaded import neither
torch nor pandas: heavy packages load when a run starts. `run` and `launch` build the recipe's
config first with the checks that need torch or reasoning-gym deferred
(`posttrain.workflows.stack_checks`), so an unknown key, a bad value or an unknown task name of
the sft, grpo, ppo and rft recipes answers before torch loads; then in full, before the run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn

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
    if not _names_class(recipe.get("config_class"), cls):
        raise ValueError(
            f"{folder} ran config class {recipe.get('config_class')!r}, but recipe "
            f"{name!r} now defines {cls.__module__}.{cls.__qualname__}"
        )
    try:
        cfg = override(module.Config(), json.loads(path.read_text()))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    return module, name or Path(file).stem, cfg


def _names_class(recorded: object, cls: type) -> bool:
    """Whether `recorded` (lineage.json's config_class) names `cls`: by its name now, or by a
    name it had before it moved to another module, which still imports it (a run recorded
    `posttrain.workflows.sft.SFTConfig`, now in `posttrain.workflows.sft_config`)."""
    if recorded == f"{cls.__module__}.{cls.__qualname__}":
        return True
    module, _, name = recorded.rpartition(".") if isinstance(recorded, str) else ("", "", "")
    if not module.startswith("posttrain."):  # a recipe file's own class: by its name only
        return False
    try:
        return getattr(importlib.import_module(module), name, None) is cls
    except ImportError:
        return False


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


def _fail(command: str, message: str) -> NoReturn:
    """The one-line error of a mistake in what was typed: stderr, exit code 2."""
    print(f"posttrain {command}: error: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(2)


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    subs = {"info": sub.add_parser("info", help="versions, device, threads, compatibility check")}
    subs["ls"] = sub.add_parser("ls", help="the recipes and presets, one line each")
    run = subs["run"] = sub.add_parser(
        "run", help="run a recipe: posttrain run RECIPE [key=value ...]"
    )
    run.add_argument("recipe", help="recipe name (sft) or file (recipes/sft.py)")
    run.add_argument("--config", help=_CONFIG_HELP)
    run.add_argument(
        "--parent",
        action="append",
        default=[],
        metavar="FOLDER",
        help="a run this run derives from (recorded in lineage.json; repeatable)",
    )
    run.add_argument("overrides", nargs="*", help="config overrides key=value")
    runs = subs["runs"] = sub.add_parser(
        "runs", help="table of the runs under FOLDER ... (default: ./runs)"
    )
    runs.add_argument("folders", nargs="*", default=["runs"])
    resume = subs["resume"] = sub.add_parser(
        "resume",
        help="continue a stopped run with its saved config: posttrain resume RUN [key=value ...]",
    )
    resume.add_argument("run", help=_RUN_HELP)
    resume.add_argument("overrides", nargs="*", help="resumable overrides key=value (progress=...)")
    rerun = subs["rerun"] = sub.add_parser(
        "rerun",
        help="run again from a run folder's config.json: posttrain "
        "rerun RUN [out_dir=...] [key=value ...] (default out_dir: "
        "RUN-rerun)",
    )
    rerun.add_argument("folder", metavar="run", help=_RUN_HELP)
    rerun.add_argument("overrides", nargs="*", help="config overrides key=value")
    launch = subs["launch"] = sub.add_parser(
        "launch",
        help="submit a recipe as a job (posttrain.launch.submit): "
        "posttrain launch RECIPE [options] [key=value ...]",
    )
    launch.add_argument("recipe", help="recipe name (sft) or file (recipes/sft.py)")
    launch.add_argument("--config", help=_CONFIG_HELP)
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
    return parser, subs


_CONFIG_HELP = "YAML preset (a file, or a name `posttrain ls` lists) applied before the overrides"
_RUN_HELP = "a run folder (runs/a, as `posttrain runs` lists it) or a run's name under ./runs (a)"
_CONFIGURED = ("run", "launch", "rerun", "resume")
"""The commands that build a recipe's config from overrides."""


def _import_from_cwd() -> None:
    """Modules in the working folder import by name, as under `python -m`: `rewards.funcs=
    [my_rewards:fn]` finds `./my_rewards.py`. The folder goes first on `sys.path` and on
    PYTHONPATH, so that ranks and jobs this command starts find the module too."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if cwd not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *paths])


def main(argv: list[str] | None = None) -> int:
    """The `posttrain` command (`argv`: its arguments; None: `sys.argv[1:]`, and the thread
    plan is set in `os.environ` first). Returns the exit code: 0, 1 (`info` found an
    incompatible stack, a launch failed), 130 (Ctrl-C stopped the run at a whole step).

    Raises:
        SystemExit: code 2 for a mistake in what was typed (see the module docstring), 0 after
            `--help`.
    """
    if argv is None:  # the `posttrain` command itself (a call with argv leaves the process alone)
        try:
            _thread_env()
        except ValueError as e:
            print(f"posttrain: {e}", file=sys.stderr)
            return 2
        _import_from_cwd()
    parser, subs = _parser()
    args, rest = parser.parse_known_args(argv)  # overrides may come before and after --config
    if rest and (args.command not in _CONFIGURED or any(r.startswith("-") for r in rest)):
        subs[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in _CONFIGURED:
        args.overrides += rest

    if args.command == "info":
        from posttrain.core.info import format_report

        text, ok = format_report()
        print(text)
        return 0 if ok else 1
    if args.command == "ls":
        from posttrain.cli.listing import listing
        from posttrain.workflows.recipes import available_presets, available_recipes

        print(listing(available_recipes(), available_presets()))
        return 0
    if args.command == "runs":
        return _runs(args.command, args.folders)
    command = "posttrain " + shlex.join(sys.argv[1:] if argv is None else argv)
    origin: dict[str, object] = {"command": command}
    try:  # what can be checked before a recipe is loaded (and torch with it) is checked first
        from posttrain.workflows.recipes import find_preset, read_config_file, split_overrides

        split_overrides(args.overrides)
        if getattr(args, "config", None):
            args.config = find_preset(args.config)
            read_config_file(args.config)  # a missing file, or not YAML
        if args.command in ("rerun", "resume"):
            module, name, cfg, folder = _from_run(args)
            origin.update(recipe=name, recipe_file=_source_file(module))
            if args.command == "rerun":
                origin.update(rerun_of=folder)
        else:
            from posttrain.workflows.recipes import apply_overrides, load_recipe
            from posttrain.workflows.stack_checks import defer_stack_checks

            module = load_recipe(args.recipe)
            with defer_stack_checks():  # a typo or a bad value answers before torch loads
                apply_overrides(module.Config(), args.overrides, config_file=args.config or None)
            cfg = apply_overrides(module.Config(), args.overrides, config_file=args.config or None)
            origin.update(
                recipe=Path(args.recipe).stem,
                recipe_file=_source_file(module),
                parents=getattr(args, "parent", []),
            )
    except (TypeError, ValueError) as e:
        _fail(args.command, str(e))
    if args.command == "launch":
        return _launch(args, module, cfg)
    return _run(args, module, cfg, origin)


def _from_run(args: argparse.Namespace) -> tuple[ModuleType, str, DataclassInstance, str]:
    """(recipe module, recipe name, Config, run folder) of `posttrain rerun` / `posttrain
    resume`: the run's saved config with `args.overrides`; a rerun writes a new folder
    (default RUN-rerun, resume=false), a resume continues the run in its folder.

    Raises:
        ValueError: for an unknown run, a finished or running one (resume), a recipe without a
            `resume` field (resume), or an override the config refuses.
    """
    from posttrain.cli.listing import find_run
    from posttrain.workflows.recipes import apply_overrides

    folder = find_run(args.run if args.command == "resume" else args.folder)
    if args.command == "resume":
        from posttrain.workflows.run_state import run_state

        state = run_state(folder)
        if state.status == "finished":
            raise ValueError(
                f"run {folder} has finished: nothing to resume; `posttrain rerun {folder} "
                "out_dir=NEW` runs it again"
            )
        if state.status == "running":
            raise ValueError(f"run {folder} is running ({state.detail}): wait for it or stop it")
    module, name, cfg = _load_run(folder)
    resumable = _resumable(cfg)
    if args.command == "rerun":
        defaults: dict[str, object] = {"out_dir": f"{folder.rstrip('/')}-rerun"}
        if resumable:
            defaults["resume"] = False
    elif not resumable:
        raise ValueError(
            f"run {folder}: recipe {name!r} cannot resume (its Config has no resume field); "
            f"`posttrain rerun {folder}` runs it again in a new folder"
        )
    else:
        defaults = {"out_dir": folder, "resume": True}
    return module, name, apply_overrides(cfg, args.overrides, defaults=defaults), folder


def _run(
    args: argparse.Namespace, module: ModuleType, cfg: object, origin: dict[str, object]
) -> int:
    """`module.main(cfg)` inside the run's origin (lineage) and outcome (stopped.json) records;
    a refusal at the run's start (`RunRefused`, a folder another process holds) is the
    command's one-line error."""
    from posttrain.core.run_lock import RunDirInUseError, run_outcome
    from posttrain.workflows.lineage import run_origin

    out_dir = getattr(cfg, "out_dir", None)
    try:
        with (
            run_origin(out_dir, **origin) if out_dir else contextlib.nullcontext(),
            run_outcome(out_dir),
        ):  # a run that raises records it (`posttrain runs`)
            module.main(cfg)
    except KeyboardInterrupt as e:  # Ctrl-C: the stage stopped at a whole step (RunInterrupted)
        label = getattr(args, "recipe", None) or getattr(args, "run", None) or args.folder
        print(f"posttrain {args.command} {label}: interrupted. {e}".rstrip(), file=sys.stderr)
        if out_dir and _resumable(cfg):
            print(f"continue it with: posttrain resume {out_dir}", file=sys.stderr)
        return 130
    except (ValueError, RunDirInUseError) as e:
        from posttrain.workflows.recipe_run import RunRefused

        if not isinstance(e, (RunRefused, RunDirInUseError)):
            raise
        _fail(args.command, str(e))
    return 0


def _resumable(cfg: object) -> bool:
    """Whether config `cfg` is a dataclass with a `resume` field (`posttrain resume` sets it)."""
    return dataclasses.is_dataclass(cfg) and any(
        f.name == "resume" for f in dataclasses.fields(cfg)
    )


def _source_file(module: ModuleType) -> str | None:
    file = getattr(module, "__file__", None)
    return str(Path(file).resolve()) if file else None


def _runs(command: str, folders: list[str]) -> int:
    """Print the table of `posttrain.workflows.run_table.run_rows(*folders)`."""
    from posttrain.cli.listing import format_rows
    from posttrain.workflows.run_table import RUN_COLUMNS, run_rows

    try:
        rows = run_rows(*folders)
    except ValueError as e:
        _fail(command, str(e))
    if not rows:
        print(f"no runs (folders with config.json and lineage.json) under {', '.join(folders)}")
        return 0
    print(format_rows(rows, RUN_COLUMNS))
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
