"""What the evaluation harness returns (`SuiteResult`: one table of metrics with intervals and
one per-item table per set, saved and loaded as stage files) and the regression check against
an earlier result (`regression_check`). The harness itself is `posttrain.workflows.evaluation`.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from posttrain.core.stage_files import read_stage_file, write_stage_file
from posttrain.rewards.evaluation import paired_bootstrap_diff
from posttrain.workflows.eval_sets import _fail, _int
from posttrain.workflows.reports import read_table, write_table

__all__ = ["COLUMNS", "SuiteResult", "RegressionError", "regression_check"]

COLUMNS = (
    "set",
    "metric",
    "value",
    "ci_low",
    "ci_high",
    "n",
    "method",
    "excluded",
    "errors",
    "per_item_column",
)
"""`SuiteResult.table` columns. n: items the value averages over; excluded: items left out
(judge errors); errors: failed checks counted as failures (HumanEval error/timeout samples);
per_item_column: the column of `per_item[set]` whose mean is `value`."""


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
    def load(cls, folder: str | Path) -> SuiteResult:
        """Read what `save` wrote. Raises FileNotFoundError if `folder/eval_suite.json` is not
        there, StageFileError naming a file cut or changed after `save` wrote it."""
        folder = Path(folder)
        doc = json.loads(read_stage_file(folder / "eval_suite.json", required=True))
        table = pd.DataFrame(doc["table"], columns=list(COLUMNS)).astype(
            {"value": float, "ci_low": float, "ci_high": float}
        )
        per_item = {}
        for name, f in doc["per_item"].items():  # an empty question stays "", other cells NaN
            cols = read_table(folder / f, required=True, nrows=0).columns  # checked first
            per_item[name] = read_table(
                folder / f,
                required=True,
                keep_default_na=False,
                dtype={"question": str},
                na_values={c: [""] for c in cols if c != "question"},
            )
        return cls(table, per_item)

    def _repr_html_(self) -> str:
        shown = self.table.drop(columns=["per_item_column"])
        return f"<b>evaluation suite: {self.table['set'].nunique()} sets</b>" + shown.to_html(
            index=False, float_format=lambda x: f"{x:.3f}"
        )


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
    now, before = cur.per_item.get(name), old.per_item.get(name)
    if (
        now is None
        or before is None
        or any(col not in t or "question" not in t for t in (now, before))
    ):
        return f"no per-item column {col!r} in both"
    tables = (now, before)
    q_cur, q_old = (t["question"].astype(str) for t in tables)
    a, b = (t[col].astype(float).set_axis(q) for t, q in zip(tables, (q_cur, q_old)))
    if list(q_cur) != list(q_old):
        if not (q_cur.is_unique and q_old.is_unique) or set(q_cur) != set(q_old):
            return "items differ"
        b = b.reindex(a.index)
    a, b = a.to_numpy(), b.to_numpy()
    keep = ~(np.isnan(a) | np.isnan(b))  # items a judge could not score, in either run
    return (a[keep], b[keep]) if keep.any() else "no item scored in both"


def regression_check(
    current: SuiteResult,
    earlier: SuiteResult | str | Path,
    *,
    seed: int = 0,
    num_resamples: int = 10_000,
    raise_on_regression: bool = False,
) -> pd.DataFrame:
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
    for arg, value, ok in (
        ("current", current, SuiteResult),
        ("earlier", earlier, (SuiteResult, str, Path)),
    ):
        if not isinstance(value, ok):
            raise _fail(arg, value, "a SuiteResult" + (arg == "earlier") * " or a saved folder")
    _int("seed", seed, 0)
    _int("num_resamples", num_resamples, 1)
    old = earlier if isinstance(earlier, SuiteResult) else SuiteResult.load(earlier)
    for label, t in (("current", current.table), ("earlier", old.table)):
        if t.duplicated(["set", "metric"]).any():
            raise ValueError(f"regression_check: {label}.table lists a (set, metric) twice")
    both = current.table.merge(old.table, on=["set", "metric"], suffixes=("", "_old")).astype(
        {c + sfx: float for c in ("value", "ci_low", "ci_high") for sfx in ("", "_old")}
    )
    if both.empty:
        raise ValueError(
            "regression_check: no (set, metric) in common; current has "
            f"{list(zip(current.table['set'], current.table['metric']))}, earlier "
            f"has {list(zip(old.table['set'], old.table['metric']))}"
        )
    rows = []
    for r in both.itertuples(index=False):
        what = f"{r.set}/{r.metric}"
        row = dict(
            set=r.set,
            metric=r.metric,
            current=r.value,
            earlier=r.value_old,
            difference=r.value - r.value_old,
            ci_low=math.nan,
            ci_high=math.nan,
        )
        pair = (
            _paired(current, old, r)
            if r.per_item_column == r.per_item_column_old
            else "per-item columns differ"
        )
        if math.isnan(r.value) or math.isnan(r.value_old):
            worse, method = math.isnan(r.value) and not math.isnan(r.value_old), "none"
            reason = (
                f"{what} got worse: no value now (n={r.n}, {r.excluded} excluded), "
                f"earlier {r.value_old:.3f}"
                if worse
                else f"{what}: no value to compare"
            )
        elif not isinstance(pair, str):
            d = paired_bootstrap_diff(*pair, seed=seed, num_resamples=num_resamples)
            row.update(ci_low=d["ci_low"], ci_high=d["ci_high"])
            worse, method = d["ci_high"] < 0, f"paired bootstrap on {d['num_items']} items"
            paired = (
                f"paired difference {d['difference']:+.3f} with 95% CI "
                f"[{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
            )
            reason = (
                f"{what} got worse: {r.value:.3f} vs {r.value_old:.3f}, {paired} below 0"
                if worse
                else f"{what}: {paired} includes or is above 0"
            )
        else:
            worse, method = r.ci_high < r.ci_low_old, f"interval overlap ({pair})"
            ivs = (
                f"interval [{r.ci_low:.3f}, {r.ci_high:.3f}] vs the earlier "
                f"[{r.ci_low_old:.3f}, {r.ci_high_old:.3f}]"
            )
            reason = f"{what} got worse: {ivs}, below it" if worse else f"{what}: {ivs}, overlap"
        rows.append({**row, "method": method, "worse": bool(worse), "reason": reason})
    table = pd.DataFrame(rows)
    if raise_on_regression and table["worse"].any():
        bad = table[table["worse"]]
        raise RegressionError("regression: " + "; ".join(bad["reason"]), table)
    return table
