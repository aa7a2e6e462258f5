"""Waiting and timing in tests on a shared machine (conftest.py's docstring says how to use
them). A module of its own, not conftest: `from conftest import` resolves to whichever conftest
module pytest imported first (tests/notebook/browser/ has one too)."""

from __future__ import annotations

import time
from collections.abc import Callable

SKIP_NO_SLURM = "no local Slurm cluster: run scripts/slurm-up.sh (needs root and apt)"
WAIT_S = 300.0
"""Default deadline of `wait_for`, seconds: generous, since a wait that holds returns at once."""
RUN_S = 900.0
"""Deadline of a subprocess that trains or benchmarks at tiny size (a minute when quiet)."""
LATE_S = 60.0
"""Seconds a call cut at its budget may return late on a loaded machine (a replacement worker's
start included); work a budget must cut runs far longer (it sleeps or spins for 600 s)."""


def wait_for(
    predicate: Callable[[], object],
    *,
    what: str,
    timeout: float = WAIT_S,
    poll_s: float = 0.05,
    detail: Callable[[], object] | None = None,
) -> object:
    """Poll `predicate()` every `poll_s` seconds until it returns a truthy value; return that
    value. Works in watcher threads too (it only raises).

    Args:
        what: the state waited for, as the failure message names it ("job 12 to write its pid").
        timeout: seconds before giving up (generous: the wait ends as soon as the state holds).
        detail: called once on time-out, its value added to the message (a log tail, a state).

    Raises:
        TimeoutError: "timed out after {timeout} s waiting for {what}" (+ detail).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            message = f"timed out after {timeout:g} s waiting for {what}"
            if detail is not None:
                message += f"; {detail()}"
            raise TimeoutError(message)
        time.sleep(poll_s)


def thread_cpu_s(fn: Callable[[], object]) -> tuple[object, float]:
    """(fn(), CPU seconds the calling thread spent in it: `time.thread_time`). Unlike wall time
    it does not count waiting for a core; it does not count other threads or processes."""
    start = time.thread_time()
    value = fn()
    return value, time.thread_time() - start
