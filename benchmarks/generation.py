"""Generation throughput: `Policy.generate` vs a naive no-cache loop vs transformers `generate`.

All three run side by side in one process on the same weights: a tiny-10m Qwen2 (posttrain preset,
~10M parameters, byte vocabulary) with matrices drawn from N(0, 0.02) (transformers'
`initializer_range`); the transformers model is `Qwen2ForCausalLM.from_pretrained` of the folder
`Policy.save` writes, and its logits are checked against the torchtune model before timing.
Machines here are shared: the cases run round-robin (`pairs.run_interleaved`: one warm-up each,
then rep 1 of every case, rep 2 of every case, ...) so load falls on all alike; medians, best runs,
CPU seconds and each method's per-round ratio to transformers greedy (tokens per wall second and
per CPU second, median [min, max]) are reported.

Work is fixed so tokens/s compare like for like: batch 32 prompts of 32 tokens, 64 new tokens
each, no early stop (stop ids disabled on every side), fp32, 2 threads. Greedy rows also check that
the three produce the same tokens.

Usage:
    python benchmarks/generation.py            # writes docs/benchmarks/generation.{md,png}
    python benchmarks/generation.py --reps 3 --naive-reps 1 --out /tmp/gen   # quicker
    python benchmarks/generation.py --batch 128 --group-size 8 --prompt-len 48 --new-tokens 8 \
        --out docs/benchmarks/generation_grouped   # GRPO's shape: 16 prompts x G=8, short answers

With --group-size G, the batch is batch/G distinct prompts sampled G times each: `Policy.generate`
prefills each distinct prompt once and copies its KV-cache rows to the G samples (prefix
sharing); transformers `generate` gets the G copies as separate rows, as TRL's GRPOTrainer
passes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from pairs import ratio_cells, run_interleaved

from posttrain.models import ByteTokenizer
from posttrain.policy import Policy

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


@dataclasses.dataclass(frozen=True)
class NoStopByteTokenizer(ByteTokenizer):
    """ByteTokenizer without stop ids, so every method generates exactly `max_new_tokens`."""

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset()


NAIVE = "naive loop (no KV cache), greedy"


def make_policy(seed: int = 0) -> Policy:
    policy = Policy.from_spec("tiny-10m", tokenizer=NoStopByteTokenizer(), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in policy.model.parameters():
            if w.ndim >= 2:
                w.copy_(torch.randn(w.shape, generator=g) * 0.02)
    policy.model.eval()
    return policy


def make_hf_model(policy: Policy, folder: Path):
    from transformers import Qwen2ForCausalLM

    policy.save(folder)
    hf = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # fixed work: never stop early
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(ids).logits - policy.model(ids)).abs().max().item()
    assert diff < 1e-4, f"transformers and torchtune logits differ by {diff}"
    return hf


@torch.inference_mode()
def naive_generate(model, prompt_BP: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy without a KV cache: the whole sequence goes through the model at every step."""
    tokens = prompt_BP
    for _ in range(max_new_tokens):
        next_B1 = model(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_B1], dim=1)
    return tokens[:, prompt_BP.shape[1] :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="G: batch/G distinct prompts, each sampled G times as in GRPO "
        "(Policy.generate(prompts, n=G); transformers gets the G copies as rows, "
        "as TRL's GRPOTrainer passes them)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--naive-reps", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DOCS / "generation")
    args = parser.parse_args(argv)

    import transformers

    torch.set_num_threads(args.threads)
    B, P, N, G = args.batch, args.prompt_len, args.new_tokens, args.group_size
    if G < 1 or B % G:
        parser.error(f"--group-size {G} must be >= 1 and divide --batch {B}")
    policy = make_policy()
    distinct = torch.randint(0, 256, (B // G, P), generator=torch.Generator().manual_seed(0))
    prompts_BP = distinct.repeat_interleave(G, dim=0)
    prompt_lists = distinct.tolist()
    ones_BP = torch.ones_like(prompts_BP)

    with tempfile.TemporaryDirectory() as tmp:
        hf = make_hf_model(policy, Path(tmp) / "ckpt")

    def ours(**kw):
        return lambda: [
            c.token_ids for c in policy.generate(prompt_lists, n=G, max_new_tokens=N, **kw)
        ]

    def theirs(**kw):
        def run():
            with torch.inference_mode():
                out = hf.generate(
                    input_ids=prompts_BP,
                    attention_mask=ones_BP,
                    max_new_tokens=N,
                    pad_token_id=256,
                    **kw,
                )
            return out[:, P:].tolist()

        return run

    sample = dict(temperature=1.0, top_p=0.9)
    cases = {
        "Policy.generate, greedy": ours(temperature=0),
        "transformers generate, greedy": theirs(do_sample=False),
        NAIVE: lambda: naive_generate(policy.model, prompts_BP, N).tolist(),
        "Policy.generate, T=1 top_p=0.9": ours(seed=0, **sample),
        "transformers generate, T=1 top_p=0.9": theirs(do_sample=True, top_k=None, **sample),
    }
    outputs: dict[str, list[list[int]]] = {}

    def contender(label):
        def run(_seed: int) -> int:
            outputs[label] = cases[label]()
            return sum(len(t) for t in outputs[label])  # the tokens generated

        return run

    load_before = os.getloadavg()[0]
    runs = run_interleaved(
        {label: contender(label) for label in cases},
        {label: args.naive_reps if label == NAIVE else args.reps for label in cases},
        # the naive loop (slow; the model is warm by then) makes no warm-up run
        warmup=[label for label in cases if label != NAIVE],
    )
    load_after = os.getloadavg()[0]
    rows = []
    for label, rs in runs.items():
        assert all(len(t) == N for t in outputs[label]), f"{label}: a sequence stopped early"
        wall = statistics.median(r.wall_s for r in rs)
        rows.append((label, wall, B * N / wall, min(r.wall_s for r in rs),
                     statistics.median(r.cpu_s for r in rs)))  # fmt: skip
    greedy = [v for k, v in outputs.items() if "greedy" in k]
    same = all(g == greedy[0] for g in greedy)
    hf_runs = runs["transformers generate, greedy"]
    # per round: a method's tokens/s over transformers greedy's in the same round
    versus = {label: ratio_cells(rs, hf_runs[: len(rs)]) for label, rs in runs.items()}

    group = f" ({B // G} prompts x G={G} samples)" if G > 1 else ""
    setup = (
        f"tiny-10m Qwen2 ({policy.num_parameters() / 1e6:.2f}M params), batch {B}{group}, "
        f"prompt {P} tokens, {N} new tokens, fp32, {args.threads} threads, {args.reps} runs "
        f"each ({args.naive_reps} for the naive loop), round-robin, after a warm-up run; "
        f"'vs transformers greedy': tokens per wall / CPU second over transformers greedy's in "
        f"the same round, median [min, max] over rounds; OpenMP wait policy "
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset (OpenMP default)')}; torch "
        f"{torch.__version__}, transformers {transformers.__version__}"
    )
    setup += f"; 1-min load average {load_before:.1f} before, {load_after:.1f} after"
    lines = [
        "| method | median s | tokens/s (median) | best s | CPU s (median) | "
        "vs transformers greedy, wall | vs transformers greedy, CPU |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {label} | {s:.3f} | {tps:,.0f} | {best:.3f} | {cpu:.2f} | {versus[label]['wall']} "
        f"| {versus[label]['cpu']} |"
        for label, s, tps, best, cpu in rows
    ]
    table = "\n".join(lines)
    text = f"{setup}\n\n{table}\n\nGreedy tokens identical across the three methods: {same}\n"
    print("\n" + text)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    _plot(rows, setup, args.out.with_suffix(".png"), B * N)
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")
    return 0 if same else 1


def _plot(rows, setup: str, path: Path, n_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r[0].replace(", ", "\n") for r in rows]
    values = [r[2] for r in rows]
    colors = [
        "tab:blue"
        if r[0].startswith("Policy")
        else "tab:orange"
        if r[0].startswith("transformers")
        else "tab:gray"
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    best = [n_tokens / r[3] for r in rows]
    bars = ax.barh(labels[::-1], values[::-1], color=colors[::-1], label="median run")
    ax.scatter(
        best[::-1], labels[::-1], marker="|", s=300, color="black", label="best run", zorder=3
    )
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values[::-1]], padding=3)
    ax.legend(loc="center right", fontsize=8)
    ax.set_xlabel("generated tokens / s (higher is better)")
    ax.set_xlim(0, max(values + best) * 1.15)
    ax.set_title("Generation throughput, tiny-10m Qwen2, CPU fp32", fontsize=11)
    fig.text(0.01, 0.01, setup, fontsize=6.5, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
