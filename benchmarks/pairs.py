"""Side-by-side timing as docs/benchmarks/README.md ("Conventions") defines it: contenders run
interleaved in one process, round-robin (run k of every contender before run k + 1 of any), after
an untimed warm-up; each run records its work (tokens, completion tokens, steps), its wall seconds
and the CPU seconds of the processes doing the work; a comparison gives the per-pair ratio as
median [min, max] by wall time and by CPU time, because wall ratios swing 2x under load on a
shared machine and CPU time is the work done.

Used by `generation.py`, `rollout_throughput.py`, `gpu_vllm_rollout.py`, `grpo_step.py`,
`grpo_engine_step.py` and `sft_packed.py` (`timing.StepClock.block_run` turns a block of trainer
steps into one `Run`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Literal, NamedTuple

Clock = Literal["wall", "cpu"]
CLOCKS: tuple[Clock, ...] = ("wall", "cpu")


class Run(NamedTuple):
    """One timed run of a contender.

    Attributes:
        work: what the run produced, in the unit the comparison normalises by (tokens
            generated, completion tokens, optimizer steps); > 0.
        wall_s: wall-clock seconds (`time.perf_counter`).
        cpu_s: CPU seconds (user + system) of the processes that did the work: this process's
            `time.process_time`, or a server's process group's (`group_cpu_s`).
    """

    work: float
    wall_s: float
    cpu_s: float


def _say(line: str) -> None:
    print(line, flush=True)


def run_interleaved(
    contenders: Mapping[str, Callable[[int], float | Run]],
    reps: int | Mapping[str, int],
    cpu_clocks: Mapping[str, Callable[[], float]] | None = None,
    *,
    warmup: bool | Collection[str] = True,
    log: Callable[[str], object] | None = _say,
) -> dict[str, list[Run]]:
    """Call every contender once untimed (seed -1), then round-robin `reps` times (seed = rep).

    Args:
        contenders: name -> fn(seed). The fn returns its work (then this function times the
            call), or a `Run` it timed itself (a block whose first steps are its own warm-up).
        reps: timed runs per contender, or name -> runs for contenders that run fewer times
            (a contender with fewer runs drops out of the later rounds).
        cpu_clocks: name -> a clock of the CPU seconds that contender's work uses (a server's
            process group, `group_cpu_s`); `time.process_time` (this process) for the others.
        warmup: whether to make the untimed call: True for all, False for none (contenders
            that warm up inside each run), or the names of the contenders that make it (a slow
            reference already warm from the others' runs may skip it).
        log: called with one line per timed run; None for silence.

    Returns:
        name -> its `Run`s in run order.

    Raises:
        ValueError: a contender's reps < 1, a warm-up name that is no contender, or a run's
            work <= 0 (its rate would be undefined).
    """
    counts = {name: reps if isinstance(reps, int) else reps[name] for name in contenders}
    for name, count in counts.items():
        if count < 1:
            raise ValueError(f"reps for {name!r} is {count}; must be >= 1")
    clocks = cpu_clocks or {}
    warm = set(contenders) if warmup is True else set() if warmup is False else set(warmup)
    if warm - set(contenders):
        raise ValueError(f"warmup names {sorted(warm - set(contenders))}; not contenders")
    for name, fn in contenders.items():
        if name in warm:
            fn(-1)
    runs: dict[str, list[Run]] = {name: [] for name in contenders}
    for rep in range(max(counts.values())):
        for name, fn in contenders.items():
            if rep >= counts[name]:
                continue
            clock = clocks.get(name, time.process_time)
            t0, c0 = time.perf_counter(), clock()
            out = fn(rep)
            run = out if isinstance(out, Run) else Run(out, time.perf_counter() - t0, clock() - c0)
            if not run.work > 0:
                raise ValueError(f"{name!r} run {rep} did {run.work} work; each run must do some")
            runs[name].append(run)
            if log is not None:
                log(
                    f"    rep {rep} {name:12s} {run.work:g} work {run.wall_s:.3f} s "
                    f"cpu {run.cpu_s:.3f} s"
                )
    return runs


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group `pgid`
    (a vLLM server: its API server, engine core and worker), from /proc."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended
        if int(fields[2]) == pgid:  # state ppid pgrp ... utime (11) stime (12)
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def seconds(run: Sequence[float], clock: Clock = "wall") -> float:
    """The run's seconds by `clock` ("wall" or "cpu").

    Raises:
        ValueError: an unknown clock, or a run recorded without CPU seconds.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r}; must be one of {CLOCKS}")
    if clock == "cpu" and len(run) < 3:
        raise ValueError("the run has no CPU seconds: record (work, wall_s, cpu_s)")
    return run[1] if clock == "wall" else run[2]


def rates(runs: Sequence[Sequence[float]], clock: Clock = "wall") -> list[float]:
    """Work per second of each run (tokens/s, steps/s) by `clock`."""
    return [run[0] / seconds(run, clock) for run in runs]


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of `values`. Raises ValueError when there are none."""
    if not values:
        raise ValueError("no runs to summarise: --reps must be >= 1")
    return statistics.median(values), min(values), max(values)


def paired_ratios(
    a: Sequence[Sequence[float]],
    b: Sequence[Sequence[float]],
    clock: Clock = "wall",
    *,
    per_work: bool = True,
) -> list[float]:
    """How many times faster `a` is than `b`, pair by pair (run k of each was interleaved).

    With `per_work`, the rate of `a` over the rate of `b` (work per second: `b`'s seconds per unit
    of work over `a`'s); without, `b`'s seconds over `a`'s (runs of the same fixed work, e.g. the
    same number of steps, whatever tokens they produced).

    Raises:
        ValueError: the two have different numbers of runs.
    """
    if len(a) != len(b):
        raise ValueError(f"{len(a)} runs against {len(b)}: pair runs of the same cell")
    if per_work:
        return [x / y for x, y in zip(rates(a, clock), rates(b, clock), strict=True)]
    return [seconds(y, clock) / seconds(x, clock) for x, y in zip(a, b, strict=True)]


def fmt(median: float, low: float, high: float, digits: int = 0, unit: str = "") -> str:
    """'median [low, high]' with `digits` decimals and thousands separators."""
    return f"{median:,.{digits}f}{unit} [{low:,.{digits}f}, {high:,.{digits}f}]"


def ratio_cells(
    a: Sequence[Sequence[float]],
    b: Sequence[Sequence[float]],
    *,
    per_work: bool = True,
    digits: int = 2,
) -> dict[Clock, str]:
    """{"wall": ..., "cpu": ...}: `paired_ratios(a, b)` by each clock as 'median [min, max]x'."""
    return {
        clock: fmt(*spread(paired_ratios(a, b, clock, per_work=per_work)), digits=digits, unit="x")
        for clock in CLOCKS
    }
