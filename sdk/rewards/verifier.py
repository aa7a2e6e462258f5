"""Verifiers: deterministic reward checks that return a typed result, never a silent 0.0.

A verifier is any callable `verifier(completion, item) -> VerifierResult` (the `Verifier`
protocol); `item` is the task item, a mapping with at least `question` and `answer` (reasoning-gym
items also carry `metadata`). Concrete verifiers live in `posttrain.verifiers` and are chosen by
name through the registry here (`get_verifier("math_answer")`).

Always call a verifier through `run_verifier` / `score_batch`: they turn every failure into an
`Outcome` that is recorded and counted instead of crashing the run or hiding as a zero reward.

    =============  ==================================================================
    outcome        meaning
    =============  ==================================================================
    ok             scored and correct / accepted (`VerifierResult.ok`)
    wrong          scored but incorrect; `score` may hold partial credit (0.05, ...)
    format_error   no answer could be extracted (no \\boxed{}, no <answer> tag, ...)
    timeout        the verifier ran past its time budget (`timeout_s`)
    error          the verifier raised, or returned a non-finite score or a bad type
    =============  ==================================================================

Failures (format_error, timeout, error) carry `score == 0.0`; the trainer decides by an explicit
rule whether they are penalised or excluded, and `count_outcomes` counts them for the metrics.

Timeouts: each call runs on a daemon worker thread and is waited on until its deadline. Python
cannot kill a thread, so a verifier that hangs is *abandoned*: its thread keeps running in the
background (as a daemon it never blocks interpreter exit) and its late result is ignored. The
worker pool grows instead of queueing, so a hung verifier never delays the calls after it;
idle workers are reused (a handoff costs ~15 us, a new thread ~1 ms). Closures and classes
defined in notebook cells work as they are (nothing is pickled). A verifier that can spin forever on the CPU (executing untrusted
code) should run that code in a subprocess of its own, with a hard limit; an abandoned
busy thread still takes its share of the interpreter lock.

Example:
    >>> from posttrain.rewards.verifier import run_verifier, score_batch, count_outcomes
    >>> def exact(completion, item):
    ...     return 1.0 if completion.strip() == item["answer"] else 0.0   # a bare float is fine
    >>> run_verifier(exact, " 4 ", {"question": "2+2=", "answer": "4"})
    VerifierResult(score=1.0, outcome=<Outcome.OK: 'ok'>, reason='')
    >>> def broken(completion, item):
    ...     raise KeyError("answer")
    >>> run_verifier(broken, "4", {}).outcome, run_verifier(broken, "4", {}).reason
    (<Outcome.ERROR: 'error'>, "KeyError: 'answer'")
    >>> results = score_batch(exact, ["4", "5"], [{"answer": "4"}] * 2, timeout_s=1.0)
    >>> count_outcomes(results)
    {'ok': 1, 'wrong': 1, 'format_error': 0, 'timeout': 0, 'error': 0}
"""

from __future__ import annotations

import math
import numbers
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from posttrain.core.registry import Registry

DEFAULT_TIMEOUT_S = 5.0
"""Default time budget of one verifier call, in seconds (wall clock)."""

DEFAULT_MAX_WORKERS = 8
"""Verifier calls `score_batch` runs at the same time by default."""


class Outcome(str, Enum):
    """What happened when a completion was verified. Compares equal to its string value."""

    OK = "ok"
    WRONG = "wrong"
    FORMAT_ERROR = "format_error"
    TIMEOUT = "timeout"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class VerifierResult:
    """The typed result of one verification.

    Attributes:
        score: the reward, a finite float (1.0 correct, 0.0 incorrect or failed, partial credit in
            between when the task defines it).
        outcome: an `Outcome` (a plain string such as "ok" is converted).
        reason: a short human-readable explanation ("expected 3/4, got 0.7"); empty when there is
            nothing to say.

    Raises:
        ValueError: if `score` is not a finite real number or `outcome` is not an Outcome value.
    """

    score: float
    outcome: Outcome
    reason: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.score, (str, bytes)) or not isinstance(self.score, numbers.Real):
            raise ValueError(f"VerifierResult score must be a real number, got {self.score!r}")
        score = float(self.score)
        if not math.isfinite(score):
            raise ValueError(f"VerifierResult score must be finite, got {score}")
        try:
            outcome = Outcome(self.outcome)
        except ValueError:
            raise ValueError(f"VerifierResult outcome {self.outcome!r} is not one of "
                             f"{[o.value for o in Outcome]}") from None
        object.__setattr__(self, "score", score)
        object.__setattr__(self, "outcome", outcome)
        object.__setattr__(self, "reason", str(self.reason))

    @property
    def ok(self) -> bool:
        """True when the completion was judged correct / accepted."""
        return self.outcome is Outcome.OK

    @property
    def scored(self) -> bool:
        """True when the verifier reached a judgement (ok or wrong), False for a failure."""
        return self.outcome in (Outcome.OK, Outcome.WRONG)

    @classmethod
    def from_score(cls, score: float, reason: str = "") -> VerifierResult:
        """`ok` when `score >= 1`, else `wrong` with that score (partial credit is kept)."""
        return cls(score, Outcome.OK if score >= 1.0 else Outcome.WRONG, reason)

    @classmethod
    def failure(cls, outcome: Outcome | str, reason: str) -> VerifierResult:
        """A failed verification (format_error, timeout or error) with score 0.0."""
        return cls(0.0, outcome, reason)


@runtime_checkable
class Verifier(Protocol):
    """Checks one completion against its task item.

    `item` is the task item (a mapping with `question`, `answer` and, for reasoning-gym tasks,
    `metadata`). Return a `VerifierResult`; `run_verifier` also accepts a bare finite number
    (ok when >= 1, else wrong) so that a two-line function in a notebook cell is a verifier.
    A verifier may raise or hang: `run_verifier` records that as outcome error / timeout.
    """

    def __call__(self, completion: str, item: Mapping[str, Any]) -> VerifierResult: ...


# --------------------------------------------------------------------------------------------
# Running verifiers with a time budget
# --------------------------------------------------------------------------------------------


def _coerce(value: Any) -> VerifierResult:
    """Turn what a verifier returned into a VerifierResult (outcome error when unusable)."""
    if isinstance(value, VerifierResult):
        if not math.isfinite(value.score):     # only reachable by bypassing __post_init__
            return VerifierResult.failure(Outcome.ERROR, f"non-finite score {value.score}")
        return value
    if isinstance(value, (str, bytes)) or not (isinstance(value, numbers.Real)
                                               or hasattr(value, "__float__")):
        return VerifierResult.failure(
            Outcome.ERROR, f"verifier returned {type(value).__name__} {value!r:.80}; expected a "
            "VerifierResult or a real number")
    try:
        score = float(value)
    except Exception as exc:   # e.g. a multi-element tensor
        return VerifierResult.failure(Outcome.ERROR, f"score not convertible to float: "
                                                     f"{type(exc).__name__}: {exc}")
    if not math.isfinite(score):
        return VerifierResult.failure(Outcome.ERROR, f"verifier returned a non-finite score "
                                                     f"({score})")
    return VerifierResult.from_score(score)


def _raised(exc: BaseException) -> VerifierResult:
    return VerifierResult.failure(Outcome.ERROR, f"{type(exc).__name__}: {exc}")


def _timed_out(timeout_s: float) -> VerifierResult:
    return VerifierResult.failure(Outcome.TIMEOUT, f"verifier ran past {timeout_s:g} s "
                                                   "(thread abandoned)")


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
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()   # a lock copied by fork may be held by a lost thread
        self._pid = os.getpid()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._reset()
            if self._idle > 0:
                self._idle -= 1
                spawn = False
            else:
                spawn = True
            tasks = self._tasks
            tasks.put(fn)
        if spawn:
            threading.Thread(target=self._work, args=(tasks,), name="posttrain-verifier",
                             daemon=True).start()

    def _work(self, tasks: queue.SimpleQueue) -> None:
        while True:
            tasks.get()()
            with self._lock:
                if tasks is not self._tasks or self._idle >= self.max_idle:
                    return
                self._idle += 1


_POOL = _GrowingPool()


def _start(verifier: Callable, completion: str, item: Mapping, index: int,
           results: queue.SimpleQueue) -> None:
    """Run `verifier` on a pool thread that posts (index, VerifierResult) to `results`."""
    def work() -> None:
        try:
            result = _coerce(verifier(completion, item))
        except BaseException as exc:   # noqa: BLE001 - any failure of user code is data here
            result = _raised(exc)
        results.put((index, result))

    _POOL.submit(work)


def _check_timeout(timeout_s: float | None) -> None:
    if timeout_s is not None and not (isinstance(timeout_s, numbers.Real) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got "
                         f"{timeout_s!r}")


def run_verifier(verifier: Verifier | Callable[[str, Mapping], Any], completion: str,
                 item: Mapping[str, Any], *,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S) -> VerifierResult:
    """Verify one completion; every failure of the verifier becomes a typed outcome.

    - raises -> outcome error, reason "ExceptionType: message";
    - runs past `timeout_s` seconds (wall clock) -> outcome timeout; the thread is abandoned;
    - returns a NaN/inf score, or something that is neither a VerifierResult nor a real number
      -> outcome error, with the reason;
    - returns a bare finite number -> ok if it is >= 1, else wrong with that score.

    Args:
        verifier: a `Verifier` (any callable `(completion, item)`).
        completion: the model's text.
        item: the task item.
        timeout_s: time budget in seconds; None runs the verifier in the calling thread with no
            budget (fastest; for debugging).

    Raises:
        ValueError: if `timeout_s` is not positive. Nothing the verifier does raises here.

    Example:
        >>> import time
        >>> run_verifier(lambda c, i: time.sleep(5), "x", {}, timeout_s=0.05).outcome
        <Outcome.TIMEOUT: 'timeout'>
        >>> run_verifier(lambda c, i: float("nan"), "x", {}).reason
        'verifier returned a non-finite score (nan)'
    """
    _check_timeout(timeout_s)
    if timeout_s is None:
        try:
            return _coerce(verifier(completion, item))
        except Exception as exc:   # noqa: BLE001
            return _raised(exc)
    results: queue.SimpleQueue = queue.SimpleQueue()
    _start(verifier, completion, item, 0, results)
    try:
        return results.get(timeout=timeout_s)[1]
    except queue.Empty:
        return _timed_out(timeout_s)


def score_batch(verifier: Verifier | Callable[[str, Mapping], Any], completions: Sequence[str],
                items: Sequence[Mapping[str, Any]], *,
                timeout_s: float | None = DEFAULT_TIMEOUT_S,
                max_workers: int = DEFAULT_MAX_WORKERS) -> list[VerifierResult]:
    """`run_verifier` over a batch, up to `max_workers` calls at a time.

    Each call has its own budget of `timeout_s` seconds from its start; a hung call holds one of
    the `max_workers` slots until its deadline and is then abandoned, so a batch with k hangers
    takes about `ceil(k / max_workers) * timeout_s` longer, never forever. Calls run in threads:
    verifiers that are pure Python share the interpreter lock, so running them side by side
    saves no time and stretches each call's wall clock; use `max_workers=1` when a tight
    `timeout_s` must measure one verifier alone.

    Args:
        completions, items: the same length N; `completions[i]` is checked against `items[i]`.
        timeout_s: per-call budget in seconds; None runs every call inline with no budget.
        max_workers: calls in flight at once (>= 1).

    Returns:
        N results, in input order.

    Raises:
        ValueError: if the lengths differ, `timeout_s` is not positive or `max_workers` < 1.

    Example:
        >>> import time
        >>> hang = lambda c, i: time.sleep(5)
        >>> start = time.monotonic()
        >>> results = score_batch(hang, ["a"] * 6, [{}] * 6, timeout_s=0.1)
        >>> [r.outcome.value for r in results][:2], time.monotonic() - start < 1.0
        (['timeout', 'timeout'], True)
    """
    if len(completions) != len(items):
        raise ValueError(f"score_batch needs one item per completion, got {len(completions)} "
                         f"completions and {len(items)} items")
    _check_timeout(timeout_s)
    if not (isinstance(max_workers, int) and max_workers >= 1):
        raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
    if timeout_s is None:
        return [run_verifier(verifier, c, i, timeout_s=None) for c, i in zip(completions, items)]

    n = len(completions)
    results: list[VerifierResult | None] = [None] * n
    posted: queue.SimpleQueue = queue.SimpleQueue()   # abandoned threads post here too: ignored
    deadlines: dict[int, float] = {}                   # index -> monotonic deadline, in flight
    next_index = 0
    while next_index < n or deadlines:
        while next_index < n and len(deadlines) < max_workers:
            deadlines[next_index] = time.monotonic() + timeout_s
            _start(verifier, completions[next_index], items[next_index], next_index, posted)
            next_index += 1
        try:
            index, result = posted.get(timeout=max(0.0, min(deadlines.values()) - time.monotonic()))
        except queue.Empty:
            now = time.monotonic()
            for index in [i for i, deadline in deadlines.items() if deadline <= now]:
                results[index] = _timed_out(timeout_s)
                del deadlines[index]
            continue
        if deadlines.pop(index, None) is not None:
            results[index] = result
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def count_outcomes(results: Iterable[VerifierResult]) -> dict[str, int]:
    """How many results have each outcome; every `Outcome` value is a key (zeros included), in
    declaration order, so metric columns stay the same from step to step."""
    counts = {outcome.value: 0 for outcome in Outcome}
    for result in results:
        counts[Outcome(result.outcome).value] += 1
    return counts


def as_score_fn(verifier: Verifier | Callable[[str, Mapping], Any], *,
                timeout_s: float | None = DEFAULT_TIMEOUT_S) -> Callable[[str, Mapping], float]:
    """A `(completion, item) -> float` function (the verified score; 0.0 for failures), for
    code that wants a plain score such as `posttrain.rewards.evaluation.evaluate_generations`.

    The returned object pickles when `verifier` does.
    """
    return _ScoreFn(verifier, timeout_s)


@dataclass(frozen=True)
class _ScoreFn:
    verifier: Any
    timeout_s: float | None

    def __call__(self, completion: str, item: Mapping[str, Any]) -> float:
        return run_verifier(self.verifier, completion, item, timeout_s=self.timeout_s).score


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

VerifierFactory = Callable[..., Verifier]
"""Builds a verifier from keyword options (usually the verifier class itself)."""


VERIFIERS: Registry[VerifierFactory] = Registry(
    "verifier", builtins_hint="the built-in verifiers register on `import posttrain.verifiers`")


def register_verifier(name: str) -> Callable[[VerifierFactory], VerifierFactory]:
    """Decorator registering a verifier factory (usually its class) under `name`
    (see `posttrain.core.registry.Registry` for the rules on registering twice).

    Example:
        >>> @register_verifier("doc_always_right")
        ... def always_right():
        ...     return lambda completion, item: 1.0
        >>> run_verifier(get_verifier("doc_always_right"), "anything", {}).ok
        True

    Raises:
        ValueError: if `name` is already registered by another definition.
    """
    return VERIFIERS.register(name)


def get_verifier(name: str, /, **options: Any) -> Verifier:
    """Build the verifier registered under `name` with `options` (its constructor's keywords).

    The built-in verifiers (math_answer, reasoning_gym, ...) register when `posttrain.verifiers`
    is imported; `posttrain.verifiers.get_verifier` is this function with them loaded.

    Raises:
        ValueError: if `name` is unknown; the message lists the registered names.
    """
    return VERIFIERS.build(name, **options)


def registered_verifiers() -> tuple[str, ...]:
    """Names `get_verifier` accepts (the built-ins once `posttrain.verifiers` is imported)."""
    return VERIFIERS.names()
