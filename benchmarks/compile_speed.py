"""Step time eager vs `torch.compile` (inductor) on the CPU: a training step with compiled blocks
(`posttrain.train.compile.compile_blocks`) and the builtin decoding loop with a compiled step
(`Policy.generate(compile=True)`'s `_generate_tokens(compile=True)`).

Each (threads, mode) cell runs in a fresh Python process with that many intra-op threads
(OMP_NUM_THREADS and `torch.set_num_threads`): it builds the `--preset` model (default tiny-10m,
~10M parameters, fp32, seed 0), then
  * train: AdamW (lr 1e-3) steps of next-token cross-entropy on one fixed batch of B x T random
    tokens; the first step (with compile: the compilation) is timed on its own as "first", then
    `--repeats` timed steps, median (min-max);
  * decode: greedy `_generate_tokens` of B prompts of P random tokens, N new tokens (no stop);
    the first call is "first" (with compile: the step's compilation), then `--repeats` calls;
  * decode-stops: the same with rows that stop one after another: row j's prompt is j * N / B
    tokens longer and the length budget P + N (prompt + new tokens) ends it after N - j * N / B
    tokens, so rows leave the batch at B different steps.
With compile, "graphs" counts the step's compilations (dynamo's unique graphs, all calls).
It reports wall seconds and the process's CPU seconds (`time.process_time()`), per cell, and
the load average when the cell started: machines here are shared (docs in FACTS: ratios swing
2x under load; a 1-thread process's CPU time is the work done).

Usage:
    python benchmarks/compile_speed.py                      # the table of
                                                            # docs/benchmarks_real_models.md
    python benchmarks/compile_speed.py --preset tiny-1m --threads 1   # a quick run
    python benchmarks/compile_speed.py --what decode-stops --threads 1   # rows that stop
    python benchmarks/compile_speed.py --preset tiny-1m --what decode-stops --threads 1 \
        --backend eager --repeats 2         # count the step's graphs in minutes (no codegen)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cell(args: argparse.Namespace) -> dict:
    import torch

    from posttrain.models import build_model, get_preset
    from posttrain.policy import generation
    from posttrain.train.compile import compile_blocks

    torch.set_num_threads(args.threads)
    generation.COMPILE_BACKEND = args.backend
    spec = get_preset(args.preset)
    model = build_model(spec, seed=0)
    gen = torch.Generator().manual_seed(0)
    compiled = args.mode == "compiled"

    def timed(fn) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - wall, time.process_time() - cpu

    if args.what == "train":
        if compiled:
            compile_blocks(model, backend=args.backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, spec.vocab_size, (args.batch, args.seq), generator=gen)

        def run() -> None:
            logits = model(x)[:, :-1].flatten(0, 1)
            loss = torch.nn.functional.cross_entropy(logits, x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
    else:
        model.eval()
        stagger = args.new_tokens // args.batch if args.what == "decode-stops" else 0
        longest = args.prompt + stagger * (args.batch - 1)
        ids = torch.randint(3, spec.vocab_size, (args.batch, longest), generator=gen).tolist()
        rows = [r[: args.prompt + stagger * j] for j, r in enumerate(ids)]
        max_seq_len = args.prompt + args.new_tokens if stagger else spec.max_seq_len

        def run() -> None:
            generation._generate_tokens(
                model,
                rows,
                max_new_tokens=args.new_tokens,
                max_seq_len=max_seq_len,
                temperature=0.0,
                top_k=None,
                top_p=1.0,
                stop_ids=[],
                stops=[],
                decode=None,
                pad_id=0,
                seed=0,
                compile=compiled,
            )

    from torch._dynamo.utils import counters

    first = timed(run)
    times = [timed(run) for _ in range(args.repeats)]
    params = sum(p.numel() for p in model.parameters())
    graphs = int(counters["stats"]["unique_graphs"])
    return {"first": first, "times": times, "params": params, "graphs": graphs}


def _row(what: str, threads: int, mode: str, load: float, out: dict) -> str:
    walls = [w for w, _ in out["times"]]
    cpus = [c for _, c in out["times"]]
    med, cpu = statistics.median(walls), statistics.median(cpus)
    return (
        f"| {what} | {threads} | {mode} | {med:.3f} ({min(walls):.3f}-{max(walls):.3f}) | "
        f"{cpu:.3f} | {out['first'][0]:.1f} | {out['graphs'] if mode == 'compiled' else '-'} | "
        f"{load:.1f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny-10m")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--what",
        nargs="+",
        default=["train", "decode", "decode-stops"],
        choices=["train", "decode", "decode-stops"],
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256, help="training sequence length")
    p.add_argument("--prompt", type=int, default=32, help="decode prompt length")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--backend",
        default="inductor",
        help="torch.compile backend of the compiled cells (eager: dynamo's capture only, to "
        "count graphs quickly)",
    )
    p.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="eager", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cell:
        args.threads, args.what = args.threads[0], args.what[0]
        print("RESULT " + json.dumps(_cell(args)))
        return
    print(f"preset {args.preset}, batch {args.batch}, train T={args.seq}, decode P={args.prompt}")
    print(f"N={args.new_tokens}; median of {args.repeats} (min-max), wall s; CPU s median")
    print(f"compiled: backend {args.backend}")
    print("| step | threads | mode | wall s | CPU s | first call s | graphs | load |")
    print("|---|---|---|---|---|---|---|---|")
    for what in args.what:
        for threads in args.threads:
            for mode in ("eager", "compiled"):
                env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
                cmd = [sys.executable, __file__, "--cell", "--mode", mode, "--what", what]
                cmd += ["--threads", str(threads), "--preset", args.preset]
                cmd += ["--repeats", str(args.repeats), "--batch", str(args.batch)]
                cmd += ["--seq", str(args.seq), "--prompt", str(args.prompt)]
                cmd += ["--new-tokens", str(args.new_tokens), "--backend", args.backend]
                load = os.getloadavg()[0]
                done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
                if not lines:
                    print(f"| {what} | {threads} | {mode} | failed: {done.stderr[-300:]!r} |")
                    continue
                print(_row(what, threads, mode, load, json.loads(lines[-1][7:])), flush=True)


if __name__ == "__main__":
    main()
