"""One evaluation harness: several evaluation sets in one call (`evaluate_suite`), one table of
metrics with intervals (`SuiteResult`), and a regression check against an earlier result
(`regression_check`).

Eval sets (keyword-only dataclasses, each with a unique `name`):

    ===============  ==========================================================================
    set              metrics (per-item column)              interval (95%)
    ===============  ==========================================================================
    ExactMatchSet    accuracy (correct): greedy             Wilson score
                     pass@1 (pass@1), pass@S (pass@S):      percentile bootstrap over items /
                     S = `samples` sampled answers          Wilson (items with >= 1 correct)
    HumanEvalSet     pass@k (pass@k) for each k, Chen et    percentile bootstrap over problems
                     al. 2021 eq. 1 from n samples
    JudgeWinRateSet  win_rate (score): policy vs baseline,  percentile bootstrap over judged
                     judged in both orders                  items
    ===============  ==========================================================================

Win-rate rule: each item is judged twice, (policy, baseline) and (baseline, policy). The item
scores 1 if the policy wins in both orders, 0 if it loses in both, 0.5 otherwise (a tie, an
`inconsistent` verdict, or orders that disagree). An item whose judgement is `error` in either
order is excluded from the rate and counted in the `excluded` column (never scored 0).

Values are fractions in [0, 1]. Bootstrap: 10,000 resamples of the items with replacement, the
2.5th and 97.5th percentiles of the resampled mean (Efron & Tibshirani 1993, ch. 13).

The eval sets are defined in `posttrain.workflows.eval_sets`, the result and the regression
check in `posttrain.workflows.suite_result`; this module exports them too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from posttrain.policy.policy import Policy
from posttrain.rewards.evaluation import (
    ScoreFn,
    evaluate_generations,
    evaluate_sampled,
    wilson_interval,
)
from posttrain.rewards.pairwise import PairwiseOutcome
from posttrain.verifiers.reasoning_gym import task_score
from posttrain.workflows.eval_sets import ExactMatchSet, HumanEvalSet, JudgeWinRateSet, _fail, _int
from posttrain.workflows.sft import evaluate, held_out_items
from posttrain.workflows.suite_result import COLUMNS, RegressionError, SuiteResult, regression_check

__all__ = [
    "ExactMatchSet",
    "HumanEvalSet",
    "JudgeWinRateSet",
    "SuiteResult",
    "RegressionError",
    "evaluate_suite",
    "regression_check",
    "bootstrap_mean_interval",
    "SET_TYPES",
]

BOOTSTRAP = "percentile bootstrap over items, 10k resamples"


def bootstrap_mean_interval(
    values_N: Sequence[float] | np.ndarray, *, seed: int = 0, num_resamples: int = 10_000
) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of `values_N` ([N] floats, N >= 1): items
    resampled with replacement `num_resamples` times. NaN, NaN when N = 0; ValueError for a NaN
    value (drop unscored items first)."""
    v = np.asarray(values_N, dtype=float)
    _int("num_resamples", num_resamples, 1)
    if np.isnan(v).any():
        raise ValueError("values_N holds NaN; must be numbers (drop unscored items first)")
    if v.size == 0:
        return math.nan, math.nan
    idx = np.random.default_rng(seed).integers(0, v.size, size=(num_resamples, v.size))
    low, high = np.percentile(v[idx].mean(axis=1), [2.5, 97.5])
    return float(low), float(high)


def _row(
    set_name: str,
    metric: str,
    value: float,
    ci: tuple[float, float],
    n: int,
    method: str,
    column: str,
    excluded: int = 0,
    errors: int = 0,
) -> dict[str, Any]:
    return dict(
        zip(
            COLUMNS,
            (
                set_name,
                metric,
                float(value),
                float(ci[0]),
                float(ci[1]),
                int(n),
                method,
                int(excluded),
                int(errors),
                column,
            ),
        )
    )


def _run_exact(policy: Policy, s: ExactMatchSet, seed: int) -> tuple[list[dict], pd.DataFrame]:
    score_fn: ScoreFn
    if s.task is not None:
        items, ds = held_out_items(s.task)
        greedy = evaluate(policy, items, ds, max_new_tokens=s.max_new_tokens, chat=s.chat)
        score_fn = lambda text, item: task_score(ds, text.strip(), item)  # noqa: E731 - as sft
    else:
        assert s.items is not None and s.score_fn is not None  # check(): items with score_fn
        items, score_fn = list(s.items), s.score_fn
        greedy = evaluate_generations(
            policy, items, score_fn=score_fn, max_new_tokens=s.max_new_tokens, chat=s.chat
        )
    per = greedy.table.copy()
    rows = [
        _row(
            s.name,
            "accuracy",
            greedy.accuracy,
            (greedy.ci_low, greedy.ci_high),
            greedy.num_items,
            "greedy; Wilson score",
            "correct",
        )
    ]
    if s.samples:
        sampled = evaluate_sampled(
            policy,
            items,
            score_fn=score_fn,
            samples=s.samples,
            temperature=s.temperature,
            max_new_tokens=s.max_new_tokens,
            seed=seed + 1,
            chat=s.chat,
        )
        any_ok = sampled.table["correct"].to_numpy(bool).reshape(s.samples, -1).any(axis=0)
        per["pass@1"], per[f"pass@{s.samples}"] = sampled.per_item_pass1, any_ok.astype(float)
        at, n = f"{s.samples} samples at T={s.temperature}", len(items)
        rows += [
            _row(
                s.name,
                "pass@1",
                sampled.pass_at_1,
                bootstrap_mean_interval(sampled.per_item_pass1, seed=seed),
                n,
                f"{at}; {BOOTSTRAP}",
                "pass@1",
            ),
            _row(
                s.name,
                f"pass@{s.samples}",
                sampled.pass_at_k,
                wilson_interval(int(any_ok.sum()), n),
                n,
                f"{at}; Wilson score",
                f"pass@{s.samples}",
            ),
        ]
    return rows, per


def _run_humaneval(policy: Policy, s: HumanEvalSet, seed: int) -> tuple[list[dict], pd.DataFrame]:
    from posttrain.verifiers.humaneval import evaluate_pass_at_k, humaneval_problems

    items = (list(s.items) if s.items is not None else humaneval_problems())[: s.limit]
    result = evaluate_pass_at_k(
        items,
        policy=policy,
        n=s.n,
        ks=s.k,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=seed,
    )
    errors = sum(result.outcome_counts.get(o, 0) for o in ("error", "timeout"))
    per = result.table.copy()
    per.insert(1, "question", [item.get("question", str(item.get("task_id"))) for item in items])
    rows = [
        _row(
            s.name,
            f"pass@{k}",
            result.pass_at_k[k],
            bootstrap_mean_interval(per[f"pass@{k}"], seed=seed),
            len(items),
            f"n={s.n} samples at T={s.temperature}, unbiased pass@k (Chen et al. 2021); "
            f"{BOOTSTRAP.replace('items', 'problems')}; error/timeout samples fail",
            f"pass@{k}",
            errors=errors,
        )
        for k in s.k
    ]
    return rows, per


def _order_score(outcome: PairwiseOutcome, policy_is: str) -> float | None:
    """1 policy wins, 0 it loses, 0.5 tie/inconsistent, None error, for one judged order."""
    if outcome is PairwiseOutcome.ERROR:
        return None
    if outcome in (PairwiseOutcome.TIE, PairwiseOutcome.INCONSISTENT):
        return 0.5
    return 1.0 if outcome.value == policy_is else 0.0


def _run_judge(policy: Policy, s: JudgeWinRateSet, seed: int) -> tuple[list[dict], pd.DataFrame]:
    items = list(s.items)
    blank = lambda text, item: 0.0  # noqa: E731 - generation only; the judge scores
    ours = (
        evaluate_generations(
            policy, items, score_fn=blank, max_new_tokens=s.max_new_tokens, chat=s.chat
        )
        .table["completion"]
        .tolist()
    )
    theirs = (
        evaluate_generations(
            s.baseline_policy, items, score_fn=blank, max_new_tokens=s.max_new_tokens, chat=s.chat
        )
        .table["completion"]
        .tolist()
    )
    first = s.judge.compare(ours, theirs, items)  # policy is A
    second = s.judge.compare(theirs, ours, items)  # policy is B
    if len(first) != len(items) or len(second) != len(items):
        raise ValueError(
            f"JudgeWinRateSet({s.name!r}).judge returned {len(first)} and "
            f"{len(second)} results for {len(items)} items; must be one per item"
        )
    rows = []
    for item, a, b, r1, r2 in zip(items, ours, theirs, first, second):
        o1, o2 = PairwiseOutcome(r1.outcome), PairwiseOutcome(r2.outcome)
        s1, s2 = _order_score(o1, "a"), _order_score(o2, "b")
        score = math.nan if s1 is None or s2 is None else s1 if s1 == s2 and s1 != 0.5 else 0.5
        rows.append(
            {
                "question": item["question"],
                "completion": a,
                "baseline_completion": b,
                "policy_first": o1.value,
                "baseline_first": o2.value,
                "score": score,
                "error": "; ".join(
                    r.reason
                    for r in (r1, r2)
                    if PairwiseOutcome(r.outcome) is PairwiseOutcome.ERROR
                ),
            }
        )
    per = pd.DataFrame(rows)
    judged = per["score"].dropna().to_numpy(float)
    value = float(judged.mean()) if judged.size else math.nan
    return [
        _row(
            s.name,
            "win_rate",
            value,
            bootstrap_mean_interval(judged, seed=seed),
            judged.size,
            f"both orders: 1 win-win, 0 loss-loss, 0.5 otherwise; errors excluded; {BOOTSTRAP}",
            "score",
            excluded=len(per) - judged.size,
        )
    ], per


SET_TYPES: dict[type, Callable[[Any, Any, int], tuple[list[dict], pd.DataFrame]]] = {
    ExactMatchSet: _run_exact,
    HumanEvalSet: _run_humaneval,
    JudgeWinRateSet: _run_judge,
}
"""The registry: eval-set type -> its runner `(policy, set, seed) -> (table rows, per_item)`."""


def _check_sets(sets: Any) -> None:
    if isinstance(sets, (str, bytes)) or not isinstance(sets, Sequence) or len(sets) == 0:
        raise _fail(
            "sets",
            sets,
            "a non-empty list of eval sets (" + ", ".join(t.__name__ for t in SET_TYPES) + ")",
        )
    seen: set[str] = set()
    for i, s in enumerate(sets):
        if type(s) not in SET_TYPES:
            raise ValueError(
                f"sets[{i}] is a {type(s).__name__}; the eval-set types are "
                + ", ".join(t.__name__ for t in SET_TYPES)
            )
        s.check()  # fields may have changed since construction
        if s.name in seen:
            raise ValueError(f"sets[{i}].name={s.name!r} is a duplicate; set names must be unique")
        seen.add(s.name)


def evaluate_suite(
    policy: Policy, sets: Sequence[Any], *, seed: int = 0, progress: bool = True
) -> SuiteResult:
    """Evaluate `policy` on every eval set in `sets`, in order; returns a `SuiteResult` (one
    table row per (set, metric), one per-item table per set).

    Args:
        policy: a `posttrain.policy.Policy` (anything with `generate` and `tokenizer`).
        sets: eval sets (`ExactMatchSet`, `HumanEvalSet`, `JudgeWinRateSet`), unique names.
        seed: sampling seed (sampled sets) and bootstrap seed.
        progress: print one line per set as it finishes.

    Raises:
        ValueError: before any generation, for empty `sets`, a duplicate name, an object that
            is not an eval set, or a bad field of a set (named, with what is allowed).
    """
    _int("seed", seed, 0)
    _check_sets(sets)
    rows, per_item = [], {}
    for s in sets:
        set_rows, per_item[s.name] = SET_TYPES[type(s)](policy, s, seed)
        rows += set_rows
        if progress:
            print(
                f"{s.name}: "
                + ", ".join(
                    f"{r['metric']}={r['value']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
                    if r["n"]
                    else f"{r['metric']}: no item scored ({r['excluded']} excluded)"
                    for r in set_rows
                )
            )
    return SuiteResult(pd.DataFrame(rows, columns=list(COLUMNS)), per_item)
