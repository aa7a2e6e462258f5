"""Preemption and time limits on Slurm: act on the warning signal at a step boundary.

Slurm sends a warning signal (USR2 with submitit's `--signal=USR2@90` default, or
`scancel --signal=USR2 JOBID`) before it preempts or times out a job. Inside a submitit job the
signal's handler checkpoints the submitted callable, requeues the job and exits the process at
once, which may be in the middle of an optimizer step.

`install()` (called by `posttrain.launch.submit` inside each job) puts a deferring handler in front
of submitit's. While a `Trainer` is inside `fit` (`deferring()`), the signal only marks a request;
the trainer calls `step_boundary(save)` after each completed step, which saves a checkpoint (rank 0
writes it) and then hands over to submitit's handler (requeue and exit on rank 0; nothing on other
ranks, whose processes Slurm stops with the requeue). Outside `deferring()` the signal goes straight
to submitit's handler, as without posttrain. The requeued job resumes from that checkpoint, so no
completed step is lost or repeated.

Example (outside a job nothing is installed and a boundary is a no-op):
    >>> requested()
    False
    >>> step_boundary(lambda: print("saved"))
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["install", "uninstall", "requested", "deferring", "step_boundary", "sigint_held"]

_lock = threading.Lock()
_original: Any = None  # submitit's handler (or whatever was installed before)
_signum: int | None = None
_pending: tuple[int, FrameType | None] | None = None
_depth = 0  # nesting of deferring()


def install(signum: int | None = None) -> None:
    """Defer the preemption signal `signum` (default: submitit's, USR2 unless
    SUBMITIT_PREEMPT_SIGNAL says otherwise) to step boundaries. Main thread only; idempotent."""
    global _original, _signum
    if signum is None:
        from submitit.core.job_environment import JobEnvironment

        signum = JobEnvironment._usr_sig()
    if _signum == signum:
        return
    _original, _signum = signal.getsignal(signum), signum
    signal.signal(signum, _deferred)


def uninstall() -> None:
    """Put back the handler that `install` replaced."""
    global _original, _signum, _pending
    if _signum is not None:
        signal.signal(_signum, _original)
    _original, _signum, _pending = None, None, None


def requested() -> bool:
    """True if a preemption signal arrived and has not been handled yet."""
    return _pending is not None


@contextlib.contextmanager
def deferring() -> Iterator[None]:
    """While inside, a preemption signal waits for `step_boundary`; a request still pending when
    the outermost block exits is handed over then."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _pending is not None:
            _hand_over()


def step_boundary(save: Callable[[], object] | None = None) -> None:
    """Call after each completed step: if preemption was requested, `save()` (a checkpoint) and
    hand over to the original handler (submitit: requeue and exit on rank 0)."""
    if _pending is None:
        return
    if save is not None:
        save()
    _hand_over()


def _deferred(signum: int, frame: FrameType | None) -> None:
    global _pending
    _pending = (signum, frame)
    if _depth == 0:
        _hand_over()


def _hand_over() -> None:
    global _pending
    with _lock:
        pending, _pending = _pending, None
    if pending is None:
        return
    if callable(_original):
        _original(*pending)
    elif _original == signal.SIG_DFL:
        signal.signal(pending[0], signal.SIG_DFL)
        signal.raise_signal(pending[0])


class _Held:
    received = False


@contextlib.contextmanager
def sigint_held() -> Iterator[_Held]:
    """Hold SIGINT (Ctrl-C) until the block ends, so a parameter update is never cut in half;
    `.received` tells whether one arrived. Only the main thread can handle signals; elsewhere
    this does nothing."""
    held = _Held()
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is None
    ):  # a handler Python cannot restore
        yield held
        return

    def handler(signum, frame):
        held.received = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)
