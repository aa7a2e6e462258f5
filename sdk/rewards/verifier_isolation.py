"""Where a budgeted verifier call runs, chosen by the verifier's `isolation`: a worker process
of the pool (`posttrain.rewards.verifier_pool`) or a daemon thread
(`posttrain.rewards.verifier_threads`).

`run_verifier` / `score_batch` (`posttrain.rewards.verifier`) hand every call that has a time
budget to `run_calls`, which reads the verifier's `isolation` attribute (class or instance):

    =========  =======================================  ========================================
    isolation  where a call runs                        a call past its budget `timeout_s`
    =========  =======================================  ========================================
    "process"  a worker process of a bounded pool       outcome timeout at `timeout_s` (a few ms
    (default)  (`WorkerPool`, one per process)          later; at most `KILL_MARGIN_S`); the
                                                        worker and all its descendants are
                                                        killed (SIGKILL) and a new worker started
    "thread"   a daemon thread (judges, clients of a    outcome timeout at `timeout_s`; the
               judge server: verifiers that hold a      thread is abandoned and runs on until the
               model or do network I/O)                 verifier returns, so such a verifier must
                                                        bound its own time (a request deadline)
    =========  =======================================  ========================================

A process call's lateness past its budget is bounded by `verifier_pool.KILL_MARGIN_S`; what the
pool adds as outcomes (a worker that died, a verifier that did not load or pickle) is in
`posttrain.rewards.verifier_pool`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from posttrain.rewards.outcome import VerifierResult
from posttrain.rewards.verifier_pool import verifier_pool
from posttrain.rewards.verifier_threads import Call, check_timeout, run_on_threads

__all__ = ["ISOLATIONS", "isolation_of", "run_calls"]

ISOLATIONS = ("process", "thread")
"""Values of a verifier's `isolation` attribute; "process" when it has none."""


def isolation_of(verifier: Any) -> str:
    """The verifier's declared `isolation` ("process" when it declares none).

    Raises:
        ValueError: if it declares something other than one of `ISOLATIONS`.

    Example:
        >>> class JudgeClient:
        ...     isolation = "thread"   # holds a connection and a request deadline of its own
        ...     def __call__(self, completion, item):
        ...         return 1.0
        >>> isolation_of(JudgeClient()), isolation_of(lambda completion, item: 1.0)
        ('thread', 'process')
    """
    isolation = getattr(verifier, "isolation", "process")
    if isolation not in ISOLATIONS:
        raise ValueError(
            f"{type(verifier).__name__}.isolation is {isolation!r}; allowed values: "
            f"{ISOLATIONS} ('process' when not set)"
        )
    return isolation


def run_calls(
    verifier: Callable, calls: Sequence[Call], *, timeout_s: float, max_workers: int
) -> list[VerifierResult]:
    """Run `verifier` on every (completion, item) of `calls` with a budget of `timeout_s`
    seconds each, at most `max_workers` at a time, where its `isolation` says (module
    docstring). Returns one result per call, in order. Nothing the verifier does raises here.

    Raises:
        ValueError: for an unknown `isolation` value, or `timeout_s` not in (0, MAX_TIMEOUT_S].
    """
    check_timeout(timeout_s)
    if isolation_of(verifier) == "thread":
        return run_on_threads(verifier, calls, timeout_s=timeout_s, max_workers=max_workers)
    return verifier_pool().run(verifier, calls, timeout_s=timeout_s, max_workers=max_workers)
