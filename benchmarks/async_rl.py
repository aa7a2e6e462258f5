"""Step time of asynchronous RL (`posttrain.rl.AsyncRLTrainer` on one Ray node on this host,
`posttrain.launch.ray_cluster.ray_cluster()`) against the synchronous `RLTrainer` loop, on CPU at
tiny size.

Work per step, the same in every mode: P chain_sum prompts (reasoning-gym), G completions each
(temperature 1, at most N new tokens), the chain_sum verifier, GRPO advantages, one PPO epoch
with one minibatch, AdamW lr 1e-4, the `tiny-1m` preset (seed 0), fp32.

Modes (each a fresh policy and trainer, same seeds):
    sync-2t     RLTrainer.step, the driver on 2 torch threads (the machine's default here)
    sync-1t     RLTrainer.step on 1 thread: the sequential baseline of the two modes below
    async-s0    AsyncRLTrainer(max_staleness=0), 1 worker: driver 1 thread, worker 1 thread;
                rollout and update never overlap (the cost of Ray: transfers, weight sync)
    async-s1    AsyncRLTrainer(max_staleness=1), 1 worker: driver 1 thread, worker 1 thread;
                rollout k+1 runs in the worker while update k runs in the driver

A step's time runs from the end of the previous step to the end of this one. The first
`--warmup` steps are not timed (actor start, first weight sync); the table gives the median of
the next `--steps`; modes alternate over `--repeats` blocks and the table gives the median of
the block medians. For the synchronous modes rollout_s is the rollout's share and update_s the
rest. Overlap = (rollout_s + update_s of sync-1t - step of async-s1) / min(rollout_s, update_s of
sync-1t): 1 when the shorter half is hidden completely, 0 when nothing is.

Usage:
    python benchmarks/async_rl.py            # writes docs/guides/async_rl.md
    python benchmarks/async_rl.py --quick    # smoke run, nothing written
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _trainer(args):
    import torch

    from posttrain.envs import chain_sum_task
    from posttrain.policy import Policy
    from posttrain.rl import RLAlgorithm, RLTrainer

    policy = Policy.from_spec("tiny-1m", seed=0)
    return RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=1e-4),
        task=chain_sum_task(size=256, held_out_size=2),
        algo=RLAlgorithm.grpo(group_size=args.group_size, kl_coef=0.0),
        prompts_per_step=args.prompts,
        max_new_tokens=args.max_new_tokens,
        progress=False,
        seed=0,
    )


def _run(mode: str, args) -> dict[str, float]:
    import torch

    from posttrain.rl import AsyncRLTrainer

    torch.set_num_threads(2 if mode == "sync-2t" else 1)
    trainer = _trainer(args)
    runner = None
    if mode.startswith("async"):
        runner = AsyncRLTrainer(trainer, max_staleness=int(mode[-1]), num_threads=1)
    step = runner.step if runner else trainer.step
    times, rollouts, rows = [], [], []
    last = time.perf_counter()
    for i in range(args.warmup + args.steps):
        row = step()
        now = time.perf_counter()
        if i >= args.warmup:
            times.append(now - last)
            rollouts.append(row["rollout_s"])
            rows.append(row)
        last = now
    if runner:
        runner.close()
    out = {"step_s": statistics.median(times), "rollout_s": statistics.median(rollouts)}
    out["update_s"] = statistics.median(t - r for t, r in zip(times, rollouts))
    if runner:
        out["worker_rollout_s"] = statistics.median(r["worker_rollout_s"] for r in rows)
        out["weight_sync_s"] = statistics.median(r["weight_sync_s"] for r in rows)
        out["max_staleness_seen"] = max(r["staleness"] for r in rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 timed steps, nothing written")
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.steps, args.repeats = 1, 2, 1

    from posttrain.launch.ray_cluster import ray_cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    modes = ("sync-2t", "sync-1t", "async-s0", "async-s1")
    blocks: dict[str, list] = {mode: [] for mode in modes}
    with ray_cluster(num_cpus_per_node=2) as cluster:  # tried again on a loaded machine
        init_s = cluster.start_s
        for _ in range(args.repeats):  # alternate the modes: other jobs' load hits them alike
            for mode in modes:
                blocks[mode].append(_run(mode, args))
    results = {
        mode: {k: statistics.median(b[k] for b in runs) for k in runs[0]}
        for mode, runs in blocks.items()
    }

    base, s1 = results["sync-1t"], results["async-s1"]
    overlap = (base["rollout_s"] + base["update_s"] - s1["step_s"]) / min(
        base["rollout_s"], base["update_s"]
    )
    lines = [
        "| mode | step s (median) | rollout / wait s | rest of step s | worker rollout s |"
        " weight sync s |",
        "|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        lines.append(
            f"| {mode} | {r['step_s']:.3f} | {r['rollout_s']:.3f} | {r['update_s']:.3f} |"
            f" {r.get('worker_rollout_s', float('nan')):.3f} |"
            f" {r.get('weight_sync_s', float('nan')):.4f} |"
        )
    table = "\n".join(lines)
    summary = (
        f"overlap (async-s1 vs sync-1t) = {overlap:.2f}; speed-up async-s1 / sync-1t = "
        f"{base['step_s'] / s1['step_s']:.2f}x, / sync-2t = "
        f"{results['sync-2t']['step_s'] / s1['step_s']:.2f}x; Ray start {init_s:.1f} s; "
        f"largest staleness trained on: s0 {results['async-s0']['max_staleness_seen']}, "
        f"s1 {s1['max_staleness_seen']}"
    )
    setup = (
        f"P={args.prompts} prompts x G={args.group_size}, max_new_tokens="
        f"{args.max_new_tokens}, warmup {args.warmup}, timed steps {args.steps}; "
        f"{args.repeats} alternating blocks (median of block medians); "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average at the end {os.getloadavg()[0]:.1f}"
    )
    print(setup, table, summary, sep="\n")
    if not args.quick:
        doc = DOCS / "guides" / "async_rl.md"
        text = doc.read_text()
        begin, end = "<!-- results -->", "<!-- /results -->"
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        doc.write_text(f"{head}{begin}\n{setup}\n\n{table}\n\n{summary}\n{end}{tail}")


if __name__ == "__main__":
    main()
