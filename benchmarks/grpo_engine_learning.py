"""Does GRPO learn as well when the vLLM engine samples its rollouts as when the policy does?

Tutorial 02's run (notebooks/02_grpo_reasoning.ipynb: echo a digit, tiny-1m, 50 SFT steps, then
GRPO 16 prompts x 8 samples, lr 2e-3; benchmarks/echo_grpo.py) is swept with `posttrain.sweep`
over `rollout.engine` in {builtin, vllm} x `--seeds`, the same number of steps for both, one run
after the other in this process (executor "debug": one vLLM server at a time, started at the
run's first rollout and stopped at its end). Reported per engine, over the seeds (mean and
two-sided 95% Student-t interval):

  * the reward curve (reward_mean per step) and the held-out accuracy curve (160 sampled
    answers at T=1 on prompts with unseen verbs, every `--eval-every` steps; always measured
    with the trained policy's own `Policy.generate`, so both engines are scored alike);
  * the final reward (mean of the last 5 steps) and held-out accuracy after GRPO;
  * vllm minus builtin, paired seed by seed (same seed = same start, same prompts; the samples
    differ: the two engines draw from their own random streams), with a t-interval over the
    seeds, and the sweep's paired bootstrap on the same held-out answers (`Sweep.summary`);
  * the sampler-vs-trainer mismatch of the vllm runs (rollout_logprob_delta_max per step).

Usage:
    nice -n 19 .venv/bin/python benchmarks/grpo_engine_learning.py        # 3 seeds, 30 steps
    nice -n 19 .venv/bin/python benchmarks/grpo_engine_learning.py --seeds 0 1 2 3 4
    nice -n 19 .venv/bin/python benchmarks/grpo_engine_learning.py --quick # 1 seed, 6 steps

Writes `--md` and `--png` (defaults: docs/benchmarks/grpo_engine_learning.md and the .png beside
it; --quick: print only); a hand-written "## Reading" section at the end of `--md` is kept.
`--report-only --folder F` reports the finished runs of an earlier sweep folder without running
anything.
Running needs the vLLM venv (scripts/vllm-up.sh); without it the script exits 2, naming why.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from echo_grpo import metrics_of  # noqa: E402
from timing import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("builtin", "vllm")
SWEEP_JSON = "sweep.json"  # posttrain.workflows.sweep.SWEEP_FILE
READING = "## Reading"  # a hand-written section of the report, kept when it is written again
MEASURE_FILE = "measured.json"  # in the sweep folder: each invocation's wall time and load


def t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided 95% Student-t interval of the mean of `values`,
    mean +- t_{0.975, n-1} * sd / sqrt(n) (sd with n - 1); low = high = NaN for one value.

    Raises:
        ValueError: for no values.
    """
    from posttrain.workflows.sweep import t_quantile

    n = len(values)
    if n == 0:
        raise ValueError("t_interval needs at least one value")
    mean = sum(values) / n
    if n == 1:
        return mean, float("nan"), float("nan")
    half = t_quantile(0.975, n - 1) * statistics.stdev(values) / n**0.5
    return mean, mean - half, mean + half


def curve_band(frames: Sequence[Any], x: str, y: str) -> Any:
    """The curve of column `y` against `x` over runs (one DataFrame each, the same `x` values):
    a DataFrame with `x`, mean, low, high (`t_interval` across the runs at each `x`).

    Raises:
        ValueError: when the runs do not share their `x` values.
    """
    import pandas as pd

    xs = [list(f[x]) for f in frames]
    if any(v != xs[0] for v in xs):
        raise ValueError(f"curve_band: the runs differ in their {x!r} values; cannot average them")
    rows = []
    for i, at in enumerate(xs[0]):
        mean, low, high = t_interval([float(f[y].iloc[i]) for f in frames])
        rows.append({x: at, "mean": mean, "low": low, "high": high})
    return pd.DataFrame(rows)


def paired_difference(mine: dict[int, float], base: dict[int, float]) -> dict[str, Any]:
    """`mine[s] - base[s]` for every seed s in both: {"seeds", "diffs" (per seed), "interval":
    their `t_interval` (mean, low, high)}."""
    seeds = sorted(set(mine) & set(base))
    diffs = [mine[s] - base[s] for s in seeds]
    diff, low, high = t_interval(diffs) if diffs else (float("nan"),) * 3
    return {"seeds": seeds, "diffs": diffs, "interval": (diff, low, high)}


def _fmt(mean: float, low: float, high: float, sign: str = "") -> str:
    """mean [low, high] to 3 decimals (`sign="+"`: signed), or the mean alone without an
    interval (NaN: one seed)."""
    if low != low:
        return f"{mean:{sign}.3f}"
    return f"{mean:{sign}.3f} [{low:{sign}.3f}, {high:{sign}.3f}]"


class LoadSampler:
    """The 1-minute load average every `every_s` seconds in a daemon thread, while it runs."""

    def __init__(self, every_s: float = 15.0) -> None:
        self.values = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.values.append(os.getloadavg()[0])

    def stop(self) -> dict[str, float]:
        """Stop sampling; {"min", "median", "max"} of the samples."""
        self._stop.set()
        self.values.append(os.getloadavg()[0])
        v = self.values
        return {"min": min(v), "median": statistics.median(v), "max": max(v)}


def record_measure(folder: Path, wall_s: float, load: dict[str, float]) -> list[dict]:
    """Append one invocation's wall seconds and load to `folder/MEASURE_FILE` (an invocation
    that ran runs: a later one that only reads finished runs records nothing) and return every
    invocation's record."""
    path = folder / MEASURE_FILE
    records = json.loads(path.read_text()) if path.is_file() else []
    records.append({"wall_s": wall_s, **load})
    path.write_text(json.dumps(records, indent=2))
    return records


def _measured(folder: Path) -> str:
    path = folder / MEASURE_FILE
    records = json.loads(path.read_text()) if path.is_file() else []
    if not records:
        return "wall time and load not recorded"
    wall = sum(r["wall_s"] for r in records) / 60
    loads = "; ".join(f"{r['min']:.1f} / {r['median']:.1f} / {r['max']:.1f}" for r in records)
    return f"{wall:.0f} min wall; load average (1 min) min / median / max: {loads}"


def _runs(s: Any) -> dict[tuple[str, int], tuple[Any, Any, dict]]:
    """(engine, seed) -> (GRPO metrics, eval_curve.csv, results.json) of a finished sweep."""
    import pandas as pd

    out = {}
    for e in ENGINES:
        for seed in s.seeds:
            folder = s.out_dir(f"rollout.engine={e}", seed)
            out[e, seed] = (
                metrics_of(folder),
                pd.read_csv(folder / "eval_curve.csv"),
                json.loads((folder / "results.json").read_text()),
            )
    return out


def figure(s: Any, runs: dict) -> Any:
    """Four panels: reward and held-out accuracy per engine (each seed thin, the mean thick,
    its 95% t-band over seeds), the paired reward difference vllm - builtin per step with its
    band and zero, and the vllm runs' max |logprob delta| per step."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 3.9))
    many = len(s.seeds) > 1
    for i, e in enumerate(ENGINES):
        for ax, part, y in ((axes[0], 0, "reward_mean"), (axes[1], 1, "sampled")):
            frames = [runs[e, k][part] for k in s.seeds]
            for f in frames:
                ax.plot(f["step"], f[y], color=f"C{i}", lw=0.6, alpha=0.5)
            band = curve_band(frames, "step", y)
            ax.plot(band["step"], band["mean"], color=f"C{i}", lw=2, label=e)
            if many:
                ax.fill_between(band["step"], band["low"], band["high"], color=f"C{i}", alpha=0.15)
    diffs = [
        runs["vllm", k][0].assign(
            d=runs["vllm", k][0]["reward_mean"] - runs["builtin", k][0]["reward_mean"]
        )
        for k in s.seeds
    ]
    band = curve_band(diffs, "step", "d")
    axes[2].plot(band["step"], band["mean"], color="C2")
    if many:
        axes[2].fill_between(band["step"], band["low"], band["high"], color="C2", alpha=0.2)
    axes[2].axhline(0, color="0.4", lw=1)
    for k in s.seeds:
        m = runs["vllm", k][0]
        axes[3].semilogy(m["step"], m["rollout_logprob_delta_max"].clip(lower=1e-9), color="C1")
    axes[0].set(xlabel="GRPO step", ylabel="reward_mean", title="training reward", ylim=(0, 1.02))
    axes[1].set(xlabel="GRPO step", ylabel="accuracy", ylim=(0, 1.02),
                title="held-out accuracy (sampled, T=1)")  # fmt: skip
    axes[2].set(xlabel="GRPO step", ylabel="reward difference",
                title="vllm - builtin, paired by seed")  # fmt: skip
    axes[3].set(xlabel="GRPO step", ylabel="max |logprob delta|", title="vllm: sampler vs trainer")
    for ax in axes[:2]:
        ax.legend()
    fig.suptitle(
        f"echo GRPO per rollout engine, {len(s.seeds)} seeds: thin = one seed, thick = mean, "
        "band = 95% t-interval over seeds (clipped to the axes)"
    )
    fig.tight_layout()
    return fig


def _verdict(name: str, d: dict, n: int) -> str:
    mean, low, high = d["interval"]
    if low != low:
        return f"{name}: one seed, no interval."
    shown = f"{mean:+.4f} [{low:+.4f}, {high:+.4f}]"
    if low > 0:
        return f"{name}: vllm higher, {shown} (interval above 0)."
    if high < 0:
        return f"{name}: vllm lower, {shown} (interval below 0)."
    return (
        f"{name}: {shown}: the interval holds 0, so {n} seeds show no difference either way; "
        f"it bounds how much lower vllm could be at {-low:.4f}."
    )


def report(s: Any, args: argparse.Namespace) -> tuple[str, Any]:
    """The markdown report and the figure of a finished sweep `s`."""
    from posttrain.workflows.sweep import t_quantile

    runs = _runs(s)
    n = len(s.seeds)

    def per_engine(get: Any) -> dict[str, dict[int, float]]:
        return {e: {k: float(get(runs[e, k][2])) for k in s.seeds} for e in ENGINES}

    first, final = per_engine(lambda r: r["reward_first"]), per_engine(lambda r: r["reward_last"])
    start = per_engine(lambda r: r["before_grpo"]["accuracy"])
    held = per_engine(lambda r: r["after_grpo"]["accuracy"])
    greedy = per_engine(lambda r: r["after_grpo"]["greedy"])
    step_s = {
        e: [t for k in s.seeds for t in runs[e, k][0]["step_time_s"].iloc[1:]] for e in ENGINES
    }
    delta = [float(runs["vllm", k][0]["rollout_logprob_delta_max"].max()) for k in s.seeds]
    rows = [
        "| engine | reward, first 5 steps | reward, last 5 steps | held-out sampled: start "
        "-> after GRPO | held-out greedy after | step s median [min-max] |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for e in ENGINES:
        f = {name: _fmt(*t_interval(list(d[e].values())))
             for name, d in (("first", first), ("final", final), ("start", start),
                             ("held", held), ("greedy", greedy))}  # fmt: skip
        rows.append(
            f"| {e} | {f['first']} | {f['final']} | {f['start']} -> {f['held']} | "
            f"{f['greedy']} | {statistics.median(step_s[e]):.2f} "
            f"[{min(step_s[e]):.2f}-{max(step_s[e]):.2f}] |"
        )
    step1 = {e: {k: float(runs[e, k][0]["reward_mean"].iloc[0]) for k in s.seeds} for e in ENGINES}
    every = {e: {k: float(runs[e, k][0]["reward_mean"].mean()) for k in s.seeds} for e in ENGINES}
    d_step1 = paired_difference(step1["vllm"], step1["builtin"])
    d_every = paired_difference(every["vllm"], every["builtin"])
    d_final = paired_difference(final["vllm"], final["builtin"])
    d_held = paired_difference(held["vllm"], held["builtin"])
    boot = s.summary().set_index("arm").loc["rollout.engine=vllm"]
    t_text = f"t(0.975, {n - 1}) = {t_quantile(0.975, n - 1):.2f}" if n > 1 else "one seed: none"
    paired_rows = [
        f"| {label} | {', '.join(f'{x:+.3f}' for x in d['diffs'])} | "
        f"{_fmt(d['interval'][0], d['interval'][1], d['interval'][2], sign='+')} |"
        for label, d in (
            ("reward, last 5 steps", d_final),
            ("held-out sampled accuracy after GRPO", d_held),
            ("reward at step 1 (same weights)", d_step1),
            (f"reward, mean over all {args.steps} steps", d_every),
        )
    ]
    text = f"""# GRPO per rollout engine: does it learn on vLLM as on builtin?

`{command(args)}` ({_measured(s.folder)})

Setup: tutorial 02's run (notebooks/02_grpo_reasoning.ipynb, echo a digit; tiny-1m, 50 SFT
steps, then GRPO 16 prompts x 8 samples, at most 4 new tokens, lr 2e-3, k3 KL 0.04;
benchmarks/echo_grpo.py) swept with `posttrain.sweep` over `rollout.engine` = builtin, vllm x
seeds {s.seeds}, {args.steps} GRPO steps each, one run at a time in one process (the vllm run
starts its server at its first rollout and stops it at its end). Torch {args.threads}
thread(s); the vLLM server bound to as many. Held-out accuracy: 160 answers sampled at T=1 on
20 prompts with verbs never trained on, scored with the policy's own `Policy.generate` for both
engines. Mean over seeds with its 95% t-interval ({t_text}); the seeds start from very
different warm starts, so per-engine intervals are wide (and may run past [0, 1]): the paired
differences below are the comparison. Machine: {cpu_model()}, shared with other work.

{chr(10).join(rows)}

vllm minus builtin, paired seed by seed (same start and prompts, each engine's own samples):

| figure | per seed | mean [95% t-interval over seeds] |
|---|---|---:|
{chr(10).join(paired_rows)}

- {_verdict("Final reward", d_final, n)}
- {_verdict("Held-out sampled accuracy", d_held, n)}
- The sweep's paired bootstrap over the same {int(boot["paired_items"])} held-out answers, seeds
  pooled (`Sweep.summary`): {boot["diff"]:+.3f} [{boot["diff_ci_low"]:+.3f},
  {boot["diff_ci_high"]:+.3f}]. It resamples answers of these {2 * n} trained policies, not
  seeds: it says how much these policies differ, not how much the engines do.
- Sampler vs trainer in the vllm runs: the largest per-token |logprob delta| of any step was
  {max(delta):.1e} (per seed: {", ".join(f"{d:.1e}" for d in delta)}): fp32 rounding.

![reward and held-out curves per engine](grpo_engine_learning.png)
"""
    return text, figure(s, runs)


def command(args: argparse.Namespace) -> str:
    parts = ["nice -n 19 .venv/bin/python benchmarks/grpo_engine_learning.py"]
    if args.quick:
        parts.append("--quick")
    else:
        parts.append(f"--seeds {' '.join(map(str, args.seeds))} --steps {args.steps}")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps per run")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--folder", type=Path, help="the sweep folder (default: a temporary one)")
    parser.add_argument("--md", type=Path, default=ROOT / "docs/benchmarks/grpo_engine_learning.md")
    parser.add_argument(
        "--png", type=Path, default=ROOT / "docs/benchmarks/grpo_engine_learning.png"
    )
    parser.add_argument("--quick", action="store_true", help="1 seed, 6 steps, print only")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="report the finished runs of --folder (its sweep.json) without running anything",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.eval_every, args.md, args.png = [0], 6, 3, None, None
    if args.report_only:
        if args.folder is None or not (args.folder / SWEEP_JSON).is_file():
            parser.error(f"--report-only needs --folder, a sweep folder with {SWEEP_JSON}")
        return write(*report(finished_sweep(args), args), args)
    from posttrain.core.threads import apply_thread_env

    apply_thread_env()  # OMP_WAIT_POLICY=PASSIVE before torch, as the posttrain command does
    import echo_grpo  # the run the sweep runs: a module with Config and main

    from posttrain import sweep
    from posttrain.policy.vllm_server import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason is not None:
        print(f"grpo_engine_learning.py needs the vLLM venv: {reason}", file=sys.stderr)
        return 2
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or Path(tmp) / "sweep"
        load, started = LoadSampler(), time.perf_counter()
        s = sweep(
            echo_grpo,
            {"rollout.engine": list(ENGINES)},
            seeds=args.seeds,
            base={"rl_steps": args.steps, "eval_every": args.eval_every, "threads": args.threads},
            baseline="rollout.engine=builtin",
            executor="debug",
            folder=folder,
        )
        table = s.wait()
        wall_s, load_now = time.perf_counter() - started, load.stop()
        if any(run is not None for run in s.runs.values()):  # runs ran now, not only read
            record_measure(s.folder, wall_s, load_now)
        print(table.drop(columns=["out_dir"]).to_string(index=False))
        failed = table[table.status != "finished"]
        if len(failed):
            print(f"runs did not finish:\n{failed.to_string(index=False)}", file=sys.stderr)
            return 1
        text, fig = report(s, args)
    return write(text, fig, args)


def write(text: str, fig: Any, args: argparse.Namespace) -> int:
    """Print the report; write `--md` (keeping its hand-written `READING` section, if any: check
    it against the new numbers) and `--png`."""
    print(text)
    if args.md is not None:
        old = args.md.read_text() if args.md.is_file() else ""
        if READING in old:
            text += "\n" + old[old.index(READING) :]
        args.md.write_text(text)
    if args.png is not None:
        fig.savefig(args.png, dpi=110)
    return 0


def finished_sweep(args: argparse.Namespace) -> Any:
    """The `Sweep` handle of `args.folder` as its sweep.json records it (nothing submitted);
    `args.seeds` and `args.steps` set from it (the report's command line)."""
    from posttrain.workflows.sweep import Arm, Sweep

    record = json.loads((args.folder / SWEEP_JSON).read_text())
    arms = [Arm(**a) for a in record["arms"]]
    base = next(a for a in arms if a.name == record["baseline"])
    seeds = record["seeds"]
    config = json.loads((args.folder / base.name / f"seed{seeds[0]}" / "config.json").read_text())
    args.seeds, args.steps, args.threads = seeds, config["rl_steps"], config["threads"]
    runs: dict[tuple[str, int], Any] = {(a.name, int(k)): None for a in arms for k in seeds}
    return Sweep(args.folder.absolute(), arms, seeds, base, runs)


if __name__ == "__main__":
    raise SystemExit(main())
