"""Where demonstrations stop: train the main job's SFT stage on one slice of a reasoning-gym task
and score the policy on every slice, to choose a split where RL has something to learn.

A split suits a main job where RL must go beyond its demonstrations when, on the slices the
demonstrations leave out, the SFT policy's greedy accuracy is low, its pass@k is above 0 (GRPO
needs a group with a correct or better answer to learn from) and its mean score (the task's
partial credit) leaves room. Per slice: greedy accuracy, sampled pass@1 and pass@k at
temperature 1, and the mean sampled score.

    python benchmarks/task_split.py --work /tmp/split                  # spell_backward, 3-5 letters
    python benchmarks/task_split.py --work W --reuse --out docs/benchmarks/task_split.md
    python benchmarks/task_split.py --work W --task chain_sum --min-key min_terms \
        --max-key max_terms --slice-key terms --demo-range 2 2 --slices 2 3 4 \
        --options '{"min_digits": 1, "max_digits": 2}'

The SFT stage is `posttrain run sft` with the main job's settings (tiny-2m, 300 steps of 64 at
lr 1e-3); slices are `--slice-key` set to each of `--slices` (min and max both).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from timing import cpu_model  # noqa: E402


def train(work: Path, args: argparse.Namespace) -> Path:
    out = work / "sft"
    if args.reuse and (out / "policy").is_dir():
        return out / "policy"
    lo, hi = args.demo_range
    cmd = [
        sys.executable, "-m", "posttrain.cli", "run", "sft", f"out_dir={out}",
        "model.name=tiny-2m", f"task.name={args.task}",
        f"task.options={json.dumps({**args.options, args.min_key: lo, args.max_key: hi})}",
        f"optim.steps={args.steps}", "optim.lr=1e-3", "optim.batch_size=64",
        "optim.warmup_steps=20", "task.eval_size=200", "eval.max_new_tokens=12",
        "progress=false", f"seed={args.seed}",
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    return out / "policy"


def _scorer(ds: Any) -> Callable[[str, Any], float]:
    from posttrain.verifiers.reasoning_gym import task_score

    return lambda text, item: task_score(ds, text.strip(), item)


def score_slices(policy_dir: Path, args: argparse.Namespace) -> list[dict]:
    from posttrain.policy.policy import Policy
    from posttrain.rewards.evaluation import evaluate_sampled
    from posttrain.workflows.config import TaskConfig
    from posttrain.workflows.task_data import evaluate, held_out_items

    policy = Policy.from_pretrained(policy_dir)
    rows = []
    for n in args.slices:
        task = TaskConfig(
            name=args.task,
            options={**args.options, args.min_key: n, args.max_key: n},
            eval_size=args.items,
            eval_seed=10_000,
        )
        items, ds = held_out_items(task)
        greedy = evaluate(policy, items, ds, max_new_tokens=args.max_new_tokens)
        sampled = evaluate_sampled(
            policy,
            items,
            score_fn=_scorer(ds),
            samples=args.k,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed + 1,
        )
        table = sampled.table
        rows.append({
            "slice": n,
            "greedy": greedy.accuracy,
            "pass@1": sampled.pass_at_1,
            f"pass@{args.k}": sampled.pass_at_k,
            "mean_score": float(table["score"].mean()),
            "greedy_mean_score": float(greedy.table["score"].mean()),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def report(rows: list[dict], args: argparse.Namespace, seconds: float) -> str:
    k = args.k
    lo, hi = args.demo_range
    lines = [
        f"SFT on {args.task} with {args.min_key}..{args.max_key} = {lo}..{hi} (tiny-2m, "
        f"{args.steps} steps of 64, lr 1e-3, seed {args.seed}); {args.items} held-out items per "
        f"slice (seed 10000), {k} samples each at temperature 1, {args.max_new_tokens} new "
        f"tokens. {cpu_model()}, {seconds:.0f} s.",
        "",
        f"| {args.slice_key} | in the demonstrations | greedy | pass@1 | pass@{k} | "
        "mean score (sampled) | mean score (greedy) |",
        "|---:|:-:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        seen = "yes" if lo <= r["slice"] <= hi else "no"
        lines.append(
            f"| {r['slice']} | {seen} | {r['greedy']:.3f} | {r['pass@1']:.3f} | "
            f"{r[f'pass@{k}']:.3f} | {r['mean_score']:.3f} | {r['greedy_mean_score']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--task", default="spell_backward")
    p.add_argument("--min-key", default="min_word_len")
    p.add_argument("--max-key", default="max_word_len")
    p.add_argument("--slice-key", default="word length")
    p.add_argument(
        "--options",
        type=json.loads,
        default={},
        help='the task\'s other options, as JSON: \'{"min_digits": 1, "max_digits": 1}\'',
    )
    p.add_argument("--demo-range", type=int, nargs=2, default=(3, 5))
    p.add_argument("--slices", type=int, nargs="+", default=[3, 4, 5, 6, 7, 8])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", action="store_true", help="reuse --work's trained policy")
    p.add_argument("--out", type=Path, help="write the markdown table here")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = score_slices(train(args.work, args), args)
    text = report(rows, args, time.perf_counter() - start)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
