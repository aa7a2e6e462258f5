"""Memory and step time of SFT with fp32, LoRA, QLoRA (NF4 base) and FP8 training, on CPU.

One model for every variant: a Qwen2 spec of 27M parameters (D=512, 8 layers, 8 heads, 8 KV
heads, MLP 1536, byte vocabulary, tied embeddings), every weight's numel divisible by 16,384 so
that QLoRA can quantise all seven projections of each block. Variants:

  fp32    full fine-tuning, every parameter trains (AdamW);
  lora    `posttrain.models.lora.apply_lora`, rank 16, alpha 32, on q/k/v/output_proj and
          w1/w2/w3; the base frozen in fp32, only the adapters train;
  qlora   the same adapters on an NF4 base (`LoRAConfig(quantize_base=True)`);
  fp8     `posttrain.train.float8.apply_float8` (tensorwise), every block linear in float8, all
          parameters train.

Each variant runs in a fresh process (MALLOC_MMAP_THRESHOLD_=65536, so RSS follows the live
tensors; one intra-op thread): warm-up on a tiny model, peak RSS reset (`/proc/self/clear_refs`),
then build (seed 0), convert, AdamW (lr 1e-4), `posttrain.train.Trainer` (clipping at 1.0) and
`--steps` SFT steps on random byte tokens (B x T, every next token trained). Reported: the bytes
of the weights as stored (an NF4 tensor counts its packed data and scales), of the gradients and
of the optimizer state at the end, trainable parameters, the peak RSS increase, and the median
step time after the first step (wall). The step time is the CPU's: FP8 matmuls are emulated on a
CPU (torch._scaled_mm upcasts), so FP8 is slower here, not faster; its speed-up is a GPU's
(the fp8 section of benchmarks/gpu/acceptance.py). NF4 dequantises each weight in every
forward, so QLoRA is slower than LoRA on any device; it buys memory.

Usage:
    python benchmarks/quantized_training.py          # ~4 min; writes the generated block of
                                                     # docs/benchmarks/quantized_training.md
    python benchmarks/quantized_training.py --quick  # tiny model, 2 steps, nothing written
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

VARIANTS = ("fp32", "lora", "qlora", "fp8")
DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "quantized_training.md"
BEGIN, END = "<!-- quantized_training.py: begin -->", "<!-- quantized_training.py: end -->"


def model_spec(quick: bool):
    from posttrain.models import ModelSpec

    if quick:
        return ModelSpec(
            family="qwen2",
            vocab_size=272,
            num_layers=2,
            num_heads=4,
            num_kv_heads=4,
            embed_dim=128,
            intermediate_dim=256,
            max_seq_len=128,
            rope_base=1e6,
            norm_eps=1e-6,
            tie_word_embeddings=True,
        )
    return ModelSpec(
        family="qwen2",
        vocab_size=272,
        num_layers=8,
        num_heads=8,
        num_kv_heads=8,
        embed_dim=512,
        intermediate_dim=1536,
        max_seq_len=512,
        rope_base=1e6,
        norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _leaves(t):
    """The plain tensors a tensor holds: a tensor subclass (NF4, float8) gives its inner ones."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [leaf for n in names for leaf in _leaves(getattr(t, n))]


def _unique_bytes(tensors) -> int:
    """Bytes of `tensors` as stored, each storage counted once (a tied weight is one)."""
    seen, total = set(), 0
    for t in tensors:
        for leaf in _leaves(t):
            key = (leaf.data_ptr(), leaf.numel(), leaf.dtype)
            if key not in seen:
                seen.add(key)
                total += leaf.numel() * leaf.element_size()
    return total


def convert(model, spec, variant: str):
    from posttrain.models.lora import LoRAConfig, apply_lora
    from posttrain.train.float8 import Float8Config, apply_float8

    modules = ("q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3")
    if variant in ("lora", "qlora"):
        return apply_lora(
            model,
            LoRAConfig(rank=16, alpha=32.0, modules=modules, quantize_base=variant == "qlora"),
            spec=spec,
        )
    if variant == "fp8":
        return apply_float8(model, Float8Config(recipe="tensorwise"), spec=spec)
    return None


def worker(variant: str, quick: bool, steps: int, batch: int, seq: int) -> dict:
    """One variant in this process; returns its measurements."""
    from posttrain.data import Sample, SFTLoader
    from posttrain.models import build_model
    from posttrain.train import Trainer

    torch.set_num_threads(1)
    spec = model_spec(quick)
    warm_spec = spec.replace(num_layers=1)
    warm = build_model(warm_spec, seed=0)  # lazy imports, kernel set-up
    convert(warm, warm_spec, variant)
    x = torch.randint(0, 256, (2, 16))
    torch.nn.functional.cross_entropy(warm(x).flatten(0, 1), x.flatten()).backward()
    del warm, x
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    baseline = _status_bytes("VmRSS")
    model = build_model(spec, seed=0)
    report = convert(model, spec, variant)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    rows = [
        Sample.from_loss_mask(
            torch.randint(0, 256, (seq,), generator=generator).tolist(), [True] * seq
        )
        for _ in range(batch * (steps + 1))
    ]
    loader = SFTLoader(rows, batch_size=batch, seed=0, pad_id=0)
    trainer = Trainer(model, optimizer, data=loader, max_grad_norm=1.0, progress=False)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.fit(trainer.step_count + 1)
        times.append(time.perf_counter() - start)
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "variant": variant,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in trainable),
        "weight_bytes": _unique_bytes(list(model.parameters()) + list(model.buffers())),
        # each gradient at the optimizer step has its parameter's shape and dtype
        "grad_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "optimizer_bytes": _unique_bytes(state),
        "peak_rss_bytes": _status_bytes("VmHWM") - baseline,
        "step_s": statistics.median(times[1:] or times),
        "report": str(report),
    }


def launch(variant: str, args) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
    ] + (["--quick"] * args.quick)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"{variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    mib = 2**20
    fp32 = next((r for r in rows if r["variant"] == "fp32"), rows[0])
    lines = [
        "| variant | trainable params | weights MiB | grads MiB | AdamW state MiB | "
        "peak RSS increase MiB | step s (median) | step vs fp32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['trainable']:,} | {r['weight_bytes'] / mib:.1f} | "
            f"{r['grad_bytes'] / mib:.1f} | {r['optimizer_bytes'] / mib:.1f} | "
            f"{r['peak_rss_bytes'] / mib:.0f} | {r['step_s']:.2f} | "
            f"{r['step_s'] / fp32['step_s']:.2f}x |"
        )
    return "\n".join(lines)


def report(rows: list[dict], args, elapsed: float) -> str:
    import torch

    spec = model_spec(args.quick)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return "\n".join(
        [
            BEGIN,
            "",
            f"Measured {time.strftime('%Y-%m-%d')} with `python benchmarks/quantized_training.py"
            f"{' --quick' * args.quick}` ({elapsed:.0f} s): {cpu}, 1 thread per process, torch "
            f"{torch.__version__}; model {rows[0]['params'] / 1e6:.1f}M parameters (D="
            f"{spec.embed_dim}, {spec.num_layers} layers), SFT steps of {args.batch} x {args.seq} "
            f"random byte tokens, {args.steps} steps per variant.",
            "",
            table(rows),
            "",
            *[f"- {r['variant']}: {r['report']}" for r in rows if r["report"] != "None"],
            "",
            END,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps, no doc")
    parser.add_argument("--steps", type=int, default=None, help="SFT steps per variant (5)")
    parser.add_argument("--batch", type=int, default=4, help="rows per step (default 4)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per row (default 256)")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 5)
    if args.quick and args.seq == 256:
        args.seq = 32
    if args.worker:
        print(json.dumps(worker(args.worker, args.quick, args.steps, args.batch, args.seq)))
        return 0
    start = time.perf_counter()
    rows = [launch(v, args) for v in VARIANTS]
    block = report(rows, args, time.perf_counter() - start)
    print(block)
    if not args.quick:
        text = DOC.read_text() if DOC.is_file() else f"{BEGIN}\n{END}\n"
        head, rest = text.split(BEGIN, 1)
        DOC.write_text(head + block + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
