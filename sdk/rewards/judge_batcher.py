"""Dynamic batching for a judge under load: a bounded queue of requests, batches formed by size
and wait, the judge run on one worker thread, results handed back per request.

This is the part of the judge server (`posttrain.rewards.judge_server`) that knows nothing of
HTTP. It runs on one asyncio event loop (uvicorn's); only `begin_drain`, `idle`, `fail_pending`
and `stats` may be called (and `draining`, `failed` read) from other threads.

Batching (as in NVIDIA Triton's dynamic batcher and TorchServe's `batchSize`/`maxBatchDelay`):
a batch starts with the oldest waiting request and takes the next ones, whole, while their
completions fit in `max_batch_size`; it waits for more to arrive until `max_wait_s` after its
first request arrived (so a request that already waited for the judge goes at once), and not at
all once it is full. A request that fits (a GRPO group of G completions) is never split across
batches. While the judge works on one batch, the next one fills up.

Large requests and deadlines: a request of more than `max_batch_size` completions is judged in
pieces of `max_batch_size`, each a batch of its own; after each piece the rest goes to the back
of the queue, so requests that arrived meanwhile are judged first and no request holds the judge
for longer than one batch at a time. A request carries a `deadline` (the latest time anyone
waits for its answer, `time.monotonic()` seconds); once it has passed, what is left of the
request is dropped (its future cancelled, counted as `expired` and `expired_completions`)
instead of being judged for nobody: whether it is still queued, or between two of its pieces.
A judge call in progress is never interrupted.

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
from typing import TYPE_CHECKING, Any

from posttrain.core.checks import check_int
from posttrain.rewards.verifier import Outcome, VerifierResult

if TYPE_CHECKING:
    from posttrain.rewards.judge_protocol import Judge

__all__ = ["Batcher", "JudgeRequest", "BatchOutput", "ServerShutDown", "result_to_json"]


class ServerShutDown(RuntimeError):
    """The server stopped before this request was judged (its drain time ran out)."""


@dataclass(eq=False)
class JudgeRequest:
    """One request: `completions[i]` judged against `items[i]`; answered through `future`
    (a `BatchOutput`), which belongs to the loop the request was made on. `deadline`
    (`time.monotonic()` seconds, default never): after it, nobody waits for the answer and the
    batcher drops what is not judged yet; a retry that joins the request moves it later."""

    request_id: str
    completions: list[str]
    items: list[dict]
    future: asyncio.Future = field(default=None, repr=False)  # type: ignore[arg-type]  # set on submit
    enqueued: float = field(default_factory=time.monotonic)
    deadline: float = math.inf
    waiters: int = 0  # HTTP handlers waiting on `future` (a retried id adds one)
    results: list[dict] = field(default_factory=list, repr=False)  # of the pieces judged
    started: float | None = field(default=None, repr=False)  # its first judge call
    judge_s: float = field(default=0.0, repr=False)  # its pieces' judge seconds

    def __post_init__(self) -> None:
        if self.future is None:
            self.future = asyncio.get_running_loop().create_future()

    @property
    def remaining(self) -> int:
        """Completions not judged yet."""
        return len(self.completions) - len(self.results)


@dataclass(frozen=True)
class _Piece:
    """Completions `start:stop` of `request`, one part of a batch."""

    request: JudgeRequest
    start: int
    stop: int


@dataclass(frozen=True)
class BatchOutput:
    """What a request gets back: one JSON-ready result per completion (`result_to_json`), the
    batch it rode in (`batch_id`, `batch_requests`, `batch_completions`), its seconds in the
    queue (until its first judge call) and the judge's seconds on its batch. A request judged
    in pieces names the batch of its last piece and the judge's seconds on all of its pieces."""

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
            return _error_json(
                f"judge returned {type(result).__name__} {result!r:.80}, not a VerifierResult"
            )
        raw_score = getattr(result, "raw_score", None)
        if raw_score is not None:
            number = None
            if not isinstance(raw_score, (str, bytes, bool)):
                with contextlib.suppress(TypeError, ValueError, RuntimeError):
                    number = float(raw_score)
            if number is None or not math.isfinite(number):
                return _error_json(
                    f"judge returned raw_score={raw_score!r:.80}; must be a finite number or None"
                )
            raw_score = number
        score = float(result.score)
        if not math.isfinite(score):
            return _error_json(f"judge returned score={score!r}; must be finite")
        return {
            "score": score,
            "outcome": Outcome(result.outcome).value,
            "reason": str(result.reason),
            "raw": str(getattr(result, "raw", "")),
            "raw_score": raw_score,
        }
    except Exception as exc:  # noqa: BLE001 - a malformed result is data for the client
        return _error_json(
            f"judge returned a result that cannot be sent: {type(exc).__name__}: {exc}"[:300]
        )


def _error_json(reason: str) -> dict:
    return {
        "score": 0.0,
        "outcome": Outcome.ERROR.value,
        "reason": reason,
        "raw": "",
        "raw_score": None,
    }


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

    def __init__(
        self, judge: Judge, *, max_batch_size: int, max_wait_s: float, max_queue: int
    ) -> None:
        check_int("max_batch_size", max_batch_size, minimum=1)
        check_int("max_queue", max_queue, minimum=1)
        if not (isinstance(max_wait_s, (int, float)) and 0 <= max_wait_s < math.inf):
            raise ValueError(f"max_wait_s={max_wait_s!r}; must be a finite number of seconds >= 0")
        self.judge, self.max_batch_size = judge, max_batch_size
        self.max_wait_s, self.max_queue = float(max_wait_s), max_queue
        self.draining = False
        self.failed: str | None = None  # why the batching task died (a bug), else None
        self._queue: collections.deque[JudgeRequest] = collections.deque()
        self._running: list[_Piece] | None = None
        self._held = 0  # requests taken and not yet answered or dropped
        self._closing = False
        self._abandoned = False  # fail_pending was called: do not wait for the judge
        self._batch_s = 0.05  # running mean seconds per batch, for Retry-After
        self._lock = threading.Lock()  # guards _stats (read by other threads)
        self._stats: dict[str, Any] = {
            "requests": 0,
            "completions": 0,
            "batches": 0,
            "rejected_full": 0,
            "rejected_draining": 0,
            "rejected_failed": 0,
            "judge_failures": 0,
            "shut_down": 0,
            "expired": 0,
            "expired_completions": 0,
            "max_queue_depth": 0,
            "judge_s": 0.0,
            "batch_completions": {},
            "batch_requests": {},
        }

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
        for request in self._pending():
            if not request.future.done():
                request.future.set_exception(
                    ServerShutDown(f"the judge batcher failed ({why}); this request was not judged")
                )
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
        ahead = math.ceil(sum(r.remaining for r in list(self._queue)) / self.max_batch_size) or 1
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
            for request in self._pending():
                if not request.future.done():
                    request.future.set_exception(
                        ServerShutDown("the judge server stopped before judging this request")
                    )
                    self._count("shut_down")
            self._held -= len(self._queue)
            self._queue.clear()

        self._loop.call_soon_threadsafe(fail)

    def is_judging(self, request: JudgeRequest) -> bool:
        """True while `request` (or a piece of it) is in the batch the judge is working on."""
        return any(p.request is request for p in (self._running or ()))

    def _pending(self) -> list[JudgeRequest]:
        """Every request taken and not answered: queued or in the judge."""
        return [*self._queue, *(p.request for p in self._running or ())]

    def queue_depth(self) -> int:
        return len(self._queue)

    def stats(self) -> dict[str, Any]:
        """Counters since start: requests (answered with a judgement) and completions judged,
        batches, the histograms of batch sizes (completions -> batches, requests or pieces of
        one -> batches), refusals, requests dropped at their deadline (`expired`, with the
        `expired_completions` left unjudged), seconds in the judge."""
        with self._lock:
            stats = {k: dict(v) if isinstance(v, dict) else v for k, v in self._stats.items()}
        stats.update(
            queue_depth=len(self._queue), draining=self.draining, judging=self._running is not None
        )
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
                outputs = [[_error_json(why)] * (p.stop - p.start) for p in batch]
            seconds = time.monotonic() - start  # `_running` stays set until all are answered
            finished = sum(p.stop == len(p.request.completions) for p in batch)
            self._record(batch, finished, seconds)
            size = sum(p.stop - p.start for p in batch)
            self._batch_s = 0.8 * self._batch_s + 0.2 * seconds
            batch_id = self._stats["batches"]
            for piece, results in zip(batch, outputs):
                request = piece.request
                if request.future.done():  # timed out or failed meanwhile: dropped
                    self._held -= 1
                    continue
                request.results.extend(results)
                request.started = start if request.started is None else request.started
                request.judge_s += seconds
                if request.remaining:
                    self._queue.append(request)  # the rest after those waiting now
                    continue
                request.future.set_result(
                    BatchOutput(
                        request.results,
                        batch_id,
                        len(batch),
                        size,
                        request.started - request.enqueued,
                        request.judge_s,
                    )
                )
                self._held -= 1
            self._running = None

    def _take(self, request: JudgeRequest, now: float) -> bool:
        """False (and the request dropped) when nobody waits for it any more: its deadline has
        passed (its future is then cancelled), its handler dropped it (cancelled), or it was
        failed already. A cancelled one counts as `expired`, with what it had left."""
        if not request.future.done() and now > request.deadline:
            request.future.cancel()
        if not request.future.done():
            return True
        if request.future.cancelled():
            self._count("expired")
            self._count("expired_completions", request.remaining)
        self._held -= 1
        return False

    async def _next_batch(self) -> list[_Piece] | None:
        """The next batch, or None once closing with nothing left."""
        first = await self._pop()
        if first is None:
            return None
        done = len(first.results)
        if first.remaining > self.max_batch_size:  # a piece of a large request, alone
            return [_Piece(first, done, done + self.max_batch_size)]
        batch, size = [_Piece(first, done, len(first.completions))], first.remaining
        until = first.enqueued + self.max_wait_s  # from its arrival: a request that waited
        while size < self.max_batch_size:  # for the judge already goes at once
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
            if not self._take(head, time.monotonic()):
                self._queue.popleft()
                continue
            if size + head.remaining > self.max_batch_size:
                break
            batch.append(_Piece(self._queue.popleft(), len(head.results), len(head.completions)))
            size += head.remaining
        return batch

    async def _pop(self) -> JudgeRequest | None:
        while True:
            while self._queue:
                request = self._queue.popleft()
                if self._take(request, time.monotonic()):
                    return request
            if self._closing:
                return None
            self._wake.clear()
            await self._wake.wait()

    def _record(self, batch: list[_Piece], finished: int, seconds: float) -> None:
        size = sum(p.stop - p.start for p in batch)
        with self._lock:
            s = self._stats
            s["batches"] += 1
            s["requests"] += finished
            s["completions"] += size
            s["judge_s"] += seconds
            s["batch_completions"][size] = s["batch_completions"].get(size, 0) + 1
            s["batch_requests"][len(batch)] = s["batch_requests"].get(len(batch), 0) + 1

    # ---------------------------------------------------------------- the worker thread
    def _judge_batch(self, batch: list[_Piece]) -> list[list[dict]]:
        """One judge call over the whole batch, split back per piece; if it raises, each piece
        alone (one bad request fails only itself)."""
        completions = [c for p in batch for c in p.request.completions[p.start : p.stop]]
        items = [i for p in batch for i in p.request.items[p.start : p.stop]]
        try:
            results = list(self.judge.judge(completions, items))
            if len(results) != len(completions):
                raise ValueError(
                    f"{type(self.judge).__name__}.judge returned {len(results)} "
                    f"results for {len(completions)} completions"
                )
            out, start = [], 0
            for piece in batch:
                n = piece.stop - piece.start
                out.append([result_to_json(r) for r in results[start : start + n]])
                start += n
            return out
        # BaseException too (SystemExit, KeyboardInterrupt raised by the judge's own code): this
        # is the worker thread, which a Ctrl-C never reaches, and it must not end the server.
        except BaseException as exc:  # noqa: BLE001 - the judge's failure is data for the client
            if len(batch) > 1:
                return [self._judge_batch([p])[0] for p in batch]
            self._count("judge_failures")
            why = f"judge raised {type(exc).__name__}: {exc}"[:500]
            return [[_error_json(why)] * (batch[0].stop - batch[0].start)]
