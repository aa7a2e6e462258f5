"""How the benchmarks that time posttrain beside another framework clock a step and name the
machine: `StepClock` (the end of every optimizer step, from a callback of either side, by wall
and by CPU time; a block of steps as one `pairs.Run` for `pairs.run_interleaved`) and
`cpu_model` (the CPU's name, and with `isa=True` its family, model and vector extensions, which
decide the kernels and so the last bits of a run). Used by `sft_throughput.py`, `grpo_step.py`,
`grpo_vs_trl.py` and `main_job_seeds.py`.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from pairs import Run

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
"""The vector extensions a CPU line names, where the CPU has them (lscpu's "Flags")."""


class Blocks(Protocol):
    """A benchmark's setup, as far as the clock reads it: each block is `warmup` untimed steps,
    then `steps` timed ones."""

    @property
    def warmup(self) -> int: ...

    @property
    def steps(self) -> int: ...


class StepClock:
    """`perf_counter()` at the end of every optimizer step (after the update): `tick()` from a
    trainer's step callback. A step's time runs from the end of the previous step to the end of
    this one, so the last warm-up step's end starts the first timed step (`warmup` >= 1).

    Attributes:
        times: the tick times of the current block, seconds (`clear()` between blocks).
        cpu_times: this process's CPU seconds (`time.process_time`) at each tick.
        then: called after each tick (the other side's step, to interleave the two), or None.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.then: Callable[[], object] | None = None

    def clear(self) -> None:
        """Forget the ticks of the last block."""
        self.times.clear()
        self.cpu_times.clear()

    def tick(self) -> None:
        self.times.append(time.perf_counter())
        self.cpu_times.append(time.process_time())
        if self.then is not None:
            self.then()

    def durations(self, setup: Blocks, clock: str = "wall") -> list[float]:
        """Seconds of each timed step of the block (the `setup.steps` after the warm-up), by
        `clock`: "wall" (`perf_counter`) or "cpu" (this process's `process_time`).

        Raises:
            ValueError: if `setup.warmup` < 1 (the first timed step would have no start), the
                block did not tick `warmup + steps` times, or `clock` is neither.
        """
        if clock not in ("wall", "cpu"):
            raise ValueError(f"clock {clock!r}; must be 'wall' or 'cpu'")
        ticks = self.times if clock == "wall" else self.cpu_times
        if setup.warmup < 1:
            raise ValueError(f"warmup={setup.warmup}; must be >= 1 to time the first step")
        if len(ticks) != setup.warmup + setup.steps:
            raise ValueError(
                f"the block ticked {len(ticks)} times; warmup={setup.warmup} + "
                f"steps={setup.steps} expected"
            )
        timed = ticks[setup.warmup - 1 :]
        return [b - a for a, b in zip(timed, timed[1:])]

    def block_run(self, setup: Blocks, work_per_step: Sequence[float]) -> Run:
        """The block as one `pairs.Run`: the work of its timed steps (the last `setup.steps` of
        `work_per_step`, e.g. the completion tokens each step sampled) and their wall and CPU
        seconds.

        Raises:
            ValueError: `work_per_step` does not count `warmup + steps` steps, or as
                `durations`.
        """
        if len(work_per_step) != setup.warmup + setup.steps:
            raise ValueError(
                f"{len(work_per_step)} steps counted; warmup={setup.warmup} + "
                f"steps={setup.steps} expected"
            )
        return Run(
            sum(work_per_step[setup.warmup :]),
            sum(self.durations(setup)),
            sum(self.durations(setup, "cpu")),
        )

    def median_step(self, setup: Blocks) -> float:
        """The median of `durations(setup)`, seconds."""
        return statistics.median(self.durations(setup))


def cpu_model(*, isa: bool = False) -> str:
    """The CPU's model name from `lscpu` ("unknown CPU" where it says none; `platform.processor()`
    without lscpu); with `isa`, followed by its family, model and the `ISA_FLAGS` it has, e.g.
    "AMD EPYC 7B13 (family 25, model 1; avx2, fma)"."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    if not isa:
        return name
    flags = fields.get("Flags", "").split()
    extensions = ", ".join(f for f in ISA_FLAGS if f in flags) or "no AVX2"
    return (
        f"{name} (family {fields.get('CPU family', '?').strip()}, model "
        f"{fields.get('Model', '?').strip()}; {extensions})"
    )
