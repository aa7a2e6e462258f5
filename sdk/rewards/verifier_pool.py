"""A bounded pool of killable verifier worker processes: where a budgeted verifier call runs
when its verifier's `isolation` is "process", the default (`posttrain.rewards.verifier_isolation`
reads it and chooses between this pool and threads).

Worker processes are fresh interpreters (`subprocess.Popen` of `verifier_worker.py`: fork + exec),
never a fork of the training process (which holds torch, CUDA or server threads) and never a
re-import of its `__main__` script (what multiprocessing's spawn and forkserver do). Each runs in a
session of its own and is the subreaper of its descendants (Linux `PR_SET_CHILD_SUBREAPER`): a
process a verifier starts stays its descendant even after `setsid` or its own parent's exit, so
killing a worker kills them all first (`WorkerProcess.kill`), and after each call the worker kills
whatever the call left running. Each is started from one long-lived launcher thread and asks Linux
to kill it when that thread ends (`PR_SET_PDEATHSIG`), so a training process killed by SIGKILL
leaves no worker spinning; not covered: processes that a call *still running* at that moment had
started outlive it (between calls a worker has none). A worker's stdout and stderr are discarded
(`/dev/null`: a verifier's prints would flood a notebook; run it with `timeout_s=None` to see them),
and the `reason` it sends back is cut to `verifier_worker.MAX_REASON_CHARS`. A worker gets the
parent's `sys.path` and working directory, and does not import torch unless the verifier does
(posttrain's packages load their re-exports on first use: `posttrain.core.lazy`). The pool starts
lazily, keeps its workers between calls, is shut down at interpreter exit, and is never shared with
a forked child (the child closes its copies of the pipes and starts its own pool when it needs one).

A verifier is shipped to a worker once (cloudpickle, so classes and closures from notebook cells
work) and kept there by key: the same object (a bound method: the same function and instance)
is not pickled or sent again. Changing a verifier's attributes after its first call is not seen
by the workers; build a new object instead. A call's budget starts when its worker starts it:
a worker's start (~0.1 s) and the first load of a verifier (its imports) are not charged to the
call but bounded by `LOAD_TIMEOUT_S`.

A verifier that cannot be shipped (cloudpickle fails on it, or the worker cannot unpickle it:
a lock, an open connection, a module the worker cannot import) runs on a thread, with a warning
that names the part that failed and says how to choose this explicitly (`isolation = "thread"`).
Its work is not lost, but its budget no longer stops CPU-bound loops.

Outcomes added by the process path: timeout (past the budget), error "worker process died"
(the verifier crashed the interpreter or called os._exit), error "did not load" (unpickling ran
past `LOAD_TIMEOUT_S`), error "did not pickle" for an item or completion that cannot be sent.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import pickle
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

import cloudpickle

from posttrain.core.threads import available_cpus
from posttrain.rewards.outcome import Outcome, VerifierResult
from posttrain.rewards.verifier_threads import Call, run_on_threads
from posttrain.rewards.verifier_worker import (
    MAX_REPLY_BYTES,
    Launcher,
    WorkerProcess,
    dumps_message,
    what_does_not_pickle,
)

DEFAULT_MAX_WORKERS = 8
"""Most verifier calls `score_batch` runs at the same time by default (and the most worker
processes a pool keeps, further bounded by this process's CPUs: `WorkerPool`)."""

KILL_MARGIN_S = 0.5
"""Bound on how late after its budget a timed-out process call returns (measured: a few ms)."""

LOAD_TIMEOUT_S = 120.0
"""Seconds a worker may take to start and unpickle a verifier (its imports included)."""

WORKER_CACHE_SIZE = 16
"""Verifiers a worker keeps loaded (least recently used forgotten first)."""

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_TOP_UP_S = 0.01  # how often a batch short of workers looks for a free one


# --------------------------------------------------------------------------------------------
# Worker processes
# --------------------------------------------------------------------------------------------


@dataclass
class _Shipment:
    """A verifier as the workers receive it: its key and cloudpickle blob, or why it cannot go."""

    key: int
    blob: bytes | None
    problem: str = ""
    refs: tuple = ()  # keeps the object alive while cached, so its id is not reused


@dataclass
class _InFlight:
    index: int
    deadline: float  # monotonic; while loading, the load's deadline
    loading: bool


@dataclass(eq=False)
class _Batch:
    """The state of one `WorkerPool.run`: what is left, in flight, done, and sent to threads."""

    calls: Sequence[Call]
    timeout_s: float
    want: int  # workers it may hold
    results: list = field(init=False)
    todo: collections.deque = field(init=False)
    busy: dict = field(default_factory=dict)  # WorkerProcess -> _InFlight
    mine: list = field(default_factory=list)  # the workers this batch holds
    on_threads: list = field(default_factory=list)  # indices to run on threads instead
    retried: set = field(default_factory=set)
    problem: str = ""

    def __post_init__(self) -> None:
        self.results = [None] * len(self.calls)
        self.todo = collections.deque(range(len(self.calls)))

    def to_threads(self) -> None:
        self.on_threads.extend(self.todo)
        self.todo.clear()


def _identity(verifier: Any) -> tuple[tuple[int, ...], tuple]:
    """(id key, objects to keep alive): a bound method is its function and instance, because
    `obj.method` is a new object at every attribute lookup."""
    function, owner = getattr(verifier, "__func__", None), getattr(verifier, "__self__", None)
    if function is not None and owner is not None:
        return (id(function), id(owner)), (function, owner)
    return (id(verifier),), (verifier,)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class WorkerPool:
    """A bounded pool of verifier worker processes (see the module docstring).

    Args:
        max_processes: most workers alive at once (default `min(DEFAULT_MAX_WORKERS,
            available_cpus())`: a CPU-bound check runs no faster with more, and its wall-clock
            budget would stretch).

    Attributes:
        stats: counts of workers `started`, `killed` (calls past their budget) and `died` (a
            verifier crashed its interpreter), since the pool was made (or forked).

    Use the process-wide pool, `verifier_pool()`, rather than making your own.
    """

    def __init__(self, max_processes: int | None = None) -> None:
        if max_processes is None:
            max_processes = min(DEFAULT_MAX_WORKERS, available_cpus())
        if not (isinstance(max_processes, int) and max_processes >= 1):
            raise ValueError(f"max_processes must be an int >= 1, got {max_processes!r}")
        self.max_processes = max_processes
        self._shipments: collections.OrderedDict = collections.OrderedDict()
        self._keys = itertools.count(1)
        self._reset()
        os.register_at_fork(after_in_child=self._after_fork_in_child)
        atexit.register(self.shutdown)

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._free = threading.Condition(self._lock)
        self._idle: list[WorkerProcess] = []  # least recently used first
        self._workers: set[WorkerProcess] = set()  # every live worker, idle or busy
        self._alive = 0  # workers alive or being started (the bound)
        self._launcher: Launcher | None = None
        self.stats = {"started": 0, "killed": 0, "died": 0}

    def _after_fork_in_child(self) -> None:
        """A forked child must not use (or keep open) its parent's workers' pipes."""
        for worker in self._workers:
            worker.close()
        self._reset()

    # ---------------------------------------------------------------- public
    def pids(self) -> list[int]:
        """Process ids of the live workers (each also the id of its process group)."""
        with self._lock:
            return sorted(w.pid for w in self._workers)

    def shutdown(self) -> None:
        """Kill every worker (and its descendants) now; the pool starts new ones if used
        again. Registered with `atexit`."""
        if self._pid != os.getpid():
            return
        with self._lock:
            workers, self._workers, self._idle = list(self._workers), set(), []
            self._alive -= len(workers)
        for worker in workers:
            worker.kill()
            worker.exit_status(wait_s=5.0)  # reaps it

    def run(
        self, verifier: Callable, calls: Sequence[Call], *, timeout_s: float, max_workers: int
    ) -> list[VerifierResult]:
        """`run_calls` on this pool's workers, at most `min(max_workers, max_processes)` at once.
        Falls back to threads, with a warning, for a verifier that cannot be shipped."""
        shipment = self._shipment(verifier)
        if shipment.blob is None:
            return self._on_threads(verifier, calls, shipment.problem, timeout_s, max_workers)
        batch = _Batch(calls, timeout_s, want=min(max_workers, len(calls), self.max_processes))
        try:
            while batch.todo or batch.busy:
                if batch.todo and shipment.blob is None:  # another batch found it unloadable
                    batch.problem = shipment.problem
                    batch.to_threads()
                if batch.todo:
                    if len(batch.mine) < batch.want:
                        try:
                            batch.mine += self._acquire(
                                shipment.key, batch.want - len(batch.mine), block=not batch.mine
                            )
                        except OSError as exc:
                            batch.problem = f"no worker process could start: {_describe(exc)}"
                            batch.to_threads()
                            continue
                    for worker in [w for w in batch.mine if w not in batch.busy]:
                        if batch.todo:
                            self._dispatch(worker, shipment, batch)
                if batch.busy:
                    self._collect(shipment, batch)
        finally:
            for worker in list(batch.busy):  # left only by an exception (KeyboardInterrupt)
                self._discard(worker, batch)
            for worker in batch.mine:
                self._release(worker)
        if batch.on_threads:
            done = self._on_threads(
                verifier,
                [calls[i] for i in batch.on_threads],
                batch.problem,
                timeout_s,
                max_workers,
            )
            for index, result in zip(batch.on_threads, done):
                batch.results[index] = result
        return batch.results

    # ---------------------------------------------------------------- a batch
    def _dispatch(self, worker: WorkerProcess, shipment: _Shipment, batch: _Batch) -> None:
        """Send the next call of the batch to `worker`, with the verifier if it lacks it."""
        index = batch.todo.popleft()
        try:
            payload = dumps_message(batch.calls[index])
        except Exception as exc:  # noqa: BLE001
            batch.results[index] = VerifierResult.failure(
                Outcome.ERROR, f"the completion or item did not pickle: {_describe(exc)}"
            )
            return
        loading = shipment.key not in worker.loaded
        load = None
        if loading:
            evict = (
                worker.loaded.popitem(last=False)[0]
                if len(worker.loaded) >= WORKER_CACHE_SIZE
                else None
            )
            load = (shipment.blob, evict)
            worker.loaded[shipment.key] = None
        worker.loaded.move_to_end(shipment.key)
        try:
            worker.inbox.send_bytes(dumps_message(("call", index, shipment.key, load, payload)))
        except OSError:  # the worker died while idle: the call never started
            self._discard(worker, batch)
            if index in batch.retried:
                batch.results[index] = VerifierResult.failure(
                    Outcome.ERROR, "the worker processes died before the call started"
                )
            else:
                batch.retried.add(index)
                batch.todo.appendleft(index)
            return
        budget = LOAD_TIMEOUT_S if loading else batch.timeout_s
        batch.busy[worker] = _InFlight(index, time.monotonic() + budget, loading)

    def _collect(self, shipment: _Shipment, batch: _Batch) -> None:
        """Wait for the next reply or deadline of the calls in flight and handle it."""
        busy = batch.busy
        by_outbox = {w.outbox: w for w in busy}
        wait_s = max(0.0, min(c.deadline for c in busy.values()) - time.monotonic())
        if batch.todo and len(batch.mine) < batch.want:  # a replacement may be free soon
            wait_s = min(wait_s, _TOP_UP_S)
        for outbox in wait(list(by_outbox), wait_s):
            worker = by_outbox[outbox]
            call = busy[worker]
            try:
                reply = pickle.loads(worker.outbox.recv_bytes(MAX_REPLY_BYTES))  # the worker caps
            except (EOFError, OSError, pickle.UnpicklingError):
                del busy[worker]
                batch.results[call.index] = self._died(worker, call)
                self._discard(worker, batch)
                continue
            if reply[0] == "loaded":
                call.loading, call.deadline = False, time.monotonic() + batch.timeout_s
            elif reply[0] == "load_failed":
                del busy[worker]
                worker.loaded.pop(shipment.key, None)
                shipment.blob, shipment.problem = (
                    None,
                    f"the worker could not unpickle it: {reply[2]}",
                )
                batch.problem = shipment.problem
                batch.on_threads.append(call.index)
                batch.to_threads()
            else:
                del busy[worker]
                batch.results[call.index] = reply[2]
        now = time.monotonic()
        for worker, call in [(w, c) for w, c in busy.items() if c.deadline <= now]:
            del busy[worker]
            if call.loading:
                reason = f"the verifier did not load in a worker within {LOAD_TIMEOUT_S:g} s"
                batch.results[call.index] = VerifierResult.failure(Outcome.ERROR, reason)
            else:
                batch.results[call.index] = VerifierResult.failure(
                    Outcome.TIMEOUT,
                    f"verifier ran past {batch.timeout_s:g} s (worker process killed)",
                )
                self.stats["killed"] += 1
            self._discard(worker, batch)

    def _died(self, worker: WorkerProcess, call: _InFlight) -> VerifierResult:
        self.stats["died"] += 1
        doing = "loading" if call.loading else "running"
        return VerifierResult.failure(
            Outcome.ERROR,
            f"the worker process died ({worker.exit_status()}) while {doing} the verifier",
        )

    def _on_threads(self, verifier, calls, problem, timeout_s, max_workers):
        warnings.warn(
            f"verifier {getattr(verifier, '__qualname__', type(verifier).__name__)} cannot "
            "run in a worker process "
            f"({problem}); running it on threads, where its time budget cannot stop "
            "CPU-bound work. Make it picklable with cloudpickle, or declare isolation = "
            "'thread' on it to choose threads explicitly.",
            UserWarning,
            stacklevel=5,
        )
        return run_on_threads(verifier, calls, timeout_s=timeout_s, max_workers=max_workers)

    # ---------------------------------------------------------------- shipping
    def _shipment(self, verifier: Any) -> _Shipment:
        identity, refs = _identity(verifier)
        with self._lock:
            shipment = self._shipments.get(identity)
            if shipment is not None:
                self._shipments.move_to_end(identity)
                return shipment
        try:
            shipment = _Shipment(
                next(self._keys), cloudpickle.dumps(verifier, protocol=_PROTOCOL), refs=refs
            )
        except Exception as exc:  # noqa: BLE001 - any pickling failure: run on threads
            shipment = _Shipment(
                next(self._keys),
                None,
                f"cloudpickle failed: {_describe(exc)}{what_does_not_pickle(verifier)}",
                refs,
            )
        with self._lock:
            self._shipments[identity] = shipment
            while len(self._shipments) > 4 * WORKER_CACHE_SIZE:
                self._shipments.popitem(last=False)
        return shipment

    # ---------------------------------------------------------------- workers
    def _acquire(self, key: int, count: int, *, block: bool) -> list[WorkerProcess]:
        """Up to `count` workers for this batch: idle ones (those holding `key` first, then
        fresh ones, then the least recently used), then new ones up to `max_processes`. With
        `block`, waits until at least one is free.

        Raises:
            OSError: if `block` and no worker can be started.
        """
        with self._free:
            if self._pid != os.getpid():
                self._reset()
            while block and not self._idle and self._alive >= self.max_processes:
                self._free.wait()
            ranked = sorted(self._idle, key=lambda w: (key not in w.loaded, bool(w.loaded)))
            got = ranked[:count]
            self._idle = [w for w in self._idle if w not in got]
            start = min(count - len(got), self.max_processes - self._alive)
            self._alive += start
            launcher = self._launcher = self._launcher or Launcher()
        for _ in range(start):
            try:
                got.append(launcher.call(self._start_worker))
            except Exception as exc:  # noqa: BLE001 - the slot is given back in every case
                with self._free:
                    self._alive -= 1
                    self._free.notify_all()
                if block and not got:
                    raise OSError(f"cannot start a verifier worker: {_describe(exc)}") from exc
        return got

    def _start_worker(self) -> WorkerProcess:
        """Start one worker and register it (runs on the launcher thread)."""
        worker = WorkerProcess.start()
        with self._lock:
            self._workers.add(worker)
            self.stats["started"] += 1
        return worker

    def _replace(self) -> None:
        """Start a worker into the idle list (on the launcher thread; its slot is reserved)."""
        try:
            worker = self._start_worker()
        except Exception:  # noqa: BLE001 - the next call that needs a worker tries again
            with self._free:
                self._alive -= 1
                self._free.notify_all()
            return
        self._release(worker)

    def _release(self, worker: WorkerProcess) -> None:
        with self._free:
            if worker in self._workers:
                self._idle.append(worker)
                self._free.notify()

    def _discard(self, worker: WorkerProcess, batch: _Batch | None = None) -> None:
        """Kill `worker` and its descendants now; reap it and start its replacement on the
        launcher thread (the caller waits for neither)."""
        if batch is not None and worker in batch.mine:
            batch.mine.remove(worker)
        worker.kill()
        with self._lock:
            if worker not in self._workers:
                return
            self._workers.discard(worker)
            launcher = self._launcher
        assert launcher is not None  # made before the first worker started
        launcher.post(worker.proc.wait)
        launcher.post(self._replace)  # keeps the slot (`_alive`) for the replacement


_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()


def verifier_pool() -> WorkerPool:
    """The process-wide `WorkerPool` (made on first use; a forked child gets its own)."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = WorkerPool()
    return _POOL
