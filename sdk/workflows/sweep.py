"""Ablation sweeps from a cell: `sweep(recipe, grid, seeds=...)` runs every arm of a grid (the
cartesian product of its value lists) once per seed, through `posttrain.launch.launch_array`
(in-process "debug", "local" processes or a Slurm job array), and returns a `Sweep` handle.

Layout: `<folder>/<arm>/seed<k>/` is the run folder of an arm and a seed (`out_dir`), with the
usual results.json, metrics.jsonl, eval_*.csv and lineage.json; `<folder>/sweep.json` records the
recipe, grid, seeds and baseline; `<folder>/launch/` holds the job files. Submitting the same
sweep again (same folder) does not rerun a finished run (its config.json must match, else
ValueError), leaves a running one alone, and resumes (`resume=True`) one that failed, was
interrupted or died. A run's status is its folder's (`posttrain.workflows.run_state.run_state`,
as `runs_table()` has it) once its job has started it; a failed run shows its exception line in
the table and does not stop the others.

The live table, in a notebook, with every executor: "debug" runs the runs in turn inside
`sweep(...)`, which shows the table meanwhile, refreshed in place as each run starts and ends
(`posttrain.launch.live_view.LiveHTML`); "local" and "slurm" return at once and `Sweep.watch()`
refreshes the table every few seconds. Outside a notebook no table is drawn (a log stays
quiet: a "debug" run prints one line naming its log file).

Statistics (`Sweep.summary`, `posttrain.workflows.sweep_stats`):
  - per arm, the mean of the headline metric (`posttrain.workflows.lineage.main_metric`, e.g.
    held-out accuracy after the last stage) over its finished seeds, with a 95% interval that
    respects the metric's range: for an accuracy, a cluster bootstrap over seeds x items (3+
    seeds) or the item-level Wilson interval (fewer, labelled); for a metric without per-item
    values, the Student-t interval over seeds (3+ seeds) or none ("too few seeds");
  - against the baseline arm: the paired difference on the same held-out items, run for run
    with the same seed (the items are checked to be the same questions in the same order), by
    the same rule (cluster bootstrap over seeds, or the item-level paired bootstrap, labelled).
    The `interval` and `diff_interval` columns name the method.

Example:
    >>> s = sweep("sft", {"optim.lr": [1e-3, 3e-3]}, seeds=[0, 1], executor="debug",
    ...           base=load_recipe("sft").TINY, baseline="optim.lr=0.001")  # doctest: +SKIP
    >>> s.summary()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import itertools
import json
import math
import numbers
import os
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pandas as pd

from posttrain.launch import EXECUTORS, JobFailedError, Run, launch_array
from posttrain.launch.live_view import LiveHTML
from posttrain.launch.records import last_metrics_row, watch_until_done
from posttrain.workflows.arms import NEEDED as _NEEDED
from posttrain.workflows.arms import Arm, arms_of_grid, baseline_arm, plain_value
from posttrain.workflows.config import override
from posttrain.workflows.lineage import main_metric
from posttrain.workflows.recipes import load_config_file, load_recipe
from posttrain.workflows.reports import _check_resumed_config, read_table
from posttrain.workflows.run_state import run_state, run_status
from posttrain.workflows.sweep_plot import plot_sweep
from posttrain.workflows.sweep_stats import paired_interval, seed_interval, t_quantile

__all__ = ["SWEEP_FILE", "Arm", "Sweep", "sweep", "t_quantile"]

SWEEP_FILE = "sweep.json"


def _base_config(module: ModuleType, base: Any, config: str | os.PathLike | None) -> Any:
    cfg = module.Config()
    if config is not None:
        cfg = load_config_file(cfg, str(config))
    if isinstance(base, Mapping):
        cfg = override(cfg, dict(base))
    elif base is not None:
        if type(base) is not type(cfg):
            raise ValueError(
                f"sweep: base must be a {type(cfg).__qualname__} or a mapping of "
                f"dotted overrides, got {type(base).__qualname__}"
            )
        cfg = base
    missing = [f for f in _NEEDED if not any(x.name == f for x in dataclasses.fields(cfg))]
    if missing:
        raise ValueError(
            f"sweep: recipe config {type(cfg).__qualname__} lacks "
            f"{', '.join(missing)}; a sweep needs out_dir, seed and resume fields"
        )
    return cfg


def sweep(
    recipe: str | os.PathLike[str] | ModuleType,
    grid: Mapping[str, Sequence[Any]],
    *,
    seeds: Sequence[int] = (0,),
    base: Any = None,
    config: str | os.PathLike | None = None,
    baseline: str | Mapping[str, Any] | None = None,
    executor: str = "local",
    folder: str | os.PathLike | None = None,
    **launch_options: Any,
) -> Sweep:
    """Run `recipe` for every arm of `grid` and every seed of `seeds`; returns at once (with
    executor="debug" the runs happen in this process, in turn, before it returns, and in a
    notebook the sweep's table shows meanwhile, refreshed in place as each run starts and
    ends; `Sweep.watch()` is the live table of the other executors).

    Args:
        recipe: a recipe name or file (`posttrain.workflows.recipes.load_recipe`), or a module
            with `Config` and `main`.
        grid: dotted config key -> list of values; the arms are the cartesian product.
        seeds: training seeds (`cfg.seed`); every arm runs each.
        base: the config the arms start from: a mapping of dotted overrides of `Config()`
            (e.g. the recipe's TINY), or a `Config`; `config` (a YAML preset) applies first.
        baseline: the arm the others are compared with, by name ("optim.lr=0.001") or values
            ({"optim.lr": 0.001}).
        executor, **launch_options: as `posttrain.launch.launch_array` (nodes, tasks_per_node,
            timeout_min, partition, slurm_kwargs={"array_parallelism": k}, ...).
        folder: the sweep folder (default runs/sweeps/<recipe>-<timestamp>).

    Raises:
        ValueError: before anything is submitted or written, for a grid key that is not a
            config field (listing the valid keys), an empty grid or value list, a repeated
            value (1 and 1.0 are one), no seeds, a repeated or non-integer seed, a bad executor
            or launch option, a baseline that is not an arm, or a finished run folder whose
            config differs from its arm's.
    """
    if not isinstance(recipe, (str, os.PathLike)) and not callable(getattr(recipe, "main", None)):
        raise ValueError(
            f"sweep: recipe={recipe!r}; must be a recipe name or file, or a module "
            "with Config and main"
        )
    module = load_recipe(os.fspath(recipe)) if isinstance(recipe, (str, os.PathLike)) else recipe
    name = (
        Path(str(recipe)).stem
        if isinstance(recipe, (str, os.PathLike))
        else module.__name__.removeprefix("posttrain_recipe_")
    )
    cfg = _base_config(module, base, config)
    arms = arms_of_grid(cfg, grid)
    base_arm = baseline_arm(baseline, arms)
    listed = (
        list(seeds)
        if isinstance(seeds, Iterable) and not isinstance(seeds, (str, bytes, Mapping))
        else None
    )
    if (
        not listed
        or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in listed)
        or len(set(map(int, listed))) != len(listed)
    ):
        raise ValueError(
            "sweep: seeds must be distinct integers in a list (at least one; not "
            f"bools), e.g. [0, 1, 2], got {seeds!r}"
        )
    seed_list = [int(s) for s in listed]
    if executor not in EXECUTORS:
        raise ValueError(f"sweep: executor={executor!r}; allowed: {', '.join(EXECUTORS)}")
    if folder is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        folder = Path("runs", "sweeps", f"{name}-{stamp}")
    if (
        not isinstance(folder, (str, os.PathLike))
        or Path(folder).exists()
        and not Path(folder).is_dir()
    ):
        raise ValueError(f"sweep: folder={folder!r}; must be the path of a folder (or of none)")
    folder = Path(folder).absolute()
    cells: dict[tuple[str, int], Run | None] = {}
    todo: list[tuple[tuple[str, int], Any]] = []  # (arm name, seed), the run's recipe Config
    for arm, seed in itertools.product(arms, seed_list):
        out = folder / arm.name / f"seed{seed}"
        run_cfg = override(cfg, {**arm.values, "seed": seed, "out_dir": str(out), "resume": False})
        status = run_status(out) if (out / "config.json").is_file() else None
        if status is not None:
            _check_resumed_config(
                json.loads((out / "config.json").read_text()), dataclasses.asdict(run_cfg), out
            )
        cells[arm.name, seed] = None
        if status in (None, "failed", "interrupted", "dead"):
            todo.append(((arm.name, seed), dataclasses.replace(run_cfg, resume=status is not None)))
    handle = Sweep(folder, arms, seed_list, base_arm, cells)
    if todo:  # launch_array checks its options before it submits or writes anything
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        keys = [key for key, _ in todo]
        live = _LiveRuns(handle, keys) if executor == "debug" else None
        try:
            runs = launch_array(
                module.main,
                [c for _, c in todo],
                executor=executor,
                folder=None if executor == "debug" else folder / "launch" / stamp,
                name=f"sweep-{name}",
                on_run=live,
                **launch_options,
            )
        except BaseException:
            if live is not None:
                live.stopped()
            raise
        cells.update(zip(keys, runs))
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "recipe": name,
        "grid": {k: plain_value(list(v)) for k, v in grid.items()},
        "seeds": seed_list,
        "baseline": None if base_arm is None else base_arm.name,
        "arms": [dataclasses.asdict(a) for a in arms],
    }
    (folder / SWEEP_FILE).write_text(json.dumps(record, indent=2, default=str))
    return handle


class _LiveRuns:
    """`launch_array`'s `on_run` for a "debug" sweep: the sweep's table in a notebook
    (`posttrain.launch.live_view.LiveHTML`, nothing elsewhere), refreshed as each run starts
    (its row "running", the later ones "pending") and ends (its row from its folder)."""

    def __init__(self, sweep: Sweep, keys: list[tuple[str, int]]) -> None:
        self.sweep, self.keys = sweep, keys
        self.view = LiveHTML(sweep._repr_html_)
        sweep._queued.update(dict.fromkeys(keys, "pending"))

    def __call__(self, i: int, run: Run | None) -> None:
        if run is None:
            self.sweep._queued[self.keys[i]] = "running"
        else:
            del self.sweep._queued[self.keys[i]]
            self.sweep.runs[self.keys[i]] = run
        self._show()

    def stopped(self) -> None:
        """The sweep stopped (Ctrl-C, an error) after the table showed: the run it was in
        shows its folder's state (interrupted, failed), the ones never started "not started"."""
        queued = self.sweep._queued
        for key, status in list(queued.items()):
            if status == "running":
                del queued[key]
            else:
                queued[key] = "not started"
        if self.view.updates:
            self._show()

    def _show(self) -> None:
        """Refresh the table; a table that cannot be drawn is a warning, never a stopped run."""
        try:
            self.view.update()
        except Exception as e:  # noqa: BLE001 - the runs matter more than their table
            warnings.warn(f"sweep table not refreshed ({type(e).__name__}: {e})", stacklevel=2)


class Sweep:
    """The handle `sweep` returns: `table()` (live), `wait()`, `watch()`, `summary()`, `plot()`.

    `runs` maps (arm name, seed) to the `posttrain.launch.Run` submitted this time, or None for
    a run found finished (or running) in its folder.
    """

    def __init__(
        self,
        folder: Path,
        arms: list[Arm],
        seeds: list[int],
        baseline: Arm | None,
        runs: dict[tuple[str, int], Run | None],
    ) -> None:
        self.folder, self.arms, self.seeds, self.baseline = folder, arms, seeds, baseline
        self.runs = runs
        self._queued: dict[tuple[str, int], str] = {}  # "debug" runs not ended: shown status

    def out_dir(self, arm: str, seed: int) -> Path:
        """The run folder of arm `arm` (its name) and seed `seed`."""
        return self.folder / arm / f"seed{seed}"

    def _state(self, arm: str, seed: int) -> tuple[str, str | None]:
        """(status, error): while a "debug" sweep runs, its runs not ended yet are pending,
        running or (stopped early) not started; else the job's while it has not ended
        (pending, running), then the run folder's (`run_state`, whatever the job says: a later
        attempt may have run it); a job that ended before its run started is failed, with the
        job's error."""
        if (arm, seed) in self._queued:
            return self._queued[arm, seed], None
        run, out = self.runs.get((arm, seed)), self.out_dir(arm, seed)
        if run is not None and not run.done():
            return ("pending" if run.status() == "PENDING" else "running"), None
        if not (out / "config.json").is_file():
            return "failed", self._job_error(run) or "the job ended without starting the run"
        state = run_state(out)
        return state.status, state.error

    @staticmethod
    def _job_error(run: Run | None) -> str | None:
        """How a job that ended without COMPLETED ended: its exception line, or its state."""
        if run is None or not run.done() or run.status() == "COMPLETED":
            return None
        try:
            run.result()
        except JobFailedError as e:
            return _error_line(str(e))
        return f"job ended {run.status()}"

    def table(self) -> pd.DataFrame:
        """One row per (arm, seed), read now: arm, the grid values, seed, status (pending,
        running, finished, failed, interrupted, dead: as `runs_table()` has it once the job
        started the run; "not started" for the runs a stopped "debug" sweep never reached),
        step (last metrics.jsonl row), metric, value (the headline, once finished), error (a
        failed run's exception line, why a dead one is taken for dead), out_dir."""
        rows = []
        for arm, seed in itertools.product(self.arms, self.seeds):
            out = self.out_dir(arm.name, seed)
            status, error = self._state(arm.name, seed)
            results = _results(out) if status == "finished" else None
            metric, value = main_metric(results) if results else (None, None)
            step = last_metrics_row(out / "metrics.jsonl").get("step")
            rows.append(
                {
                    "arm": arm.name,
                    **arm.values,
                    "seed": seed,
                    "status": status,
                    "step": step,
                    "metric": metric,
                    "value": value,
                    "error": error,
                    "out_dir": str(out),
                }
            )
        return pd.DataFrame(rows)

    def done(self) -> bool:
        """True once no run is pending or running."""
        return (
            not self._queued
            and all(r is None or r.done() for r in self.runs.values())
            and not any(
                run_status(self.out_dir(a, s)) == "running"
                for (a, s), r in self.runs.items()
                if r is None and (self.out_dir(a, s) / "config.json").is_file()
            )
        )

    def wait(self, timeout: float | None = None, poll_s: float = 1.0) -> pd.DataFrame:
        """Block until every run has ended; returns `table()`. Raises TimeoutError when runs
        are still going after `timeout` seconds (they keep running)."""
        start = time.monotonic()
        while not self.done():
            if timeout is not None and time.monotonic() - start >= timeout:
                raise TimeoutError(
                    f"sweep {self.folder}: runs still going after {timeout:g} s "
                    "(they keep running; sweep.table() shows them)"
                )
            time.sleep(poll_s)
        return self.table()

    def watch(self, every_s: float = 2.0, timeout: float | None = None) -> pd.DataFrame:
        """Show `table()` refreshed every `every_s` s until every run has ended (Jupyter: one
        output updated in place; elsewhere a printed table whenever it changes). Ctrl-C stops
        watching, not the runs. Returns the last table."""
        watch_until_done(
            self.done,
            as_html=lambda: self.table().to_html(index=False),
            as_text=lambda: self.table().drop(columns=["out_dir"]).to_string(index=False),
            every_s=every_s,
            timeout=timeout,
            stopped="stopped watching; the runs go on (sweep.table() shows them)",
        )
        return self.table()

    def summary(self) -> pd.DataFrame:
        """One row per arm: arm, grid values, seeds (finished), metric, mean, ci_low, ci_high,
        interval (the method, or why there is none: see the module docstring) and, with a
        baseline, diff, diff_ci_low, diff_ci_high, paired_items, diff_interval and note (why a
        comparison is missing)."""
        table = self.table()
        rows = []
        for arm in self.arms:
            done = table[(table.arm == arm.name) & (table.status == "finished")]
            done = done[done["value"].notna()]
            values = done["value"].astype(float).tolist()
            tables = [_item_table(self.out_dir(arm.name, seed)) for seed in done["seed"]]
            items = [t for t in tables if t is not None and "correct" in t]
            correct = (
                [t["correct"].astype(bool).tolist() for t in items]
                if len(items) == len(tables)
                else None
            )
            row = {
                "arm": arm.name,
                **arm.values,
                "seeds": len(values),
                "metric": done["metric"].iloc[0] if len(done) else None,
                **seed_interval(values, correct),
            }
            if self.baseline is not None:
                row.update(self._paired(arm, self.baseline, done["seed"].tolist()))
            rows.append(row)
        return pd.DataFrame(rows)

    def _paired(self, arm: Arm, baseline: Arm, seeds: list[int]) -> dict[str, Any]:
        empty = {
            "diff": math.nan,
            "diff_ci_low": math.nan,
            "diff_ci_high": math.nan,
            "paired_items": 0,
            "diff_interval": None,
        }
        if arm == baseline:
            return {**empty, "note": "baseline"}
        mine, theirs, unpaired = [], [], []
        for seed in seeds:
            a, b = self.out_dir(arm.name, seed), self.out_dir(baseline.name, seed)
            if run_status(b) != "finished":
                unpaired.append(seed)
                continue
            ta, tb = _item_table(a), _item_table(b)
            if ta is None or tb is None:
                return {**empty, "note": "no per-item evaluation table"}
            if ta["question"].tolist() != tb["question"].tolist():
                return {
                    **empty,
                    "note": f"seed {seed}: held-out items differ from the "
                    "baseline's (a grid key changes the evaluation set)",
                }
            mine.append(ta["correct"].astype(bool).tolist())
            theirs.append(tb["correct"].astype(bool).tolist())
        if not mine:
            return {**empty, "note": "no seed finished for both this arm and the baseline"}
        return {
            **paired_interval(mine, theirs),
            "note": unpaired
            and f"seeds {unpaired} left out: the baseline did not finish them"
            or None,
        }

    def plot(self, ax=None):
        """The headline metric per arm: one dot per seed, the mean with its 95% interval, and
        the baseline's mean as a dashed line; with a baseline, a second panel of the paired
        differences with their intervals and zero (`posttrain.workflows.sweep_plot`). Returns
        the `matplotlib.figure.Figure`, made outside pyplot (`posttrain.core.figures`): it
        shows as the cell's value (`s.plot()`) or through `display(fig)`, and leaves
        matplotlib's backend as it is."""
        return plot_sweep(
            self.summary(),
            self.table(),
            [arm.name for arm in self.arms],
            None if self.baseline is None else self.baseline.name,
        )

    def _repr_html_(self) -> str:
        return f"<p>sweep {html.escape(str(self.folder))}</p>" + self.table().drop(
            columns=["out_dir"]
        ).to_html(index=False)

    def __repr__(self) -> str:
        return f"Sweep({self.folder}, {len(self.arms)} arms x {len(self.seeds)} seeds)"


def _results(out: Path) -> dict[str, Any] | None:
    path = out / "results.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _item_table(out: Path) -> pd.DataFrame | None:
    """The per-item evaluation table behind the headline metric: eval_after_rl.csv for an RL
    run (`after_<algo>`), else eval_after.csv."""
    results = _results(out) or {}
    metric, _ = main_metric(results)
    name = (
        "eval_after_rl.csv"
        if metric and metric.startswith(f"after_{results.get('algo')}")
        else "eval_after.csv"
    )
    return read_table(out / name, required=True) if metric and (out / name).is_file() else None


def _error_line(message: str) -> str:
    """The exception line of a JobFailedError message (its remote traceback's last line)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        if ("Error" in line or "Exception" in line) and not line.startswith(("File ", "raise")):
            return line[:300]
    return lines[0][:300] if lines else message
