"""The handle of a launched job (`posttrain.launch.submit.launch` returns one): state, logs, live
metrics, wait, cancel, result, a table in the notebook, and `Run.attach(folder)` to find the job
again from another process (e.g. after a kernel restart) through the run.json that `launch`
wrote (`posttrain.launch.run_record`).

States are submitit's (Slurm's `sacct` states for "slurm"; for "local" they are read from the
job controller's process and result files). Results are read from submitit's result pickles.
"""

from __future__ import annotations

import contextlib
import datetime
import html
import os
import signal
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from submitit.core.utils import JobPaths, pickle_load

from posttrain.launch.records import (
    _ACTIVE,
    _NEVER_STARTS,
    _controller_alive,
    _fmt,
    _headline,
    _no_metrics,
    _peek_outcome,
    _squeue_reason,
    _tail,
    last_metrics_row,
    watch_until_done,
)
from posttrain.launch.run_record import RUN_FILE, attach_fields, read_run_record

if TYPE_CHECKING:
    from posttrain.train.parallel import ParallelPlan

__all__ = ["Run", "JobFailedError", "RUN_FILE"]


class JobFailedError(RuntimeError):
    """A job raised, was cancelled, ended without a result, or can never start (Slurm keeps it
    pending for a reason that will not clear). The message holds the remote traceback (or the
    state and the end of the error log, or the pending reason) and the paths of the job's logs."""


# ----------------------------------------------------------------------------- Run


class Run:
    """A submitted job: its state, logs, live metrics, result; shown as a table in a notebook.

    Attributes:
        job_id: the scheduler's id ("12345", "12345_3" in a job array; the controller's process
            id for "local"; "DEBUG_..." for "debug").
        executor: "local", "slurm" or "debug".
        folder: the launch folder holding run.json (None for "debug").
        out_dir: the cfg's out_dir (absolute), where `metrics()` reads; None without one.
        target: the job's name (module and function).
        num_tasks: processes in the job.
        plan: the job's `ParallelPlan` as `launch` checked it (None without one; recorded in
            run.json, so `attach` gives it back).
        job: the submitit Job (a DebugJob that has run, for "debug").

    Example:
        >>> from posttrain.launch.submit import launch
        >>> run = launch(len, "abc", executor="debug")
        >>> run  # doctest: +ELLIPSIS
        Run(job_id='DEBUG_...', state='COMPLETED', executor='debug', target='len')
        >>> run.done(), run.logs()
        (True, '')
    """

    _refresh_s = 2.0  # at most one sacct call per this many seconds per Run

    def __init__(
        self,
        job: Any,
        *,
        executor: str,
        folder: Path | None,
        log_folder: Path | None,
        out_dir: Path | None,
        target: str,
        num_tasks: int,
        index: int = 0,
        plan: ParallelPlan | None = None,
    ) -> None:
        self.job, self.executor, self.folder = job, executor, folder
        self.log_folder, self.out_dir, self.target = log_folder, out_dir, target
        self.num_tasks, self.index, self.plan = num_tasks, index, plan
        self.job_id: str = job.job_id if job is not None else ""
        self._final: str | None = None
        self._last_force = float("-inf")
        self._debug_outcome: tuple[str, Any] | None = None
        self._reason: str | None = None
        self._reason_at = float("-inf")

    # ------------------------------------------------------------- construction

    @classmethod
    def _run_debug(
        cls, job: Any, name: str, out_dir: Path | None, plan: ParallelPlan | None = None
    ) -> Run:
        run = cls(
            job,
            executor="debug",
            folder=None,
            log_folder=None,
            out_dir=out_dir,
            target=name,
            num_tasks=1,
            plan=plan,
        )
        # DebugJob.result() would open pdb on a failure (stuck in a kernel without stdin), and
        # each exception() call runs a failed function again: call exception() exactly once.
        # What the target prints goes to <out_dir>/launch/debug.log (appended), not the cell.
        log = run._debug_log()
        with _output_to(log):
            try:
                error = job.exception()  # catches Exception only
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - sys.exit() in target is the job's failure
                error = e
        run._debug_outcome = (
            ("error", error) if error is not None else ("success", job.submission().result())
        )
        if log is not None:
            print(f"{name} -> {run.status()}: output in {log}")
        return run

    def _debug_log(self) -> Path | None:
        """Where a "debug" run's output goes: <out_dir>/launch/debug.log (None without out_dir:
        the output stays in this process's)."""
        return None if self.out_dir is None else Path(self.out_dir) / "launch" / DEBUG_LOG

    @classmethod
    def attach(cls, folder: str | os.PathLike, index: int | None = None) -> Run:
        """The Run recorded in `folder/run.json` (a launch folder, or an out_dir whose
        `launch/` holds one), e.g. from a new kernel after a restart. Attaching reads JSON only;
        `result()` then unpickles the job's result file from that folder (see `result`).

        Args:
            folder: the launch folder (or its run.json, or the cfg's out_dir).
            index: which job of a job array (None: the folder must hold exactly one job).

        Raises:
            FileNotFoundError: no run.json there.
            ValueError: a run.json that is not valid JSON or not a record written by
                `launch`, a job array without `index`, an index out of range, or a "local"
                job of another host.
        """
        return cls(**attach_fields(folder, index))

    @classmethod
    def attach_array(cls, folder: str | os.PathLike) -> list[Run]:
        """Every Run recorded in `folder/run.json` (see `attach`)."""
        first = cls.attach(folder, 0)
        assert first.folder is not None  # an attached run has its launch folder
        count = len(read_run_record(first.folder / RUN_FILE)["jobs"])
        return [first] + [cls.attach(first.folder, i) for i in range(1, count)]

    # ------------------------------------------------------------- state

    def status(self) -> str:
        """The job's state: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, or another Slurm
        state (TIMEOUT, REQUEUED, PREEMPTED, NODE_FAIL, OUT_OF_MEMORY, UNKNOWN ...). A
        "local" job is RUNNING, then COMPLETED, FAILED or CANCELLED."""
        if self._final is not None:
            return self._final
        if self.executor == "debug":
            assert self._debug_outcome is not None  # set by _run_debug
            return "COMPLETED" if self._debug_outcome[0] == "success" else "FAILED"
        outcomes = self._outcomes()
        if self.executor == "local":
            if self._local_alive():
                return "RUNNING"
            if all(o == "success" for o in outcomes):
                state = "COMPLETED"
            elif "error" not in outcomes and self._cancel_marker().exists():
                state = "CANCELLED"
            else:
                state = "FAILED"
            self._final = state
            return state
        now = time.monotonic()
        mode = "force" if now - self._last_force >= self._refresh_s else "cache"
        if mode == "force":
            self._last_force = now
        info = self.job.get_info(mode=mode)
        state = ((info.get("State") or "UNKNOWN").split() or ["UNKNOWN"])[0].upper()
        if state in ("PENDING", "UNKNOWN", "RUNNING", "COMPLETING") and None not in outcomes:
            state = "COMPLETED" if all(o == "success" for o in outcomes) else "FAILED"
        return state

    @property
    def state(self) -> str:
        """Same as `status()`."""
        return self.status()

    def done(self) -> bool:
        """True once the job has ended (in any state); it will not run again."""
        return self.status() not in _ACTIVE

    def pending_reason(self) -> str | None:
        """Why Slurm keeps the job waiting (squeue's reason: Resources, Priority,
        PartitionConfig, ...; read at most every 2 s); None when it is not a pending Slurm job
        or Slurm gives no reason."""
        if self.executor != "slurm" or self.status() not in ("PENDING", "UNKNOWN"):
            return None
        now = time.monotonic()
        if now - self._reason_at >= self._refresh_s:
            self._reason_at = now
            self._reason = _squeue_reason(self.job_id)
        return self._reason

    def wait(self, timeout: float | None = None, poll_s: float = 0.5) -> str:
        """Block until the job has ended, checking every `poll_s` seconds (Slurm: sacct at most
        every 2 s); returns its final state. `timeout`: seconds to wait at most (None: no limit).

        Raises:
            TimeoutError: still not ended after `timeout` seconds (the job keeps running).
            JobFailedError: Slurm keeps the job pending for a reason that never clears by
                itself (PartitionConfig, PartitionNodeLimit, ...: it asks for more than the
                partition allows). The job stays queued until `cancel()`.
        """
        start = time.monotonic()
        while not self.done():
            reason = self.pending_reason()
            if reason is not None and reason.split(",")[0] in _NEVER_STARTS:
                raise JobFailedError(
                    f"job {self.job_id} ({self.target}) can never start: Slurm keeps it pending "
                    f"with reason {reason} (it asks for more nodes, tasks, CPUs or time than "
                    "the partition, account or QOS allows; `scontrol show partition` lists the "
                    "limits). It stays queued: run.cancel() (scancel) removes it; then launch "
                    "again with resources that fit."
                )
            if timeout is not None and time.monotonic() - start >= timeout:
                why = f" (reason: {reason})" if reason else ""
                raise TimeoutError(
                    f"job {self.job_id} ({self.target}) is still {self.status()}"
                    f"{why} after {timeout:g} s; it keeps running (run.cancel() "
                    "stops it, run.logs() shows its output)"
                )
            time.sleep(poll_s)
        return self.status()

    def cancel(self) -> None:
        """Stop the job now, as `scancel` does: on Slurm `scancel`; locally SIGKILL to the job's
        process group (its controller runs in a session of its own, with the tasks). Not
        SIGINT: a Trainer takes Ctrl-C as a clean stop, and the recipe would go on to evaluate,
        save and end COMPLETED. Does nothing to a job that has ended."""
        if self.executor == "debug" or self.done():
            return
        if self.executor == "slurm":
            self.job.cancel(check=True)
            return
        self._cancel_marker().parent.mkdir(parents=True, exist_ok=True)
        self._cancel_marker().write_text(datetime.datetime.now().isoformat() + "\n")
        if self._local_alive():
            try:
                os.killpg(int(self.job_id), signal.SIGKILL)
            except ProcessLookupError:
                pass
        process = getattr(self.job, "_process", None)
        if process is not None:
            process.wait()  # reap it

    # ------------------------------------------------------------- results

    def result(self) -> Any:
        """What `target` returned (rank 0's value in a job of several tasks; see `results`).
        Waits for the job to end.

        The value comes from unpickling the job's result file (`<log_folder>/<job id>_<task>
        _result.pkl`, written by submitit in the job), and unpickling can run code: read results
        only from launch folders that you or your jobs wrote (`launch` creates them 0700).

        Raises:
            JobFailedError: the job raised (the message has the remote traceback and the log
                paths), returned something that cannot be pickled, was cancelled or ended
                without a result (the message has its state and the end of its error log).
        """
        return self.results()[0]

    def results(self) -> list[Any]:
        """One value per task, by global rank. Waits for the job to end.

        Raises: as `result`.
        """
        if self.executor == "debug":
            assert self._debug_outcome is not None  # set by _run_debug
            outcome, value = self._debug_outcome
            if outcome == "error":
                tb = value.__traceback__  # from the target's frame on: skip submitit and _Call
                while (
                    tb is not None
                    and tb.tb_next is not None
                    and (
                        tb.tb_frame.f_code.co_filename == __file__
                        or f"{os.sep}submitit{os.sep}" in tb.tb_frame.f_code.co_filename
                    )
                ):
                    tb = tb.tb_next
                tb = "".join(traceback.format_exception(type(value), value, tb)).rstrip()
                raise JobFailedError(
                    f"job {self.job_id} ({self.target}) failed in this process (executor='debug')"
                    f":\n{tb}\n(the original exception is this error's __cause__; "
                    "pdb.post_mortem(err.__cause__.__traceback__) inspects it)"
                ) from value
            return [value]
        self.wait()
        state = self.status()
        outcomes = self._outcomes()
        if "error" in outcomes:
            i = outcomes.index("error")
            trace = pickle_load(self._paths(i).result_pickle)[1].rstrip()
            failed = [k for k, o in enumerate(outcomes) if o == "error"]
            raise JobFailedError(
                f"job {self.job_id} ({self.target}) failed (state {state}; task(s) {failed} "
                f"raised). Remote traceback of task {i}:\n{trace}\n{self._log_hint(i)}"
            )
        if None in outcomes and self.executor == "slurm" and state == "COMPLETED":
            deadline = time.monotonic() + 15  # a shared file system may show the files late
            while None in outcomes and time.monotonic() < deadline:
                time.sleep(1)
                outcomes = self._outcomes()
        if None in outcomes:
            i = outcomes.index(None)
            err = _tail(self._paths(i).stderr, 20)
            raise JobFailedError(
                f"job {self.job_id} ({self.target}) ended in state {state} without a result "
                f"(task {i} wrote none)."
                + (f" End of its error log:\n{err}\n" if err else " ")
                + self._log_hint(i)
            )
        return [pickle_load(self._paths(i).result_pickle)[1] for i in range(self.num_tasks)]

    # ------------------------------------------------------------- logs and metrics

    def logs(self, tail: int | None = 50, stream: str = "stdout", task: int = 0) -> str:
        """The last `tail` lines (None: all) of a task's stdout or stderr; "" before the job
        writes any. "debug": the tail of <out_dir>/launch/debug.log (both streams), "" without
        an out_dir (its output went to this process).

        Raises:
            ValueError: an unknown stream or a task outside 0..num_tasks-1.
        """
        if stream not in ("stdout", "stderr"):
            raise ValueError(f"stream={stream!r}; allowed: stdout, stderr")
        if not 0 <= task < self.num_tasks:
            raise ValueError(f"task={task}; this job has tasks 0..{self.num_tasks - 1}")
        if self.executor == "debug":
            log = self._debug_log()
            return _tail(log, tail) if log is not None and log.is_file() else ""
        return _tail(getattr(self._paths(task), stream), tail)

    def metrics(self):
        """The job's metrics so far, read from `<out_dir>/metrics.jsonl` as a pandas DataFrame
        (one row per step; a partly written last line is left out). Before the first row: an
        empty DataFrame whose repr says so.

        Raises:
            ValueError: the cfg had no `out_dir`, so there is nowhere to read; or a line other
                than the last is corrupt (`posttrain.core.metrics.read_metrics`).
        """
        if self.out_dir is None:
            raise ValueError(
                f"run {self.job_id} ({self.target}) has no out_dir (its cfg has no "
                "out_dir field), so there are no metrics to read"
            )
        path = self.out_dir / "metrics.jsonl"
        if not path.exists():
            return _no_metrics(f"{path} does not exist (job {self.job_id} is {self.status()})")
        from posttrain.core.metrics import read_metrics

        frame = read_metrics(path)
        return (
            frame
            if len(frame)
            else _no_metrics(f"{path} is empty (job {self.job_id} is {self.status()})")
        )

    # ------------------------------------------------------------- display

    def _summary(self) -> dict[str, Any]:
        try:
            state = self.status()
        except Exception as e:  # noqa: BLE001 - a display must not raise
            state = f"? ({type(e).__name__})"
        try:
            reason = self.pending_reason()
        except Exception:  # noqa: BLE001 - a display must not raise
            reason = None
        row = last_metrics_row(None if self.out_dir is None else self.out_dir / "metrics.jsonl")
        return {
            "job_id": self.job_id,
            "state": state,
            "executor": self.executor,
            "target": self.target,
            "reason": reason,
            "row": row,
        }

    def __repr__(self) -> str:
        s = self._summary()
        extra = "".join(f", {k}={_fmt(v)}" for k, v in _headline(s["row"]).items())
        if s["reason"]:
            extra = f", reason={s['reason']!r}" + extra
        return (
            f"Run(job_id={s['job_id']!r}, state={s['state']!r}, executor={s['executor']!r}, "
            f"target={s['target']!r}{extra})"
        )

    def _repr_html_(self) -> str:
        s = self._summary()
        cells = {
            "job": s["job_id"],
            "state": s["state"],
            "executor": s["executor"],
            "target": s["target"],
            "tasks": self.num_tasks,
        }
        if self.plan is not None:
            cells["plan"] = str(self.plan)
        if s["reason"]:
            cells["reason"] = s["reason"]
        cells.update({k: _fmt(v) for k, v in _headline(s["row"], 4).items()})
        if self.folder is not None:
            cells["folder"] = str(self.folder)
        head = "".join(f"<th>{html.escape(str(k))}</th>" for k in cells)
        body = "".join(f"<td>{html.escape(str(v))}</td>" for v in cells.values())
        return f"<table><tr>{head}</tr><tr>{body}</tr></table>"

    def watch(self, every_s: float = 2.0, timeout: float | None = None) -> str:
        """Show the job's table, refreshed every `every_s` seconds, until it ends or `timeout`
        seconds have passed (in Jupyter: one widget updated in place; elsewhere: a printed line
        whenever it changes). Ctrl-C / a kernel interrupt stops watching, not the job. Returns
        the last state seen."""
        watch_until_done(
            self.done,
            as_html=self._repr_html_,
            as_text=lambda: repr(self),
            every_s=every_s,
            timeout=timeout,
            stopped=f"stopped watching; job {self.job_id} keeps running (run.cancel() stops it)",
        )
        return self.status()

    # ------------------------------------------------------------- internals

    def _paths(self, task: int) -> JobPaths:
        return self.job.task(task).paths if self.num_tasks > 1 else self.job.paths

    def _outcomes(self) -> list[str | None]:
        return [_peek_outcome(self._paths(i).result_pickle) for i in range(self.num_tasks)]

    def _local_alive(self) -> bool:
        process = getattr(self.job, "_process", None)
        if process is not None:
            return process.poll() is None
        return _controller_alive(int(self.job_id))

    def _cancel_marker(self) -> Path:
        return self._paths(0).folder / "cancelled"

    def _log_hint(self, task: int) -> str:
        p = self._paths(task)
        return f"Logs: {p.stdout} and {p.stderr} (run.logs(stream='stderr', task={task}))"


DEBUG_LOG = "debug.log"


@contextlib.contextmanager
def _output_to(log: Path | None) -> Iterator[None]:
    """stdout and stderr (Python-level writes) appended to `log` while the block runs; nothing
    changes for None."""
    if log is None:
        yield
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(log, "a", buffering=1) as f,
        contextlib.redirect_stdout(f),
        contextlib.redirect_stderr(f),
    ):
        yield
