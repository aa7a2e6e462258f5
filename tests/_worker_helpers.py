"""Shared pieces of the verifier-worker tests (tests/rewards/test_budgets.py,
tests/rewards/test_verifier_workers.py): a quick verifier, and how to see whether a worker process
and what it started are gone and how much CPU a process used.

This module travels to the workers by value (as notebook functions do), like the test modules
that use it: by reference a worker would have to import it from tests/, which is not on its path.
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import psutil

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def quick(completion, item):
    """A few milliseconds of pure-Python work."""
    return float(sum(range(100_000)) > 0)


def note_pid_then_spin(completion, item):
    """Appends this process's pid to the file item["pids"], then never returns, holding the CPU."""
    with open(item["pids"], "a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        pass


def timed(fn):
    """`fn()` and the wall-clock seconds it took."""
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for init counts as ended: it runs nothing)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def live_in_groups(pgids: set[int]) -> list[int]:
    """Live (non-zombie) processes whose process group is one of `pgids`."""
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) in pgids and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system
