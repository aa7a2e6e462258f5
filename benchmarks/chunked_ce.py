"""Peak memory and time of the SFT cross-entropy and its backward, unchunked against chunked
(`SFTCrossEntropy(loss_chunk_tokens=)`, `posttrain.policy.chunked_ce`), at Qwen2.5-0.5B's head:
vocabulary 151,936, width 896, fp32, on CPU.

Each measurement starts from the final hidden states [B, T, D] (a leaf that wants a gradient)
and an untied `nn.Linear(D, V)` head, every token trained, and runs the loss and `backward()`:
the part of a step the chunking changes. The unchunked side is today's path,
`token_cross_entropy_sum(head(h).float(), labels)`, exactly as the decoder's forward and
`SFTCrossEntropy` run it. Peak: the bytes of the tensors the loss allocates, gradients
included (`posttrain.train.memory_measure.TensorPeak`, one run), beside the memory plan's term
(`memory_counts.loss_bytes`). Time: wall-clock and process CPU seconds of `--repeats` runs
(median, min-max), after one warm-up run; both sides of a shape alternate.

A shape whose planned peak is above `--max-gib` (default 3) is not run on that side; its
planned peak is printed instead (2 x 2048 unchunked needs ~7 GiB: more than this shared
machine may take).

    nice -n 19 .venv/bin/python benchmarks/chunked_ce.py             # the table of the doc
    nice -n 19 .venv/bin/python benchmarks/chunked_ce.py --quick     # tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from posttrain.policy.chunked_ce import chunked_cross_entropy_sum
from posttrain.train.losses import token_cross_entropy_sum
from posttrain.train.memory_counts import loss_bytes
from posttrain.train.memory_measure import TensorPeak

_GIB = 2**30


def run_once(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, chunk: int | None):
    """Loss and backward once; the gradients are dropped after."""
    if chunk is None:
        loss, _ = token_cross_entropy_sum(head(hidden).float(), labels)
    else:
        loss, _ = chunked_cross_entropy_sum(hidden, head, labels, chunk_tokens=chunk)
    loss.backward()
    hidden.grad = head.weight.grad = None
    return float(loss.detach())


def measure(B: int, T: int, V: int, D: int, chunk: int | None, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, 0.02, generator=gen)
    hidden = torch.randn(B, T, D, generator=gen).requires_grad_(True)
    labels = torch.randint(0, V, (B, T), generator=gen)
    with TensorPeak() as peak:
        loss = run_once(hidden, head, labels, chunk)
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        run_once(hidden, head, labels, chunk)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {"peak": peak.peak_bytes, "loss": loss, "wall": walls, "cpu": cpus}


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x1024,2x2048", help="BxT,BxT,...")
    parser.add_argument("--chunk", type=int, default=512, help="loss_chunk_tokens")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--dim", type=int, default=896)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-gib", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true", help="V=1000, D=64, shapes 1x64,2x128")
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.dim, args.shapes, args.chunk, args.repeats = 1000, 64, "1x64,2x128", 32, 1
    torch.set_num_threads(args.threads)
    V, D = args.vocab, args.dim
    print(
        f"V={V} D={D} fp32, torch {torch.__version__}, {args.threads} thread(s), "
        f"{args.repeats} repeats, load {os.getloadavg()[0]:.1f}"
    )
    print(
        "| tokens (B x T) | loss | planned peak GiB | measured peak GiB | wall s, median (range) "
        "| CPU s, median (range) |"
    )
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        losses = []
        for chunk in (None, args.chunk):
            planned = loss_bytes(V, D, B * T, 4, 4, chunk)
            name = "unchunked" if chunk is None else f"chunk {chunk}"
            if planned / _GIB > args.max_gib:
                print(
                    f"| {B} x {T} | {name} | {planned / _GIB:.2f} | "
                    f"not run (> {args.max_gib:g} GiB) | | |"
                )
                continue
            r = measure(B, T, V, D, chunk, args.repeats)
            losses.append(r["loss"])
            print(
                f"| {B} x {T} | {name} | {planned / _GIB:.2f} | {r['peak'] / _GIB:.2f} | "
                f"{_cell(r['wall'])} | {_cell(r['cpu'])} |",
                flush=True,
            )
        if len(losses) == 2:
            print(f"  {B} x {T}: loss unchunked {losses[0]:.6f}, chunked {losses[1]:.6f}")
    print(f"load after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
