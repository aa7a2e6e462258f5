"""RL against its cheaper alternatives at equal training compute, from one SFT policy, when the
demonstrations cover only part of the task (`task.demo_options`): one table of held-out greedy
accuracy, sampled pass@1 and pass@k, and GRPO's paired differences with each baseline.

The arms, all from the same SFT stage (trained once, by the GRPO run, then copied into each
other arm's folder, which resumes after it):
  * GRPO (`posttrain run grpo`), with its more-SFT baseline (`baseline.steps` more SFT steps on
    the same demonstrations; choose them so that its `train_s` is about GRPO's `rl_train_s`);
  * RFT (`posttrain run rft`): rounds of sample k -> keep the verified -> fine-tune on the RL
    prompts, bounded by `rft.budget_s` = the GRPO stage's summed step seconds (`rl_train_s`);
  * DPO (`posttrain run dpo`) on verifier-ranked pairs: 8 samples of each of 2048 RL prompts,
    best vs worst by the task's score, bounded by `budget_s` = `rl_train_s` (the pairs'
    sampling, the reference log-probs and the DPO steps together).

    python benchmarks/beyond_demos.py --work W                        # the split of task_split.md
    python benchmarks/beyond_demos.py --work W --out REPORT.md --grpo optim.steps=300
    python benchmarks/beyond_demos.py --work W --quick                # tiny sizes, seconds
    python benchmarks/beyond_demos.py --work W --seeds 0 1 2          # one set of arms per seed

With `--seeds`, each seed's arms run in W/seed<S> with `seed=S` (a seed finished there is reused;
run seeds side by side as separate `--seeds S` commands on the same W, then report them all with
one `--seeds 0 1 2`): each seed's table, then one table over the seeds, each arm's mean with a
Student-t 95% interval over the seeds (`main_job_seeds.mean_interval`) and each seed's value,
and GRPO's paired difference with every arm at every seed.

Trailing `key=value` words go to every arm (the task, its split, the SFT stage, eval); GRPO's own
(`optim.*`, `rl.*`, `baseline.*`) go to it alone: pass those with `--grpo` (`--rft`, `--dpo`:
the other arms' own). Paired differences are bootstrap intervals over the held-out
items (`posttrain.rewards.evaluation.paired_bootstrap_diff`, 10k resamples): each arm's per-item
greedy correctness and per-item sampled pass@1, read from its evaluation tables.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from grpo_step import command_line  # noqa: E402
from main_job_seeds import QUICK as JOB_QUICK  # noqa: E402
from main_job_seeds import mean_interval  # noqa: E402
from timing import cpu_model  # noqa: E402

GRPO_ONLY = ("optim.", "rl.", "eval.every", "baseline.")  # keys the RFT run's config has not
SPLIT = [
    "task.name=spell_backward",
    "task.options={min_word_len: 6, max_word_len: 6}",
    "task.demo_options={min_word_len: 3, max_word_len: 5}",
]
# --quick: the main job's tiny sizes (main_job_seeds.QUICK), split into what every arm takes and
# what only the GRPO run has; a split of chain_sum that makes tiny tasks
QUICK = [
    *(kv for kv in JOB_QUICK if not kv.startswith(GRPO_ONLY)),
    "task.name=chain_sum",
    "task.options={min_terms: 2, max_terms: 2, min_digits: 2, max_digits: 2}",
    "task.demo_options={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
]
QUICK_GRPO = [*(kv for kv in JOB_QUICK if kv.startswith(GRPO_ONLY)), "baseline.steps=2"]
QUICK_RFT = ["rft.prompts_per_round=4", "rft.samples_per_prompt=2", "rft.steps=2",
             "rft.batch_size=4", "rft.warmup_steps=1", "eval.every=0"]  # fmt: skip
# the DPO run's own defaults differ from the main job's start: its SFT stage must be GRPO's (the
# copied sft/ is resumed), and its steps are bounded by the budget alone (a constant lr after
# warmup, as RFT's rounds)
DPO = ["model.name=tiny-2m", "sft.steps=300", "sft.lr=0.001", "sft.batch_size=64",
       "eval.max_new_tokens=8", "eval.samples=8", "optim.steps=1000000",
       "optim.min_lr_ratio=1.0"]  # fmt: skip
QUICK_DPO = [
    "model.name=tiny-1m",
    "sft.steps=3",
    "sft.batch_size=8",
    "eval.max_new_tokens=6",
    "eval.samples=2",
    "pairs.num_prompts=8",
    "pairs.samples_per_prompt=2",
    "pairs.reference_answer=true",
    "val_pairs=2",
    "optim.batch_size=4",
    "optim.warmup_steps=1",
    "eval.every=0",
    "optim.steps=2",
    "budget_s=600",
]  # fmt: skip  (2 GRPO steps are shorter than sampling 16 pairs)

# arm -> (its run folder, results.json key of greedy accuracy, of sampled accuracy, greedy
# table, sampled table)
ARMS = {
    "SFT (the start)": ("grpo", "after_sft", "sampled_after_sft", "sft/eval_after.csv",
                        "eval_sampled_after_sft.csv"),
    "GRPO": ("grpo", "after_grpo", "sampled_after_grpo", "eval_after_rl.csv",
             "eval_sampled_after_grpo.csv"),
    "more SFT": ("grpo", "more_sft", "sampled_after_more_sft", "more_sft/eval_after.csv",
                 "eval_sampled_after_more_sft.csv"),
    "RFT": ("rft", "after_rft", "sampled_after_rft", "eval_after_rft.csv",
            "eval_sampled_after_rft.csv"),
    "DPO": ("dpo", "after", "sampled_after_dpo", "eval_after.csv", "eval_sampled_after_dpo.csv"),
}  # fmt: skip


def _posttrain(args: list[str], log: Path) -> None:
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "posttrain.cli", "run", *args],
                              stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"posttrain run {args[0]} failed (exit {proc.returncode}):\n{tail}")


def run_arms(
    work: Path, common: list[str], grpo: list[str], rft: list[str], dpo: list[str]
) -> dict[str, Any]:
    """Run GRPO (with more SFT), then RFT and DPO from its SFT stage with the GRPO stage's
    training seconds as budget; returns {"grpo": results, "rft": ..., "dpo": ...} (finished
    runs are reused)."""
    g = work / "grpo"
    if not (g / "results.json").is_file():
        _posttrain(["grpo", f"out_dir={g}", "progress=false", *common, *grpo], work / "grpo.log")
    results = {"grpo": json.loads((g / "results.json").read_text())}
    spent = results["grpo"]["rl_train_s"]
    for arm, own in (("rft", [f"rft.budget_s={spent:.3f}", "rft.rounds=1000", *rft]),
                     ("dpo", [f"budget_s={spent:.3f}", *dpo])):  # fmt: skip
        folder = work / arm
        if not (folder / "results.json").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            if not (folder / "sft").exists():
                shutil.copytree(g / "sft", folder / "sft")  # the same start: resumed after it
            _posttrain([arm, f"out_dir={folder}", "resume=true", "progress=false", *common,
                        *own], work / f"{arm}.log")  # fmt: skip
        results[arm] = json.loads((folder / "results.json").read_text())
    return results


def _per_item(work: Path) -> dict[str, dict[str, Any]]:
    """Each arm's per-item greedy correctness and sampled pass@1 (numpy arrays, item order)."""
    import pandas as pd

    out: dict[str, dict[str, Any]] = {}
    for arm, (run, _, _, greedy, sampled) in ARMS.items():
        folder = work / run
        if not (folder / greedy).is_file():
            continue
        row = {"greedy": pd.read_csv(folder / greedy)["correct"].to_numpy(dtype=float)}
        if (folder / sampled).is_file():
            table = pd.read_csv(folder / sampled)
            row["pass1"] = table.groupby("item")["correct"].mean().sort_index().to_numpy()
        out[arm] = row
    return out


def report(work: Path, results: dict[str, Any], argv: list[str], paired: dict | None = None) -> str:
    """The markdown report of one set of arms in `work`; `paired`: its `paired_cells` when the
    caller has them already (the bootstrap is not run twice)."""
    g, r, d = results["grpo"], results["rft"], results["dpo"]
    k = g.get("sampled_after_grpo", {}).get("k", "k")
    nan, command = float("nan"), command_line(argv, {"--work": "W", "--out": "OUT"})
    lines = [
        f"Command: `python benchmarks/beyond_demos.py {command}`. "
        f"Task {g['task_config']} (held-out items and RL prompts), demonstrations from "
        f"{g.get('demo_config', g['task_config'])}; {g['eval_size']} held-out items. "
        f"Training seconds (summed step times): GRPO {g['rl_train_s']:.0f} s, more SFT "
        f"{g.get('more_sft', {}).get('train_s', nan):.0f} s, RFT "
        f"{r.get('rft_train_s', nan):.0f} s (budget {r.get('budget_s', nan):.0f} s, "
        f"{r.get('rounds', 0)} rounds, {r.get('kept', 0)} samples kept), DPO "
        f"{sum(d.get(k, 0.0) for k in ('pairs_s', 'reference_s', 'train_s')):.0f} s ("
        f"{d.get('steps', 0)} steps on {d.get('train_samples', 0)} pairs). "
        f"{cpu_model()}.",
        "",
        f"| arm | greedy | sampled pass@1 | pass@{k} |",
        "|---|---:|---:|---:|",
    ]
    for arm, v in arm_values(results).items():
        lines.append(f"| {arm} | {v['greedy']:.3f} | {v['pass1']:.3f} | {v['passk']:.3f} |")
    lines += ["", "| GRPO minus | greedy (points, 95% CI) | sampled pass@1 (points, 95% CI) |",
              "|---|---:|---:|"]  # fmt: skip
    for arm, cells in (paired_cells(_per_item(work)) if paired is None else paired).items():
        lines.append(f"| {arm} | {cells['greedy']} | {cells['pass1']} |")
    return "\n".join([*lines, "", *answer_shapes(work)]) + "\n"


def paired_cells(per_item: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """{arm: {"greedy": cell, "pass1": cell}}: GRPO minus the arm in points with its paired
    bootstrap 95% interval over the items (`paired_bootstrap_diff`, 10k resamples), "" where a
    table is missing."""
    from posttrain.rewards.evaluation import paired_bootstrap_diff

    grpo = per_item.get("GRPO", {})
    out: dict[str, dict[str, str]] = {}
    for arm, row in per_item.items():
        if arm == "GRPO" or not grpo:
            continue
        out[arm] = {}
        for key in ("greedy", "pass1"):
            if key in row and key in grpo:
                d = paired_bootstrap_diff(grpo[key], row[key], seed=0)
                out[arm][key] = (
                    f"{100 * d['difference']:+.1f} [{100 * d['ci_low']:+.1f}, "
                    f"{100 * d['ci_high']:+.1f}]"
                )
            else:
                out[arm][key] = ""
    return out


def arm_values(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{arm: {"greedy", "pass1", "passk"}}: each arm's accuracies from its `results.json`."""
    out: dict[str, dict[str, float]] = {}
    for arm, (run, greedy_key, sampled_key, _, _) in ARMS.items():
        if greedy_key in results[run]:
            s = results[run].get(sampled_key, {})
            out[arm] = {
                "greedy": results[run][greedy_key]["accuracy"],
                "pass1": s.get("pass_at_1", float("nan")),
                "passk": s.get("pass_at_k", float("nan")),
            }
    return out


def seeds_report(values: dict[int, dict[str, dict[str, float]]], paired: dict[int, dict]) -> str:
    """One table over the seeds from each seed's `arm_values` and `paired_cells`: per arm and
    figure the mean [Student-t 95% interval over the seeds] and every seed's value, then GRPO's
    paired differences at every seed.

    >>> print(seeds_report({0: {"GRPO": {"greedy": 0.2, "pass1": 0.1, "passk": 0.3}},
    ...                     1: {"GRPO": {"greedy": 0.4, "pass1": 0.3, "passk": 0.5}}}, {}))
    | arm | figure | mean [95% t over seeds] | seed 0 | seed 1 |
    |---|---|---|---:|---:|
    | GRPO | greedy | 0.300 [-0.971, 1.571] | 0.200 | 0.400 |
    | GRPO | sampled pass@1 | 0.200 [-1.071, 1.471] | 0.100 | 0.300 |
    | GRPO | pass@k | 0.400 [-0.871, 1.671] | 0.300 | 0.500 |
    <BLANKLINE>
    """
    seeds = sorted(values)
    head = " | ".join(f"seed {s}" for s in seeds)
    lines = [f"| arm | figure | mean [95% t over seeds] | {head} |",
             "|---|---|---|" + "---:|" * len(seeds)]  # fmt: skip
    names = {"greedy": "greedy", "pass1": "sampled pass@1", "passk": "pass@k"}
    for arm in ARMS:
        if not all(arm in values[s] for s in seeds):
            continue
        for key, name in names.items():
            per = [values[s][arm][key] for s in seeds]
            mean, low, high = mean_interval(per)
            cells = " | ".join(f"{v:.3f}" for v in per)
            lines.append(f"| {arm} | {name} | {mean:.3f} [{low:.3f}, {high:.3f}] | {cells} |")
    arms = [a for a in ARMS if a != "GRPO" and all(a in paired.get(s, {}) for s in seeds)]
    if arms:
        lines += ["", f"| GRPO minus, points [paired 95% CI over the items] | {head} |",
                  "|---|" + "---|" * len(seeds)]  # fmt: skip
        for arm in arms:
            for key, name in (("greedy", "greedy"), ("pass1", "sampled pass@1")):
                cells = " | ".join(paired[s][arm][key] for s in seeds)
                lines.append(f"| {arm}, {name} | {cells} |")
    return "\n".join(lines) + "\n"


def answer_shapes(work: Path) -> list[str]:
    """Markdown table of what each arm's greedy answers look like: per character position, the
    share of answers with the gold answer's character there (position 1 first), the answers'
    lengths (share of each, the commonest first) and the mean task score: where answers fail,
    e.g. a spell_backward policy that stops a letter short."""
    import pandas as pd

    tables = {arm: pd.read_csv(work / run / greedy) for arm, (run, _, _, greedy, _) in
              ARMS.items() if (work / run / greedy).is_file()}  # fmt: skip
    if not tables:
        return []
    width = max(int(t["answer"].astype(str).str.len().max()) for t in tables.values())
    lines = [
        "| arm | " + " | ".join(f"char {i + 1}" for i in range(width))
        + " | answer lengths | mean score |",
        "|---|" + "---:|" * width + "---|---:|",
    ]  # fmt: skip
    for arm, t in tables.items():
        said, gold = t["completion"].fillna("").astype(str).str.strip(), t["answer"].astype(str)
        cells = [f"{(said.str[i] == gold.str[i]).mean():.3f}" for i in range(width)]
        lengths = said.str.len().value_counts(normalize=True)
        shown = ", ".join(f"{n}: {share:.0%}" for n, share in lengths.head(3).items())
        lines.append(f"| {arm} | {' | '.join(cells)} | {shown} | {t['score'].mean():.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="tiny sizes: seconds, for a test")
    p.add_argument("--grpo", nargs="*", default=[], help="key=value for the GRPO run only")
    p.add_argument("--rft", nargs="*", default=[], help="key=value for the RFT run only")
    p.add_argument("--dpo", nargs="*", default=[], help="key=value for the DPO run only")
    p.add_argument("--out", type=Path, help="write the markdown report here")
    p.add_argument("--seeds", type=int, nargs="+", help="one set of arms per seed, W/seed<S>")
    p.add_argument("overrides", nargs="*", help="key=value for every arm")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    common = [*(QUICK if args.quick else SPLIT), *args.overrides]
    grpo = [*(QUICK_GRPO if args.quick else []), *args.grpo]
    rft = [*(QUICK_RFT if args.quick else []), *args.rft]
    dpo = [*DPO, *(QUICK_DPO if args.quick else []), *args.dpo]
    if args.seeds is None:
        text = report(args.work, run_arms(args.work, common, grpo, rft, dpo), argv)
    else:
        parts, values, paired = [], {}, {}
        for seed in args.seeds:
            work = args.work / f"seed{seed}"
            results = run_arms(work, [*common, f"seed={seed}"], grpo, rft, dpo)
            values[seed], paired[seed] = arm_values(results), paired_cells(_per_item(work))
            parts.append(f"### Seed {seed}\n\n" + report(work, results, argv, paired[seed]))
        text = "\n".join([seeds_report(values, paired), *parts])
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
