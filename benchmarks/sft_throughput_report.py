"""The report of `benchmarks/sft_throughput.py`: from the step times the benchmark measured
(each side's blocks, the interleaved step pairs, the matmul peak) to tokens/s and MFU per side,
the text it prints (machine, setup, the table and the ratios), docs/benchmarks/sft_throughput.md
around that text (what tokens/s counts, how TRL is configured and why, where the time goes) and
the bar chart beside it. The measurement itself is in `sft_throughput.py`.
"""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from timing import cpu_model

from posttrain.core.timing import mfu, step_flops
from posttrain.models import ModelSpec

if TYPE_CHECKING:
    from sft_throughput import Setup


@dataclass(frozen=True)
class Measured:
    """What one run of the benchmark measured, and how it was run.

    `blocks`: side ("posttrain", "TRL") -> one list per block of the seconds of each timed
    step; `interleaved`: (posttrain, TRL) seconds of each interleaved step after the warm-up,
    or None without `--interleave`; `peak`: `posttrain.core.timing.matmul_peak_flops()` of
    the run, FLOP/s;
    `logit_diff`: max |logit difference| of the two models; `load_start`: the 1-minute load
    average when the run started; `argv`: the command's arguments as given.
    """

    preset: str
    spec: ModelSpec
    setup: Setup
    n_params: int
    n_nonembed: int
    logit_diff: float
    blocks: dict[str, list[list[float]]]
    interleaved: tuple[list[float], list[float]] | None
    peak: float
    same_optimizer: bool
    interleave: int
    load_start: float
    argv: list[str]


def step_model_flops(m: Measured) -> int:
    """Model FLOPs of one optimizer step by the convention of docs/benchmarks/README.md
    (`posttrain.core.timing.step_flops`): B x (T - 1) trained tokens, each in a sequence of T."""
    setup, spec = m.setup, m.spec
    trained = setup.batch_size * (setup.seq_len - 1)
    return step_flops(
        m.n_nonembed,
        trained,
        span=setup.seq_len * trained,
        num_layers=spec.num_layers,
        attn_dim=spec.num_heads * (spec.attention_head_dim or spec.embed_dim // spec.num_heads),
        kind="train",
    )


def side_stats(m: Measured) -> dict[str, dict]:
    """Per side: tokens/s of the median, slowest and fastest block ("median", "lo", "hi"), of the
    fastest step ("best"), of each block ("blocks"), of the median interleaved step ("inter"),
    and the MFU of each ("mfu", "mfu_best", "mfu_inter": `step_model_flops` per step x steps/s
    / the run's peak, `posttrain.core.timing.mfu`)."""
    setup, peak, per_step = m.setup, m.peak, step_model_flops(m)

    def utilisation(tokens_per_s: float) -> float:  # steps/s = tokens/s / tokens per step
        return mfu(per_step, setup.tokens_per_step / tokens_per_s, peak_flops_per_s=peak)

    stats: dict[str, dict[str, Any]] = {}
    for name, blocks in m.blocks.items():
        block_tps = [setup.tokens_per_step / statistics.median(d) for d in blocks]
        best_tps = setup.tokens_per_step / min(min(d) for d in blocks)
        stats[name] = dict(
            median=statistics.median(block_tps),
            lo=min(block_tps),
            hi=max(block_tps),
            best=best_tps,
            blocks=block_tps,
        )
    for st in stats.values():
        st["mfu"], st["mfu_best"] = (utilisation(st[k]) for k in ("median", "best"))
    if m.interleaved is not None:
        for name, secs in zip(("posttrain", "TRL"), m.interleaved):
            stats[name]["inter"] = setup.tokens_per_step / statistics.median(secs)
            stats[name]["mfu_inter"] = utilisation(stats[name]["inter"])
    return stats


def results_text(m: Measured, stats: dict[str, dict]) -> str:
    """The machine and setup lines, the table of `stats` and the ratios of the two sides."""
    import transformers
    import trl

    setup, spec, peak = m.setup, m.spec, m.peak
    n_nonembed, inter = m.n_nonembed, m.interleaved
    trained = setup.batch_size * (setup.seq_len - 1)
    attention = step_model_flops(m) - 6 * n_nonembed * trained
    ours_st, trl_st = stats["posttrain"], stats["TRL"]
    ratio, ratio_best = ours_st["median"] / trl_st["median"], ours_st["best"] / trl_st["best"]
    pair_ratios = [p / t for p, t in zip(ours_st["blocks"], trl_st["blocks"])]
    step_ratios = [t / p for p, t in zip(*inter)] if inter is not None else []
    ratio_inter = statistics.median(step_ratios) if step_ratios else 0.0

    cpu = cpu_model(isa=True)
    trl_opt = (
        "torch.optim.AdamW (same as posttrain)"
        if m.same_optimizer
        else "its default `adamw_torch_fused` (torch.optim.AdamW(fused=True))"
    )
    setup_lines = [
        f"- CPU: {cpu}; {setup.threads} threads (`torch.set_num_threads`), fp32",
        f"- Versions: Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, trl {trl.__version__}",
        f"- Model: `{m.preset}` (Qwen2, {spec.num_layers} layers, d_model {spec.embed_dim}, "
        f"{spec.num_heads} heads / {spec.num_kv_heads} KV heads, MLP {spec.intermediate_dim}, "
        f"vocab {spec.vocab_size}, tied embeddings): {m.n_params:,} parameters, {n_nonembed:,} "
        f"non-embedding; max |logit diff| torchtune vs transformers {m.logit_diff:.1e}",
        f"- Batch: {setup.batch_size} rows x {setup.seq_len} tokens = {setup.tokens_per_step:,} "
        f"tokens per optimizer step ({setup.batch_size * (setup.seq_len - 1):,} trained), no "
        f"padding, no packing, gradient accumulation 1",
        f"- Optimizer: AdamW lr {setup.lr:g}, weight decay 0, constant lr, clip grad norm "
        f"{setup.max_grad_norm:g}; posttrain torch.optim.AdamW (for-loop on CPU), TRL {trl_opt}",
        f"- Timing: {setup.repeats} alternating block pairs (posttrain, then TRL), each block "
        f"{setup.warmup} warm-up + {setup.steps} timed optimizer steps; a block's tokens/s = "
        f"B x T / its median step time; the table gives the median, min and max over blocks"
        + (
            f"; then {m.interleave} step pairs interleaved step by step (after "
            f"{setup.warmup} warm-up pairs)"
            if m.interleave
            else ""
        ),
        f"- Load average (1 min) at start / end: {m.load_start:.2f} / {os.getloadavg()[0]:.2f} "
        f"on {os.cpu_count()} CPUs (other processes share this machine)",
        f"- Command: `python benchmarks/sft_throughput.py {' '.join(m.argv)}`",
        f"- Peak: `posttrain.core.timing.matmul_peak_flops()` of this run (one thread's fp32 "
        f"1024 x 1024 matmul rate in its CPU seconds x {setup.threads} threads): "
        f"{peak / 1e9:.1f} GFLOP/s",
    ]
    cols = [
        ("tokens/s, median block", lambda st: f"{st['median']:,.0f}"),
        ("blocks min - max", lambda st: f"{st['lo']:,.0f} - {st['hi']:,.0f}"),
        ("tokens/s, fastest step", lambda st: f"{st['best']:,.0f}"),
    ]
    if inter is not None:
        cols.append(("tokens/s, interleaved (median step)", lambda st: f"{st['inter']:,.0f}"))
    cols += [
        ("MFU, median block", lambda st: f"{st['mfu']:.0%}"),
        ("MFU, fastest step", lambda st: f"{st['mfu_best']:.0%}"),
    ]
    if inter is not None:
        cols.append(("MFU, interleaved", lambda st: f"{st['mfu_inter']:.0%}"))
    lines = ["| trainer | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---:|" * len(cols)]
    lines += [f"| {n} | " + " | ".join(f(st) for _, f in cols) + " |" for n, st in stats.items()]
    summary = (
        f"posttrain / TRL: **{ratio:.2f}x** (median blocks; per block pair "
        f"{', '.join(f'{x:.2f}' for x in pair_ratios)}), {ratio_best:.2f}x (fastest "
        "steps)"
    )
    if inter is not None:
        summary += (
            f", **{ratio_inter:.2f}x** (interleaved: median over {len(step_ratios)} "
            f"neighbouring step pairs of TRL step time / posttrain step time; quartiles "
            f"{_quartiles(step_ratios)})"
        )
    summary += (
        f".\n\nMFU (docs/benchmarks/README.md, Conventions) = (6 x {n_nonembed:,} non-embedding "
        f"parameters + 12 x {spec.num_layers} layers x T = {setup.seq_len} x d_attn) per "
        f"trained token x trained tokens/s / {peak / 1e9:.0f} GFLOP/s; the attention term is "
        f"{attention / (6 * n_nonembed * trained):.1%} of the 6 N term here."
    )
    return "\n".join(setup_lines) + "\n\n" + "\n".join(lines) + "\n\n" + summary + "\n"


def _quartiles(values: list[float]) -> str:
    """ "Q1 - Q3" of `values`, within their range (the default method extrapolates past the
    smallest and largest of a few values)."""
    if len(values) == 1:
        values = values * 2
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return f"{q1:.2f} - {q3:.2f}"


def markdown(results: str, png_name: str, packed: str | None = None) -> str:
    """docs/benchmarks/sft_throughput.md: `results` (the printed text) with what the figures mean
    and the analysis around it; `png_name` is the bar chart beside it; `packed`: the text of
    the packed comparison (`sft_packed.report`), or None when it did not run."""
    return f"""# SFT throughput: posttrain `Trainer` vs TRL `SFTTrainer` (CPU)

Produced by `python benchmarks/sft_throughput.py` (`--quick`: smoke run; `--profile`: also prints
`torch.profiler` tables of 3 steps per side). Both sides train the same tiny-10m weights (saved by
`posttrain.models.hf.save_hf_checkpoint`, loaded by `AutoModelForCausalLM.from_pretrained`; logits
checked equal) on rows of exactly T random byte tokens, no padding, no packing.

**What tokens/s counts:** every token that goes through the model, B x T per optimizer step, on
both sides. Trained tokens are B x (T - 1) per step on both sides (posttrain shifts labels in the
dataset, TRL inside its loss; the last position of a row has no target), so the trained-token rate
is (T - 1) / T of every number below. Three estimates, because this 2-core machine is shared:
median block (alternating posttrain / TRL blocks), fastest step (closest to an unloaded machine),
and an interleaved phase (one TRL step, one posttrain step, ...: neighbouring steps see the same
load, the fairest ratio when the load changes).

![SFT throughput]({png_name})

{results.rstrip()}
{PACKED.format(packed=packed.rstrip()) if packed else ""}{ANALYSIS}"""


PACKED = """
## Packed variable-length rows: posttrain's packing vs TRL's padding-free path

`sft_packed.py` (run by the same command): documents of seeded random lengths, packed by
posttrain (next-fit into rows with a block-causal mask and a padding tail); TRL gets the very
same rows as pre-packed examples (`input_ids` + `seq_lengths`, what its own `packing=True`
produces) through its padding-free collator (`padding_free=True`: the step's rows flattened into
one row of only real tokens, position ids restarting per document, from which transformers
builds the block-causal mask for SDPA), in the same order (`train_sampling_strategy=
"sequential"`). Same weights, same plain AdamW on both sides (`torch.optim.AdamW`, for-loop).
tokens/s = real trained tokens (n - 1 per document of n tokens), the same count on both sides
(checked against each side's own batch); posttrain also runs its rows' padding tails, which TRL's
flattened row does not hold. The first step's loss is checked on both sides before any update:
same weights and tokens in fp32, so they differ only by rounding (RoPE, the two attention masks,
the order of the sum); the tolerance is 1e-4 nats.

{packed}

Reading (2026-12-07; 2 rows of 256 per step, documents of 16-192 tokens, tiny-10m, 1 thread at
nice 19, load average 19-25 on the 2 cores): posttrain trained 0.79x TRL's tokens per CPU second
(per block pair 0.76-0.83; by wall time 0.80x, swinging 0.65-1.10 with the load). The gap is
the padding: next-fit packing of documents up to 192 tokens into rows of 256 leaves 29% of
posttrain's positions as padding tails, and they run through every layer. Per position through
the model posttrain is ~13% cheaper (856 against 760 positions per CPU second: 1.41x the
positions for 1.26x the CPU seconds; the attention scores are alike, 362^2 against 2 x 256^2,
and TRL's loss also computes entropy and top-1 accuracy). Packing without
the tails (a step's documents in one flattened row under the block-causal mask, as TRL does, or
rows filled best-fit) would run up to 1 / 0.71 = 1.41x fewer positions per step; not applied
here. MFU by wall time is what the load left of the CPU; by CPU time it is 55% (posttrain) and
70% (TRL) of the measured one-thread peak, counting only real tokens' FLOPs.
"""

ANALYSIS = """
## How TRL is configured, and why

- `gradient_checkpointing=False`: TRL's `SFTConfig` defaults to `True`, which recomputes every
  layer's forward during backward (about a third more compute); posttrain does not checkpoint, so
  the default would compare different work.
- Pre-tokenized `input_ids` rows of exactly T tokens, `packing=False`, `padding_free=False`,
  `max_length=T`: TRL's collator pads nothing and its all-ones `attention_mask` is dropped by
  transformers, so both sides run SDPA's causal flash kernel with no mask tensor (posttrain's
  unpacked `SFTLoader` batches carry `attention_mask=None`).
- Optimizer: each side's default implementation (TRL: fused AdamW; posttrain's recipes: plain
  `torch.optim.AdamW`, the for-loop on CPU); `--same-optimizer` gives TRL posttrain's.
- TRL's per-step entropy and top-1 accuracy metrics (from its chunked LM head, two `.item()` per
  step) are part of its step and are kept.

## Where the time goes

`torch.profiler` (3 steps per side) and interleaved micro-benchmarks, load average <= 2 (this
benchmark alone), 2026-11-30. A step takes ~1.15 s on both sides: matmuls 68-71% of operator
time, SDPA flash attention forward + backward ~14%, the rest RMSNorm, RoPE, SwiGLU, residual adds
and the update. Same weights, same work, so the differences are small; all of them were found:

| per optimizer step | posttrain | TRL |
|---|---:|---:|
| model forward + backward, plain CE (torchtune `TransformerDecoder` vs transformers `Qwen2ForCausalLM`; 15 interleaved pairs, per-pair ratio 1.02, quartiles 1.01-1.03) | 1,126 ms | 1,102 ms |
| of which grouped-query attention: K/V copied to 8 heads, gradient summed back, vs SDPA `enable_gqa=True` (8 layers fwd + bwd: 188 vs 176 ms) | +12 ms | - |
| LM head + loss (TRL: chunked log-probs + entropy + top-1 accuracy, fwd 7 + bwd 12 ms) | 7 ms | 18 ms |
| AdamW update, 12M parameters (for-loop vs fused) | 16.0 ms | 5.6 ms |
| gradient norm + clipping | 6 ms | 5 ms |
| data fetch + collation | 0.5 ms | 1.6 ms |
| per-step bookkeeping (posttrain: RNG + loader snapshot for rollback, 3 scalars to Python, one metrics row) | < 0.1 ms | not measured apart |

Net: posttrain ~2% slower per step, matching the measured 0.97-0.99x. With `--same-optimizer`
(both sides the for-loop AdamW; same day, load average <= 2) the ratio was 1.00x (median blocks),
1.00x (fastest steps), 0.99x (interleaved). At small batches the fixed ~10 ms of the optimizer
weighs more (one `--quick` run, 2 x 64 tokens per step: 0.91x blocks, 0.97x interleaved). Not
causes here:
`.item()` / `float()` syncs (on CPU there is no device queue to drain; microseconds), metrics
overhead, attention-mask materialisation (no mask on either side), thread count (both run 2
threads; asserted after every block).

## Possible improvements to posttrain (measured, not applied)

1. `sdk/workflows/sft.py` and `sdk/workflows/rl.py` (the SFT and RL recipes), the
   `torch.optim.AdamW(...)` line: add `fused=True` (CPU and CUDA, torch >= 2.4): -10 ms per
   step (~0.9%). Fused rounds differently from the
   for-loop, so both legs of a resume test must use the same setting (they do if the recipe sets
   it).
2. Grouped-query attention without the copy: torchtune's `MultiHeadAttention.forward` expands K/V
   with `unsqueeze/expand/flatten` before SDPA. A posttrain attention subclass installed by
   `sdk/models.py::build_model` on every `layer.attn` when `num_kv_heads < num_heads`, calling
   `F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=..., enable_gqa=True)`,
   saves ~12 ms per step (~1%); generation pays the same copy per decoded token.
3. `sdk/losses.py::SFTCrossEntropy.__call__`: pass `input_pos=None` when
   `batch.attention_mask is None` (unpacked rows: positions are 0..T-1 anyway), so torchtune's
   RoPE slices its cache instead of gathering `cache[input_pos]` (16 index ops per forward);
   ~3 ms per forward, within noise.
4. `sdk/trainer.py::Trainer._optimizer_step`: the rollback snapshot `self.data.state_dict()` copies
   the loader's whole epoch order every step (`SFTLoader.state_dict` returns
   `list(self._order)`): 0.01 ms here, 3.9 ms per step at 1M samples. Snapshotting
   (epoch, offset, a reference to `_order`, which is replaced per epoch and never mutated) makes it
   O(1).

1 + 2 together (~22 ms per step, ~2%) would bring posttrain level with TRL or just above.

## Machine and load

This host reports AVX-512 (AMD EPYC family 25 model 17): its 2-thread fp32 matmul peak was 183-196
GFLOP/s when quiet (wall time of a 2048 x 2048 `torch.mm`), above the ~150 GFLOP/s of the AVX2
hosts in `shared/FACTS.md`; MFU is taken against the peak measured in the same run
(`matmul_peak_flops`: one thread's rate in its CPU seconds x the threads, so a busy machine does
not lower it).

When other jobs share the 2 cores (load average 4-6), 2-thread steps of either side stall for 5-10
s at random (an op's OpenMP threads wait for each other when one is descheduled): blocks then vary
up to 5x and the sides swap places. The script warns when the 1-minute load average at start
exceeds the number of CPUs, and records it; compare only runs taken near load average <= 2 (this
benchmark alone, whose 2 threads count 2).
"""


def plot(m: Measured, stats: dict[str, dict], path: Path) -> None:
    """The bar chart of tokens/s per side (median block, whiskers min-max, the fastest step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setup, peak = m.setup, m.peak / 1e9
    names = list(stats)
    med = [stats[n]["median"] for n in names]
    errs = [
        [stats[n]["median"] - stats[n]["lo"] for n in names],
        [stats[n]["hi"] - stats[n]["median"] for n in names],
    ]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    bars = ax.bar(names, med, yerr=errs, capsize=4, color=["tab:blue", "tab:orange"], width=0.5)
    ax.bar_label(
        bars,
        labels=[f"{stats[n]['median']:,.0f} tok/s\nMFU {stats[n]['mfu']:.0%}" for n in names],
        padding=3,
        fontsize=9,
        label_type="center",
        color="white",
    )
    ax.scatter(
        names,
        [stats[n]["best"] for n in names],
        marker="_",
        s=400,
        color="black",
        zorder=3,
        label="fastest step",
    )
    ax.set_ylabel("tokens / s (higher is better)")
    ax.set_ylim(0, max(max(stats[n]["hi"], stats[n]["best"]) for n in names) * 1.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(
        f"SFT step throughput, {m.preset}, {setup.batch_size} x {setup.seq_len} tokens, "
        f"fp32, {setup.threads} threads\nbars: median of {setup.repeats} blocks "
        f"(whiskers min-max); MFU vs matmul peak {peak:.0f} GFLOP/s",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
