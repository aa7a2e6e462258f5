"""Where a GRPO step's time goes on this machine: the `time_*_s` split, tokens/s and MFU columns
that `RLTrainer` writes to every metrics row (`posttrain.rl.step_timing`), over a few steps.

Setup: the `tiny-2m` preset (Qwen2, byte vocabulary, tied embeddings), P chain_sum prompts x G
completions (temperature 1, at most `--max-new-tokens`), k3 KL to a frozen reference (beta 0.04,
so the reference log-prob pass runs), one minibatch, AdamW, fp32, `--threads` intra-op threads.
The matmul peak is measured once (`posttrain.core.timing.matmul_peak_flops`, fp32 1024 x 1024 on
CPU, best of 5 in one thread's CPU seconds x the intra-op threads) and printed. Also timed: the
cost of the instrumentation itself (`timing_row` on the last step's groups and batch, median of
200 calls, the peak already cached).

Usage:
    python benchmarks/rl_step_timing.py            # writes docs/benchmarks/rl_step_timing.md
    python benchmarks/rl_step_timing.py --quick    # smoke run, nothing written
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
PARTS = ("time_rollout_s", "time_scoring_s", "time_logprobs_s", "time_update_s", "time_other_s")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 x 2 rows, 1 step, no report")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.group_size, args.max_new_tokens, args.warmup, args.steps = 2, 2, 4, 0, 1

    from posttrain.core.timing import matmul_peak_flops, non_embedding_params
    from posttrain.envs import chain_sum_task
    from posttrain.policy import Policy
    from posttrain.rl import RLAlgorithm, RLTrainer
    from posttrain.rl.step_timing import new_step_timer, timing_row
    from posttrain.rl.trainer import make_batch

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    peak = matmul_peak_flops()
    peak_s = time.perf_counter() - start
    policy = Policy.from_spec("tiny-2m", seed=0)
    trainer = RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=1e-5),
        task=chain_sum_task(size=args.prompts * (args.warmup + args.steps) + 8, held_out_size=2),
        algo=RLAlgorithm.grpo(group_size=args.group_size, kl_coef=0.04),
        prompts_per_step=args.prompts,
        max_new_tokens=args.max_new_tokens,
        progress=False,
    )
    rows = [trainer.step() for _ in range(args.warmup + args.steps)][args.warmup :]
    groups = trainer.last_groups
    assert groups is not None  # set by every step
    batch = make_batch(groups, policy.tokenizer.pad_id)
    costs = []
    for _ in range(200):
        t0 = time.perf_counter()
        timing_row(
            new_step_timer(policy.model),
            model=policy.model,
            groups=groups,
            batch=batch,
            frozen_passes=1,
            ppo_epochs=1,
            collect_s=1.0,
            step_s=2.0,
        )
        costs.append(time.perf_counter() - t0)
    load_end = os.getloadavg()[0]

    med = {
        k: statistics.median(r[k] for r in rows)
        for k in PARTS + ("step_time_s", "tokens_per_s", "trained_tokens_per_s", "mfu")
    }
    lines = [
        "# Where a GRPO step's time goes (CPU)",
        "",
        "Produced by `python benchmarks/rl_step_timing.py`.",
        "",
        f"- CPU: {_cpu_name()}; {os.cpu_count()} CPUs visible; "
        f"{args.threads} threads, fp32; torch {torch.__version__}",
        f"- Model: `tiny-2m`, N = {non_embedding_params(policy.model):,} non-embedding "
        "parameters (tied: the embedding counts once, as the LM-head matmul)",
        f"- Work per step: {args.prompts} chain_sum prompts x G={args.group_size}, at most "
        f"{args.max_new_tokens} new tokens, k3 KL beta 0.04 to a frozen reference, 1 minibatch",
        f"- Measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s (1024 x 1024, best of 5 in one "
        f"thread's CPU seconds x {torch.get_num_threads()} threads; measuring took {peak_s:.2f} s)",
        f"- {args.warmup} warm-up + {args.steps} timed steps; medians over the timed steps",
        f"- Load average (1 min) at start / end: {load_start:.2f} / {load_end:.2f} "
        "(other processes share this machine)",
        f"- Command: `python benchmarks/rl_step_timing.py {' '.join(sys.argv[1:])}`",
        f"- Instrumentation cost (`timing_row`, median of 200): "
        f"{statistics.median(costs) * 1e6:.0f} us per step",
        "",
        "| phase | s / step (median) | share of step |",
        "|---|---:|---:|",
    ]
    for k in PARTS:
        lines.append(f"| {k} | {med[k]:.3f} | {med[k] / med['step_time_s']:.0%} |")
    lines += [
        f"| step_time_s | {med['step_time_s']:.3f} | 100% |",
        "",
        f"Sampled tokens/s {med['tokens_per_s']:.1f}; trained tokens/s "
        f"{med['trained_tokens_per_s']:.1f}; MFU {med['mfu']:.2%} of the measured peak "
        "(6 N D train + 2 N D forward + attention at each sequence's length: "
        "docs/benchmarks/README.md, Conventions).",
        "",
    ]
    report = "\n".join(lines)
    print(report)
    if not args.quick:
        (DOCS / "rl_step_timing.md").write_text(report)


if __name__ == "__main__":
    main()
