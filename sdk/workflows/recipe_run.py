"""The start and the end that every recipe's run shares (`RecipeRun`), so that a recipe's entry
point holds its own stages and nothing else:

    @recorded_run                                      # stopped.json: failed / interrupted
    def run_x(cfg):
        run = RecipeRun.start(cfg, sub_runs=("sft",))  # checks, run folder, lock, config.json,
        ...                                            #   lineage, seed; run.plan: the plan
        runtime = run.parallelize(policy.model, spec=policy.spec)  # the plan checked at start
        trainer = Trainer(..., **run.trainer_options(runtime))  # run_dir, checkpoints, seed, ...
        metrics = trainer.fit(steps)
        run.stop_if_interrupted(trainer, {...})        # Ctrl-C: results.json marked interrupted
        policy = ...                                   # under a plan: the gathered weights
        if run.others_return():                        # ranks > 0 wait for rank 0's results
            return None
        ...                                            # rank 0: evaluate, save
        run.write(results, markdown)                   # results.json + results.md
        return run.done(results)                       # the other ranks are released

What each step does is in `posttrain.workflows.config_paths.validate` (the config, once),
`posttrain.workflows.task_data.check_task_fits`, `posttrain.workflows.parallel.check_world_size`
(the plan against the job's world size and model, once: the `CheckedPlan` that
`run.parallelize` hands to `posttrain.train.parallelize`), `posttrain.workflows.reports`
(`start_run`, `stop_if_interrupted`, `write_results`) and
`posttrain.workflows.run_state.recorded_run`; this module puts them in their one order.

Ranks: a run is shared by the ranks of a process group under a `parallel` plan, or with
`data_parallel` (SFT's plain data parallelism); then rank 0 alone evaluates and writes while the
others wait, and only rank 0 returns the results. Otherwise every process runs the recipe as
its own run.

Example:
    >>> import tempfile
    >>> from posttrain.workflows.config import TaskConfig
    >>> from posttrain.workflows.sft import SFTConfig
    >>> cfg = SFTConfig(task=TaskConfig(eval_size=0, train_size=64),
    ...                 out_dir=tempfile.mkdtemp() + "/run")
    >>> run = RecipeRun.start(cfg)
    >>> run.plan is None, run.writes, (run.out / "config.json").is_file()
    (True, True, True)
    >>> run.done({"steps": 0})
    {'steps': 0}
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from posttrain.core.distributed import barrier, rank_and_world_size
from posttrain.core.trackers import Trackers
from posttrain.train.engine import Engine
from posttrain.train.parallel import ParallelPlan
from posttrain.train.plan_value import CheckedPlan
from posttrain.train.runtime import PlanRuntime, Runtime
from posttrain.train.sharding import parallelize
from posttrain.workflows.config_paths import validate
from posttrain.workflows.parallel import check_world_size, plan_of
from posttrain.workflows.reports import start_run, stop_if_interrupted, write_results
from posttrain.workflows.task_data import check_task_fits

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from posttrain.models.specs import ModelSpec

__all__ = ["RecipeRun", "RunRefused"]

RUN_FILES = ("config.json", "lineage.json")
"""What `start_run` writes and the trackers are started with (the resolved config, lineage)."""


class RunRefused(ValueError):
    """A run refused at its start, before anything was written: a bad config, a task whose data
    does not fit it, a `parallel` plan that does not fit the job (no process group, too few
    ranks), a used run folder, a resume whose config differs from the saved one, a missing
    parent run or data file. The message names the field and the fix; `posttrain run` prints
    it as its one-line error (exit code 2) where any other exception keeps its traceback."""


@dataclass(frozen=True)
class RecipeRun:
    """A recipe's run between its start and its results.

    Attributes:
        cfg: the recipe config (validated again at the start).
        out: the run folder.
        plan: the config's `ParallelPlan`, or None without one (`plan_of`).
        shared: whether the ranks of a process group share the run (rank 0 writes).
        started: `time.perf_counter()` when the run started.
        checked: the plan as checked at the start against the job's world size and the
            config's model (`check_world_size`), or None without a plan.
        trackers: the experiment trackers of `cfg.logging` (`posttrain.core.trackers`),
            started with config.json and lineage.json, on the writing process; else None.
    """

    cfg: Any
    out: Path
    plan: ParallelPlan | None
    shared: bool
    started: float
    checked: CheckedPlan | None = None
    trackers: Trackers | None = None

    @classmethod
    def start(
        cls, cfg: Any, *, sub_runs: Sequence[str] = (), data_parallel: bool = False
    ) -> RecipeRun:
        """Start a run of `cfg`: validate it once (a notebook may have changed a section in
        place since it was built), check that the task's data fits it (`check_task_fits`),
        check its plan against the job's world size and model in one call
        (`check_world_size`: `run.checked`), then `start_run` (refuse a used folder or a
        changed resume, claim the folder, write config.json and lineage.json, seed torch).
        `sub_runs`: the stage folders inside it ("sft"); `data_parallel`: the ranks of a
        process group train one run without a plan.

        Raises:
            RunRefused: (a ValueError) before anything is written, naming the field (see
                `validate`, `check_task_fits`, `check_world_size` and `start_run`).
            FieldTypeError: for a section of the wrong type (see `validate`).
            RunDirInUseError: if another live process holds the folder.
        """
        started = time.perf_counter()
        try:
            validate(cfg)
            check_task_fits(cfg)
            checked = check_world_size(cfg)
            out = start_run(cfg, sub_runs=sub_runs, checked=True)
        except ValueError as e:
            if isinstance(e, TypeError):  # a section of the wrong type: a notebook's bug
                raise
            raise RunRefused(str(e)) from e
        plan = plan_of(cfg)
        shared = plan is not None or data_parallel
        trackers = None
        if getattr(cfg, "logging", None) is not None and (
            not shared or rank_and_world_size()[0] == 0
        ):
            trackers = cfg.logging.build(out)
            trackers.start(*(_read_json(out / f) for f in RUN_FILES))
        return cls(
            cfg=cfg,
            out=out,
            plan=plan,
            shared=shared,
            started=started,
            checked=checked,
            trackers=trackers,
        )

    def parallelize(
        self,
        model: nn.Module,
        *,
        spec: ModelSpec | None = None,
        mesh: DeviceMesh | None = None,
    ) -> PlanRuntime:
        """Split `model` by the run's plan as checked when the run started (`checked`; not
        checked again unless `spec`, its `ModelSpec`, differs from the config's model's):
        `posttrain.train.parallelize`. Returns the `PlanRuntime` the trainers take. `mesh`: the
        device mesh of a model already split by this run (`runtime.mesh`), so a second model
        (RL's frozen reference) is split on the same ranks; None builds the plan's mesh.

        Raises:
            ValueError: for a run without a plan (`plan` is None), or as
                `posttrain.train.parallelize`.
        """
        if self.checked is None:
            raise ValueError(
                "this run has no parallel plan (Config.parallel at its defaults): nothing "
                "to split; check run.plan is not None first"
            )
        return parallelize(self.checked, model, spec=spec, mesh=mesh)

    @property
    def writes(self) -> bool:
        """Whether this process evaluates and writes: rank 0 of a shared run, or any process
        running its own."""
        return not self.shared or rank_and_world_size()[0] == 0

    def seconds(self) -> float:
        """Wall seconds since the run started."""
        return time.perf_counter() - self.started

    def trainer_options(
        self, runtime: Runtime | None, *, callbacks: Sequence[Any] = ()
    ) -> dict[str, Any]:
        """The keywords of a stage's trainer (`Trainer`, `RLTrainer`) that every recipe takes
        from its config the same way: the run folder (`run_dir`), `checkpoint.every` and
        `checkpoint.keep_last`, `optim.max_grad_norm`, `progress`, `seed`, `resume`, the
        `runtime` of the model split by the plan (None without one), and `callbacks`: the
        recipe's own, then the run's `trackers` (every metrics row goes to them)."""
        cfg = self.cfg
        return {
            "callbacks": [*callbacks, *([self.trackers] if self.trackers else [])],
            "max_grad_norm": cfg.optim.max_grad_norm,
            "run_dir": self.out,
            "checkpoint_every": cfg.checkpoint.every,
            "keep_last": cfg.checkpoint.keep_last,
            "progress": cfg.progress,
            "seed": cfg.seed,
            "resume": cfg.resume,
            "runtime": runtime,
        }

    def stop_if_interrupted(self, trainer: Engine, results: dict[str, Any]) -> None:
        """After `trainer.fit`: on Ctrl-C, results.json marked interrupted (with `results`, what
        the run knows so far) and `RunInterrupted` (`reports.stop_if_interrupted`); the
        trackers are closed first."""
        if trainer.interrupted and self.trackers is not None:
            self.trackers.finish()
        stop_if_interrupted(trainer, self.out, results)

    def others_return(self) -> bool:
        """On the ranks that do not write (a shared run's ranks > 0): wait until rank 0 has
        written the results (its `done`), then True: the caller returns None. False where this
        process writes. Call it after the last collective (gathering the weights)."""
        if self.writes:
            return False
        barrier()
        return True

    def write(self, results: dict[str, Any], markdown: str) -> None:
        """`results.json` and `results.md` in the run folder (`reports.write_results`). With
        trackers: the run folder's plots go to them, they are closed, and `results["trackers"]`
        gets their `report()` (per tracker, its failure count and first error); a run without
        trackers writes no such key."""
        if self.trackers is not None:
            self.trackers.finish(self.out)
            if report := self.trackers.report():
                results["trackers"] = report
        write_results(self.out, results, markdown)

    def done(self, results: dict[str, Any]) -> dict[str, Any]:
        """The end of a run on the writing process: release the ranks waiting in
        `others_return` (a shared run) and return `results`."""
        if self.shared:
            barrier()
        return results


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
