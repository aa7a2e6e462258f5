"""Run lineage: what a run folder was made from, written as `lineage.json` when the run starts
(`posttrain.workflows.reports.start_run` calls `check_parents` and `write_lineage`, so every
recipe gets it). The table of the runs under some folders (`run_rows`, `runs_table`) is in
`posttrain.workflows.run_table`, and its names import from here too.

`lineage.json` holds the config (as config.json), sha256 hashes of the data (a data file's
bytes; for a reasoning-gym task the hash of its spec, name + options + sizes + seeds + the
reasoning-gym version, and of the generated training questions and answers), the code version
(git commit and dirty flag when the package is a git checkout, else the installed version), the
versions of key packages (read with importlib.metadata, nothing imported), python, hostname,
start time (UTC), the command line, the recipe, and the run's parents.

Parents point along the data flow: a parent is a run whose output this run starts from.
  - a run with sub-runs (GRPO, PPO, DPO, reward model: `sft/`) lists its SFT sub-run, whose
    policy it starts from, unless the config sets `model.init_from` (then that is the start and
    no SFT stage runs);
  - a run whose `model.init_from` (or data file `task.name`) lies inside another run folder
    lists that run;
  - a run started under `run_origin(..., parents=[...])` (`posttrain run --parent FOLDER`)
    lists those folders, which must be existing run folders (ValueError before anything is
    written otherwise).
The sub-run itself records no link back: its parent folder is the folder above it.

Each entry is `{"path": relative to the run folder, "abs": absolute, "via": "sub_run" |
"model.init_from" | "task.name" | "declared"}`. A resumed run keeps its lineage and appends the
resume (time, command, code, host, and the folder it ran in: `run` records where the run
started, and a folder that was moved or copied resumes in its new place) to `resumes`.

Example:
    >>> sorted(code_version())  # doctest: +NORMALIZE_WHITESPACE
    ['git_commit', 'git_dirty', 'package', 'path', 'version']
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import os
import platform
import random
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from posttrain.core.checkpoint_files import write_text_atomic
from posttrain.core.run_lock import LOCK_FILE
from posttrain.workflows.run_state import run_status
from posttrain.workflows.run_table import (
    LINEAGE_FILE,
    RUN_COLUMNS,
    find_runs,
    main_metric,
    run_rows,
    runs_table,
)

__all__ = [
    "LINEAGE_FILE",
    "PACKAGES",
    "SDK_RECIPES",
    "RunOrigin",
    "run_origin",
    "code_version",
    "package_versions",
    "data_lineage",
    "check_parents",
    "write_lineage",
    "read_lineage",
    "find_runs",
    "run_status",
    "main_metric",
    "RUN_COLUMNS",
    "run_rows",
    "runs_table",
]

PACKAGES = (
    "torch",
    "transformers",
    "trl",
    "verl",
    "torchao",
    "torchtune",
    "reasoning_gym",
    "numpy",
    "pandas",
)
"""Packages whose installed versions a lineage records (those that are installed)."""
SDK_RECIPES = {
    "posttrain.workflows.sft_config.SFTConfig": "sft",
    "posttrain.workflows.rl_config.RLRunConfig": "grpo",
    "posttrain.workflows.preference_config.PreferenceRunConfig": "dpo",
    "posttrain.workflows.reward_model_config.RewardModelRunConfig": "reward_model",
}
"""The recipe that runs a config class defined in the SDK (recipes/sft.py: `Config =
SFTConfig`); a class defined in a recipe file names its recipe by its module."""
QUESTIONS_HASH_MAX = 50_000
"""Training sets up to this size are generated once more to hash their questions (chain_sum:
~0.6 s for 20,000); larger ones are identified by their spec hash alone."""
GIT_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class RunOrigin:
    """What the command line knows about the run in `out_dir` that its config does not: the
    recipe (name and file), the command, declared parents, and the run it reruns."""

    out_dir: str
    recipe: str | None = None
    recipe_file: str | None = None
    command: str | None = None
    parents: tuple[str, ...] = ()
    rerun_of: str | None = None


_ORIGIN: contextvars.ContextVar[RunOrigin | None] = contextvars.ContextVar(
    "posttrain_run_origin", default=None
)


@contextlib.contextmanager
def run_origin(out_dir: str | os.PathLike, **fields: Any) -> Iterator[RunOrigin]:
    """Within the block, the run started in `out_dir` records `fields` (see `RunOrigin`) in
    its lineage; its sub-runs and other runs do not."""
    if "parents" in fields:
        fields["parents"] = tuple(str(p) for p in fields["parents"])
    origin = RunOrigin(out_dir=str(out_dir), **fields)
    token = _ORIGIN.set(origin)
    try:
        yield origin
    finally:
        _ORIGIN.reset(token)


def _origin(out: Path) -> RunOrigin | None:
    origin = _ORIGIN.get()
    return (
        origin if origin is not None and Path(origin.out_dir).resolve() == out.resolve() else None
    )


def _git(folder: Path, *args: str) -> str | None:
    """stdout of `git args` run in `folder` (read-only: no optional locks), None on any error."""
    try:
        done = subprocess.run(
            ["git", "--no-optional-locks", *args],
            cwd=folder,
            text=True,
            capture_output=True,
            timeout=GIT_TIMEOUT_S,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def code_version(package_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The code a run ran: the installed posttrain version and, when `package_dir` (default:
    this package's source folder) is tracked in a git checkout, its HEAD commit and whether
    the checkout has changes (`git status --porcelain`, untracked files included); both None
    without git."""
    folder = Path(package_dir) if package_dir is not None else Path(__file__).resolve().parents[1]
    out: dict[str, Any] = {
        "package": "posttrain",
        "version": _version("posttrain"),
        "path": str(folder),
        "git_commit": None,
        "git_dirty": None,
    }
    head = _git(folder, "rev-parse", "HEAD")
    # a copy installed in site-packages inside some checkout is not that checkout's code
    if head and _git(folder, "ls-files", "--", "__init__.py"):
        status = _git(folder, "status", "--porcelain")
        out.update(git_commit=head, git_dirty=None if status is None else bool(status))
    return out


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str]:
    """Installed versions (importlib.metadata) of `names`; packages not installed are left out."""
    return {n: v for n in names if (v := _version(n)) is not None}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _items_sha256(name: str, options: dict, size: int, seed: int) -> str:
    """sha256 of the (question, answer) lines of a reasoning-gym dataset, in order; the global
    `random` state is left as it was."""
    import reasoning_gym

    state = random.getstate()
    try:
        ds = reasoning_gym.create_dataset(name, size=size, seed=seed, **options)
        h = hashlib.sha256()
        for i in range(len(ds)):
            item = ds[i]
            h.update(json.dumps([item["question"], str(item["answer"])]).encode() + b"\n")
        return h.hexdigest()
    finally:
        random.setstate(state)


def data_lineage(cfg: Any) -> dict[str, Any]:
    """The data of `cfg.task` with sha256 hashes ({} for a config without a task): a data file's
    (or own data's `data.train` file's) path, size and sha256 (an object's type only); a
    reasoning-gym task's spec (name, options, train_size with the training seed `cfg.seed`,
    eval_size with `eval_seed`, the reasoning-gym version, `demo_options` where set), its
    `spec_sha256`, and `train_sha256` of the training questions generated from `options` (None
    above `QUESTIONS_HASH_MAX`)."""
    task = getattr(cfg, "task", None)
    if task is None:
        return {}
    own = getattr(getattr(cfg, "data", None), "train", None)
    if own is not None and not isinstance(own, (str, os.PathLike)):
        return {"kind": "object", "type": type(own).__name__}
    if own is not None or task.is_file:
        path = Path(own if own is not None else task.name)
        return {
            "kind": "file",
            "path": str(path.resolve()),
            "bytes": path.stat().st_size,
            "sha256": _sha256_file(path),
        }
    spec = {
        "task": task.name,
        "options": task.options,
        "train_size": task.train_size,
        "train_seed": cfg.seed,
        "eval_size": task.eval_size,
        "eval_seed": task.eval_seed,
        "reasoning_gym": _version("reasoning_gym"),
    }
    if task.demo_options is not None:  # the demonstrations' slice of the task
        spec["demo_options"] = task.demo_options
    train = (
        _items_sha256(task.name, task.options, task.train_size, cfg.seed)
        if task.train_size <= QUESTIONS_HASH_MAX
        else None
    )
    return {
        "kind": "reasoning_gym",
        **spec,
        "spec_sha256": _sha256_json(spec),
        "train_sha256": train,
    }


def _is_run(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (
        (folder / LINEAGE_FILE).is_file() or (folder / LOCK_FILE).exists()
    )


def _enclosing_run(path: Path) -> Path | None:
    """The nearest run folder above `path` (a policy, checkpoint or data file inside a run)."""
    for folder in path.resolve().parents:
        if _is_run(folder):
            return folder
    return None


def _entry(parent: Path, out: Path, via: str) -> dict[str, str]:
    parent = parent.resolve()
    return {"path": os.path.relpath(parent, out.resolve()), "abs": str(parent), "via": via}


def check_parents(cfg: Any, out: Path, sub_runs: Sequence[str] = ()) -> list[dict[str, str]]:
    """The parents of the run of `cfg` in `out` (see the module docstring), checked before
    anything is written: a declared parent must be an existing run folder, and a data file
    `task.name` must exist.

    Raises:
        ValueError: naming a missing parent folder or data file.
    """
    origin = _origin(out)
    parents = []
    init_from = getattr(getattr(cfg, "model", None), "init_from", None)
    if init_from is not None:
        if (run := _enclosing_run(Path(init_from))) is not None:
            parents.append(_entry(run, out, "model.init_from"))
    else:
        parents += [_entry(out / s, out, "sub_run") for s in sub_runs]
    task = getattr(cfg, "task", None)
    if task is not None and task.is_file:
        if not Path(task.name).is_file():
            raise ValueError(f"Config.task.name={task.name!r}: no such data file")
        if (run := _enclosing_run(Path(task.name))) is not None:
            parents.append(_entry(run, out, "task.name"))
    for declared in origin.parents if origin else ():
        folder = Path(declared)
        if not folder.is_dir():
            raise ValueError(f"parent run {declared!r} does not exist; pass an existing run folder")
        if not (folder / "config.json").is_file():
            raise ValueError(f"parent run {declared!r} is not a run folder (it has no config.json)")
        parents.append(_entry(folder, out, "declared"))
    return parents


def _recipe(cfg: Any, origin: RunOrigin | None) -> dict[str, str | None]:
    cls = type(cfg)
    config_class = f"{cls.__module__}.{cls.__qualname__}"
    name = file = None
    if origin is not None and origin.recipe:
        name, file = origin.recipe, origin.recipe_file
    elif cls.__module__.startswith("posttrain_recipe_"):
        name = cls.__module__.removeprefix("posttrain_recipe_")
        with contextlib.suppress(TypeError, OSError):
            file = inspect.getsourcefile(cls)
    else:
        name = SDK_RECIPES.get(config_class)
    return {"name": name, "file": file, "config_class": config_class}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _command(origin: RunOrigin | None) -> str:
    return origin.command if origin is not None and origin.command else shlex.join(sys.argv)


def write_lineage(
    cfg: Any, out: Path, config: dict[str, Any], parents: list[dict[str, str]]
) -> dict[str, Any]:
    """Write `out/lineage.json` for a run starting now (`config`: the dict of config.json;
    `parents` from `check_parents`); a resumed run (`cfg.resume` and a lineage on disk) keeps
    it and appends the resume to `resumes`. Returns what was written."""
    origin, path = _origin(out), out / LINEAGE_FILE
    code, host = code_version(), socket.gethostname()
    if getattr(cfg, "resume", False) and path.is_file():
        record = json.loads(path.read_text())
        record.setdefault("resumes", []).append(
            {
                "started": _now(),
                "command": _command(origin),
                "hostname": host,
                "code": code,
                "run": str(out.resolve()),
            }
        )  # a moved or copied folder resumes in its new place
    else:
        rerun_of = origin.rerun_of if origin is not None else None
        record = {
            "schema": 1,
            "run": str(out.resolve()),
            "recipe": _recipe(cfg, origin),
            "started": _now(),
            "command": _command(origin),
            "hostname": host,
            "python": platform.python_version(),
            "code": code,
            "packages": package_versions(),
            "data": data_lineage(cfg),
            "parents": parents,
            "rerun_of": None if rerun_of is None else str(Path(rerun_of).resolve()),
            "config": config,
            "resumes": [],
        }
    write_text_atomic(path, json.dumps(record, indent=2, default=str))
    return record


def read_lineage(folder: str | os.PathLike) -> dict[str, Any]:
    """The lineage.json of run folder `folder`.

    Raises:
        ValueError: if the folder has none (naming it).
    """
    path = Path(folder) / LINEAGE_FILE
    if not path.is_file():
        raise ValueError(
            f"{folder} has no {LINEAGE_FILE}: not a run folder, or a run started "
            "before runs recorded their lineage"
        )
    return json.loads(path.read_text())
