"""Reward functions written as plain Python callables, in TRL's convention or one sample at a time.

Two forms, told apart explicitly (never by inspecting a signature):

- batch form, TRL's `GRPOTrainer(reward_funcs=[fn])` convention (trl 1.16,
  `GRPOTrainer._calculate_rewards`): `fn(completions, **kwargs) -> list[float | None]`, called
  with keyword lists of one entry per completion: `prompts`, `completions` (strings for a plain
  prompt; `[{"role": "assistant", "content": text}]` for a conversational one, i.e. a prompt
  given as a list of messages), `completion_ids` (token ids), every other column of the prompt
  record, and `trainer_state=None`, `log_extra`, `log_metric` (no-ops here). A function written
  for TRL runs unchanged.
- per-sample form, wrapped with `per_sample(fn)`: `fn(prompt, completion, **row) -> float | None`
  with the record's other columns as keywords.

`None` means "not applicable" as in TRL: that function is left out of the sample's weighted sum;
a sample for which every function returned None is unscorable.

`RewardFunctions(funcs, weights)` combines them: `score(...)` returns one typed `VerifierResult`
per completion with score `sum_k w_k * r_k` over the functions that applied. Where TRL raises (or
silently sums NaN away), each failure here is a typed outcome "error" with a reason naming the
function, counted and excluded by the trainer:

    ===========================================  ==============================================
    what the function did                        outcome
    ===========================================  ==============================================
    raised                                       error on every completion of the call
    returned a non-list / the wrong length       error on every completion of the call
    returned NaN, inf, a string, |x| > float32   error on that completion (`check_reward`)
    every function returned None for a sample   error on that completion ("unscorable")
    ===========================================  ==============================================

Functions are named by import path in YAML (`rewards.funcs: [mypkg.rewards:fn]`, resolved by
`load_reward`). `score_terms` also returns each function's own (unweighted) value and failures
per completion (`RewardTerms`): the RL metrics `reward/<name>` and `reward/<name>/failures` of
each step (`posttrain.rl.rollout.reward_term_metrics`, as TRL's `rewards/<name>/mean`).

Example:
    >>> def exact(completions, answer, **kwargs):
    ...     return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]
    >>> rewards = RewardFunctions([exact, per_sample(lambda prompt, completion, **row: None)])
    >>> [r.score for r in rewards.score(["1+2="] * 2, ["3", "4"], {"answer": ["3", "3"]})]
    [1.0, 0.0]
    >>> nan = RewardFunctions([lambda completions, **kw: [float("nan")]])
    >>> nan.score(["q"], ["a"], {})[0].outcome
    <Outcome.ERROR: 'error'>
    >>> terms = rewards.score_terms(["1+2="] * 2, ["3", "4"], {"answer": ["3", "3"]})
    >>> terms.values, terms.failed
    ([{'exact': 1.0, '<lambda>': None}, {'exact': 0.0, '<lambda>': None}], [[], []])
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.rewards.outcome import Outcome, VerifierResult, check_reward

__all__ = [
    "PerSample",
    "RewardFunctions",
    "RewardTerms",
    "load_reward",
    "per_sample",
    "reward_name",
]

_TRL_EXTRAS = ("completion_ids", "trainer_state", "log_extra", "log_metric")


def _noop(*args: Any, **kwargs: Any) -> None:
    """TRL's `log_extra` / `log_metric` stand-in: reward functions may call it; nothing logs."""


def reward_name(fn: Callable[..., Any]) -> str:
    """The name errors and reasons use: `__name__` (a per-sample wrapper's inner function's), or
    the type's name."""
    inner = fn.fn if isinstance(fn, PerSample) else fn
    return getattr(inner, "__name__", type(inner).__name__)


@dataclass(frozen=True)
class PerSample:
    """A per-sample reward function `fn(prompt, completion, **row) -> float | None` in the batch
    form (see the module docstring). Pickles when `fn` does. Build it with `per_sample(fn)`."""

    fn: Callable[..., Any]

    def __call__(
        self, *, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any
    ) -> list[Any]:
        row_columns = {k: v for k, v in columns.items() if k not in _TRL_EXTRAS}
        return [
            self.fn(prompt, completion, **{k: v[i] for k, v in row_columns.items()})
            for i, (prompt, completion) in enumerate(zip(prompts, completions))
        ]


def per_sample(fn: Callable[..., Any]) -> PerSample:
    """Mark `fn(prompt, completion, **row) -> float | None` as a per-sample reward function.

    Raises:
        TypeError: if `fn` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"per_sample needs a callable, got {type(fn).__name__} {fn!r:.80}")
    return PerSample(fn)


def load_reward(path: str) -> Callable[..., Any]:
    """The reward function at import path `"package.module:attribute"` (the attribute may be
    dotted, `"mod:Class.method"`). A per-sample function is named by the `per_sample` wrapper
    its module exports (`score = per_sample(score_one)`).

    Raises:
        ValueError: if `path` is not "module:attribute", the module does not import (the import
            error is quoted), or it has no such attribute.
        TypeError: if the object there is not callable.
    """
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ValueError(f"a reward function path must be 'package.module:function', got {path!r}")
    module_name, attribute = path.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to see
        raise ValueError(
            f"reward function {path!r}: module {module_name!r} does not import: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"reward function {path!r}: {module_name} has no attribute {attribute!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"reward function {path!r} is a {type(obj).__name__}, not a callable")
    return obj


@dataclass(frozen=True)
class RewardTerms:
    """What `RewardFunctions.score_terms` returns for N completions.

    Attributes:
        results: N typed results, as `RewardFunctions.score` returns them (the weighted sum).
        values: N dicts `{metric name: the function's own, unweighted reward, or None}` (None
            where it returned None, "not applicable", or failed on that completion).
        failed: N lists of the metric names of the functions that failed on that completion
            (raised, returned the wrong length, or a value `check_reward` refuses).
    """

    results: list[VerifierResult]
    values: list[dict[str, float | None]]
    failed: list[list[str]]


@dataclass(frozen=True, init=False)
class RewardFunctions:
    """Reward functions and their weights, scored together (see the module docstring). Pickles
    when the functions do (module-level functions and `per_sample` wrappers of them do).

    Args:
        funcs: callables in the batch form, `per_sample` wrappers, or import paths
            ("module:function", resolved now by `load_reward`).
        weights: one finite float per function; None gives every function weight 1.0 (TRL's
            `reward_weights` default).

    Raises:
        ValueError: for no functions, a path that does not resolve, a weights list of another
            length or a weight that is not a finite number.
        TypeError: for an entry that is neither callable nor a path.
    """

    funcs: tuple[Callable[..., Any], ...]
    weights: tuple[float, ...]

    def __init__(
        self,
        funcs: Sequence[Callable[..., Any] | str],
        weights: Sequence[float] | None = None,
    ) -> None:
        if isinstance(funcs, (str, bytes)) or callable(funcs):
            funcs = [funcs]
        resolved = []
        for i, fn in enumerate(funcs):
            if isinstance(fn, str):
                fn = load_reward(fn)
            if not callable(fn):
                raise TypeError(
                    f"reward function {i} must be a callable or a 'module:function' path, got "
                    f"{type(fn).__name__} {fn!r:.80}"
                )
            resolved.append(fn)
        if not resolved:
            raise ValueError("RewardFunctions needs at least one reward function")
        if weights is None:
            weights = [1.0] * len(resolved)
        weights = list(weights)
        if len(weights) != len(resolved):
            raise ValueError(
                f"reward weights has {len(weights)} entries for {len(resolved)} reward functions "
                f"({', '.join(reward_name(f) for f in resolved)}); give one weight per function"
            )
        checked = tuple(check_reward(w, name=f"reward weight {i}") for i, w in enumerate(weights))
        object.__setattr__(self, "funcs", tuple(resolved))
        object.__setattr__(self, "weights", checked)

    @property
    def names(self) -> list[str]:
        """The functions' names, in order."""
        return [reward_name(fn) for fn in self.funcs]

    @property
    def metric_names(self) -> list[str]:
        """The functions' names as metric keys, in order: `names`, with `_<k>` appended to every
        name two functions share (two lambdas: `<lambda>_0`, `<lambda>_1`)."""
        names = self.names
        return [f"{n}_{k}" if names.count(n) > 1 else n for k, n in enumerate(names)]

    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        columns: Mapping[str, Sequence[Any]],
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[VerifierResult]:
        """One typed result per completion: the weighted sum of the functions that applied.

        Args:
            prompts, completions: N entries each (strings, or message lists when conversational).
            columns: the prompt records' other columns, each a list of N values.
            completion_ids: N token-id lists (passed as TRL does); None passes empty lists.

        Returns:
            N `VerifierResult`s: outcome ok (score >= 1) or wrong with the weighted sum and a
            reason listing each function's value; outcome error with a reason naming the
            function for the failures in the module docstring's table.

        Raises:
            ValueError: if `prompts` or a column does not have N entries.
        """
        return self.score_terms(prompts, completions, columns, completion_ids).results

    def score_terms(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        columns: Mapping[str, Sequence[Any]],
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> RewardTerms:
        """`score`'s results with each function's own value per completion (`RewardTerms`),
        for per-function metrics (TRL logs `rewards/<name>/mean`). Same arguments and errors as
        `score`."""
        n = len(completions)
        if len(prompts) != n or any(len(v) != n for v in columns.values()):
            raise ValueError(
                f"score needs one prompt and one value per column for each of the {n} "
                f"completions, got {len(prompts)} prompts and column lengths "
                f"{ {k: len(v) for k, v in columns.items()} }"
            )
        ids = [list(c) for c in completion_ids] if completion_ids is not None else [[]] * n
        values: list[list[float | None]] = [[None] * len(self.funcs) for _ in range(n)]
        failed: list[list[bool]] = [[False] * len(self.funcs) for _ in range(n)]
        errors: list[str | None] = [None] * n
        for k, fn in enumerate(self.funcs):
            name = reward_name(fn)
            try:
                out = fn(
                    prompts=list(prompts),
                    completions=list(completions),
                    completion_ids=ids,
                    trainer_state=None,
                    log_extra=_noop,
                    log_metric=_noop,
                    **{key: list(v) for key, v in columns.items()},
                )
            except Exception as exc:  # noqa: BLE001 - a failing function is data, not a crash
                failed_call = f"reward function {name} raised {type(exc).__name__}: {exc}"
                errors = [e or failed_call for e in errors]
                for row in failed:
                    row[k] = True
                continue
            sized = hasattr(out, "__len__") and not isinstance(out, (str, bytes, Mapping))
            if not sized or len(out) != n:
                got = f"{len(out)} rewards" if sized else f"a {type(out).__name__}"
                failed_call = (
                    f"reward function {name} returned {got:.80}; expected a list of {n} rewards "
                    "(one per completion, None where it does not apply)"
                )
                errors = [e or failed_call for e in errors]
                for row in failed:
                    row[k] = True
                continue
            for i, value in enumerate(list(out)):
                if value is None:
                    continue
                try:
                    values[i][k] = check_reward(value, name=f"reward function {name} value")
                except ValueError as exc:
                    errors[i] = errors[i] or str(exc)
                    failed[i][k] = True
        names = self.metric_names
        return RewardTerms(
            results=[self._combine(v, e) for v, e in zip(values, errors)],
            values=[dict(zip(names, v)) for v in values],
            failed=[[name for name, f in zip(names, row) if f] for row in failed],
        )

    def _combine(self, values: list[float | None], error: str | None) -> VerifierResult:
        if error is not None:
            return VerifierResult.failure(Outcome.ERROR, error)
        if all(v is None for v in values):
            return VerifierResult.failure(
                Outcome.ERROR,
                f"unscorable: every reward function ({', '.join(self.names)}) returned None",
            )
        total = math.fsum(w * v for w, v in zip(self.weights, values) if v is not None)
        reason = ", ".join(f"{name}={v}" for name, v in zip(self.names, values))
        try:
            return VerifierResult.from_score(check_reward(total, name="weighted reward"), reason)
        except ValueError as exc:
            return VerifierResult.failure(Outcome.ERROR, f"{exc} ({reason})")

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}*{w:g}" for n, w in zip(self.names, self.weights))
        return f"RewardFunctions({parts})"
