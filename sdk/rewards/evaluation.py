"""Held-out evaluation by generation: greedy (or sampled) answers scored by a task's scorer.

Example:
    >>> from posttrain.policy import Policy
    >>> from posttrain.rewards.evaluation import evaluate_generations
    >>> policy = Policy.from_spec("tiny-1m", seed=0)
    >>> items = [{"question": "1 + 1 =", "answer": "2"}]
    >>> def exact(text, item):
    ...     return float(text.strip() == item["answer"])
    >>> result = evaluate_generations(policy, items, max_new_tokens=4, score_fn=exact)
    >>> result.num_items, 0.0 <= result.accuracy <= 1.0
    (1, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from posttrain.policy.policy import generate_for_items

if TYPE_CHECKING:
    from posttrain.policy.policy import Policy
    from posttrain.policy.rollout_engine import RolloutEngine

ScoreFn = Callable[[str, Mapping[str, Any]], float]


@dataclass(frozen=True)
class EvalResult:
    """Accuracy over `num_items` with a 95% Wilson score interval [ci_low, ci_high].

    `table` has one row per item: question, answer, completion, score, correct, finish_reason.
    """

    accuracy: float
    ci_low: float
    ci_high: float
    num_items: int
    table: pd.DataFrame

    def as_dict(self) -> dict[str, float]:
        return {
            "accuracy": self.accuracy,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "num_items": self.num_items,
        }


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion (Wilson 1927, eq. for p with z=1.96).

    Raises ValueError if n < 1 or successes is outside [0, n].
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(
            f"wilson_interval needs 0 <= successes <= n and n >= 1, got {successes}/{n}"
        )
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def evaluate_generations(
    policy: Policy | RolloutEngine,
    items: Sequence[Mapping[str, Any]],
    *,
    score_fn: ScoreFn,
    max_new_tokens: int = 32,
    batch_size: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    correct_threshold: float = 1.0,
    chat: bool = True,
) -> EvalResult:
    """Generate an answer to each item's `question` (as a one-turn chat) and score it.

    Args:
        policy: a `posttrain.policy.policy.Policy`, or a rollout engine that samples its
            weights (`posttrain.policy.rollout_engine`: "builtin" answers exactly as the policy,
            "vllm" through a vLLM server); sampled through `generate_for_items`.
        items: mappings with at least "question" (str) and "answer"; passed to `score_fn`.
        score_fn: `(completion_text, item) -> score`; an item counts as correct when
            score >= `correct_threshold`.
        temperature: 0 is greedy (the default for held-out accuracy).
        chat: render the question as a one-turn chat with a generation prompt (True), or feed
            the raw question text after BOS (False, for continued-pretraining models).

    Raises:
        ValueError: `items` is empty or an item has no string "question".
        TypeError: `policy` is neither a Policy nor a rollout engine.
    """
    if not items:
        raise ValueError("evaluate_generations: items is empty")
    for i, item in enumerate(items):
        if not isinstance(item.get("question"), str):
            raise ValueError(f"evaluate_generations: item {i} has no string 'question'")
    rows = []
    for _start, chunk, completions in generate_for_items(
        policy,
        items,
        batch_size=batch_size,
        chat=chat,
        seed=seed,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
    ):  # Policy.generate samples in eval mode and restores the model's mode
        for c in completions:
            item = chunk[c.prompt_index]
            score = float(score_fn(c.text, item))
            rows.append(
                {
                    "question": item["question"],
                    "answer": item.get("answer"),
                    "completion": c.text,
                    "score": score,
                    "correct": score >= correct_threshold,
                    "finish_reason": c.finish_reason,
                }
            )
    table = pd.DataFrame(rows)
    successes = int(table["correct"].sum())
    low, high = wilson_interval(successes, len(table))
    return EvalResult(
        accuracy=successes / len(table), ci_low=low, ci_high=high, num_items=len(table), table=table
    )


def paired_bootstrap_diff(
    correct_a: Sequence[bool] | np.ndarray,
    correct_b: Sequence[bool] | np.ndarray,
    *,
    seed: int = 0,
    num_resamples: int = 10_000,
) -> dict[str, Any]:
    """Accuracy of A minus accuracy of B on the same items, with a 95% percentile interval from
    a paired bootstrap (items resampled with replacement, both arms together; Efron & Tibshirani
    1993, ch. 13).

    Shapes: correct_a, correct_b = [N] booleans, item i in both. Raises ValueError otherwise.

    Example:
        >>> d = paired_bootstrap_diff([1, 1, 0, 0], [0, 1, 0, 0])
        >>> d["difference"], d["num_items"]
        (0.25, 4)
    """
    a, b = np.asarray(correct_a, dtype=float), np.asarray(correct_b, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"need two equal-length 1-D arrays; got {a.shape} and {b.shape}")
    idx = np.random.default_rng(seed).integers(0, a.size, size=(num_resamples, a.size))
    low, high = np.percentile((a[idx] - b[idx]).mean(axis=1), [2.5, 97.5])
    return {
        "difference": float((a - b).mean()),
        "ci_low": float(low),
        "ci_high": float(high),
        "num_items": int(a.size),
        "method": "paired bootstrap, 10k resamples, percentile",
    }


@dataclass(frozen=True)
class SampledEvalResult:
    """`k` sampled answers per item: pass@1 is the mean over items of the share of an item's
    answers that are correct, pass@k the share of items with at least one correct answer (the
    unbiased estimator of Chen et al. 2021, eq. 1, at n = k samples).

    `per_item_pass1`: [N] float64 (item i's share of correct answers). `table`: one row per
    answer, as `evaluate_generations` writes it, plus "sample" (0..k-1) and "item" (0..N-1).
    """

    pass_at_1: float
    pass_at_k: float
    k: int
    num_items: int
    per_item_pass1: np.ndarray
    table: pd.DataFrame

    def as_dict(self) -> dict[str, float]:
        return {
            "pass_at_1": self.pass_at_1,
            "pass_at_k": self.pass_at_k,
            "k": self.k,
            "num_items": self.num_items,
        }


def evaluate_sampled(
    policy: Policy | RolloutEngine,
    items: Sequence[Mapping[str, Any]],
    *,
    score_fn: ScoreFn,
    samples: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    seed: int = 1,
    batch_size: int = 64,
    chat: bool = True,
) -> SampledEvalResult:
    """`samples` answers per item at `temperature` (seeded: the same weights give the same
    answers), scored like `evaluate_generations`; returns pass@1 and pass@`samples`. `policy`:
    a `Policy` or a rollout engine, as in `evaluate_generations`.

    Raises:
        ValueError: `samples` < 1, `temperature` <= 0 (greedy answers are all the same: use
            `evaluate_generations`), or what `evaluate_generations` raises.
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"evaluate_sampled: samples={samples!r}; must be an integer >= 1")
    if not temperature > 0:
        raise ValueError(f"evaluate_sampled: temperature={temperature!r}; must be > 0")
    n = len(items)
    result = evaluate_generations(
        policy,
        list(items) * samples,
        score_fn=score_fn,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        temperature=temperature,
        seed=seed,
        chat=chat,
    )
    correct = result.table["correct"].to_numpy(bool).reshape(samples, n)
    table = result.table.assign(
        sample=np.repeat(np.arange(samples), n), item=np.tile(np.arange(n), samples)
    )
    per_item = correct.mean(axis=0)
    return SampledEvalResult(
        pass_at_1=float(per_item.mean()),
        pass_at_k=float(correct.any(axis=0).mean()),
        k=samples,
        num_items=n,
        per_item_pass1=per_item,
        table=table,
    )
