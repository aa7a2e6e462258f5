"""SFT model FLOPs utilisation (MFU) of the qwen2.5-0.5b spec in bf16 on one GPU under FSDP2.

Prepared for one NVIDIA H200; NOT run yet (no GPU where it was written): see
docs/benchmarks/parallel_memory.md. It exits with a message when CUDA is absent.

What it does:
  * a 1-rank NCCL process group and a 1-D DeviceMesh ("dp_shard",) of size 1;
  * the `qwen2.5-0.5b` ModelSpec (494M parameters, tied embeddings, vocabulary 151,936) built by
    `posttrain.models.build_model` on the GPU in fp32, random weights (it measures speed only);
  * optionally `torch.compile` of every transformer block (torchtune's `training.compile_model`
    does the same per-block compile), then `fully_shard` of every block and of the root with
    `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`. `ParallelPlan(dp_shard=1)`
    would not apply FSDP (posttrain wraps only when the data-parallel size exceeds 1), so the
    script calls `fully_shard` itself: on one rank nothing is sharded, FSDP2 keeps fp32 master
    weights and gathers bf16 copies for compute, the code path of a multi-GPU run;
  * SFT steps on random tokens: B rows of exactly T tokens, every next token trained,
    `posttrain.train.token_cross_entropy_sum` / trained tokens (fp32 log-softmax over the full
    vocabulary), backward, clipping at 1.0, fused AdamW (lr 1e-5, weight decay 0), zero_grad.

Reported: tokens/s over the timed steps (CUDA-synchronised wall time), MFU = 6 x N x tokens/s /
peak with N = all 494M parameters (the tied embedding is the LM-head matmul, so counting it counts
that matmul; the embedding lookup itself is free), and the same with the causal attention FLOPs
(6 x L x T x D per token: the 12 L T D of PaLM, Chowdhery et al. 2022, appendix B, halved for the
causal mask) added. Peak: 989 TFLOP/s dense bf16 for an H200 SXM (NVIDIA H200 Tensor Core GPU
datasheet lists 1,979 TFLOP/s bf16 with 2:4 sparsity; dense is half). Also the peak CUDA memory
against `posttrain.train.memory_plan.plan_memory`. Target: MFU >= 45%.

Usage:
    python benchmarks/gpu_mfu_fsdp.py                      # B=8, T=2048, compile, ~3-5 min
    python benchmarks/gpu_mfu_fsdp.py --no-compile --steps 10
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

H200_BF16_DENSE_FLOPS = 989e12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step (default 8)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per row (default 2048)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps (compile included)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--no-compile", action="store_true", help="eager blocks")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=H200_BF16_DENSE_FLOPS / 1e12,
        help="dense bf16 peak of the GPU (default 989, H200 SXM)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="stop the timed steps after this many seconds in all (default 420)",
    )
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_mfu_fsdp.py needs a CUDA GPU (torch.cuda.is_available() is False; this torch is "
            f"{torch.__version__}); nothing was measured.",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from posttrain.models import build_model, get_preset
    from posttrain.train import ParallelPlan, token_cross_entropy_sum
    from posttrain.train.memory_plan import MemoryBatch, plan_memory

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        spec = get_preset("qwen2.5-0.5b").replace(max_seq_len=max(args.seq_len, 2048))
        B, T = args.batch_size, args.seq_len
        model = build_model(spec, device="cuda", seed=0)
        n_params = sum(p.numel() for p in model.parameters())
        if args.activation_checkpointing:
            from torchtune.modules import TransformerSelfAttentionLayer
            from torchtune.training import set_activation_checkpointing

            set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
        if not args.no_compile:
            for layer in model.layers:
                layer.compile()
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp_shard",))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
        g = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.randint(0, spec.vocab_size, (B, T + 1), device="cuda", generator=g)
        inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

        def step() -> None:
            logits = model(inputs)
            loss_sum, n = token_cross_entropy_sum(logits, labels)
            del logits
            (loss_sum / n).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        print(
            f"qwen2.5-0.5b: {n_params / 1e6:.1f}M parameters, B={B} T={T}, bf16 FSDP2 on 1 GPU "
            f"({torch.cuda.get_device_name(0)}), compile={not args.no_compile}, "
            f"activation checkpointing={args.activation_checkpointing}",
            flush=True,
        )
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        print(f"warm-up: {args.warmup} steps in {time.perf_counter() - t0:.1f} s", flush=True)
        torch.cuda.reset_peak_memory_stats()
        times: list[float] = []
        for _ in range(args.steps):
            if time.perf_counter() - start > args.budget_s:
                print(
                    f"stopping after {len(times)} timed steps: --budget-s {args.budget_s} reached"
                )
                break
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        if not times:
            print("no timed step fit in the budget", file=sys.stderr)
            return 1
        tokens_per_s = B * T * len(times) / sum(times)
        peak = args.peak_tflops * 1e12
        mfu = 6 * n_params * tokens_per_s / peak
        attn = 6 * spec.num_layers * T * spec.embed_dim * tokens_per_s / peak
        plan = ParallelPlan(
            param_dtype="bfloat16",
            reduce_dtype="float32",
            activation_checkpointing=args.activation_checkpointing,
        )
        predicted = plan_memory(
            spec, plan, MemoryBatch(micro_batch_size=B, seq_len=T), device_type="cuda"
        ).attrs["peak_bytes"]
        measured = torch.cuda.max_memory_allocated()
        print(
            f"timed steps: {len(times)}, median {sorted(times)[len(times) // 2] * 1e3:.1f} ms, "
            f"{tokens_per_s:,.0f} tokens/s"
        )
        print(
            f"MFU (6N): {mfu:.1%} of {args.peak_tflops:.0f} TFLOP/s; with causal attention "
            f"FLOPs: {mfu + attn:.1%}; target >= 45%: {'met' if mfu >= 0.45 else 'NOT met'}"
        )
        print(
            f"peak CUDA memory allocated {measured / 2**30:.1f} GiB; plan_memory predicts "
            f"{predicted / 2**30:.1f} GiB (no FSDP buffers: it counts FSDP from 2 ranks) "
            f"(ratio {measured / predicted:.2f}); total {time.perf_counter() - start:.0f} s"
        )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
