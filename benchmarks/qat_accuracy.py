"""Held-out accuracy of QAT vs post-training quantisation (PTQ) on chain_sum, CPU.

One SFT run in fp32, then two continuations from its weights with the same data order, lr and
number of steps: one under QAT (`posttrain.train.qat.prepare_qat`: fake-quantised forward, fp32
weights) and one in plain fp32 (the control: it separates "trained longer" from "trained with
quantisation"). Rows of the table:

    (a) fp32, no QAT                      the SFT model after `--steps` steps
    (b) fp32 + PTQ <scheme>               (a) quantised with `quantize_post_training`
    (e) fp32 continued, no QAT            (a) + `--qat-steps` more fp32 steps
    (f) fp32 continued + PTQ <scheme>     (e) quantised
    (c) QAT, fake-quantised               (a) + `--qat-steps` QAT steps, evaluated fake-quantised
    (d) QAT, converted <scheme>           (c) after `convert_qat` (integer weights)

QAT here starts after the fp32 SFT (the usual fine-tuning recipe: torchao's and torchtune's QAT
recipes prepare a trained model), not from the start. Accuracy: greedy exact match on
`--eval-size` held-out chain_sum questions (`posttrain.workflows.sft.held_out_items`, dropped from
the training rows), scored by reasoning-gym, with 95% Wilson intervals; the paired differences
(same items) use the paired bootstrap of `posttrain.rewards.evaluation`.

Usage:
    python benchmarks/qat_accuracy.py       # ~4-6 min on 2 cores; docs/benchmarks/qat_accuracy.md
    python benchmarks/qat_accuracy.py --quick     # < 30 s smoke run (tiny numbers)
    python benchmarks/qat_accuracy.py --scheme int8da_int8w --out /tmp/qat.md
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-1m", help="posttrain preset")
    parser.add_argument("--steps", type=int, default=300, help="fp32 SFT steps")
    parser.add_argument("--qat-steps", type=int, default=60, help="steps of each continuation")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak lr of the SFT run")
    parser.add_argument(
        "--qat-lr",
        type=float,
        default=2e-4,
        help="constant lr of both continuations (QAT and fp32 control)",
    )
    parser.add_argument("--eval-size", type=int, default=200, help="held-out questions")
    parser.add_argument("--train-size", type=int, default=20000)
    parser.add_argument("--scheme", default="int8da_int4w")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 10 + 4 steps, batch 8, 16 held-out questions",
    )
    parser.add_argument("--out", type=Path, default=DOCS / "qat_accuracy.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.qat_steps, args.batch_size = 10, 4, 8
        args.eval_size, args.train_size = 16, 300
    return args


def train(model, dataset, *, steps: int, batch_size: int, lr: float, seed: int, warmup: bool):
    """`steps` AdamW steps of the SFT token-mean loss; warmup-cosine (SFT) or constant lr."""
    from posttrain.data import SFTLoader
    from posttrain.train import Trainer, warmup_cosine_schedule

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = (
        warmup_cosine_schedule(
            optimizer, warmup_steps=min(20, steps // 10), total_steps=steps, min_lr_ratio=0.1
        )
        if warmup
        else None
    )
    loader = SFTLoader(dataset, batch_size=batch_size, seed=seed)
    start = time.perf_counter()
    metrics = Trainer(
        model,
        optimizer,
        data=loader,
        lr_scheduler=schedule,
        max_grad_norm=1.0,
        progress=False,
        seed=seed,
    ).fit(steps)
    return float(metrics["loss"].iloc[-1]), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from posttrain.models import ByteTokenizer, build_model, get_preset
    from posttrain.policy import Policy
    from posttrain.rewards.evaluation import paired_bootstrap_diff
    from posttrain.train.qat import (
        QATConfig,
        convert_qat,
        parameter_bytes,
        prepare_qat,
        quantize_post_training,
    )
    from posttrain.workflows.config import BatchOptimConfig, EvalConfig, ModelConfig, TaskConfig
    from posttrain.workflows.reports import accuracy_table, difference_line
    from posttrain.workflows.sft import SFTConfig, build_dataset, evaluate, held_out_items

    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    load_before = os.getloadavg()[0]
    spec, config = get_preset(args.model), QATConfig(scheme=args.scheme, group_size=args.group_size)
    task = TaskConfig(train_size=args.train_size, eval_size=args.eval_size)
    cfg = SFTConfig(
        model=ModelConfig(name=args.model),
        task=task,
        seed=args.seed,
        eval=EvalConfig(max_new_tokens=args.max_new_tokens),
        optim=BatchOptimConfig(
            steps=args.steps, batch_size=args.batch_size, warmup_steps=min(20, args.steps // 10)
        ),
        progress=False,
    )
    tokenizer = ByteTokenizer()
    items, ds = held_out_items(task)
    dataset, dropped = build_dataset(cfg, tokenizer, {it["question"] for it in items})

    results, times = {}, {}

    def score(label: str, model) -> None:
        start = time.perf_counter()
        results[label] = evaluate(
            Policy(model, tokenizer, spec), items, ds, max_new_tokens=args.max_new_tokens
        )
        times[label] = time.perf_counter() - start
        r = results[label]
        print(
            f"{label}: {r.accuracy:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] ({times[label]:.1f} s)",
            flush=True,
        )

    model = build_model(spec, seed=args.seed)
    sft_loss, sft_s = train(
        model,
        dataset,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        warmup=True,
    )
    print(f"fp32 SFT: {args.steps} steps, final loss {sft_loss:.4f}, {sft_s:.0f} s", flush=True)
    fp32_bytes = parameter_bytes(model)
    score("(a) fp32, no QAT", model)
    ptq = copy.deepcopy(model)
    quantize_post_training(ptq, config)
    score(f"(b) fp32 + PTQ {args.scheme}", ptq)

    control, qat = copy.deepcopy(model), copy.deepcopy(model)
    cont = dict(
        steps=args.qat_steps,
        batch_size=args.batch_size,
        lr=args.qat_lr,
        seed=args.seed + 1,
        warmup=False,
    )
    control_loss, control_s = train(control, dataset, **cont)
    score("(e) fp32 continued, no QAT", control)
    quantize_post_training(control, config)
    score(f"(f) fp32 continued + PTQ {args.scheme}", control)

    report = prepare_qat(qat, config, spec=spec)
    qat_loss, qat_s = train(qat, dataset, **cont)
    score("(c) QAT, fake-quantised", qat)
    convert_qat(qat, config)
    score(f"(d) QAT, converted {args.scheme}", qat)
    quant_bytes = parameter_bytes(qat)

    order = [
        "(a) fp32, no QAT",
        f"(b) fp32 + PTQ {args.scheme}",
        "(e) fp32 continued, no QAT",
        f"(f) fp32 continued + PTQ {args.scheme}",
        "(c) QAT, fake-quantised",
        f"(d) QAT, converted {args.scheme}",
    ]
    table = accuracy_table(
        [(k, results[k].as_dict()) for k in order], header="model (greedy, held-out)"
    )

    def diff(a: str, b: str) -> str:
        d = paired_bootstrap_diff(
            results[a].table["correct"].to_numpy(),
            results[b].table["correct"].to_numpy(),
            seed=args.seed,
        )
        return "- " + difference_line(f"{a[:3]} - {b[:3]}", d)

    diffs = [
        diff(order[5], order[3]),
        diff(order[5], order[4]),
        diff(order[1], order[0]),
        diff(order[3], order[2]),
        diff(order[2], order[0]),
    ]
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python benchmarks/qat_accuracy.py", *given])
    setup = [
        f"- Model: `{args.model}` ({spec.num_parameters():,} parameters, "
        f"{spec.num_layers} layers, d_model {spec.embed_dim}, tied embeddings: "
        f"{spec.tie_word_embeddings}), byte tokenizer, fp32, built with seed {args.seed}",
        f"- Task: reasoning-gym chain_sum {task.options}, {len(dataset)} training rows (seed "
        f"{args.seed}; {dropped} rows dropped because their question is held out), "
        f"{len(items)} held-out questions (eval seed {task.eval_seed}), greedy, "
        f"{args.max_new_tokens} new tokens, exact match by the task's scorer",
        f"- fp32 SFT: {args.steps} steps of batch {args.batch_size}, AdamW lr {args.lr} "
        f"(warmup-cosine to 10%), weight decay 0, clip 1.0; final loss {sft_loss:.4f}, "
        f"{sft_s:.0f} s",
        f"- Continuations from the SFT weights, both {args.qat_steps} steps of batch "
        f"{args.batch_size}, constant lr {args.qat_lr}, same data order (loader seed "
        f"{args.seed + 1}): fp32 final loss {control_loss:.4f} ({control_s:.0f} s); QAT final "
        f"loss {qat_loss:.4f} ({qat_s:.0f} s, fake-quantised forward)",
        f"- Quantisation: `QATConfig(scheme={args.scheme!r}, group_size={args.group_size})`; "
        f"{report}",
        f"- Parameter bytes: fp32 {fp32_bytes:,}, converted {quant_bytes:,} "
        f"({quant_bytes / fp32_bytes:.2f}x; `parameter_bytes`, int4 values stored unpacked in "
        f"int8 on this CPU path)",
        "- Evaluation time (s): " + ", ".join(f"{k[:3]} {v:.1f}" for k, v in times.items()),
        f"- Machine: {platform.processor() or platform.machine()}, {args.threads} threads, "
        f"torch {torch.__version__}; 1-min load average {load_before:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end; total {time.perf_counter() - wall:.0f} s",
        f"- Command: `{command}`",
    ]
    text = "\n".join(
        [
            "## Setup",
            "",
            *setup,
            "",
            "## Held-out accuracy",
            "",
            *table,
            "",
            "Paired differences (same items):",
            "",
            *diffs,
            "",
        ]
    )
    print("\n" + text)
    if args.quick and args.out == DOCS / "qat_accuracy.md":
        print("--quick: nothing written (pass --out to write the table)")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _write(args.out, text)
    print(f"wrote {args.out}")
    return 0


MARK = "<!-- measured: written by benchmarks/qat_accuracy.py -->"


def _write(path: Path, text: str) -> None:
    """Write `text` below MARK, keeping a hand-written head above MARK if `path` has one."""
    old = path.read_text() if path.is_file() else ""
    head = old.split(MARK)[0] if MARK in old else ""
    path.write_text(f"{head}{MARK}\n\n{text}")


if __name__ == "__main__":
    sys.exit(main())
