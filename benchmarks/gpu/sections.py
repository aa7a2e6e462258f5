"""The sections of benchmarks/gpu/acceptance.py: each runs in its own process and returns one row,
{"result": what was measured, "check": "pass", "FAIL: why" or "-" (nothing to check)}.

Every section takes `device` ("cuda" for the acceptance run; "cpu" runs the same code at tiny
size, which is how the CPU tests exercise it) and `quick` (tiny shapes, a few steps).
MFU follows the convention of docs/benchmarks/README.md: (6 N + 12 L T d_attn) x tokens/s,
`posttrain.core.timing.model_flops` + `attention_flops`, over the measured bf16 matmul peak and
the datasheet peak (`datasheet_peak_flops`), both shown.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import statistics
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from posttrain.core.timing import (
    attention_flops,
    datasheet_peak_flops,
    matmul_peak_flops,
    model_flops,
    non_embedding_params,
)
from posttrain.models import build_model, get_preset
from posttrain.models.specs import ModelSpec

FP8_VARIANTS = ("bf16", "tensorwise", "rowwise")
COPY_ALPHABET = 256
"""Token ids of the periodic-copy task of the FP8 section: fresh random data can do no better
than ln(256) = 5.55 nats a token, so a final loss below `COPY_LOSS_MAX` shows learning."""
COPY_PERIOD = 16
COPY_LOSS_MAX = 1.0
FP8_LOSS_MARGIN = (1.10, 0.05)
"""FP8's final loss must be <= bf16's x 1.10 + 0.05 (a relative and an absolute slack)."""


@contextlib.contextmanager
def one_rank_group(device: str) -> Iterator[None]:
    """A 1-rank process group (NCCL on CUDA, gloo on CPU), for FSDP2 on one device."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard_bf16(model: torch.nn.Module, spec: ModelSpec, device: str):
    """`ParallelPlan(param_dtype="bfloat16", reduce_dtype="float32")` applied to `model` on one
    rank: FSDP2 over a mesh of one (fp32 master weights, bf16 compute), the code path of a
    multi-GPU run; on CUDA the blocks are compiled first (`compile_blocks`, inductor). Returns
    the plan's runtime (for the Trainer)."""
    from posttrain.train import ParallelPlan
    from posttrain.train.compile import compile_blocks

    if device == "cuda":
        compile_blocks(model)
    plan = ParallelPlan(param_dtype="bfloat16", reduce_dtype="float32")
    return plan.parallelize(model, spec=spec)


def attn_dim(spec: ModelSpec) -> int:
    """d_attn = num_heads x head width (the query width)."""
    return spec.num_heads * (spec.attention_head_dim or spec.embed_dim // spec.num_heads)


def mfu_cells(spec: ModelSpec, n_params: int, seq_len: int, tokens_per_s: float, device: str):
    """Model FLOP/s ((6 N + 12 L T d_attn) x tokens/s) and the MFU text: against the datasheet
    peak of the device (or "n/a" and why) and against the matmul peak measured now (bf16 on
    CUDA, fp32 on CPU), both shown."""
    per_token = model_flops(n_params, 1, kind="train") + attention_flops(
        spec.num_layers, seq_len, attn_dim(spec), 1, kind="train"
    )
    flops_per_s = per_token * tokens_per_s
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    measured = matmul_peak_flops(device, dtype=dtype)
    table, why = datasheet_peak_flops(torch.cuda.get_device_name() if device == "cuda" else "cpu")
    if table is None:
        sheet = f"MFU n/a ({why})"
    else:
        sheet = f"MFU {flops_per_s / table:.1%} of {table / 1e12:.0f} TFLOP/s ({why})"
    return flops_per_s, (
        f"{sheet}; {flops_per_s / measured:.1%} of the measured "
        f"{str(dtype).removeprefix('torch.')} matmul peak {measured / 1e12:.3g} TFLOP/s"
    )


class RandomTokens:
    """`next_batch()` of B rows of T random tokens, every next token trained (a Trainer's data)."""

    def __init__(self, vocab: int, batch: int, seq: int, device: str) -> None:
        from posttrain.data.loader import Batch

        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        pos = torch.arange(seq).expand(batch, seq)
        self.batch = Batch(
            input_ids=ids[:, :-1].contiguous().to(device),
            labels=ids[:, 1:].contiguous().to(device),
            position_ids=pos.contiguous().to(device),
            attention_mask=None,
            num_samples=batch,
        )

    def next_batch(self):
        return self.batch


def section_mfu(device: str, quick: bool) -> dict:
    """MFU of `posttrain.train.Trainer` steps (SFTCrossEntropy, chunked head, clipping, fused
    AdamW) at Qwen2.5-0.5B's shape, bf16 FSDP2 on one device, B=8 x T=2048."""
    from posttrain.train import Trainer
    from posttrain.train.losses import SFTCrossEntropy

    preset, batch, seq, warmup, steps = (
        ("tiny-1m", 2, 64, 1, 3) if quick else ("qwen2.5-0.5b", 8, 2048, 4, 15)
    )
    spec = get_preset(preset).replace(max_seq_len=seq)
    with one_rank_group(device):
        model = build_model(spec, device=device, seed=0)
        n_params = non_embedding_params(model)
        runtime = shard_bf16(model, spec, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
        trainer = Trainer(
            model,
            opt,
            data=RandomTokens(spec.vocab_size, batch, seq, device),
            loss=SFTCrossEntropy(loss_chunk_tokens=min(seq, 2048)),
            max_grad_norm=1.0,
            progress=False,
            runtime=runtime,
        )
        rows = trainer.fit(warmup + steps)
    step_s = statistics.median(rows["step_time_s"].iloc[warmup:])
    tokens_per_s = batch * seq / step_s
    _, cells = mfu_cells(spec, n_params, seq, tokens_per_s, device)
    return {
        "result": f"{preset} B={batch} T={seq}: {tokens_per_s:,.0f} tok/s, {cells}",
        "check": "-",
    }


def copy_batch(batch: int, seq: int, generator: torch.Generator, device: str):
    """[B, T+1] rows that repeat a fresh random pattern of COPY_PERIOD ids from COPY_ALPHABET;
    the labels of the first period are ignored (unpredictable), the rest can be copied."""
    from posttrain.data.loader import IGNORE_INDEX

    pattern = torch.randint(0, COPY_ALPHABET, (batch, COPY_PERIOD), generator=generator)
    ids = pattern.repeat(1, (seq + 1) // COPY_PERIOD + 1)[:, : seq + 1]
    labels = ids[:, 1:].clone()
    labels[:, : COPY_PERIOD - 1] = IGNORE_INDEX
    return ids[:, :-1].to(device), labels.to(device)


def fp8_check(final: dict[str, float]) -> str:
    """'pass', or 'FAIL: ...' naming the variant and the bound it missed (FP8_LOSS_MARGIN
    against bf16, COPY_LOSS_MAX for every variant)."""
    scale, slack = FP8_LOSS_MARGIN
    bad = [f"{v} {x:.3f} >= {COPY_LOSS_MAX}" for v, x in final.items() if not x < COPY_LOSS_MAX]
    if "bf16" in final:
        bound = final["bf16"] * scale + slack
        bad += [f"{v} {x:.3f} > bf16 bound {bound:.3f}" for v, x in final.items() if x > bound]
    return "FAIL: " + "; ".join(bad) if bad else "pass"


def section_fp8(device: str, quick: bool, variants: tuple[str, ...] = FP8_VARIANTS) -> dict:
    """FP8 (torchao, tensorwise and rowwise) against bf16 at ~1B (llama3.2-1b's blocks, a
    1,024-token vocabulary: the task uses 256 ids), fp32 master weights under FSDP2, trained on
    the periodic-copy task; the variants run round-robin, `per_round` steps each, the order
    rotating every round. Loss: the mean of each variant's last 5 steps."""
    from posttrain.data.loader import IGNORE_INDEX
    from posttrain.train import token_cross_entropy_sum
    from posttrain.train.float8 import Float8Config, apply_float8

    preset, batch, seq, rounds, per_round = (
        ("tiny-llama-1m", 4, 64, 3, 20) if quick else ("llama3.2-1b", 4, 1024, 6, 10)
    )
    spec = get_preset(preset).replace(max_seq_len=seq, vocab_size=1024)
    with one_rank_group(device):
        runs: dict[str, tuple] = {}
        for v in variants:
            model = build_model(spec, device=device, seed=0)
            if v != "bf16":
                apply_float8(model, Float8Config(recipe=v), spec=spec)
            shard_bf16(model, spec, device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device == "cuda")
            runs[v] = (model, opt, torch.Generator().manual_seed(1), [], [])
        for r in range(rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                model, opt, gen, losses, times = runs[v]
                start = time.perf_counter()
                for _ in range(per_round):
                    inputs, labels = copy_batch(batch, seq, gen, device)
                    loss_sum, n = token_cross_entropy_sum(
                        model(inputs), labels, ignore_index=IGNORE_INDEX
                    )
                    (loss_sum / n).backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    losses.append((loss_sum / n).detach())  # read after the run: no sync
                if r > 0:  # round 0 compiles
                    times.append(time.perf_counter() - start)
    final = {v: statistics.mean(float(x) for x in runs[v][3][-5:]) for v in variants}
    rate = {v: statistics.median(batch * seq * per_round / t for t in runs[v][4]) for v in variants}
    cells = [
        f"{v} loss {float(runs[v][3][0]):.2f} -> {final[v]:.3f}, {rate[v]:,.0f} tok/s"
        + (f" ({rate[v] / rate['bf16']:.2f}x)" if "bf16" in rate and v != "bf16" else "")
        for v in variants
    ]
    return {
        "result": f"{preset} vocab 1024 B={batch} T={seq}: " + "; ".join(cells),
        "check": fp8_check(final),
    }


def section_chunked_ce(device: str, quick: bool) -> dict:
    """Peak memory of the SFT cross-entropy forward + backward from the final hidden states at
    Qwen2.5-0.5B's head (vocabulary 151,936, width 896, fp32), 8 x 2048 tokens, unchunked
    (`token_cross_entropy_sum` of the full logits) against `chunked_cross_entropy_sum` with
    1,024-token chunks, beside the memory plan's term (`memory_counts.loss_bytes`)."""
    from posttrain.policy.chunked_ce import chunked_cross_entropy_sum
    from posttrain.train.losses import token_cross_entropy_sum
    from posttrain.train.memory_counts import loss_bytes
    from posttrain.train.memory_measure import TensorPeak

    vocab, width, batch, seq, chunk = (
        (512, 64, 2, 128, 64) if quick else (151936, 896, 8, 2048, 1024)
    )
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(width, vocab, bias=False).to(device)
    hidden = torch.randn(batch, seq, width, generator=g).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    cells = []
    for c in (None, chunk):
        hidden.grad, head.weight.grad = None, None
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        peak = TensorPeak()
        with contextlib.nullcontext() if device == "cuda" else peak:
            if c is None:
                loss_sum, n = token_cross_entropy_sum(head(hidden).float(), labels)
            else:
                loss_sum, n = chunked_cross_entropy_sum(hidden, head, labels, chunk_tokens=c)
            (loss_sum / n).backward()
        used = torch.cuda.max_memory_allocated() - base if device == "cuda" else peak.peak_bytes
        planned = loss_bytes(vocab, width, batch * seq, 4, 4, c)
        cells.append(
            f"{'unchunked' if c is None else f'chunk {c}'} "
            f"{used / 2**20:,.1f} MiB (plan {planned / 2**20:,.1f})"
        )
    return {"result": f"V={vocab} D={width} {batch}x{seq}: " + ", ".join(cells), "check": "-"}


def section_vllm(device: str, quick: bool) -> dict:
    """benchmarks/gpu_vllm_rollout.py at Qwen2.5-0.5B's shape: vLLM and `Policy.generate`
    tokens/s, their paired ratio and the weight-sync time (one row per prompt shape)."""
    import gpu_vllm_rollout

    out = io.StringIO()
    args = ["--models", "qwen2.5-0.5b", "--reps", "2", "--syncs", "3", "--budget-s", "60"]
    with contextlib.redirect_stdout(out):
        rc = gpu_vllm_rollout.main(args + (["--new-tokens", "16", "--eager"] if quick else []))
    rows = [line for line in out.getvalue().splitlines() if line.startswith("| qwen")]
    if rc != 0 or not rows:
        raise RuntimeError(f"gpu_vllm_rollout.py exited {rc} with no table row")
    return {"result": " / ".join(dict.fromkeys(rows)), "check": "-"}


SECTIONS = {
    "mfu": section_mfu,
    "fp8": section_fp8,
    "chunked_ce": section_chunked_ce,
    "vllm": section_vllm,
}
