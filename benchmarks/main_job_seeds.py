"""The main job's seed spread: run it (or its SFT stage alone) once per seed and report each
figure as mean and 95% interval over the seeds, with every seed's value and the CPU it ran on.

One run of the main job is one draw: the SFT stage of a 2M-parameter policy lands at very
different held-out accuracies with the seed (and with a CPU's last-bit arithmetic), so a figure
quoted from one seed says little. This runs `posttrain run grpo seed=S ...` per seed (each in its
own process and run folder, `--parallel N` at a time, `--threads` each) and aggregates the
`results.json` files; `--stage sft` runs only the SFT warm start (the stage that swings most)
with the main job's settings, e.g. to compare learning rates:

    python benchmarks/main_job_seeds.py --seeds 0 1 2                      # the main job
    python benchmarks/main_job_seeds.py --stage sft --seeds 0 1 2 sft.lr=1e-3
    python benchmarks/main_job_seeds.py --quick                            # tiny sizes, seconds
    python benchmarks/main_job_seeds.py --work W --reuse --plot curves.png # report finished runs
    python benchmarks/main_job_seeds.py --sweep --work W --seeds 0 1 2    # through posttrain.sweep

`--plot` draws every seed's held-out greedy curve during GRPO (`eval_curve.csv`) with its
more-SFT baseline's accuracy; `--reuse` takes a seed's results from `--work` when its run
finished there before instead of running it again.

`--sweep` submits the seeds as one `posttrain.sweep` of the grpo recipe (executor "local", all
seeds at once, `--threads` each; the run folders are `W/rl.algo=grpo/seed<k>`, and a finished
one is not run again) and adds the sweep's own summary of held-out greedy accuracy: a cluster
bootstrap over seeds x items, where the t-interval below has only the seeds.

Intervals are Student-t over the per-seed values (mean +- t_{0.975, n-1} * sd / sqrt(n)); with 3
seeds they are wide by construction. Writes `--out` (markdown, default: print only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from grpo_step import command_line  # noqa: E402
from timing import cpu_model  # noqa: E402

# Student-t 0.975 quantiles for 1..10 degrees of freedom (any statistics table), then ~normal.
T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
}

# (label, path into results.json); missing paths (a stage not run) are left out.
FIGURES = [
    ("greedy after SFT", ("after_sft", "accuracy")),
    ("greedy after GRPO", ("after_grpo", "accuracy")),
    ("GRPO minus SFT, greedy (points)", ("difference", "difference")),
    ("sampled pass@1 after SFT", ("sampled_after_sft", "pass_at_1")),
    ("sampled pass@1 after GRPO", ("sampled_after_grpo", "pass_at_1")),
    ("pass@k after SFT", ("sampled_after_sft", "pass_at_k")),
    ("pass@k after GRPO", ("sampled_after_grpo", "pass_at_k")),
    ("GRPO minus SFT, sampled pass@1 (points)", ("sampled_difference", "difference")),
    ("greedy after more SFT", ("more_sft", "accuracy")),
    ("GRPO minus more SFT, greedy (points)", ("rl_minus_more_sft", "difference")),
    ("wall time (s)", ("wall_s",)),
]
SFT_FIGURES = [
    ("greedy after SFT", ("after", "accuracy")),
    ("final SFT loss", ("final_loss",)),
    ("wall time (s)", ("wall_s",)),
]
QUICK = [
    "model.name=tiny-1m",
    "task.train_size=64",
    "task.eval_size=8",
    "eval.max_new_tokens=6",
    "eval.samples=2",
    "sft.steps=3",
    "sft.batch_size=8",
    "optim.steps=2",
    "optim.warmup_steps=1",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "sampling.max_new_tokens=4",
    "checkpoint.every=1",
    "eval.every=0",
    "baseline.steps=0",
]


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the Student-t 95% interval of the mean; (v, nan, nan) for one value.

    >>> mean_interval([0.2, 0.4, 0.6])  # sd 0.2, t(2) = 4.303: 0.4 +- 4.303 * 0.2 / sqrt(3)
    (0.4, -0.0968..., 0.8968...)
    """
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = T975.get(n - 1, 1.96) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def _one_sft(seed: int, out: Path, overrides: list[str]) -> None:
    """The main job's SFT stage alone (`warm_start` with the grpo recipe's config)."""
    from posttrain import cli
    from posttrain.workflows.recipes import apply_overrides
    from posttrain.workflows.sft import warm_start

    cfg = apply_overrides(
        cli.load_recipe("grpo").Config(),
        [*overrides, f"seed={seed}", f"out_dir={out}", "progress=false"],
    )
    start = time.perf_counter()
    results = warm_start(cfg, out)
    if results is None:  # warm_start returns None on ranks other than 0; this is one process
        raise RuntimeError(f"seed {seed}: the SFT stage returned no results (see {out})")
    results["wall_s"] = time.perf_counter() - start
    (out / "seed_results.json").write_text(json.dumps(results, default=str))


def _run(
    seed: int, stage: str, folder: Path, overrides: list[str], threads: int, reuse: bool = False
) -> dict:
    out = folder / f"seed{seed}"
    name = "seed_results.json" if stage == "sft" else "results.json"
    if reuse and (out / name).is_file():
        return json.loads((out / name).read_text())
    env = {**os.environ, "POSTTRAIN_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    if stage == "sft":
        cmd = [sys.executable, __file__, "--one-sft", str(seed), str(out), *overrides]
    else:
        cmd = [
            sys.executable,
            "-m",
            "posttrain.cli",
            "run",
            "grpo",
            f"seed={seed}",
            f"out_dir={out}",
            "progress=false",
            *overrides,
        ]
    log = folder / f"seed{seed}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise RuntimeError(f"seed {seed}: `{' '.join(cmd)}` exited {rc}; see {log}")
    return json.loads((out / name).read_text())


SWEEP_ARM = {"rl.algo": ["grpo"]}  # one arm: the main job as it is


def _swept(seeds: list[int], folder: Path, overrides: list[str], threads: int) -> tuple:
    """Every seed's run of the main job through `posttrain.sweep` (local processes, all at
    once, `threads` each); returns ({seed: results}, the arm's run folder, the sweep's summary
    as markdown)."""
    import yaml

    from posttrain.workflows.recipes import split_overrides
    from posttrain.workflows.sweep import sweep

    os.environ.update(POSTTRAIN_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    # values parsed as YAML, as the command line parses them
    base = {k: yaml.safe_load(v) for k, v in split_overrides([*overrides, "progress=false"])}
    s = sweep("grpo", SWEEP_ARM, seeds=seeds, base=base, executor="local", folder=folder,
              timeout_min=600)  # fmt: skip
    table = s.wait()
    failed = table[table["status"] != "finished"]
    if len(failed):
        raise RuntimeError(f"sweep runs did not finish:\n{failed.to_string()}")
    arm = s.arms[0].name
    runs = {k: json.loads((s.out_dir(arm, k) / "results.json").read_text()) for k in seeds}
    return runs, folder / arm, s.summary().to_markdown(index=False)


def _get(results: dict, path: tuple[str, ...]) -> float | None:
    """The number at `path` in a results dict, or None where the path is missing (a stage the
    run did not have)."""
    value: Any = results
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value)


def report(per_seed: dict[int, dict], figures: list, header: list[str]) -> str:
    seeds = sorted(per_seed)
    lines = [
        *header,
        "",
        "| figure | mean [95% t-interval over seeds] | min | max | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " |",
        "|---|---|---:|---:|" + "---:|" * len(seeds),
    ]
    for label, path in figures:
        found = [_get(per_seed[s], path) for s in seeds]
        if any(v is None for v in found):
            continue
        scale = 100.0 if "points" in label else 1.0
        values = [v * scale for v in found if v is not None]
        mean, low, high = mean_interval(values)
        fmt = (
            (lambda v: f"{v:.0f}")
            if "(s)" in label
            else ((lambda v: f"{v:+.1f}") if "points" in label else (lambda v: f"{v:.3f}"))
        )
        lines.append(
            f"| {label} | {fmt(mean)} [{fmt(low)}, {fmt(high)}] | {fmt(min(values))} "
            f"| {fmt(max(values))} | " + " | ".join(fmt(v) for v in values) + " |"
        )
    return "\n".join(lines) + "\n"


def plot_curves(folder: Path, per_seed: dict[int, dict], path: Path) -> None:
    """Each seed's held-out greedy accuracy during GRPO (its run's `eval_curve.csv`: step,
    accuracy) as a line, its more-SFT baseline's greedy accuracy as a dashed line of the same
    colour; written to `path` (PNG)."""
    import matplotlib.pyplot as plt
    import pandas as pd

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    top = 0.0
    for i, seed in enumerate(sorted(per_seed)):
        colour = f"C{i}"
        curve = pd.read_csv(folder / f"seed{seed}" / "eval_curve.csv")
        ax.plot(curve["step"], curve["accuracy"], "o-", color=colour, label=f"seed {seed}: GRPO")
        more = _get(per_seed[seed], ("more_sft", "accuracy"))
        top = max(top, float(curve["accuracy"].max()), more or 0.0)
        if more is not None:
            ax.axhline(
                more,
                color=colour,
                linestyle="--",
                linewidth=1,
                label=f"seed {seed}: more SFT instead",
            )
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, min(1.02, max(0.05, 1.3 * top)))  # low curves stay readable
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--one-sft":
        _one_sft(int(argv[1]), Path(argv[2]), argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--stage", choices=("all", "sft"), default="all")
    parser.add_argument("--threads", type=int, default=1, help="threads per run")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time")
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="folder for the run folders (default: a temporary one)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="take a seed's results from --work when its run finished there",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write the seeds' held-out curves during GRPO here (PNG)",
    )
    parser.add_argument(
        "--sweep", action="store_true", help="run the seeds as one posttrain.sweep (local)"
    )
    parser.add_argument("overrides", nargs="*", help="dotted key=value for every seed's run")
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds}: each seed once")
    if args.reuse and args.work is None:
        parser.error("--reuse takes the runs from --work: name the folder")
    if args.sweep and (args.work is None or args.stage != "all" or args.reuse):
        parser.error("--sweep runs the whole main job into --work (it skips finished runs)")
    if args.plot is not None and args.stage != "all":
        parser.error("--plot draws the GRPO stage's curves: use it with --stage all")
    overrides = [*(QUICK if args.quick else []), *args.overrides]
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.work or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        summary = None
        if args.sweep:
            runs, folder, summary = _swept(args.seeds, folder, overrides, args.threads)
        else:
            with ThreadPoolExecutor(max(1, args.parallel)) as pool:
                runs = dict(
                    zip(
                        args.seeds,
                        pool.map(
                            lambda s: _run(
                                s, args.stage, folder, overrides, args.threads, args.reuse
                            ),
                            args.seeds,
                        ),
                    )
                )
        if args.plot is not None:
            plot_curves(folder, runs, args.plot)
    what = "the main job's SFT stage" if args.stage == "sft" else "the main job (`make run`)"
    placeholders = {"--work": "WORK", "--plot": "PLOT", "--out": "OUT"}
    command = "python benchmarks/main_job_seeds.py " + command_line(argv, placeholders)
    header = [
        f"{what}, {len(runs)} seeds" + (f", overrides {' '.join(overrides)}" if overrides else ""),
        "",
        f"- Command: `{command}`",
        f"- {cpu_model(isa=True)}, {os.cpu_count()} CPUs, {args.threads} thread(s) per run, "
        f"{len(runs) if args.sweep else args.parallel} run(s) at a time"
        f"{' (one posttrain.sweep)' if args.sweep else ''}; load average at start {load:.2f}, "
        "at end "
        f"{os.getloadavg()[0]:.2f}",
    ]
    text = report(runs, SFT_FIGURES if args.stage == "sft" else FIGURES, header)
    if summary is not None:
        text += f"\nThe sweep's summary (`Sweep.summary()`):\n\n{summary}\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
