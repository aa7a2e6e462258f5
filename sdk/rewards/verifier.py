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
    error          the verifier raised, crashed its worker process, or returned a bad type
                   or a score that breaks `check_reward` (NaN, inf, 1e39)
    =============  ==================================================================

Failures (format_error, timeout, error) carry `score == 0.0`; the trainer decides by an explicit
rule whether they are penalised or excluded, and `count_outcomes` counts them for the metrics.

Rewards are finite and fit float32 (`check_reward`, the one rule for every place a reward
enters: here, `StepResult`, group reward hooks, trajectories, the RL trainer's batch): a score
of NaN, inf or beyond +-3.4028235e38 (1e39 would become inf in the trainer's float32 tensors) is
outcome error here, never an exception that ends a run. `Outcome`, `VerifierResult` and
`check_reward` are defined in `posttrain.rewards.outcome` and are the same objects here.

Time budgets: each budgeted call runs in a worker process of a bounded pool
(`posttrain.rewards.verifier_pool`); a call past `timeout_s` is outcome timeout within its budget
plus a few milliseconds (at most `verifier_pool.KILL_MARGIN_S`), and its worker is killed with
everything it started (`setsid` included), so a CPU-bound check (a catastrophic regex, `10**10**9`)
stops instead of spinning on; a call that returns leaves no process running either. A budget is at
most `MAX_TIMEOUT_S` (1e6 s); `timeout_s=None` means none. What a verifier prints in a worker is
discarded, and a `reason` longer than 4096 characters comes back cut. Verifiers travel to the
workers with cloudpickle, once per worker, so classes and closures defined in notebook cells work. A
verifier that holds a model or talks to a server declares `isolation = "thread"` and runs on a
daemon thread instead, bounding its own time; a verifier that cannot be pickled runs on threads too,
with a warning. The budget of a call starts when its worker starts it (not while a worker starts or
first loads the verifier).

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

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from posttrain.core.registry import Registry
from posttrain.rewards.outcome import (
    FLOAT32_MAX,
    Outcome,
    VerifierResult,
    check_reward,
    coerce_result,
    raised_result,
)
from posttrain.rewards.verifier_isolation import run_calls
from posttrain.rewards.verifier_pool import DEFAULT_MAX_WORKERS
from posttrain.rewards.verifier_threads import MAX_TIMEOUT_S, check_timeout

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_TIMEOUT_S",
    "DEFAULT_MAX_WORKERS",
    "FLOAT32_MAX",
    "Outcome",
    "VerifierResult",
    "Verifier",
    "check_reward",
    "run_verifier",
    "score_batch",
    "count_outcomes",
    "as_score_fn",
    "VERIFIERS",
    "register_verifier",
    "get_verifier",
    "registered_verifiers",
]

DEFAULT_TIMEOUT_S = 5.0
"""Default time budget of one verifier call, in seconds (wall clock)."""


@runtime_checkable
class Verifier(Protocol):
    """Checks one completion against its task item.

    `item` is the task item (a mapping with `question`, `answer` and, for reasoning-gym tasks,
    `metadata`). Return a `VerifierResult`; `run_verifier` also accepts a bare finite number
    (ok when >= 1, else wrong) so that a two-line function in a notebook cell is a verifier.
    A verifier may raise or hang: `run_verifier` records that as outcome error / timeout.
    It runs in a worker process, so it must pickle with cloudpickle (notebook classes and
    closures do), or declare `isolation = "thread"` and bound its own time.
    """

    def __call__(self, completion: str, item: Mapping[str, Any]) -> VerifierResult: ...


# --------------------------------------------------------------------------------------------
# Running verifiers with a time budget
# --------------------------------------------------------------------------------------------


def run_verifier(
    verifier: Verifier | Callable[[str, Mapping], Any],
    completion: str,
    item: Mapping[str, Any],
    *,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> VerifierResult:
    """Verify one completion; every failure of the verifier becomes a typed outcome.

    - raises -> outcome error, reason "ExceptionType: message";
    - runs past `timeout_s` seconds (wall clock) -> outcome timeout, returned within the budget
      plus a few ms; its worker process is killed (see the module docstring; a verifier with
      `isolation = "thread"` is abandoned on its thread instead);
    - returns a score that breaks `check_reward` (NaN, inf, 1e39), or something that is neither
      a VerifierResult nor a real number -> outcome error, with the reason;
    - crashes its worker process (os._exit, a segfault) -> outcome error, with the exit status;
    - returns a bare finite number -> ok if it is >= 1, else wrong with that score;
    - a `reason` longer than `verifier_worker.MAX_REASON_CHARS` (4096) comes back cut to that
      length, its start and end kept.

    Args:
        verifier: a `Verifier` (any callable `(completion, item)`); it must pickle with
            cloudpickle, or declare `isolation = "thread"` (else it runs on threads with a
            warning).
        completion: the model's text.
        item: the task item (sent to the worker with pickle, or cloudpickle).
        timeout_s: time budget in seconds, in (0, MAX_TIMEOUT_S = 1e6]; None runs the verifier
            in the calling thread with no budget (fastest; for debugging: what it prints shows
            here, while a worker process discards its output).

    Raises:
        ValueError: if `timeout_s` is not None or a finite number in (0, MAX_TIMEOUT_S], or
            the verifier's `isolation` is not "process" or "thread". Nothing the verifier does
            raises here.

    Example:
        >>> import time
        >>> run_verifier(lambda c, i: time.sleep(5), "x", {}, timeout_s=0.5).outcome
        <Outcome.TIMEOUT: 'timeout'>
        >>> print(run_verifier(lambda c, i: float("nan"), "x", {}).reason)
        verifier score must be a finite number within float32 range (|x| <= 3.4028235e+38), got nan
    """
    check_timeout(timeout_s)
    if timeout_s is None:
        try:
            return coerce_result(verifier(completion, item))
        except Exception as exc:  # noqa: BLE001
            return raised_result(exc)
    return run_calls(verifier, [(completion, item)], timeout_s=timeout_s, max_workers=1)[0]


def score_batch(
    verifier: Verifier | Callable[[str, Mapping], Any],
    completions: Sequence[str],
    items: Sequence[Mapping[str, Any]],
    *,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    max_workers: int = DEFAULT_MAX_WORKERS,
) -> list[VerifierResult]:
    """`run_verifier` over a batch, up to `max_workers` calls at a time.

    Each call has its own budget of `timeout_s` seconds from its start; a hung call holds one
    worker until its deadline, then that worker is killed and replaced, so a batch with k
    hangers takes about `ceil(k / workers) * timeout_s` longer, never forever. Worker processes
    run side by side for real (no shared interpreter lock), at most `min(max_workers, CPUs of
    this process, DEFAULT_MAX_WORKERS)` at once; verifiers with `isolation = "thread"` run on
    up to `max_workers` threads.

    Args:
        completions, items: sequences of the same length N (a list or tuple, not a str or a
            mapping); `completions[i]` is checked against `items[i]`.
        timeout_s: per-call budget in seconds, in (0, MAX_TIMEOUT_S]; None runs every call
            inline with no budget.
        max_workers: calls in flight at once (>= 1).

    Returns:
        N results, in input order.

    Raises:
        TypeError: if `completions` or `items` is a str, bytes or a mapping (they would be
            zipped character by character or key by key).
        ValueError: if the lengths differ, `timeout_s` is not in (0, MAX_TIMEOUT_S],
            `max_workers` < 1, or the verifier's `isolation` is unknown.

    Example:
        >>> import time
        >>> hang = lambda c, i: time.sleep(5)
        >>> start = time.monotonic()
        >>> results = score_batch(hang, ["a"] * 4, [{}] * 4, timeout_s=0.2)
        >>> [r.outcome.value for r in results][:2], time.monotonic() - start < 4.0
        (['timeout', 'timeout'], True)
    """
    if isinstance(completions, (str, bytes, Mapping)):
        raise TypeError(
            f"score_batch completions must be a sequence (list, tuple) of str, one "
            f"per item, got a {type(completions).__name__}; wrap a single "
            f"completion in a list"
        )
    if isinstance(items, (str, bytes, Mapping)):
        raise TypeError(
            f"score_batch items must be a sequence (list, tuple) of item mappings, "
            f"one per completion, got a {type(items).__name__}; wrap a single "
            f"item in a list"
        )
    if len(completions) != len(items):
        raise ValueError(
            f"score_batch needs one item per completion, got {len(completions)} "
            f"completions and {len(items)} items"
        )
    check_timeout(timeout_s)
    if not (isinstance(max_workers, int) and max_workers >= 1):
        raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
    if timeout_s is None:
        return [run_verifier(verifier, c, i, timeout_s=None) for c, i in zip(completions, items)]
    return run_calls(
        verifier, list(zip(completions, items)), timeout_s=timeout_s, max_workers=max_workers
    )


def count_outcomes(results: Iterable[VerifierResult]) -> dict[str, int]:
    """How many results have each outcome; every `Outcome` value is a key (zeros included), in
    declaration order, so metric columns stay the same from step to step."""
    counts = {outcome.value: 0 for outcome in Outcome}
    for result in results:
        counts[Outcome(result.outcome).value] += 1
    return counts


def as_score_fn(
    verifier: Verifier | Callable[[str, Mapping], Any],
    *,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> Callable[[str, Mapping], float]:
    """A `(completion, item) -> float` function (the verified score; 0.0 for failures), for
    code that wants a plain score such as `posttrain.rewards.evaluation.evaluate_generations`.

    The returned object pickles when `verifier` does.
    """
    return _ScoreFn(verifier, timeout_s)


@dataclass(frozen=True)
class _ScoreFn:
    verifier: Verifier | Callable[[str, Mapping], Any]
    timeout_s: float | None

    def __call__(self, completion: str, item: Mapping[str, Any]) -> float:
        return run_verifier(self.verifier, completion, item, timeout_s=self.timeout_s).score


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

VerifierFactory = Callable[..., Verifier]
"""Builds a verifier from keyword options (usually the verifier class itself)."""


VERIFIERS: Registry[VerifierFactory] = Registry(
    "verifier", builtins_hint="the built-in verifiers register on `import posttrain.verifiers`"
)


_F = TypeVar("_F", bound=VerifierFactory)


def register_verifier(name: str) -> Callable[[_F], _F]:
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
    return cast("Callable[[_F], _F]", VERIFIERS.register(name))


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
