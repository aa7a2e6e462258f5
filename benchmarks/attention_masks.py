"""Peak memory and time of packed rows' forward (and backward) with a dense [1, T, T] mask
against a block-sparse FlexAttention mask (`posttrain.models.attention_masks`), on CPU.

The model: a narrow torchtune qwen2 (2 layers, width 128, 2 heads of the real head_dim 64, MLP
256, vocabulary 256, fp32), so that the attention is most of the work and a run stays under
~3 GiB on this shared machine. One packed row of T tokens: documents of seeded uneven lengths
(64 to T/4 tokens) back to back, the last one cut to fill the row (`pack_samples`' layout),
position ids restarting per document.

Paths:
- dense fwd+bwd: today's path, SDPA with the dense bool mask, `logits.sum().backward()`.
- dense fwd: the same, forward only under `torch.no_grad()`.
- block fwd (eager / compiled): FlexAttention with the `BlockMask`, forward only under
  `torch.no_grad()`: FlexAttention has no backward on CPU in torch 2.13. torchtune's attention
  sends a `BlockMask` to FlexAttention only on CUDA, so the benchmark routes it there itself.
  The compiled kernel is `torch.compile(flex_attention, dynamic=False)`, as torchtune compiles
  it; its compile (one per T) is timed apart, in the warm-up.

Peak: the resident memory one run adds at its peak (`allocated_peak`: VmHWM after a reset, less
VmRSS before); the mask is built outside the region and its own size is printed beside. Time:
wall-clock seconds (median, min-max) and process CPU seconds (median) of `--repeats` runs after
one warm-up run.

    nice -n 19 .venv/bin/python benchmarks/attention_masks.py            # the table of the doc
    nice -n 19 .venv/bin/python benchmarks/attention_masks.py --quick    # T=256, seconds
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torchtune.models.qwen2._component_builders import qwen2

from posttrain.models.attention_masks import block_segment_mask, dense_segment_mask

_MIB = 2**20


def narrow_model(max_seq_len: int) -> torch.nn.Module:
    """The benchmark's qwen2: 2 layers, width 128, 2 heads of 64, fp32, seeded."""
    torch.manual_seed(0)
    return qwen2(
        vocab_size=256,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        embed_dim=128,
        intermediate_dim=256,
        max_seq_len=max_seq_len,
        attn_dropout=0.0,
    )


def route_block_masks(model: torch.nn.Module, kernel: Callable[..., Any]) -> None:
    """Make every attention of `model` run a `BlockMask` through `kernel` (what torchtune's
    attention does on CUDA); dense masks still go to SDPA."""
    for module in model.modules():
        if hasattr(module, "_attention_call"):
            sdpa = module._attention_call

            def call(
                q: Tensor,
                k: Tensor,
                v: Tensor,
                mask: Any,
                dropout_p: float,
                is_causal: bool,
                sdpa: Any = sdpa,
            ) -> Tensor:
                if isinstance(mask, BlockMask):
                    return kernel(q, k, v, block_mask=mask)
                return sdpa(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)

            setattr(module, "_attention_call", call)  # noqa: B010 (a method slot, not a field)


def packed_row(T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [1, T], position ids [1, T], document ids [1, T]) of one packed row."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < T:
        lengths.append(int(torch.randint(64, max(65, T // 4), (1,), generator=g)))
    lengths[-1] -= sum(lengths) - T
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.randint(3, 256, (T,), generator=g)
    return ids[None], positions[None], documents[None]


def run(model: torch.nn.Module, ids: Tensor, pos: Tensor, mask: Any, backward: bool) -> None:
    if backward:
        model(ids, mask=mask, input_pos=pos).sum().backward()
        model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            model(ids, mask=mask, input_pos=pos)


def measure(fn: Callable[[], None], repeats: int) -> tuple[float, float, float, float, float, int]:
    """(warm-up s, median s, min s, max s, median process CPU s, peak bytes) of `fn`."""
    t0 = time.perf_counter()
    fn()
    warm = time.perf_counter() - t0
    peak = allocated_peak(fn)
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return warm, statistics.median(times), min(times), max(times), statistics.median(cpu), peak


def allocated_peak(fn: Callable[[], None]) -> int:
    """Bytes of resident memory `fn` adds at its peak: VmHWM after a reset of it (writing 5 to
    /proc/self/clear_refs) less VmRSS before. Counts every allocation, those inside
    FlexAttention's eager kernel too (`TensorPeak`'s dispatch mode cannot see inside its
    higher-order op). `main` runs with glibc's mmap threshold fixed at 64 KiB, so a freed
    tensor leaves the resident set at once and the next measurement starts clean."""
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled kernel")
    parser.add_argument("--quick", action="store_true", help="T=256, 1 repeat, no compile")
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # see allocated_peak
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if args.quick:
        args.lengths, args.repeats, args.no_compile = [256], 1, True
    warnings.filterwarnings("ignore", message=".*flex_attention.*")  # eager: "unfused" warning
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, load {os.getloadavg()[0]:.1f}")
    print("| T | path | time s (median, min-max) | CPU s | warm-up s | peak MiB | mask MiB |")
    print("|---|---|---|---|---|---|---|")
    kernels: list[tuple[str, Callable[..., Any]]] = [("block fwd (eager)", flex_attention)]
    if not args.no_compile:
        kernels.append(("block fwd (compiled)", torch.compile(flex_attention, dynamic=False)))
    for T in args.lengths:
        ids, pos, documents = packed_row(T)
        dense = dense_segment_mask(documents)
        block = block_segment_mask(documents)
        cases: list[tuple[str, Callable[[], None], Any]] = []
        model = narrow_model(T)
        for name, backward in (("dense fwd+bwd", True), ("dense fwd", False)):
            cases.append((name, functools.partial(run, model, ids, pos, dense, backward), dense))
        for name, kernel in kernels:
            routed = narrow_model(T)
            route_block_masks(routed, kernel)
            cases.append((name, functools.partial(run, routed, ids, pos, block, False), block))
        for name, fn, mask in cases:
            warm, med, lo, hi, cpu, peak = measure(fn, args.repeats)
            mask_bytes = (
                mask.numel() * mask.element_size()
                if isinstance(mask, torch.Tensor)
                else sum(
                    t.numel() * t.element_size() for t in mask.as_tuple() if torch.is_tensor(t)
                )
            )
            print(
                f"| {T} | {name} | {med:.2f} ({lo:.2f}-{hi:.2f}) | {cpu:.2f} | {warm:.1f} | "
                f"{peak / _MIB:.0f} | {mask_bytes / _MIB:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
