"""GPU acceptance run: one table of what posttrain's GPU paths reach on one H100 or H200.

Four sections (benchmarks/gpu/sections.py), each in its own process under its own time budget,
so a section that fails, runs out of memory or overruns is reported in its row and the others
still run:

  mfu         MFU of `posttrain.train.Trainer` steps at Qwen2.5-0.5B's shape (B=8 x T=2048,
              bf16 compute over fp32 master weights, FSDP2 on one GPU, compiled blocks, chunked
              head), against the datasheet peak of the device (by name; "n/a" with the reason
              for a GPU the table does not list) and the bf16 matmul peak measured in the run
  fp8         torchao FP8 (tensorwise, rowwise) against bf16 at ~1B on a periodic-copy task
              (fresh random patterns repeated along the row: learnable, unlike random tokens),
              fp32 master weights, the variants round-robin; the check fails unless every
              final loss is below 1.0 nats (fresh random tokens cannot go below ln 256 = 5.55)
              and FP8's is within bf16's x 1.10 + 0.05
  chunked_ce  peak memory of the cross-entropy forward + backward at Qwen2.5-0.5B's vocabulary,
              8 x 2048 tokens, unchunked against 1,024-token chunks, beside the memory plan
  vllm        benchmarks/gpu_vllm_rollout.py at Qwen2.5-0.5B's shape: vLLM vs Policy.generate
              tokens/s and the weight-sync time (needs the CUDA vLLM venv: scripts/vllm-up.sh)

Conventions (MFU, peaks, pairs): docs/benchmarks/README.md. The default budgets add up to
7.5 minutes; the run refuses to start without CUDA.

Usage:
    python benchmarks/gpu/acceptance.py                       # all sections, < 8 minutes
    python benchmarks/gpu/acceptance.py --sections mfu fp8 --budget fp8=240
    python benchmarks/gpu/acceptance.py --section chunked_ce --device cpu --quick   # one, here
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # sections.py; the benchmarks/ modules it uses

BUDGETS_S = {"mfu": 110.0, "fp8": 180.0, "chunked_ce": 40.0, "vllm": 120.0}
"""Seconds each section may run, process start and imports included (450 s in all)."""
RESULT_PREFIX = "ACCEPTANCE-RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=list(BUDGETS_S), default=list(BUDGETS_S))
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="SECTION=SECONDS",
        help="another time budget for a section (repeatable)",
    )
    parser.add_argument("--section", choices=list(BUDGETS_S), help="run one section in-process")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="with --section")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a few steps")
    args = parser.parse_args(argv)
    budgets = dict(BUDGETS_S)
    for item in args.budget:
        name, _, value = item.partition("=")
        if name not in BUDGETS_S:
            parser.error(f"--budget {item!r}: unknown section {name!r}; allowed: {list(BUDGETS_S)}")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not seconds > 0:
            parser.error(f"--budget {item!r}: seconds must be a number > 0")
        budgets[name] = seconds
    if args.device == "cpu" and args.section is None:
        parser.error("--device cpu runs one section (--section NAME); the table needs CUDA")
    args.budgets = budgets
    return args


def cuda_refusal() -> str | None:
    """Why this machine cannot run the acceptance table (a sentence), or None."""
    import torch

    if not torch.cuda.is_available():
        return (
            f"benchmarks/gpu/acceptance.py needs a CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); nothing was measured"
        )
    return None


def run_section(name: str, budget_s: float, quick: bool) -> dict:
    """Run section `name` in a child process for at most `budget_s` seconds; its row, or a row
    that says why there is none (timed out, exited with an error: its last stderr line)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd + (["--quick"] if quick else []), capture_output=True, text=True, timeout=budget_s
        )
    except subprocess.TimeoutExpired:
        return failed_row(name, f"timed out after its budget of {budget_s:g} s", budget_s)
    seconds = time.monotonic() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return {"section": name, "seconds": seconds, **json.loads(line[len(RESULT_PREFIX) :])}
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    return failed_row(
        name, f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}", seconds
    )


def failed_row(name: str, why: str, seconds: float) -> dict:
    return {"section": name, "result": f"not measured: {why}", "check": "FAIL", "seconds": seconds}


def table(rows: list[dict], header: str) -> str:
    """The Markdown table of the run (`|` inside a cell escaped)."""
    lines = [header, "", "| section | result | check | s |", "|---|---|---|---:|"]
    for r in rows:
        cells = [r["section"], r["result"], r["check"], f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.section is not None:
        from sections import SECTIONS

        row = SECTIONS[args.section](args.device, args.quick)
        print(RESULT_PREFIX + json.dumps(row), flush=True)
        return 0
    reason = cuda_refusal()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    import torch

    header = (
        f"GPU acceptance: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"budgets {', '.join(f'{s} {args.budgets[s]:g} s' for s in args.sections)}"
    )
    print(header, flush=True)
    rows = []
    for name in args.sections:
        rows.append(run_section(name, args.budgets[name], args.quick))
        print(f"{name}: {rows[-1]['check']} ({rows[-1]['seconds']:.0f} s)", flush=True)
    print(table(rows, header))
    return 1 if any(r["check"].startswith("FAIL") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
