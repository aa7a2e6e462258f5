"""How far a run is and how fast it goes, from its per-step metrics rows: elapsed time, the
estimated time to the last step (ETA) and token throughput, for the live dashboard's header and
text log line (`posttrain.notebook.dashboard.LiveDashboard`).

Columns read (those the trainers log per step):

    step                   the optimizer step
    step_time_s            wall seconds of the step (`Trainer`, `RLTrainer`)
    tokens_per_s           SFT, CPT and preference rows (`Trainer`): the tokens the loss trains
                           on per second of step_time_s (the trainer counts no other tokens:
                           prompt tokens run forward and backward without a loss and are not
                           logged). RL rows (`posttrain.rl.step_timing`): the tokens the
                           rollout sampled per second
    trained_tokens_per_s   RL rows only: the response tokens the loss covers per second

so `trained` is `trained_tokens_per_s` where a row has it, else `tokens_per_s`; `sampled` is
`tokens_per_s` of RL rows (those with `trained_tokens_per_s`) and None for the others.

ETA and throughput follow the recent pace (the first steps of a run include allocation and
warm-up). When the caller timed the rows' arrival (`step_clock`: (step, clock seconds) of the
latest rows, as the dashboard does), the pace is wall-clock seconds per step over the last
`window` of them: what the user waits for, evaluation, checkpoints and callbacks (the
dashboard's own redraws) included. Without it, it is the mean step time of the last `window`
rows that have one (a lower bound: the steps alone). With t_i the step times and r_i a rate
column of those rows,

    ETA        = (total - step) x (t_clock_last - t_clock_first) / (step_last - step_first)
                 or (total - step) x mean(t_i)
    tokens/s   = sum(r_i x t_i) / sum(t_i)       (tokens of the window / its step seconds)

Elapsed is the wall-clock time the caller measured when it has one (the dashboard: since the
first step it saw began), else the sum of all step times (a lower bound: evaluation, checkpoints
and data loading between steps are not in it).

Example (steps of 2 s, 3 of 5 done, 100 trained tokens a step):
    >>> import pandas as pd
    >>> frame = pd.DataFrame({"step": [1, 2, 3], "step_time_s": [2.0, 2.0, 2.0],
    ...                       "tokens_per_s": [50.0, 50.0, 50.0]})
    >>> pace = run_pace(frame, total=5)
    >>> pace.elapsed_s, pace.eta_s, pace.trained_tokens_per_s, pace.sampled_tokens_per_s
    (6.0, 4.0, 50.0, None)
    >>> format_duration(pace.eta_s), format_rate(1234.0)
    ('0:04', '1.2k')
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pandas as pd

__all__ = ["RunPace", "run_pace", "pace_parts", "format_duration", "format_rate", "PACE_WINDOW"]

PACE_WINDOW = 10
"""Rows (those with a step time) the ETA and the throughput are averaged over."""


@dataclasses.dataclass(frozen=True)
class RunPace:
    """Where a run stands (see the module docstring for the formulas).

    Attributes:
        step: the last row's step (None without a numeric step).
        total: the run's last step (None when unknown).
        elapsed_s: seconds since the run began (None without step times or a measured clock).
        eta_s: seconds to step `total` at the recent pace (0 at or past it; None without
            `total` or step times).
        trained_tokens_per_s: tokens the loss trained on, per second of step time (None when
            the rows have no throughput column).
        sampled_tokens_per_s: RL rows: tokens the rollout sampled, per second of step time;
            None for other rows.
    """

    step: int | None
    total: int | None
    elapsed_s: float | None
    eta_s: float | None
    trained_tokens_per_s: float | None
    sampled_tokens_per_s: float | None


def _numbers(frame: pd.DataFrame, column: str) -> pd.Series:
    if column not in frame:
        return pd.Series(math.nan, index=frame.index, dtype=float)
    return pd.to_numeric(frame[column], errors="coerce").astype(float)


def _rate(rates: pd.Series, seconds: pd.Series) -> float | None:
    """sum(rate x seconds) / sum(seconds) over rows where both are finite; None if none."""
    keep = rates.notna() & seconds.notna() & (seconds > 0)
    if not keep.any():
        return None
    return float((rates[keep] * seconds[keep]).sum() / seconds[keep].sum())


def run_pace(
    frame: pd.DataFrame,
    *,
    total: int | None = None,
    elapsed_s: float | None = None,
    step_clock: Sequence[tuple[int, float]] = (),
    window: int = PACE_WINDOW,
) -> RunPace:
    """Elapsed time, ETA and throughput of the run whose metrics rows are `frame`.

    Args:
        frame: the per-step rows (columns as in the module docstring; others are ignored,
            missing ones give None fields, NaN cells are skipped).
        total: the run's last step, for the ETA.
        elapsed_s: wall-clock seconds the caller measured; None: the sum of `step_time_s`.
        step_clock: (step, clock seconds when its row arrived) of the latest rows, oldest
            first (any monotonic clock); the ETA's pace when two of them are `window` steps
            apart or less and their steps differ.
        window: how many of the last rows (with a step time, or in `step_clock`) the ETA and
            the throughput average.

    Returns:
        A `RunPace`.

    Raises:
        ValueError: `window` < 1, `total` < 1 or a negative or non-finite `elapsed_s`.
    """
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window={window!r}; must be an integer >= 1 (rows averaged)")
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 1):
        raise ValueError(f"total={total!r}; must be a positive integer or None")
    if elapsed_s is not None and not (math.isfinite(elapsed_s) and elapsed_s >= 0):
        raise ValueError(f"elapsed_s={elapsed_s!r}; must be a finite number of seconds >= 0")
    steps = _numbers(frame, "step").dropna()
    step = int(steps.iloc[-1]) if len(steps) else None
    seconds = _numbers(frame, "step_time_s")
    timed = seconds.notna()
    if elapsed_s is None and timed.any():
        elapsed_s = float(seconds[timed].sum())
    recent = frame.index[timed][-window:]
    clock = list(step_clock)[-(window + 1) :]
    per_step = None
    if len(clock) >= 2 and clock[-1][0] > clock[0][0]:
        per_step = (clock[-1][1] - clock[0][1]) / (clock[-1][0] - clock[0][0])
    elif len(recent):
        per_step = float(seconds[recent].mean())
    eta_s = None
    if total is not None and step is not None and per_step is not None:
        eta_s = max(total - step, 0) * per_step
    rl = "trained_tokens_per_s" in frame
    trained = _numbers(frame, "trained_tokens_per_s" if rl else "tokens_per_s")
    return RunPace(
        step=step,
        total=total,
        elapsed_s=elapsed_s,
        eta_s=eta_s,
        trained_tokens_per_s=_rate(trained[recent], seconds[recent]),
        sampled_tokens_per_s=(
            _rate(_numbers(frame, "tokens_per_s")[recent], seconds[recent]) if rl else None
        ),
    )


def format_duration(seconds: float) -> str:
    """`m:ss` below an hour, else `h:mm:ss` (rounded down to whole seconds).

    >>> format_duration(7.9), format_duration(3599), format_duration(3723)
    ('0:07', '59:59', '1:02:03')

    Raises:
        ValueError: a negative or non-finite number of seconds.
    """
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"seconds={seconds!r}; must be finite and >= 0")
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_rate(value: float) -> str:
    """A rate with 2-3 significant digits and a k / M suffix: 950 -> '950', 1234 -> '1.2k',
    25300 -> '25k', 3.4e6 -> '3.4M'."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            scaled = value / scale
            return f"{scaled:.1f}{suffix}" if abs(scaled) < 10 else f"{scaled:.0f}{suffix}"
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.2g}"


def pace_parts(pace: RunPace) -> list[str]:
    """The known parts of `pace` as short phrases, for a header or a log line.

    >>> pace_parts(RunPace(3, 10, 8.0, 14.0, 1500.0, None))
    ['elapsed 0:08', 'ETA 0:14', 'trained 1.5k tok/s']
    """
    parts = []
    if pace.elapsed_s is not None:
        parts.append(f"elapsed {format_duration(pace.elapsed_s)}")
    if pace.eta_s is not None:
        parts.append(f"ETA {format_duration(pace.eta_s)}")
    rates = (("trained", pace.trained_tokens_per_s), ("sampled", pace.sampled_tokens_per_s))
    for kind, rate in rates:
        if rate is not None and math.isfinite(rate):
            parts.append(f"{kind} {format_rate(rate)} tok/s")
    return parts
