"""SFT steps/s alone and beside one busy process, for several intra-op thread settings.

Each measurement runs in a fresh Python process (OpenMP reads its thread count and wait policy
when torch is imported): it builds the posttrain `tiny-10m` preset (`build_model(seed=0)`), a
plain `torch.optim.AdamW` (lr 1e-3), and one fixed batch of B rows of T random byte tokens
(seed 0), then takes `--warmup` untimed steps (forward, next-token cross-entropy over every
position, backward, step) and timed steps until `--seconds` have passed (at least 3 steps).
It reports steps/s = timed steps / their wall time.

"Busy" runs the same measurement while a child `python -c "while True: pass"` (one
single-threaded busy process) is running; the slowdown is steps/s alone / steps/s busy.

Settings: `1` (OMP_NUM_THREADS=1), `2` (OMP_NUM_THREADS=2, OpenMP's default wait policy: the
Makefile's old setting), `2-passive` (OMP_NUM_THREADS=2, OMP_WAIT_POLICY=PASSIVE), `1-passive`,
and `default` (what `posttrain.core.threads.apply_thread_env` chooses for a clean environment).

Usage:
    python benchmarks/threads.py                     # the table of docs/benchmarks/threads.md
    python benchmarks/threads.py --quick             # 2 s per measurement (a smoke run)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "1": {"OMP_NUM_THREADS": "1"},
    "2": {"OMP_NUM_THREADS": "2"},
    "1-passive": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"},
    "2-passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
    "default": None,  # posttrain.core.threads.apply_thread_env on a clean environment
}
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "MKL_NUM_THREADS",
    "GOMP_SPINCOUNT",
    "KMP_BLOCKTIME",
    "POSTTRAIN_NUM_THREADS",
)


def worker(batch: int, seq: int, warmup: int, seconds: float) -> dict:
    """One measurement in this process; returns steps/s, steps and torch's thread count."""
    import torch
    import torch.nn.functional as F

    from posttrain.models import PRESETS, build_model

    model = build_model(PRESETS["tiny-10m"], seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 272, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    steps, start = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - start < seconds:
        step()
        steps += 1
    elapsed = time.perf_counter() - start
    return {"steps_per_s": steps / elapsed, "steps": steps, "threads": torch.get_num_threads()}


def measure(setting: str, busy: bool, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    chosen = SETTINGS[setting]
    if chosen is None:
        sys.path.insert(0, str(ROOT / "sdk" / "core"))
        # sdk/core/threads.py as a module of its own: stdlib only, no torch in this process
        importlib.import_module("threads").apply_thread_env(env)
    else:
        env.update(chosen)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        time.sleep(0.5 if busy else 0)
        load = os.getloadavg()[0]
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--worker",
                "--batch",
                str(args.batch),
                "--seq",
                str(args.seq),
                "--warmup",
                str(args.warmup),
                "--seconds",
                str(args.seconds),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row.update(
        setting=setting,
        busy=busy,
        load1=load,
        env={k: env[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in env},
    )
    return row


def report(rows: list[dict], args, command: str) -> str:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    lines = [
        f"CPU: {cpu}; {os.cpu_count()} CPUs, affinity mask {len(os.sched_getaffinity(0))}; "
        f"torch {torch.__version__}; Python {platform.python_version()}.",
        f"Work: tiny-10m, batch {args.batch} x {args.seq} tokens, AdamW, fp32; "
        f"{args.warmup} warm-up steps, then >= {args.seconds:g} s of timed steps.",
        f"Command: `{command}`",
        "",
        "| setting | environment | threads | alone steps/s | busy steps/s | slowdown | "
        "load (1 min) alone / busy |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        alone = [r for r in rows if r["setting"] == setting and not r["busy"]]
        busy = [r for r in rows if r["setting"] == setting and r["busy"]]
        if not alone or not busy:
            continue
        a, b = alone[0], busy[0]
        env = " ".join(f"{k}={v}" for k, v in a["env"].items())
        lines.append(
            f"| {setting} | {env} | {a['threads']} | {a['steps_per_s']:.2f} | "
            f"{b['steps_per_s']:.2f} | {a['steps_per_s'] / b['steps_per_s']:.2f}x | "
            f"{a['load1']:.2f} / {b['load1']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"comma-separated subset of {', '.join(SETTINGS)}",
    )
    parser.add_argument("--quick", action="store_true", help="2 s per measurement, nothing written")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.batch, args.seq, args.warmup, args.seconds)))
        return
    if args.quick:
        args.seconds, args.warmup = 2.0, 1
    chosen = args.settings.split(",")
    unknown = [s for s in chosen if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    rows = []
    for setting in chosen:
        for busy in (False, True):
            row = measure(setting, busy, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    text = report(rows, args, "python benchmarks/threads.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.out and not args.quick:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
