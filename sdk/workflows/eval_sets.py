"""The eval sets of the evaluation harness (`posttrain.workflows.evaluation.evaluate_suite`):
keyword-only dataclasses, each with a unique `name`, that check their fields when built (and
again when a suite runs) and name a bad one with what is allowed. What each set measures, and
with which interval, is in the harness's module docstring.

Example:
    >>> HumanEvalSet(name="h", n=2, k=(1, 3))
    Traceback (most recent call last):
    ...
    ValueError: HumanEvalSet('h').k=(1, 3); must be a non-empty tuple of distinct ints in [1, n=2]
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.rewards.evaluation import ScoreFn
from posttrain.workflows.config import TaskConfig

__all__ = ["ExactMatchSet", "HumanEvalSet", "JudgeWinRateSet"]


def _fail(name: str, value: Any, must: str) -> ValueError:
    return ValueError(f"{name}={value!r}; must be {must}")


def _int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(name, value, f"an int >= {minimum}")


def _real(name: str, value: Any, must: str, ok: Callable[[float], bool]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise _fail(name, value, must)  # ok(nan) and ok(inf) are False for each use here


def _check_common(set_: Any, items: Any, keys: tuple[str, ...] = ("question",)) -> str:
    """Checks name, chat and items (None: not given) of an eval set; returns how errors name it."""
    if not isinstance(set_.name, str) or not set_.name.strip():
        raise _fail(f"{type(set_).__name__}.name", set_.name, "a non-empty string")
    at = f"{type(set_).__name__}({set_.name!r})"
    if not isinstance(getattr(set_, "chat", True), bool):  # HumanEvalSet has no chat
        raise _fail(f"{at}.chat", set_.chat, "True or False")
    _int(f"{at}.max_new_tokens", set_.max_new_tokens, 1)
    if items is not None and (
        isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or len(items) == 0
    ):
        raise ValueError(f"{at}.items={reprlib.repr(items)}; must be a non-empty list of items")
    for i, item in enumerate(items or ()):
        if not isinstance(item, Mapping) or any(not isinstance(item.get(k), str) for k in keys):
            raise ValueError(
                f"{at}.items[{i}]={reprlib.repr(item)}; must be a mapping with "
                f"string {' and '.join(map(repr, keys))}"
            )
    return at


@dataclass(kw_only=True)
class ExactMatchSet:
    """Exact-match accuracy on a reasoning-gym task (`task`: its `eval_size` held-out items,
    scored by the task's scorer, `posttrain.workflows.sft.held_out_items`) or on given `items`
    (mappings with "question" and "answer") scored by `score_fn(text, item) -> score` (correct
    when score >= 1). Greedy accuracy always; with `samples` = S > 0 also pass@1 and pass@S from
    S answers per item at `temperature`."""

    name: str
    task: TaskConfig | None = None
    items: Sequence[dict] | None = None
    score_fn: ScoreFn | None = None
    max_new_tokens: int = 32
    samples: int = 0
    temperature: float = 1.0
    chat: bool = True

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        at = _check_common(self, self.items)
        if (self.task is None) == (self.items is None):
            raise ValueError(
                f"{at}: give exactly one of task= (a TaskConfig) or items= with score_fn="
            )
        if self.task is not None:
            if not isinstance(self.task, TaskConfig) or self.task.is_file:
                raise _fail(f"{at}.task", self.task, "a TaskConfig of a reasoning-gym task")
            if self.task.eval_size < 1:
                raise _fail(f"{at}.task.eval_size", self.task.eval_size, "an int >= 1")
            if self.score_fn is not None:
                raise _fail(f"{at}.score_fn", self.score_fn, "None with task= (its scorer)")
        elif not callable(self.score_fn):
            raise _fail(f"{at}.score_fn", self.score_fn, "a callable (text, item) -> score")
        _int(f"{at}.samples", self.samples, 0)
        _real(
            f"{at}.temperature", self.temperature, "a finite number > 0", lambda t: 0 < t < math.inf
        )


@dataclass(kw_only=True)
class HumanEvalSet:
    """HumanEval pass@k (`posttrain.verifiers.humaneval.evaluate_pass_at_k`): `n` samples per
    problem at `temperature`/`top_p`, checked in the sandbox, pass@k for each k in `k` (each
    <= n). `limit`: the first `limit` problems only (None: all 164); `items`: other code items
    instead. Error and timeout samples count as failures (a lower bound), in `errors`."""

    name: str
    n: int = 1
    k: tuple[int, ...] = (1,)
    max_new_tokens: int = 256
    limit: int | None = None
    temperature: float = 0.8
    top_p: float = 0.95
    items: Sequence[dict] | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        at = _check_common(self, self.items, keys=("question", "test"))  # as humaneval_problems
        _int(f"{at}.n", self.n, 1)
        ks = tuple(self.k) if isinstance(self.k, (tuple, list)) else None
        if (
            not ks
            or len(set(ks)) != len(ks)
            or any(
                isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.n for k in ks
            )
        ):
            raise _fail(f"{at}.k", self.k, f"a non-empty tuple of distinct ints in [1, n={self.n}]")
        if self.limit is not None:
            _int(f"{at}.limit", self.limit, 1)
        _real(
            f"{at}.temperature",
            self.temperature,
            "a finite number >= 0 (0: greedy)",
            lambda t: 0 <= t < math.inf,
        )
        _real(f"{at}.top_p", self.top_p, "a number in (0, 1]", lambda p: 0 < p <= 1)


@dataclass(kw_only=True)
class JudgeWinRateSet:
    """Win-rate of the policy against `baseline_policy` on `items` (each with "question"), both
    answering greedily, judged by `judge` (a `posttrain.rewards.pairwise.PairwiseJudge`) in both
    orders; the scoring rule is in the module docstring."""

    name: str
    items: Sequence[dict] = field(default_factory=list)
    baseline_policy: Any = None
    judge: Any = None
    max_new_tokens: int = 32
    chat: bool = True

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        at = _check_common(self, self.items if self.items is not None else [])
        if not hasattr(self.baseline_policy, "generate"):
            raise _fail(f"{at}.baseline_policy", self.baseline_policy, "a Policy")
        if not callable(getattr(self.judge, "compare", None)):
            raise _fail(f"{at}.judge", self.judge, "a PairwiseJudge (with .compare(a, b, items))")
