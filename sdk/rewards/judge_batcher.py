"""Dynamic batching for a judge under load: a bounded queue of requests, batches formed by size
and wait, the judge run on one worker thread, results handed back per request.

This is the part of the judge server (`posttrain.rewards.judge_server`) that knows nothing of
HTTP. It runs on one asyncio event loop (uvicorn's); only `begin_drain`, `idle`, `fail_pending`
and `stats` may be called (and `draining`, `failed` read) from other threads.

Batching (as in NVIDIA Triton's dynamic batcher and TorchServe's `batchSize`/`maxBatchDelay`):
a batch starts with the oldest waiting request and takes the next ones, whole, while their
completions fit in `max_batch_size`; it waits for more to arrive until `max_wait_s` after its
first request arrived (so a request that already waited for the judge goes at once), and not at
all once it is full. One request (a GRPO group of G completions) is
never split across batches; a request larger than `max_batch_size` is a batch of its own. While
the judge works on one batch, the next one fills up.

Backpressure: at most `max_queue` requests wait; `offer` refuses the next one with the number of
seconds after which a retry is likely to be taken (the queue's completions divided by the batch
size, times the recent time per batch), which the server sends as 429 + Retry-After.

Failures stay per request: when the judge raises (any exception, SystemExit included) or returns
something that cannot be sent on a batch of several requests, each request is judged again
alone, so one bad request fails only itself (its results are outcome `error`). Should the
batching task itself ever die (a bug), `failed` says why, every request taken is answered with
`ServerShutDown` and `offer` refuses new ones ("failed"): never a request left hanging.

Example (without a server: an event loop in this thread):
    >>> import asyncio
    >>> from posttrain.rewards.verifier import VerifierResult
    >>> class Length:
    ...     def judge(self, completions, items):
    ...         return [VerifierResult.from_score(len(c) / 10) for c in completions]
    >>> async def main():
    ...     batcher = Batcher(Length(), max_batch_size=8, max_wait_s=0.01, max_queue=4)
    ...     await batcher.start()
    ...     a, b = (JudgeRequest(f"r{i}", ["x" * i], [{"question": "?"}]) for i in (1, 2))
    ...     assert batcher.offer(a) is None and batcher.offer(b) is None
    ...     outputs = await asyncio.gather(a.future, b.future)
    ...     await batcher.close()
    ...     return [(o.results[0]["score"], o.batch_requests) for o in outputs]
    >>> asyncio.run(main())
    [(0.1, 2), (0.2, 2)]
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from posttrain.core.checks import check_int
from posttrain.rewards.verifier import Outcome, VerifierResult

__all__ = ["Batcher", "JudgeRequest", "BatchOutput", "ServerShutDown", "result_to_json"]


class ServerShutDown(RuntimeError):
    """The server stopped before this request was judged (its drain time ran out)."""


@dataclass(eq=False)
class JudgeRequest:
    """One request: `completions[i]` judged against `items[i]`; answered through `future`
    (a `BatchOutput`), which belongs to the loop the request was made on."""

    request_id: str
    completions: list[str]
    items: list[dict]
    future: asyncio.Future = field(default=None, repr=False)  # type: ignore[assignment]
    enqueued: float = field(default_factory=time.monotonic)
    waiters: int = 0     # HTTP handlers waiting on `future` (a retried id adds one)

    def __post_init__(self) -> None:
        if self.future is None:
            self.future = asyncio.get_running_loop().create_future()


@dataclass(frozen=True)
class BatchOutput:
    """What a request gets back: one JSON-ready result per completion (`result_to_json`), the
    batch it rode in (`batch_id`, `batch_requests`, `batch_completions`), its seconds in the
    queue and the judge's seconds on the whole batch."""

    results: list[dict]
    batch_id: int
    batch_requests: int
    batch_completions: int
    queue_s: float
    judge_s: float


def result_to_json(result: Any) -> dict:
    """A judge's result as JSON: {score, outcome, reason, raw, raw_score}. `raw` and `raw_score`
    are a `JudgeResult`'s ("" / None for a plain `VerifierResult`). Never raises: anything that
    is not a `VerifierResult`, or one whose `raw_score` is not a finite number (or None), or
    whose fields cannot be read, becomes outcome error, saying what it was."""
    try:
        if not isinstance(result, VerifierResult):
            return _error_json(f"judge returned {type(result).__name__} {result!r:.80}, not a "
                               "VerifierResult")
        raw_score = getattr(result, "raw_score", None)
        if raw_score is not None:
            number = None
            if not isinstance(raw_score, (str, bytes, bool)):
                with contextlib.suppress(TypeError, ValueError, RuntimeError):
                    number = float(raw_score)
            if number is None or not math.isfinite(number):
                return _error_json(f"judge returned raw_score={raw_score!r:.80}; must be a "
                                   "finite number or None")
            raw_score = number
        score = float(result.score)
        if not math.isfinite(score):
            return _error_json(f"judge returned score={score!r}; must be finite")
        return {"score": score, "outcome": Outcome(result.outcome).value,
                "reason": str(result.reason), "raw": str(getattr(result, "raw", "")),
                "raw_score": raw_score}
    except Exception as exc:  # noqa: BLE001 - a malformed result is data for the client
        return _error_json(f"judge returned a result that cannot be sent: "
                           f"{type(exc).__name__}: {exc}"[:300])


def _error_json(reason: str) -> dict:
    return {"score": 0.0, "outcome": Outcome.ERROR.value, "reason": reason, "raw": "",
            "raw_score": None}


class Batcher:
    """Queue + dynamic batching + one judge worker thread (see the module docstring).

    Args:
        judge: a `posttrain.rewards.judges.Judge` (`judge(completions, items)`).
        max_batch_size: completions per judge call (>= 1).
        max_wait_s: a batch waits for more until this many seconds after its first request
            arrived (>= 0).
        max_queue: requests that may wait (>= 1); `offer` refuses more.

    Raises:
        ValueError: for a setting outside its range (named).
    """

    def __init__(self, judge: Any, *, max_batch_size: int, max_wait_s: float,
                 max_queue: int) -> None:
        check_int("max_batch_size", max_batch_size, minimum=1)
        check_int("max_queue", max_queue, minimum=1)
        if not (isinstance(max_wait_s, (int, float)) and 0 <= max_wait_s < math.inf):
            raise ValueError(f"max_wait_s={max_wait_s!r}; must be a finite number of seconds >= 0")
        self.judge, self.max_batch_size = judge, max_batch_size
        self.max_wait_s, self.max_queue = float(max_wait_s), max_queue
        self.draining = False
        self.failed: str | None = None    # why the batching task died (a bug), else None
        self._queue: collections.deque[JudgeRequest] = collections.deque()
        self._running: list[JudgeRequest] | None = None
        self._held = 0                    # requests taken and not yet answered or dropped
        self._closing = False
        self._abandoned = False           # fail_pending was called: do not wait for the judge
        self._batch_s = 0.05              # running mean seconds per batch, for Retry-After
        self._lock = threading.Lock()     # guards _stats (read by other threads)
        self._stats: dict[str, Any] = {
            "requests": 0, "completions": 0, "batches": 0, "rejected_full": 0,
            "rejected_draining": 0, "rejected_failed": 0, "judge_failures": 0, "shut_down": 0, "max_queue_depth": 0,
            "judge_s": 0.0, "batch_completions": {}, "batch_requests": {}}

    # ---------------------------------------------------------------- lifecycle (loop thread)
    async def start(self) -> None:
        """Start the batching task on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="posttrain-judge")
        self._task = asyncio.create_task(self._run(), name="posttrain-judge-batcher")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        """Done callback of the batching task: if it ended other than by `close` (a bug),
        record why (`failed`) and answer every request taken with `ServerShutDown`."""
        if task.cancelled():
            why = None if self._closing else "the batching task was cancelled"
        elif task.exception() is not None:
            why = f"{type(task.exception()).__name__}: {task.exception()}"
        else:
            why = None if self._closing else "the batching task ended"
        if why is None:
            return
        self.failed = why
        for request in [*self._queue, *(self._running or ())]:
            if not request.future.done():
                request.future.set_exception(ServerShutDown(
                    f"the judge batcher failed ({why}); this request was not judged"))
                self._count("shut_down")
        self._queue.clear()
        self._running, self._held = None, 0

    async def close(self) -> None:
        """Judge what is queued, then stop the task and the worker thread; after
        `fail_pending`, stop at once (a judge call in progress ends in the background)."""
        self._closing = True
        self._wake.set()
        if not self._task.done():  # a task that is done failed (see `failed`): nothing to wait for
            if self._abandoned:
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pool.shutdown(wait=not self._abandoned and self.failed is None)

    def offer(self, request: JudgeRequest) -> tuple[str, float] | None:
        """Queue `request`; None when taken, else ("full" | "draining" | "failed", retry-after
        seconds); "failed": the batching task died (`failed` says why)."""
        if self.failed is not None:
            self._count("rejected_failed")
            return "failed", 1.0
        if self.draining or self._closing:
            self._count("rejected_draining")
            return "draining", 1.0
        if len(self._queue) >= self.max_queue:
            self._count("rejected_full")
            return "full", self.retry_after_s()
        self._queue.append(request)
        self._held += 1
        with self._lock:
            self._stats["max_queue_depth"] = max(self._stats["max_queue_depth"], len(self._queue))
        self._wake.set()
        return None

    def retry_after_s(self) -> float:
        """Seconds until the queue has likely moved on: batches ahead x recent seconds per batch
        (between 0.01 and 10)."""
        ahead = math.ceil(sum(len(r.completions) for r in list(self._queue))
                          / self.max_batch_size) or 1
        return min(10.0, max(0.01, ahead * self._batch_s))

    # ---------------------------------------------------------------- any thread
    def begin_drain(self) -> None:
        """Refuse new requests from now on; what is queued is still judged."""
        self.draining = True
        self._loop.call_soon_threadsafe(self._wake.set)

    def idle(self) -> bool:
        """Every request taken has been answered (or dropped after its timeout)."""
        return self._held == 0

    def fail_pending(self) -> None:
        """Answer every request not answered yet, queued or in the judge, with
        `ServerShutDown` (the end of the drain time); a judgement that comes later is dropped."""
        self._abandoned = True

        def fail() -> None:
            for request in [*self._queue, *(self._running or ())]:
                if not request.future.done():
                    request.future.set_exception(ServerShutDown(
                        "the judge server stopped before judging this request"))
                    self._count("shut_down")
            self._held -= len(self._queue)
            self._queue.clear()
        self._loop.call_soon_threadsafe(fail)

    def is_judging(self, request: JudgeRequest) -> bool:
        """True while `request` is in the batch the judge is working on."""
        return any(r is request for r in (self._running or ()))

    def queue_depth(self) -> int:
        return len(self._queue)

    def stats(self) -> dict[str, Any]:
        """Counters since start: requests/completions judged, batches, the histograms of batch
        sizes (completions -> batches, requests -> batches), refusals, seconds in the judge."""
        with self._lock:
            stats = {k: dict(v) if isinstance(v, dict) else v for k, v in self._stats.items()}
        stats.update(queue_depth=len(self._queue), draining=self.draining,
                     judging=self._running is not None)
        return stats

    # ---------------------------------------------------------------- the batching loop
    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    async def _run(self) -> None:
        while True:
            batch = await self._next_batch()
            if batch is None:
                return
            self._running = batch
            start = time.monotonic()
            try:
                outputs = await self._loop.run_in_executor(self._pool, self._judge_batch, batch)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - last guard; _judge_batch catches all
                why = f"judge worker raised {type(exc).__name__}: {exc}"
                outputs = [[_error_json(why) for _ in r.completions] for r in batch]
            seconds = time.monotonic() - start   # `_running` stays set until all are answered
            self._record(batch, seconds)
            size = sum(len(r.completions) for r in batch)
            self._batch_s = 0.8 * self._batch_s + 0.2 * seconds
            batch_id = self._stats["batches"]
            for request, results in zip(batch, outputs):
                if not request.future.done():   # a request that timed out meanwhile is dropped
                    request.future.set_result(BatchOutput(
                        results, batch_id, len(batch), size, start - request.enqueued, seconds))
                self._held -= 1
            self._running = None

    async def _next_batch(self) -> list[JudgeRequest] | None:
        """The next batch, or None once closing with nothing left."""
        first = await self._pop()
        if first is None:
            return None
        batch, size = [first], len(first.completions)
        until = first.enqueued + self.max_wait_s   # from its arrival: a request that waited
        while size < self.max_batch_size:           # for the judge already goes at once
            if not self._queue:
                remaining = until - time.monotonic()
                if remaining <= 0 or self.draining or self._closing:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), remaining)
                except TimeoutError:
                    break
                continue
            head = self._queue[0]
            if head.future.done():   # timed out while queued
                self._queue.popleft()
                self._held -= 1
                continue
            if size + len(head.completions) > self.max_batch_size:
                break
            batch.append(self._queue.popleft())
            size += len(head.completions)
        return batch

    async def _pop(self) -> JudgeRequest | None:
        while True:
            while self._queue:
                request = self._queue.popleft()
                if not request.future.done():
                    return request
                self._held -= 1     # timed out while queued
            if self._closing:
                return None
            self._wake.clear()
            await self._wake.wait()

    def _record(self, batch: list[JudgeRequest], seconds: float) -> None:
        size = sum(len(r.completions) for r in batch)
        with self._lock:
            s = self._stats
            s["batches"] += 1
            s["requests"] += len(batch)
            s["completions"] += size
            s["judge_s"] += seconds
            s["batch_completions"][size] = s["batch_completions"].get(size, 0) + 1
            s["batch_requests"][len(batch)] = s["batch_requests"].get(len(batch), 0) + 1

    # ---------------------------------------------------------------- the worker thread
    def _judge_batch(self, batch: list[JudgeRequest]) -> list[list[dict]]:
        """One judge call over the whole batch, split back per request; if it raises, each
        request alone (one bad request fails only itself)."""
        completions = [c for r in batch for c in r.completions]
        items = [i for r in batch for i in r.items]
        try:
            results = list(self.judge.judge(completions, items))
            if len(results) != len(completions):
                raise ValueError(f"{type(self.judge).__name__}.judge returned {len(results)} "
                                 f"results for {len(completions)} completions")
            out, start = [], 0
            for request in batch:
                n = len(request.completions)
                out.append([result_to_json(r) for r in results[start:start + n]])
                start += n
            return out
        # BaseException too (SystemExit, KeyboardInterrupt raised by the judge's own code): this
        # is the worker thread, which a Ctrl-C never reaches, and it must not end the server.
        except BaseException as exc:  # noqa: BLE001 - the judge's failure is data for the client
            if len(batch) > 1:
                return [self._judge_batch([r])[0] for r in batch]
            self._count("judge_failures")
            why = f"judge raised {type(exc).__name__}: {exc}"[:500]
            return [[_error_json(why) for _ in batch[0].completions]]
