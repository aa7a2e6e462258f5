"""The state of a run folder, decided in one place for every view of it: `runs_table()` and
`posttrain runs`, a sweep's table (`posttrain.workflows.sweep`) and whether a sweep submits a
run again.

    finished     results.json, not marked interrupted
    running      a live process holds the run's lock (`posttrain.core.run_lock.lock_holder`:
                 asked of the lock, so a killed process is not taken for a live one)
    failed       the run raised: stopped.json holds the exception line (`run_outcome`)
    interrupted  stopped by Ctrl-C at a whole step (results.json marked interrupted), or by a
                 Ctrl-C elsewhere (stopped.json)
    dead         none of these: the process ended without a word (SIGKILL, out of memory, a
                 node lost, a job's time limit) or ran code that records nothing

in that order: a resumed run that holds its lock is running, whatever an earlier attempt left.
A run started by a recipe's entry point (`recorded_run`: `run_sft`, the SFT -> RL run, the DPO
and reward-model recipes), by `posttrain run` or by a launched job (`posttrain.launch`) records
its failure and releases its folder when it ends; a run started by other code in a notebook
(`start_run` in a function of a cell) stays "running" until the notebook's kernel ends.

Example:
    >>> import tempfile
    >>> run_state(tempfile.mkdtemp()).status
    'dead'
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from posttrain.core.run_lock import lock_holder, read_stopped, run_outcome
from posttrain.core.run_permissions import run_permissions

__all__ = ["STATUSES", "RunState", "recorded_run", "run_state", "run_status"]

STATUSES = ("finished", "running", "failed", "interrupted", "dead")
DEAD = (
    "no results.json and no live process holds the run: it was killed (SIGKILL, out of "
    "memory, a node lost, a time limit) or ended without recording why"
)

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class RunState:
    """A run folder's state.

    Attributes:
        status: one of `STATUSES`.
        detail: failed / interrupted: the exception line ("RuntimeError: diverged") or the
            step it stopped at; dead: why it is taken for dead; running: the lock's holder
            ("pid N on host H"); finished: None.
    """

    status: str
    detail: str | None = None

    @property
    def error(self) -> str | None:
        """What the tables show in their "error" column: `detail` for a failed, interrupted
        or dead run, else None."""
        return None if self.status in ("finished", "running") else self.detail


def _results(folder: Path) -> dict[str, Any] | None:
    path = folder / "results.json"
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or being replaced right now
        return None
    return results if isinstance(results, dict) else None


def run_state(folder: str | os.PathLike) -> RunState:
    """The state of the run in `folder` (see the module docstring), read now."""
    folder = Path(folder)
    results = _results(folder)
    if results is not None and not results.get("interrupted"):
        return RunState("finished")
    holder = lock_holder(folder)
    if holder is not None:
        return RunState("running", holder)
    stopped = read_stopped(folder)
    if stopped is not None and stopped.get("status") in ("failed", "interrupted"):
        return RunState(stopped["status"], stopped.get("error"))
    if results is not None:
        done, planned = results.get("steps_done"), results.get("steps_planned")
        return RunState(
            "interrupted", None if done is None else f"interrupted after step {done} of {planned}"
        )
    return RunState("dead", DEAD)


def run_status(folder: str | os.PathLike) -> str:
    """`run_state(folder).status`: finished, running, failed, interrupted or dead."""
    return run_state(folder).status


def recorded_run(entry: F) -> F:
    """Decorator of a recipe's entry point `entry(cfg, ...)`: runs it inside
    `posttrain.core.run_lock.run_outcome(cfg.out_dir)`, so a run it started that raises is
    recorded as failed (or interrupted) and its folder is released however it ends; the run's
    files get the modes of `cfg.checkpoint.permissions` (None: the environment's setting,
    private if unset; `posttrain.core.run_permissions`: the umask while it runs, and every file
    of the run folder set to the modes when it ends, by `run_outcome`)."""

    @functools.wraps(entry)
    def run(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        setting = getattr(getattr(cfg, "checkpoint", None), "permissions", None)
        with run_permissions(setting or None), run_outcome(getattr(cfg, "out_dir", None)):
            return entry(cfg, *args, **kwargs)

    return run  # type: ignore[return-value]
