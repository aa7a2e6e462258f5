"""Run a recipe's `main` (or any function) as a job from a notebook cell, with submitit:
in this process ("debug"), as processes on this machine ("local") or on Slurm ("slurm"); the
executors, and what each can provide, are `posttrain.launch.executors`.

`launch(target, cfg)` checks that `target` and `cfg` pickle (they travel to the job with
cloudpickle), submits `target(cfg)` and returns a `Run`: state, logs, live metrics from
`cfg.out_dir/metrics.jsonl`, wait, cancel, result, and a table in the notebook. Inside the job
each task joins a torch.distributed process group when the job has several tasks, acts on Slurm's
warning signal at the Trainer's next step boundary (`posttrain.core.preemption`) and, when requeued
after preemption or a time limit, calls `target` again with `cfg.resume=True`.
`<folder>/run.json` lets `Run.attach(folder)` find the job again from another process, e.g.
after a kernel restart. docs/runbooks/slurm.md is the operator's guide.

Parallel plans: a cfg whose `plan` or `parallel` field holds a `ParallelPlan` (or `plan=`, which
`launch` writes into that field) is checked against the job's world size (nodes x
tasks_per_node) and the model spec the cfg names (`spec` or `model`) before anything is
submitted or written (`posttrain.launch.plans` has the rule). A bad plan is a ValueError naming
the field (`cfg.parallel.tp=3`) and the allowed values.

Example ("debug" runs the function here and now, never opens pdb):
    >>> def add(x, y=1):
    ...     return x + y
    >>> run = launch(add, 41, executor="debug")
    >>> run.state, run.result()
    ('COMPLETED', 42)
    >>> launch(lambda: 1 / 0, executor="debug").result()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    posttrain.launch.run.JobFailedError: job DEBUG_... failed ...ZeroDivisionError...
"""

from __future__ import annotations

import datetime
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from submitit.core.utils import FailedJobError
from submitit.local.debug import DebugExecutor

from posttrain.core.checkpoint_files import make_private_dir
from posttrain.launch.executors import EXECUTORS, check_resources, make_executor
from posttrain.launch.job import _Call, _resolvable  # noqa: F401  (_resolvable: tests)
from posttrain.launch.pickling import _check_pickles
from posttrain.launch.plans import check_plan_memory, resolve_plan
from posttrain.launch.run import JobFailedError, Run
from posttrain.launch.run_record import RUN_FILE, write_run_record

if TYPE_CHECKING:
    from posttrain.train.parallel import ParallelPlan

__all__ = ["launch", "launch_array", "Run", "JobFailedError", "EXECUTORS", "RUN_FILE"]


# ----------------------------------------------------------------------------- launch


def launch(
    target: Callable[..., Any],
    cfg: Any = None,
    *,
    executor: str = "local",
    nodes: int = 1,
    tasks_per_node: int = 1,
    gpus_per_node: int = 0,
    cpus_per_task: int = 1,
    timeout_min: float = 60,
    partition: str | None = None,
    folder: str | os.PathLike | None = None,
    name: str | None = None,
    max_num_timeout: int = 10,
    master_addr: str | None = None,
    slurm_kwargs: dict[str, Any] | None = None,
    plan: ParallelPlan | None = None,
) -> Run:
    """Submit `target(cfg)` (or `target()` when cfg is None) as a job; return its `Run`.

    Args:
        target: a recipe's `main` or any function. Defined in a notebook (or a module the job
            cannot import), it travels by value with cloudpickle, closures included.
        cfg: its one argument, usually a recipe `Config`. A dataclass with a `resume` field is
            resubmitted with `resume=True` after preemption or a time limit; any other cfg is
            resubmitted unchanged, so such a function starts again from scratch. A cfg with an
            `out_dir` sets the default `folder` and is where `Run.metrics()` reads.
        executor: "local" (processes on this machine, surviving a kernel restart), "slurm"
            (sbatch through submitit; needs srun/sbatch/sacct and Slurm accounting) or "debug"
            (runs `target` here and now, in this process; a failure is raised by
            `Run.result()`, never by a debugger prompt). With a cfg `out_dir`, what the target
            prints goes to `<out_dir>/launch/debug.log` (`Run.logs()` reads it) and the cell
            gets one line per run; without one, the output stays in this process's.
        nodes: nodes of the job ("local" and "debug": 1).
        tasks_per_node: processes per node. With more than one task in all, every task joins a
            torch.distributed process group (RANK, WORLD_SIZE, MASTER_ADDR/PORT exported; NCCL
            when `gpus_per_node` and CUDA are available, else gloo) and leaves it at the end.
            "debug" runs one task only and refuses more.
        gpus_per_node: GPUs per node; each task sees one of them (CUDA_VISIBLE_DEVICES narrowed
            to the local rank's device).
        cpus_per_task: CPUs per task ("slurm"; ignored elsewhere).
        timeout_min: wall-clock limit in minutes (rounded up to whole minutes on Slurm). Slurm
            sends the warning signal (USR2) 90 s before it (`signal_delay_s` in slurm_kwargs).
        partition: Slurm partition (None: the cluster's default).
        folder: where `run.json` and submitit's files (pickles, logs under `%j/`) go; must be
            on a file system every node sees. Default: `<cfg.out_dir>/launch` when cfg has an
            out_dir, else `runs/launch/<name>-<timestamp>` (relative to the current folder).
            Refused while its run.json records a job that has not ended; the record of jobs
            that have ended is replaced.
        name: job name (default: the target's file and name, e.g. "sft.main").
        max_num_timeout: how many times the job may be requeued after a time limit. submitit
            counts a warning signal as a time limit (not a preemption) once the job has run for
            min(0.8 x timeout_min, timeout_min - 10) minutes, which is from the start for
            timeouts under 10 minutes, so the default is generous (10).
        master_addr: address of the rank-0 host for the process group. Default: the job's
            first node, or 127.0.0.1 (with a warning) if that name does not resolve, as with
            Slurm nodes emulated on one host.
        slurm_kwargs: more SlurmExecutor parameters by submitit's names (mem_gb, account, qos,
            constraint, signal_delay_s, setup, srun_args, additional_parameters, ...).
        plan: a `ParallelPlan` for the job, written into the cfg's `plan` or `parallel` field
            (a copy of the cfg; the field must exist and hold None, a one-rank plan or this
            plan). Without it, the plan the cfg carries there (if any) is the job's. Either way
            it is checked before anything is submitted: its axes multiply to nodes x
            tasks_per_node and it fits the model the cfg names in `spec` or `model`
            (`posttrain.launch.plans`). A plan of one rank (the default ParallelPlan()) is no
            plan: the ranks are plain data-parallel replicas.

    Returns:
        A `Run` (the job may still be pending; "debug" returns a finished one); `run.plan` is
        the job's plan (None without one).

    Raises:
        ValueError: an unknown executor, a resource count that the executor cannot provide
            (or a `timeout_min` that is not a finite number > 0), an unknown Slurm parameter,
            a `folder` whose run.json records a job that has not ended (cancel it first), or a
            plan that does not fit the job or the model (naming the field, e.g.
            `cfg.parallel.tp=3`, and the allowed values). Nothing has been submitted or written.
        TypeError: `target` is not callable, or `plan` is not a ParallelPlan.
        LaunchPickleError: `target` or `cfg` cannot be pickled; names the innermost attribute
            at fault (e.g. `cfg.tokenizer._lock`). Nothing has been submitted or written.
        RuntimeError: executor="slurm" where Slurm's commands are not installed, or a failed
            submission (sbatch's message).

    Example:
        >>> launch(lambda c: c["n"] * 2, {"n": 21}, executor="debug").result()
        42
    """
    return _submit(target, [cfg], cfg is not None, locals())[0]


def launch_array(
    target: Callable[..., Any],
    cfgs: Sequence[Any],
    *,
    executor: str = "local",
    nodes: int = 1,
    tasks_per_node: int = 1,
    gpus_per_node: int = 0,
    cpus_per_task: int = 1,
    timeout_min: float = 60,
    partition: str | None = None,
    folder: str | os.PathLike | None = None,
    name: str | None = None,
    max_num_timeout: int = 10,
    master_addr: str | None = None,
    slurm_kwargs: dict[str, Any] | None = None,
    plan: ParallelPlan | None = None,
    on_run: Callable[[int, Run | None], None] | None = None,
) -> list[Run]:
    """Submit `target(cfg)` for every cfg of `cfgs` (a sweep) in one go; one `Run` each.

    On Slurm this is one job array (`sbatch --array`; `slurm_kwargs={"array_parallelism": k}`
    caps how many run at once); "local" starts one job per cfg, "debug" runs them in turn.
    Arguments as in `launch`, except that `folder` defaults to the first cfg's
    `<out_dir>/launch` only for a single cfg: a sweep gets `runs/launch/<name>-<timestamp>`.
    Every cfg (and its plan; `plan=` goes into each) is checked before anything is submitted.

    `on_run(i, run)` (optional) hears of each run as it goes, so that a notebook can show a
    sweep's progress while "debug" runs it here: for "debug", `on_run(i, None)` just before
    `cfgs[i]` starts and `on_run(i, run)` once it has ended; for "local" and "slurm",
    `on_run(i, run)` for each run once all are submitted. Called after every check passed;
    what it raises is raised (the runs not yet started then do not run).

    Raises: as `launch`; ValueError also for an empty `cfgs`, TypeError for an `on_run` that
    is not callable.

    Example:
        >>> [r.result() for r in launch_array(abs, [-1, 2], executor="debug")]
        [1, 2]
    """
    return _submit(target, list(cfgs), True, locals())


def _submit(
    target: Callable[..., Any], cfgs: list[Any], has_cfg: bool, options: dict[str, Any]
) -> list[Run]:
    o = {k: v for k, v in options.items() if k not in ("target", "cfg", "cfgs")}
    executor, nodes, tasks_per_node = o["executor"], o["nodes"], o["tasks_per_node"]
    gpus_per_node, timeout_min, name = o["gpus_per_node"], o["timeout_min"], o["name"]
    if not callable(target):
        raise TypeError(
            f"target={target!r} is not callable; pass the function to run (e.g. a "
            "recipe's main), and its argument as cfg"
        )
    if not cfgs:
        raise ValueError("launch_array needs at least one cfg")
    hook = o.get("on_run")
    if hook is not None and not callable(hook):
        raise TypeError(f"on_run={hook!r} is not callable; pass a function of (index, run)")
    on_run = hook or (lambda i, run: None)
    check_resources(
        executor,
        nodes,
        tasks_per_node,
        gpus_per_node,
        o["cpus_per_task"],
        timeout_min,
        o["max_num_timeout"],
    )
    if o["slurm_kwargs"] and executor != "slurm":
        raise ValueError(f"slurm_kwargs are for executor='slurm', not {executor!r}")
    num_tasks = nodes * tasks_per_node
    cfgs, plans = _resolve_plans(cfgs, o["plan"], nodes, tasks_per_node)
    for cfg, plan in zip(cfgs, plans):
        check_plan_memory(cfg, plan, executor=executor, tasks_per_node=tasks_per_node)
    name = _job_name(target) if name is None else str(name)
    calls = [
        _Call(
            target,
            cfg,
            has_cfg=has_cfg,
            num_tasks=num_tasks,
            gpus_per_node=gpus_per_node,
            master_addr=o["master_addr"],
            in_job=executor != "debug",
        )
        for cfg in cfgs
    ]
    for i, call in enumerate(calls):
        _check_pickles(call, name + (f" (cfgs[{i}])" if len(calls) > 1 else ""))
    out_dirs = [_out_dir(cfg) for cfg in cfgs]
    folder = o["folder"]
    if executor == "debug":  # runs here, now, in turn; DebugExecutor writes nothing under folder
        ex = DebugExecutor(folder or ".")
        done: list[Run] = []
        for i, (call, out_dir, plan) in enumerate(zip(calls, out_dirs, plans)):
            on_run(i, None)
            done.append(Run._run_debug(ex.submit(call), name, out_dir, plan))
            on_run(i, done[-1])
        return done

    if folder is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        folder = (
            out_dirs[0] / "launch"
            if len(cfgs) == 1 and out_dirs[0] is not None
            else Path("runs", "launch", f"{name}-{stamp}")
        )
    folder = Path(folder).expanduser().absolute()
    _refuse_running_job(folder)
    log_folder = folder / "%j"
    created = _first_missing(folder)
    before = set(folder.iterdir()) if created is None else set()
    make_private_dir(folder)  # job pickles and results unpickle as code: 0700, this user's only
    ex = make_executor(
        executor,
        log_folder,
        max_num_timeout=o["max_num_timeout"],
        timeout_min=timeout_min,
        nodes=nodes,
        tasks_per_node=tasks_per_node,
        gpus_per_node=gpus_per_node,
        cpus_per_task=o["cpus_per_task"],
        partition=o["partition"],
        name=name,
        slurm_kwargs=o["slurm_kwargs"],
    )
    try:
        jobs = ex.submit_array(calls)
    except FailedJobError as e:  # sbatch refused: leave nothing of this attempt behind
        _remove_new(folder, before, created)
        hint = (
            ""
            if os.environ.get("SLURM_CONF") or executor != "slurm"
            else (
                " SLURM_CONF is not set: export SLURM_CONF=<path to the cluster's slurm.conf> (for "
                "the local cluster, the line scripts/slurm-up.sh prints)."
            )
        )
        raise RuntimeError(f"{executor} refused the job:{hint}\n{e}") from None
    runs = [
        Run(
            job,
            executor=executor,
            folder=folder,
            log_folder=log_folder,
            out_dir=out_dir,
            target=name,
            num_tasks=num_tasks,
            index=i,
            plan=plan,
        )
        for i, (job, out_dir, plan) in enumerate(zip(jobs, out_dirs, plans))
    ]
    write_run_record(
        folder,
        executor=executor,
        name=name,
        target=target,
        log_folder=log_folder,
        num_tasks=num_tasks,
        runs=runs,
        parameters=ex.parameters,
    )
    for i, run in enumerate(runs):
        on_run(i, run)
    return runs


def _resolve_plans(
    cfgs: list[Any], plan: ParallelPlan | None, nodes: int, tasks_per_node: int
) -> tuple[list[Any], list[ParallelPlan | None]]:
    """Every cfg with `plan` written in (when given) and its checked plan
    (`posttrain.launch.plans.resolve_plan`); a sweep's errors name the cfg (`cfgs[2]: ...`)."""
    resolved = []
    for i, cfg in enumerate(cfgs):
        try:
            resolved.append(resolve_plan(cfg, plan, nodes=nodes, tasks_per_node=tasks_per_node))
        except ValueError as e:
            if len(cfgs) == 1:
                raise
            raise ValueError(f"cfgs[{i}]: {e}") from None
    return [c for c, _ in resolved], [p for _, p in resolved]


def _refuse_running_job(folder: Path) -> None:
    """Raise ValueError if `folder/run.json` records a job that has not ended: a second launch
    would overwrite its record (it could no longer be attached or cancelled) and both jobs would
    write the same files. The record of jobs that have all ended is replaced."""
    if not (folder / RUN_FILE).is_file():
        return
    try:
        runs = Run.attach_array(folder)
    except ValueError as e:
        raise ValueError(
            f"{folder} already holds a {RUN_FILE} that cannot be checked ({e}); "
            "remove it, or pass another out_dir or folder"
        ) from None
    running = [r for r in runs if not r.done()]
    if running:
        ids = ", ".join(f"{r.job_id} ({r.state})" for r in running)
        raise ValueError(
            f"{folder} belongs to job {ids}, which has not ended: launching there "
            "would overwrite its record and its files. Cancel it first "
            f"(Run.attach_array({str(folder)!r}) and .cancel() each; "
            f"Run.attach({str(folder)!r}).cancel() for one job), or pass another "
            "out_dir or folder"
        )


def _first_missing(folder: Path) -> Path | None:
    """The topmost of `folder` and its parents that does not exist yet (None if folder exists)."""
    missing = None
    while not folder.exists():
        missing, folder = folder, folder.parent
    return missing


def _remove_new(folder: Path, before: set[Path], created: Path | None) -> None:
    """Remove the files a failed submission put in `folder`, and the folders it created."""
    for p in set(folder.iterdir()) - before if folder.exists() else ():
        if p.is_file():
            p.unlink()
    if created is not None:
        for d in [folder, *folder.parents]:
            try:
                d.rmdir()
            except OSError:
                break
            if d == created:
                break


def _job_name(target: Callable[..., Any]) -> str:
    """`<file>.<name>` of the function: the stem of the file that defines it (`sft.main` for a
    recipe file, whatever module name its loader gave it), or the last part of its module's
    name when that module has no file here; the name alone for `__main__` and builtins."""
    module = getattr(target, "__module__", None) or ""
    file = getattr(sys.modules.get(module), "__file__", None) if module != "__main__" else None
    if file and Path(file).name != "__init__.py":
        module = Path(file).name.split(".")[0]
    module = module.rsplit(".", 1)[-1]
    base = (getattr(target, "__name__", None) or type(target).__name__).strip("<>")
    full = base if module in ("", "__main__", "builtins") else f"{module}.{base}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", full).strip("_") or "job"


def _out_dir(cfg: Any) -> Path | None:
    out = cfg.get("out_dir") if isinstance(cfg, dict) else getattr(cfg, "out_dir", None)
    return None if out is None else Path(out).expanduser().absolute()
