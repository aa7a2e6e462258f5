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

Example:
    >>> import pandas as pd
    >>> per = pd.DataFrame({"question": ["a", "b"], "correct": [True, True]})
    >>> row = dict(set="s", metric="accuracy", value=1.0, ci_low=0.34, ci_high=1.0, n=2,
    ...            method="Wilson", excluded=0, errors=0, per_item_column="correct")
    >>> earlier = SuiteResult(pd.DataFrame([row]), {"s": per})
    >>> worse = SuiteResult(pd.DataFrame([{**row, "value": 0.0}]),
    ...                     {"s": per.assign(correct=False)})
    >>> regression_check(worse, earlier)[["set", "metric", "difference", "worse"]]
      set    metric  difference  worse
    0   s  accuracy        -1.0   True
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from posttrain.rewards.evaluation import (ScoreFn, evaluate_generations, evaluate_sampled,
                                          paired_bootstrap_diff, wilson_interval)
from posttrain.rewards.pairwise import PairwiseOutcome
from posttrain.workflows.config import TaskConfig
from posttrain.core.stage_files import read_stage_file, write_stage_file
from posttrain.workflows.reports import read_table, write_table
from posttrain.workflows.sft import evaluate, held_out_items

__all__ = ["ExactMatchSet", "HumanEvalSet", "JudgeWinRateSet", "SuiteResult", "RegressionError",
           "evaluate_suite", "regression_check", "bootstrap_mean_interval", "SET_TYPES"]

COLUMNS = ("set", "metric", "value", "ci_low", "ci_high", "n", "method", "excluded", "errors",
           "per_item_column")
"""`SuiteResult.table` columns. n: items the value averages over; excluded: items left out
(judge errors); errors: failed checks counted as failures (HumanEval error/timeout samples);
per_item_column: the column of `per_item[set]` whose mean is `value`."""
BOOTSTRAP = "percentile bootstrap over items, 10k resamples"


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
    if items is not None and (isinstance(items, (str, bytes)) or not isinstance(items, Sequence)
                              or len(items) == 0):
        raise ValueError(f"{at}.items={reprlib.repr(items)}; must be a non-empty list of items")
    for i, item in enumerate(items or ()):
        if not isinstance(item, Mapping) or any(not isinstance(item.get(k), str) for k in keys):
            raise ValueError(f"{at}.items[{i}]={reprlib.repr(item)}; must be a mapping with "
                             f"string {' and '.join(map(repr, keys))}")
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
            raise ValueError(f"{at}: give exactly one of task= (a TaskConfig) or items= with "
                             "score_fn=")
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
        _real(f"{at}.temperature", self.temperature, "a finite number > 0",
              lambda t: 0 < t < math.inf)


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
        if not ks or len(set(ks)) != len(ks) or any(
                isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.n for k in ks):
            raise _fail(f"{at}.k", self.k, f"a non-empty tuple of distinct ints in [1, n={self.n}]")
        if self.limit is not None:
            _int(f"{at}.limit", self.limit, 1)
        _real(f"{at}.temperature", self.temperature, "a finite number >= 0 (0: greedy)",
              lambda t: 0 <= t < math.inf)
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


def bootstrap_mean_interval(values_N: Sequence[float] | np.ndarray, *, seed: int = 0,
                            num_resamples: int = 10_000) -> tuple[float, float]:
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


def _row(set_name: str, metric: str, value: float, ci: tuple[float, float], n: int, method: str,
         column: str, excluded: int = 0, errors: int = 0) -> dict[str, Any]:
    return dict(zip(COLUMNS, (set_name, metric, float(value), float(ci[0]), float(ci[1]), int(n),
                              method, int(excluded), int(errors), column)))


def _run_exact(policy, s: ExactMatchSet, seed: int):
    if s.task is not None:
        items, ds = held_out_items(s.task)
        greedy = evaluate(policy, items, ds, max_new_tokens=s.max_new_tokens, chat=s.chat)
        score_fn = lambda text, item: ds.score_answer(text.strip(), item)  # noqa: E731 - as sft
    else:
        items, score_fn = list(s.items), s.score_fn
        greedy = evaluate_generations(policy, items, score_fn=score_fn,
                                      max_new_tokens=s.max_new_tokens, chat=s.chat)
    per = greedy.table.copy()
    rows = [_row(s.name, "accuracy", greedy.accuracy, (greedy.ci_low, greedy.ci_high),
                 greedy.num_items, "greedy; Wilson score", "correct")]
    if s.samples:
        sampled = evaluate_sampled(policy, items, score_fn=score_fn, samples=s.samples,
                                   temperature=s.temperature, max_new_tokens=s.max_new_tokens,
                                   seed=seed + 1, chat=s.chat)
        any_ok = sampled.table["correct"].to_numpy(bool).reshape(s.samples, -1).any(axis=0)
        per["pass@1"], per[f"pass@{s.samples}"] = sampled.per_item_pass1, any_ok.astype(float)
        at, n = f"{s.samples} samples at T={s.temperature}", len(items)
        rows += [_row(s.name, "pass@1", sampled.pass_at_1, bootstrap_mean_interval(
                     sampled.per_item_pass1, seed=seed), n, f"{at}; {BOOTSTRAP}", "pass@1"),
                 _row(s.name, f"pass@{s.samples}", sampled.pass_at_k, wilson_interval(
                     int(any_ok.sum()), n), n, f"{at}; Wilson score", f"pass@{s.samples}")]
    return rows, per


def _run_humaneval(policy, s: HumanEvalSet, seed: int):
    from posttrain.verifiers.humaneval import evaluate_pass_at_k, humaneval_problems

    items = (list(s.items) if s.items is not None else humaneval_problems())[:s.limit]
    result = evaluate_pass_at_k(items, policy=policy, n=s.n, ks=s.k,
                                max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                top_p=s.top_p, seed=seed)
    errors = sum(result.outcome_counts.get(o, 0) for o in ("error", "timeout"))
    per = result.table.copy()
    per.insert(1, "question", [item.get("question", str(item.get("task_id"))) for item in items])
    rows = [_row(s.name, f"pass@{k}", result.pass_at_k[k],
                 bootstrap_mean_interval(per[f"pass@{k}"], seed=seed), len(items),
                 f"n={s.n} samples at T={s.temperature}, unbiased pass@k (Chen et al. 2021); "
                 f"{BOOTSTRAP.replace('items', 'problems')}; error/timeout samples fail",
                 f"pass@{k}", errors=errors) for k in s.k]
    return rows, per


def _order_score(outcome: PairwiseOutcome, policy_is: str) -> float | None:
    """1 policy wins, 0 it loses, 0.5 tie/inconsistent, None error, for one judged order."""
    if outcome is PairwiseOutcome.ERROR:
        return None
    if outcome in (PairwiseOutcome.TIE, PairwiseOutcome.INCONSISTENT):
        return 0.5
    return 1.0 if outcome.value == policy_is else 0.0


def _run_judge(policy, s: JudgeWinRateSet, seed: int):
    items = list(s.items)
    blank = lambda text, item: 0.0  # noqa: E731 - generation only; the judge scores
    ours = evaluate_generations(policy, items, score_fn=blank, max_new_tokens=s.max_new_tokens,
                                chat=s.chat).table["completion"].tolist()
    theirs = evaluate_generations(s.baseline_policy, items, score_fn=blank,
                                  max_new_tokens=s.max_new_tokens,
                                  chat=s.chat).table["completion"].tolist()
    first = s.judge.compare(ours, theirs, items)    # policy is A
    second = s.judge.compare(theirs, ours, items)   # policy is B
    if len(first) != len(items) or len(second) != len(items):
        raise ValueError(f"JudgeWinRateSet({s.name!r}).judge returned {len(first)} and "
                         f"{len(second)} results for {len(items)} items; must be one per item")
    rows = []
    for item, a, b, r1, r2 in zip(items, ours, theirs, first, second):
        o1, o2 = PairwiseOutcome(r1.outcome), PairwiseOutcome(r2.outcome)
        s1, s2 = _order_score(o1, "a"), _order_score(o2, "b")
        score = (math.nan if s1 is None or s2 is None else
                 s1 if s1 == s2 and s1 != 0.5 else 0.5)
        rows.append({"question": item["question"], "completion": a, "baseline_completion": b,
                     "policy_first": o1.value, "baseline_first": o2.value, "score": score,
                     "error": "; ".join(r.reason for r in (r1, r2)
                                        if PairwiseOutcome(r.outcome) is PairwiseOutcome.ERROR)})
    per = pd.DataFrame(rows)
    judged = per["score"].dropna().to_numpy(float)
    value = float(judged.mean()) if judged.size else math.nan
    return [_row(s.name, "win_rate", value, bootstrap_mean_interval(judged, seed=seed),
                 judged.size, "both orders: 1 win-win, 0 loss-loss, 0.5 otherwise; errors "
                 f"excluded; {BOOTSTRAP}", "score", excluded=len(per) - judged.size)], per


SET_TYPES: dict[type, Callable[[Any, Any, int], tuple[list[dict], pd.DataFrame]]] = {
    ExactMatchSet: _run_exact, HumanEvalSet: _run_humaneval, JudgeWinRateSet: _run_judge}
"""The registry: eval-set type -> its runner `(policy, set, seed) -> (table rows, per_item)`."""


def _check_sets(sets: Any) -> None:
    if isinstance(sets, (str, bytes)) or not isinstance(sets, Sequence) or len(sets) == 0:
        raise _fail("sets", sets, "a non-empty list of eval sets (" +
                    ", ".join(t.__name__ for t in SET_TYPES) + ")")
    seen: set[str] = set()
    for i, s in enumerate(sets):
        if type(s) not in SET_TYPES:
            raise ValueError(f"sets[{i}] is a {type(s).__name__}; the eval-set types are "
                             + ", ".join(t.__name__ for t in SET_TYPES))
        s.check()  # fields may have changed since construction
        if s.name in seen:
            raise ValueError(f"sets[{i}].name={s.name!r} is a duplicate; set names must be unique")
        seen.add(s.name)


def evaluate_suite(policy, sets: Sequence[Any], *, seed: int = 0,
                   progress: bool = True) -> "SuiteResult":
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
            print(f"{s.name}: " + ", ".join(
                f"{r['metric']}={r['value']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]" if r["n"]
                else f"{r['metric']}: no item scored ({r['excluded']} excluded)" for r in set_rows))
    return SuiteResult(pd.DataFrame(rows, columns=list(COLUMNS)), per_item)


@dataclass
class SuiteResult:
    """What `evaluate_suite` returns.

    Attributes:
        table: one row per (set, metric), columns `COLUMNS` (value and interval in [0, 1]).
        per_item: set name -> its per-item DataFrame (a "question" column, plus the metric's
            `per_item_column`; one row per item or problem).
    """

    table: pd.DataFrame
    per_item: dict[str, pd.DataFrame]

    def save(self, folder: str | Path) -> Path:
        """Write `folder/eval_suite.json` (the table, and which CSV holds each set's items) and one
        per-item CSV per set, stage files that `load` checks (`posttrain.core.stage_files`).
        Returns the folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        files = {}
        for i, (name, per) in enumerate(self.per_item.items()):
            files[name] = f"items_{i:02d}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.csv"
            write_table(per, folder / files[name])
        doc = {"table": json.loads(self.table.to_json(orient="records")), "per_item": files}
        write_stage_file(folder / "eval_suite.json", json.dumps(doc, indent=1))
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> "SuiteResult":
        """Read what `save` wrote. Raises FileNotFoundError if `folder/eval_suite.json` is not
        there, StageFileError naming a file cut or changed after `save` wrote it."""
        folder = Path(folder)
        doc = json.loads(read_stage_file(folder / "eval_suite.json", required=True))
        table = pd.DataFrame(doc["table"], columns=list(COLUMNS)).astype(
            {"value": float, "ci_low": float, "ci_high": float})
        per_item = {}
        for name, f in doc["per_item"].items():  # an empty question stays "", other cells NaN
            cols = read_table(folder / f, required=True, nrows=0).columns  # checked first
            per_item[name] = read_table(folder / f, required=True, keep_default_na=False,
                                        dtype={"question": str},
                                        na_values={c: [""] for c in cols if c != "question"})
        return cls(table, per_item)

    def _repr_html_(self) -> str:
        shown = self.table.drop(columns=["per_item_column"])
        return (f"<b>evaluation suite: {self.table['set'].nunique()} sets</b>"
                + shown.to_html(index=False, float_format=lambda x: f"{x:.3f}"))


class RegressionError(AssertionError):
    """A metric got worse beyond its interval; `.table` is the `regression_check` table."""

    def __init__(self, message: str, table: pd.DataFrame) -> None:
        super().__init__(message)
        self.table = table


def _paired(cur: SuiteResult, old: SuiteResult, r: Any) -> tuple[np.ndarray, np.ndarray] | str:
    """Per-item values of (set, metric): row for row when both results list the same questions
    in the same order, else matched by question when both are unique and the same set; a string
    (why not) otherwise."""
    col, name = r.per_item_column, r.set
    tables = [res.per_item.get(name) for res in (cur, old)]
    if any(t is None or col not in t or "question" not in t for t in tables):
        return f"no per-item column {col!r} in both"
    q_cur, q_old = (t["question"].astype(str) for t in tables)
    a, b = (t[col].astype(float).set_axis(q) for t, q in zip(tables, (q_cur, q_old)))
    if list(q_cur) != list(q_old):
        if not (q_cur.is_unique and q_old.is_unique) or set(q_cur) != set(q_old):
            return "items differ"
        b = b.reindex(a.index)
    a, b = a.to_numpy(), b.to_numpy()
    keep = ~(np.isnan(a) | np.isnan(b))  # items a judge could not score, in either run
    return (a[keep], b[keep]) if keep.any() else "no item scored in both"


def regression_check(current: SuiteResult, earlier: SuiteResult | str | Path, *, seed: int = 0,
                     num_resamples: int = 10_000,
                     raise_on_regression: bool = False) -> pd.DataFrame:
    """Compare every (set, metric) that `current` and `earlier` share (higher is better).

    Method: when both per-item tables hold the same questions, a paired bootstrap of the
    per-item difference (`paired_bootstrap_diff`); worse when its 95% interval lies below 0.
    Otherwise the intervals of the two values: worse when current's upper bound is below
    earlier's lower bound (no overlap). No value now (NaN: nothing scored) where there was one
    earlier is worse too, so a broken evaluation cannot pass the check.

    Args:
        current, earlier: `SuiteResult`s; `earlier` may be a folder written by `save`.
        raise_on_regression: raise `RegressionError` naming every metric that got worse.

    Returns:
        One row per shared (set, metric): set, metric, current, earlier, difference (current -
        earlier), ci_low, ci_high (of the difference; NaN for the interval-overlap method),
        method, worse (bool), reason.

    Raises:
        ValueError: no (set, metric) in both, one listed twice, or a bad argument (named).
        RegressionError: with `raise_on_regression`, when a metric got worse.
    """
    for arg, value, ok in (("current", current, SuiteResult), ("earlier", earlier,
                                                               (SuiteResult, str, Path))):
        if not isinstance(value, ok):
            raise _fail(arg, value, "a SuiteResult" + (arg == "earlier") * " or a saved folder")
    _int("seed", seed, 0)
    _int("num_resamples", num_resamples, 1)
    old = earlier if isinstance(earlier, SuiteResult) else SuiteResult.load(earlier)
    for label, t in (("current", current.table), ("earlier", old.table)):
        if t.duplicated(["set", "metric"]).any():
            raise ValueError(f"regression_check: {label}.table lists a (set, metric) twice")
    both = current.table.merge(old.table, on=["set", "metric"], suffixes=("", "_old")).astype(
        {c + sfx: float for c in ("value", "ci_low", "ci_high") for sfx in ("", "_old")})
    if both.empty:
        raise ValueError("regression_check: no (set, metric) in common; current has "
                         f"{list(zip(current.table['set'], current.table['metric']))}, earlier "
                         f"has {list(zip(old.table['set'], old.table['metric']))}")
    rows = []
    for r in both.itertuples(index=False):
        what = f"{r.set}/{r.metric}"
        row = dict(set=r.set, metric=r.metric, current=r.value, earlier=r.value_old,
                   difference=r.value - r.value_old, ci_low=math.nan, ci_high=math.nan)
        pair = (_paired(current, old, r) if r.per_item_column == r.per_item_column_old else
                "per-item columns differ")
        if math.isnan(r.value) or math.isnan(r.value_old):
            worse, method = math.isnan(r.value) and not math.isnan(r.value_old), "none"
            reason = (f"{what} got worse: no value now (n={r.n}, {r.excluded} excluded), "
                      f"earlier {r.value_old:.3f}" if worse else f"{what}: no value to compare")
        elif not isinstance(pair, str):
            d = paired_bootstrap_diff(*pair, seed=seed, num_resamples=num_resamples)
            row.update(ci_low=d["ci_low"], ci_high=d["ci_high"])
            worse, method = d["ci_high"] < 0, f"paired bootstrap on {d['num_items']} items"
            paired = (f"paired difference {d['difference']:+.3f} with 95% CI "
                      f"[{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]")
            reason = (f"{what} got worse: {r.value:.3f} vs {r.value_old:.3f}, {paired} below 0"
                      if worse else f"{what}: {paired} includes or is above 0")
        else:
            worse, method = r.ci_high < r.ci_low_old, f"interval overlap ({pair})"
            ivs = (f"interval [{r.ci_low:.3f}, {r.ci_high:.3f}] vs the earlier "
                   f"[{r.ci_low_old:.3f}, {r.ci_high_old:.3f}]")
            reason = f"{what} got worse: {ivs}, below it" if worse else f"{what}: {ivs}, overlap"
        rows.append({**row, "method": method, "worse": bool(worse), "reason": reason})
    table = pd.DataFrame(rows)
    if raise_on_regression and table["worse"].any():
        bad = table[table["worse"]]
        raise RegressionError("regression: " + "; ".join(bad["reason"]), table)
    return table
