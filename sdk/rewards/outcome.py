"""The typed result of a verification, and the one rule every reward obeys.

`Outcome`, `VerifierResult` and `check_reward` are also importable (and documented for users)
as `posttrain.rewards.verifier.Outcome` etc.; they live here, below the runner and its worker
processes, which all build results.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar, cast

FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32, `torch.finfo(torch.float32).max`: the bound of `check_reward`."""


def check_reward(value: Any, *, name: str = "reward") -> float:
    """`value` as a float if it is a usable reward: a real number (or a 0-d tensor / numpy
    scalar) that is finite and within float32 range, |x| <= `FLOAT32_MAX`. The trainer holds
    rewards in float32 tensors, where a larger value becomes inf; so 1e39 is refused exactly
    like inf. The one rule for every place a reward enters (verifiers, environments, group
    reward hooks, trajectories, the RL trainer).

    Raises:
        ValueError: naming `name`, for a string, None or another non-number, a value that does
            not convert to float, NaN, +-inf or |x| > FLOAT32_MAX.

    Example:
        >>> check_reward(1), check_reward(-3.4e38)
        (1.0, -3.4e+38)
        >>> try:
        ...     check_reward(1e39, name="score")
        ... except ValueError as exc:
        ...     print(exc)
        score must be a finite number within float32 range (|x| <= 3.4028235e+38), got 1e+39
    """
    if isinstance(value, (str, bytes)) or not (
        isinstance(value, numbers.Real) or hasattr(value, "__float__")
    ):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r:.80}")
    try:
        number = float(value)
    except Exception as exc:  # noqa: BLE001 - e.g. a multi-element tensor, 10**400
        raise ValueError(
            f"{name} {value!r:.80} does not convert to float: {type(exc).__name__}: {exc}"
        ) from None
    if not (math.isfinite(number) and abs(number) <= FLOAT32_MAX):
        raise ValueError(
            f"{name} must be a finite number within float32 range "
            f"(|x| <= {FLOAT32_MAX:.8g}), got {number!r}"
        )
    return number


class Outcome(str, Enum):
    """What happened when a completion was verified. Compares equal to its string value."""

    OK = "ok"
    WRONG = "wrong"
    FORMAT_ERROR = "format_error"
    TIMEOUT = "timeout"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


_R = TypeVar("_R", bound="VerifierResult")  # a subclass's constructors return it


@dataclass(frozen=True)
class VerifierResult:
    """The typed result of one verification.

    Attributes:
        score: the reward, a float that passes `check_reward` (1.0 correct, 0.0 incorrect or
            failed, partial credit in between when the task defines it).
        outcome: an `Outcome` (a plain string such as "ok" is converted).
        reason: a short human-readable explanation ("expected 3/4, got 0.7"); empty when there is
            nothing to say.

    Raises:
        ValueError: if `score` breaks `check_reward` (not a real number, NaN, inf, beyond
            float32) or `outcome` is not an Outcome value.
    """

    score: float
    outcome: Outcome
    reason: str = ""

    def __post_init__(self) -> None:
        score = check_reward(self.score, name="VerifierResult score")
        try:
            outcome = Outcome(self.outcome)
        except ValueError:
            raise ValueError(
                f"VerifierResult outcome {self.outcome!r} is not one of "
                f"{[o.value for o in Outcome]}"
            ) from None
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
    def from_score(cls: type[_R], score: float, reason: str = "") -> _R:
        """`ok` when `score >= 1`, else `wrong` with that score (partial credit is kept)."""
        return cls(score, Outcome.OK if score >= 1.0 else Outcome.WRONG, reason)

    @classmethod
    def failure(cls: type[_R], outcome: Outcome | str, reason: str) -> _R:
        """A failed verification (format_error, timeout or error) with score 0.0."""
        return cls(0.0, cast(Outcome, outcome), reason)  # __post_init__ checks and converts it


def coerce_result(value: Any) -> VerifierResult:
    """What a verifier returned as a VerifierResult: itself, or a bare number (ok when >= 1,
    else wrong with that score); outcome error, with the reason, for anything else or a score
    that breaks `check_reward`.

    Example:
        >>> coerce_result(0.5)
        VerifierResult(score=0.5, outcome=<Outcome.WRONG: 'wrong'>, reason='')
        >>> print(coerce_result(None).reason)
        verifier returned NoneType None; expected a VerifierResult or a real number
    """
    if isinstance(value, VerifierResult):
        try:  # only fails for a result built around __post_init__
            check_reward(value.score, name="verifier score")
        except ValueError as exc:
            return VerifierResult.failure(Outcome.ERROR, str(exc))
        return value
    if isinstance(value, (str, bytes)) or not (
        isinstance(value, numbers.Real) or hasattr(value, "__float__")
    ):
        return VerifierResult.failure(
            Outcome.ERROR,
            f"verifier returned {type(value).__name__} {value!r:.80}; expected a "
            "VerifierResult or a real number",
        )
    try:
        score = check_reward(value, name="verifier score")
    except ValueError as exc:
        return VerifierResult.failure(Outcome.ERROR, str(exc))
    return VerifierResult.from_score(score)


def raised_result(exc: BaseException) -> VerifierResult:
    """Outcome error for a verifier that raised `exc`: reason "ExceptionType: message"."""
    return VerifierResult.failure(Outcome.ERROR, f"{type(exc).__name__}: {exc}")
