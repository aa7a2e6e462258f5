"""FP8 training throughput against bf16 on one GPU: the llama3.2-1b spec (1.24B parameters).

Prepared for one NVIDIA H200 (or H100); it exits with a message when CUDA is absent. Target:
FP8 (torchao float8, tensorwise scaling) >= 1.2x the bf16 tokens/s (torchao reports about 1.25x
for Llama 3 8B on 8 GPUs with FSDP2 + torch.compile). Budget: under 8 minutes on an H200.

What it does, for each variant (bf16, then `posttrain.train.float8.apply_float8` with the
tensorwise and the rowwise recipe):
  * builds `get_preset("llama3.2-1b")` (max_seq_len set to T) with `posttrain.models.build_model`
    on the GPU in bf16, random weights, seed 0 (it measures speed, not quality);
  * FP8 variants: every linear layer of the transformer blocks becomes a torchao Float8Linear
    (the output projection and embeddings stay bf16: `Float8Config.skip_modules`); the report
    line of the converter is printed;
  * `torch.compile` of every transformer block (float8 needs compile to fuse its casts and
    scaling; without it FP8 is slower than bf16), then SFT steps on random tokens: B rows of T
    tokens, every next token trained, `posttrain.train.token_cross_entropy_sum` / tokens, backward,
    clipping at 1.0, fused AdamW (lr 1e-5), zero_grad. `--warmup` untimed steps (compilation), then
    `--steps` timed, CUDA-synchronised.

Reported (a markdown table on stdout, also written to `--out` when given): tokens/s, step time,
peak CUDA memory and the speed-up over bf16, plus the loss of the last step of each variant
(random data: a sanity check that FP8 trains like bf16, not a quality figure).

Usage:
    python benchmarks/gpu_fp8.py                      # B=4, T=2048, three variants, ~5 min
    python benchmarks/gpu_fp8.py --variants bf16 tensorwise --steps 10 --out fp8.md
"""

from __future__ import annotations

import argparse
import sys
import time

VARIANTS = ("bf16", "tensorwise", "rowwise")


def _step(model, optimizer, tokens_BT):
    import torch

    from posttrain.train import token_cross_entropy_sum

    loss_sum, num_tokens = token_cross_entropy_sum(model(tokens_BT[:, :-1]), tokens_BT[:, 1:])
    loss = loss_sum / num_tokens
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def run_variant(name: str, *, batch: int, seq: int, warmup: int, steps: int) -> dict:
    """Build, convert (FP8 variants), compile and time one variant; returns its measurements."""
    import torch

    from posttrain.models import build_model, get_preset
    from posttrain.train.float8 import Float8Config, apply_float8

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    spec = get_preset("llama3.2-1b").replace(max_seq_len=seq + 1)
    model = build_model(spec, device="cuda", dtype=torch.bfloat16, seed=0)
    report = None
    if name != "bf16":
        report = apply_float8(model, Float8Config(recipe=name), spec=spec)
        print(report, flush=True)
    for layer in model.layers:
        layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens_BT = torch.randint(
        0, spec.vocab_size, (batch, seq + 1), device="cuda", generator=generator
    )
    for _ in range(warmup):
        _step(model, optimizer, tokens_BT)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        loss = _step(model, optimizer, tokens_BT)
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / steps
    result = {
        "variant": name,
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": elapsed,
        "tokens_per_s": batch * seq / elapsed,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss": float(loss),
        "converted": None if report is None else len(report.converted),
    }
    del model, optimizer
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="rows per step (default 4)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per row (default 2048)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps (compilation)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps (default 15)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_fp8.py needs a CUDA GPU (FP8 tensor cores: H100/H200); none here, nothing "
            "measured",
            file=sys.stderr,
        )
        return 2
    rows = [
        run_variant(v, batch=args.batch, seq=args.seq, warmup=args.warmup, steps=args.steps)
        for v in args.variants
    ]
    base = next((r for r in rows if r["variant"] == "bf16"), None)
    lines = [
        f"FP8 vs bf16, llama3.2-1b spec ({rows[0]['params'] / 1e9:.2f}B parameters), "
        f"{torch.cuda.get_device_name()}, B={args.batch} x T={args.seq}, torch "
        f"{torch.__version__}, {args.steps} timed steps after {args.warmup}",
        "",
        "| variant | tokens/s | step (s) | speed-up vs bf16 | peak GiB | last loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        speedup = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        lines.append(
            f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | "
            f"{speedup} | {r['peak_gib']:.1f} | {r['loss']:.4f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
