"""Verifier calls on daemon threads: `isolation = "thread"` verifiers (judges, clients of a
judge server) and verifiers that cannot be shipped to a worker process.

A thread cannot be killed: a call past its budget is outcome timeout at `timeout_s` and its
thread is *abandoned*: it runs on until the verifier returns (as a daemon it never blocks
interpreter exit) and its late result is ignored. A verifier run this way must bound its own
time (a request deadline, a generation length); a busy abandoned thread still takes its share
of the interpreter lock, which slows every thread after it. A result's `reason` is cut to
`verifier_worker.MAX_REASON_CHARS` here as in a worker process; what the verifier prints goes to
this process's output (in a worker process it is discarded).
"""

from __future__ import annotations

import math
import numbers
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.rewards.outcome import Outcome, VerifierResult, coerce_result, raised_result
from posttrain.rewards.verifier_worker import capped

Call = tuple[str, Mapping[str, Any]]
"""One verification to run: (completion, item)."""

MAX_TIMEOUT_S = 1e6
"""Largest time budget of one call, in seconds (~11.6 days; the operating system's waits do not
take much longer ones). For no budget at all, pass `timeout_s=None` to `run_verifier`."""


def check_timeout(timeout_s: float | None) -> None:
    """Raise ValueError unless `timeout_s` is None or a real number of seconds in
    (0, MAX_TIMEOUT_S] (not a bool, not NaN or inf)."""
    if timeout_s is None:
        return
    if not (
        isinstance(timeout_s, numbers.Real)
        and not isinstance(timeout_s, bool)
        and math.isfinite(timeout_s)
        and 0 < timeout_s <= MAX_TIMEOUT_S
    ):
        raise ValueError(
            f"timeout_s must be None (no budget) or a number of seconds in "
            f"(0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}"
        )


class _GrowingPool:
    """Daemon worker threads that never make a call wait behind a hung verifier.

    Every submission reserves a free worker or starts a new one, so a task is picked up at once
    even while other workers are stuck in verifiers that never return (those are abandoned:
    once they finish, late, they rejoin the pool). At most `max_idle` free workers are kept.
    Reusing threads matters: starting one costs ~1 ms here, handing work to one ~15 us.
    A forked child process starts with a fresh pool (threads do not survive a fork).
    """

    def __init__(self, max_idle: int = 32) -> None:
        self.max_idle = max_idle
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()  # a lock copied by fork may be held by a lost thread
        self._pid = os.getpid()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._reset()
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
            tasks = self._tasks
            tasks.put(fn)
        if spawn:
            threading.Thread(
                target=self._work, args=(tasks,), name="posttrain-verifier", daemon=True
            ).start()

    def _work(self, tasks: queue.SimpleQueue) -> None:
        while True:
            tasks.get()()
            with self._lock:
                if tasks is not self._tasks or self._idle >= self.max_idle:
                    return
                self._idle += 1


_THREADS = _GrowingPool()


def run_on_threads(
    verifier: Callable, calls: Sequence[Call], *, timeout_s: float, max_workers: int
) -> list[VerifierResult]:
    """Run `verifier` on every (completion, item) of `calls` on daemon threads, at most
    `max_workers` at a time, each with a budget of `timeout_s` seconds from its start. A hung
    call holds its slot until its deadline and is then abandoned. Returns one result per call,
    in order; nothing the verifier does raises here.

    Raises:
        ValueError: if `timeout_s` is not in (0, MAX_TIMEOUT_S] (`check_timeout`).
    """
    check_timeout(timeout_s)
    n = len(calls)
    results: list[VerifierResult | None] = [None] * n
    posted: queue.SimpleQueue = queue.SimpleQueue()  # abandoned threads post here too: ignored
    deadlines: dict[int, float] = {}  # index -> monotonic deadline, in flight

    def start(index: int) -> None:
        completion, item = calls[index]

        def work() -> None:
            try:
                result = coerce_result(verifier(completion, item))
            except BaseException as exc:  # noqa: BLE001 - any failure of user code is data
                result = raised_result(exc)
            posted.put((index, capped(result)))

        _THREADS.submit(work)

    next_index = 0
    while next_index < n or deadlines:
        while next_index < n and len(deadlines) < max_workers:
            deadlines[next_index] = time.monotonic() + timeout_s
            start(next_index)
            next_index += 1
        try:
            index, result = posted.get(timeout=max(0.0, min(deadlines.values()) - time.monotonic()))
        except queue.Empty:
            now = time.monotonic()
            for index in [i for i, deadline in deadlines.items() if deadline <= now]:
                results[index] = VerifierResult.failure(
                    Outcome.TIMEOUT, f"verifier ran past {timeout_s:g} s (on a thread, abandoned)"
                )
                del deadlines[index]
            continue
        if deadlines.pop(index, None) is not None:
            results[index] = result
    return results  # type: ignore[return-value]
