"""vLLM vs `Policy.generate` on one GPU: rollout tokens/s and weight-sync time, bf16, at the shapes
of Qwen2.5-0.5B and Qwen2.5-1.5B.

Prepared for one NVIDIA H100 or H200; NOT run yet (no GPU where it was written): see
docs/benchmarks/rollout_throughput.md. It exits with a message when CUDA is absent.

What it does, per model shape (random weights from posttrain's own spec: no model hub):
  * `Policy.from_spec(spec, device="cuda", dtype=torch.bfloat16)`, with a tokenizer that has no
    stop ids (no engine stops early; decoded text is the ids, the vocabulary being 151,936);
  * `VLLMServer.start` from the official `vllm` venv (scripts/vllm-up.sh builds it where
    `nvidia-smi` works), with CUDA graphs (`--eager` turns them off) and
    `--gpu-memory-utilization` 0.5 by default (the policy shares the GPU);
  * two shapes, as in benchmarks/rollout_throughput.py: grouped (8 prompts x n=8) and distinct
    (64 prompts, n=1), random prompts of `--prompt-len` tokens, `--new-tokens` new tokens,
    temperature 1; one warm-up per engine, then `--reps` runs interleaved (vllm, builtin, ...);
    tokens/s counts the tokens each engine returned; the builtin engine's time includes
    `torch.cuda.synchronize()`;
  * weight sync: `server.sync_weights(policy)` `--syncs` times after one warm-up (save the bf16
    safetensors to /dev/shm, `reload_weights` in the server, reset its prefix cache); skipped,
    with the reason in the table, when /dev/shm has less free space than twice the weights.

Prints one Markdown table: tokens/s median [min-max] per engine and the paired ratio, and the
median sync time. It stops starting new model shapes after `--budget-s` seconds (default 420; the
whole run is meant to fit in 8 minutes: two server starts with CUDA graphs, ~1-2 minutes each).

Usage:
    python benchmarks/gpu_vllm_rollout.py                       # both shapes
    python benchmarks/gpu_vllm_rollout.py --models qwen2.5-0.5b --reps 2 --eager
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from generation import NoStopByteTokenizer
from pairs import Run, fmt, paired_ratios, rates, run_interleaved, spread
from rollout_throughput import SHAPES

from posttrain.models import get_preset
from posttrain.models.specs import ModelSpec

# Qwen2.5-1.5B's config.json numbers (qwen2.5-0.5b is a posttrain preset).
QWEN25_1_5B = ModelSpec(
    family="qwen2",
    vocab_size=151936,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    embed_dim=1536,
    intermediate_dim=8960,
    max_seq_len=32768,
    rope_base=1e6,
    norm_eps=1e-6,
    tie_word_embeddings=True,
)
MODELS = {"qwen2.5-0.5b": get_preset("qwen2.5-0.5b"), "qwen2.5-1.5b": QWEN25_1_5B}

HEADER = (
    "| model | prompts x n | vllm tok/s | builtin tok/s | vllm/builtin | sync s (reload s) |\n"
    "|---|---|---:|---:|---:|---:|"
)


class IdTokenizer(NoStopByteTokenizer):
    """No stop ids; decodes ids as their numbers (the model's vocabulary exceeds the bytes')."""

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3, help="timed runs per engine and shape")
    parser.add_argument("--syncs", type=int, default=3, help="timed weight syncs per model")
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--budget-s", type=float, default=420.0)
    args = parser.parse_args(argv)
    for name in ("prompt_len", "new_tokens", "reps", "syncs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.05 <= args.gpu_memory_utilization <= 0.9:
        parser.error("--gpu-memory-utilization must be in [0.05, 0.9] (the policy shares the GPU)")
    return args


def row(model: str, shape: str, runs: dict[str, list[Run]], sync: str) -> str:
    """One Markdown row: tokens/s median [min, max] per engine, the paired ratio, the sync."""
    speed = " | ".join(fmt(*spread(rates(runs[e]))) for e in ("vllm", "builtin"))
    ratio = fmt(*spread(paired_ratios(runs["vllm"], runs["builtin"])), digits=2, unit="x")
    return f"| {model} | {shape} | {speed} | {ratio} | {sync} |"


def sync_cell(syncs: list) -> str:
    """'total [reload]' medians, in seconds, of `WeightSync`s (the warm-up left out already)."""
    total = statistics.median(s.total_s for s in syncs)
    reload = statistics.median(s.reload_s for s in syncs)
    return f"{total:.3f} ({reload:.3f})"


def shm_refusal(nbytes: int, root: str = "/dev/shm") -> str | None:
    """Why weight sync cannot be timed here (a sentence), or None when `root` has room."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return f"skipped: no {root}"
    if free < 2 * nbytes:
        return f"skipped: {root} has {free / 2**30:.1f} GiB free, needs {2 * nbytes / 2**30:.1f}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_vllm_rollout.py needs a CUDA GPU (torch.cuda.is_available() is False; this torch "
            f"is {torch.__version__}); nothing was measured.",
            file=sys.stderr,
        )
        return 2
    from rollout_throughput import engines_for

    from posttrain.policy import Policy
    from posttrain.policy.vllm_server import VLLMServer, vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason is not None:
        print(f"gpu_vllm_rollout.py needs the vLLM venv: {reason}", file=sys.stderr)
        return 2
    start = time.monotonic()
    most = max(s.prompts for s in SHAPES)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (most, args.prompt_len), generator=gen).tolist()
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {args.prompt_len} "
        f"prompt tokens, {args.new_tokens} new tokens, temperature 1, vLLM "
        f"{'eager' if args.eager else 'CUDA graphs'}, {args.reps} interleaved runs",
        flush=True,
    )
    rows = []
    for name in args.models:
        if time.monotonic() - start > args.budget_s:
            rows.append(f"| {name} | not run: --budget-s {args.budget_s:g} s spent | | | | |")
            continue
        policy = Policy.from_spec(
            MODELS[name], tokenizer=IdTokenizer(), seed=0, device="cuda", dtype=torch.bfloat16
        )
        policy.model.eval()
        label = f"{name} ({policy.num_parameters() / 1e9:.2f}B)"
        with (
            tempfile.TemporaryDirectory() as tmp,
            VLLMServer.start(
                policy,
                Path(tmp),
                enforce_eager=args.eager,
                max_concurrency=most,
                startup_timeout_s=600,
                extra_args=["--gpu-memory-utilization", str(args.gpu_memory_utilization)],
            ) as server,
        ):
            print(f"## {label}: server up after {time.monotonic() - start:.0f} s", flush=True)
            nbytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
            sync = shm_refusal(nbytes)
            if sync is None:
                sync = sync_cell([server.sync_weights(policy) for _ in range(args.syncs + 1)][1:])
            for shape in SHAPES:
                engines = engines_for(
                    policy, server, None, prompts[: shape.prompts], shape.n, args.new_tokens
                )
                builtin = engines["builtin"]

                def synced(seed: int, fn=builtin) -> int:
                    tokens = fn(seed)
                    torch.cuda.synchronize()
                    return tokens

                runs = run_interleaved({"vllm": engines["vllm"], "builtin": synced}, args.reps)
                rows.append(row(label, f"{shape.prompts} x {shape.n}", runs, sync))
                print(rows[-1], flush=True)
        del policy
        torch.cuda.empty_cache()
    print(f"\n{HEADER}\n" + "\n".join(rows))
    print(f"\n# {time.monotonic() - start:.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
