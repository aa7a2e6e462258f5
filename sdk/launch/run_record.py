"""run.json, the record of a launch: `launch` writes it into the launch folder once the job is
submitted, and `Run.attach(folder)` reads it to find the job again from another process (e.g.
after a kernel restart).

The record is JSON (version 1): the executor, the job's name and target, the submitting host and
Python, the launch and log folders, the tasks per job, one entry per job of the array (its id,
the cfg's out_dir, its `ParallelPlan` as a dict) and submitit's parameters that are JSON. It is
written atomically (a reader never sees half a file) and checked when read: a file that is not
a record names what it lacks. Attaching reads JSON only; submitit's job handle is built again
from the recorded ids ("local" jobs only on the host that submitted them).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from posttrain.launch.executors import QuietLocalJob

if TYPE_CHECKING:
    from submitit.core.core import Job

    from posttrain.train.parallel import ParallelPlan

__all__ = ["RUN_FILE", "RecordedJob", "write_run_record", "read_run_record", "attach_fields"]

RUN_FILE = "run.json"
"""File in a launch folder that records what was submitted, for `Run.attach`."""

_RECORD_KEYS = ("executor", "name", "host", "log_folder", "num_tasks", "jobs")


class RecordedJob(Protocol):
    """What a record keeps of one job of a launch: a `posttrain.launch.run.Run` has it."""

    @property
    def job_id(self) -> str: ...

    @property
    def out_dir(self) -> Path | None: ...

    @property
    def plan(self) -> ParallelPlan | None: ...


def write_run_record(
    folder: Path,
    *,
    executor: str,
    name: str,
    target: Any,
    log_folder: Path,
    num_tasks: int,
    runs: Sequence[RecordedJob],
    parameters: Mapping[str, Any],
) -> None:
    """Write `folder/run.json` for the jobs of `runs` (one per job of the array, in order),
    atomically; `parameters` (submitit's) are kept where they are JSON."""
    record = {
        "version": 1,
        "executor": executor,
        "name": name,
        "target": _qualname(target),
        "submitted_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": sys.executable,
        "folder": str(folder),
        "log_folder": str(log_folder),
        "num_tasks": num_tasks,
        "jobs": [
            {
                "job_id": r.job_id,
                "out_dir": None if r.out_dir is None else str(r.out_dir),
                "plan": None if r.plan is None else r.plan.to_dict(),
            }
            for r in runs
        ],
        "parameters": {k: v for k, v in parameters.items() if _jsonable(v)},
    }
    _write_json(folder / RUN_FILE, record)


def read_run_record(path: Path) -> dict[str, Any]:
    """The record in a run.json, checked to have what `Run.attach` reads.

    Raises:
        ValueError: not valid JSON, not a JSON object, a key of the record missing, or 'jobs'
            not a non-empty list of {'job_id', 'out_dir'} entries.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp(), RUN_FILE)
        >>> _ = path.write_text('{"executor": "local", "name": "sft.main"}')
        >>> read_run_record(path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: ...run.json is not a launch record ...: it has no 'host', 'log_folder', ...
    """
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path} is not valid JSON ({e}); it is not a launch record "
            "(written by posttrain.launch.submit), or was damaged"
        ) from None
    if not isinstance(record, dict):
        raise ValueError(f"{path} holds a JSON {type(record).__name__}, not a launch record")
    missing = [k for k in _RECORD_KEYS if k not in record]
    if missing:
        raise ValueError(
            f"{path} is not a launch record written by posttrain.launch.submit: it has "
            f"no {', '.join(repr(k) for k in missing)}"
        )
    jobs = record["jobs"]
    if (
        not isinstance(jobs, list)
        or not jobs
        or not all(isinstance(j, dict) and "job_id" in j and "out_dir" in j for j in jobs)
    ):
        raise ValueError(
            f"{path}: 'jobs' must be a non-empty list of {{'job_id', 'out_dir'}} "
            f"entries, got {jobs!r:.200}"
        )
    return record


def attach_fields(folder: str | os.PathLike, index: int | None) -> dict[str, Any]:
    """What `Run(...)` is built from for job `index` of the record in `folder` (a launch
    folder, its run.json, or an out_dir whose `launch/` holds one): submitit's job handle
    (`job`), the executor, folders, out_dir, target, tasks, index and plan.

    Raises: as `Run.attach`.
    """
    path = Path(folder).expanduser().absolute()
    if path.is_dir():
        path = path / RUN_FILE if (path / RUN_FILE).exists() else path / "launch" / RUN_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {RUN_FILE} in {folder} (nor in {folder}/launch): "
            "pass the folder that launch() printed or returned"
        )
    record = read_run_record(path)
    jobs = record["jobs"]
    if index is None:
        if len(jobs) != 1:
            raise ValueError(
                f"{path} records a job array of {len(jobs)} jobs: pass index= "
                "(0..{}) or use Run.attach_array".format(len(jobs) - 1)
            )
        index = 0
    if not 0 <= index < len(jobs):
        raise ValueError(f"index={index}; {path} records {len(jobs)} job(s)")
    executor, log_folder = record["executor"], Path(record["log_folder"])
    tasks = list(range(record["num_tasks"]))
    entry = jobs[index]
    if executor == "local":
        if record["host"] != socket.gethostname():
            raise ValueError(
                f"{path}: this local job runs on host {record['host']!r}; "
                f"attach to it there, not on {socket.gethostname()!r}"
            )
        job: Job[Any] = QuietLocalJob(folder=log_folder, job_id=entry["job_id"], tasks=tasks)
    elif executor == "slurm":
        from submitit.slurm.slurm import SlurmJob

        job = SlurmJob(folder=log_folder, job_id=entry["job_id"], tasks=tasks)
    else:
        raise ValueError(f"{path}: executor {executor!r} cannot be attached to")
    plan = None
    if entry.get("plan") is not None:  # absent in records written before plans were recorded
        from posttrain.train.parallel import ParallelPlan

        plan = ParallelPlan(**entry["plan"])
    return dict(
        job=job,
        executor=executor,
        folder=path.parent,
        log_folder=log_folder,
        out_dir=None if entry["out_dir"] is None else Path(entry["out_dir"]),
        target=record["name"],
        num_tasks=len(tasks),
        index=index,
        plan=plan,
    )


def _qualname(target: Any) -> str:
    qualname = getattr(target, "__qualname__", type(target).__qualname__)
    return f"{getattr(target, '__module__', '?')}.{qualname}"


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
