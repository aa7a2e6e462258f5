"""SFT training throughput: posttrain `Trainer` vs TRL `SFTTrainer` on the same tiny-10m weights.

Both sides train the same model, side by side in one process: the posttrain `tiny-10m` preset (Qwen2,
byte vocabulary of 272, ~12M parameters, tied embeddings) built with `build_model(seed=0)`, and the
`Qwen2ForCausalLM` that transformers loads (`AutoModelForCausalLM.from_pretrained`) from the folder
`posttrain.models_hf.save_hf_checkpoint` writes; their logits are checked to agree before timing.

Same work per optimizer step on both sides: B rows of exactly T random byte tokens (no padding, no
packing, every next token trained: B x (T - 1) trained tokens, B x T tokens through the model),
fp32, full causal attention, AdamW at the same lr (weight decay 0, betas and eps at their torch
defaults), constant lr, gradient clipping at 1.0, gradient accumulation 1, no evaluation, no
checkpoints, no logging. TRL gets pre-tokenized `input_ids` rows with `packing=False`,
`padding_free=False`, `max_length=T`, `use_cpu=True`, `report_to=[]`, `logging_strategy="no"`,
`dataloader_num_workers=0` and otherwise its defaults (its optimizer is then `adamw_torch_fused`,
TRL's default since torch 2.8; posttrain's recipes build a plain `torch.optim.AdamW`, which on CPU
is the for-loop implementation). `--same-optimizer` gives TRL posttrain's optimizer instead.

Timing: a step's time runs from the end of the previous optimizer step to the end of this one (data
fetch, forward, backward, clipping, update and each framework's per-step bookkeeping included);
a block's tokens/s = B x T / median step time of its `--steps` timed steps, after `--warmup`
untimed ones. Blocks alternate, posttrain then TRL, `--repeats` times, with a matmul peak
measurement (best of several `torch.mm` of 2048 x 2048 fp32) before each pair; the median block is
reported. MFU = 6 x non-embedding parameters x tokens/s / peak FLOP/s (Kaplan et al. 2020, eq. 2.1:
attention-score and LM-head FLOPs not counted; the `MFU incl. attention` column adds
6 x (n_layers x T x d_model + d_model x vocab) per token, the causal-halved score and value matmuls
and the LM head).

Usage:
    python benchmarks/sft_throughput.py                  # writes docs/benchmarks_sft.{md,png}
    python benchmarks/sft_throughput.py --quick          # < 60 s smoke run, nothing written
    python benchmarks/sft_throughput.py --profile        # also a torch.profiler table of each side
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.data import Sample, SFTLoader
from posttrain.models import build_model, get_preset
from posttrain.models_hf import save_hf_checkpoint
from posttrain.tokenizer import ByteTokenizer
from posttrain.trainer import Trainer

DOCS = Path(__file__).resolve().parents[1] / "docs"
PRESET = "tiny-10m"


@dataclass(frozen=True)
class Setup:
    batch_size: int
    seq_len: int
    warmup: int
    steps: int
    repeats: int
    threads: int
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    seed: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


# --------------------------------------------------------------------------------------------
# Peak
# --------------------------------------------------------------------------------------------


def matmul_gflops(n: int = 2048, reps: int = 8) -> float:
    """Best GFLOP/s of `torch.mm` on two n x n fp32 matrices (2 n^3 FLOP per call)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


# --------------------------------------------------------------------------------------------
# The two sides
# --------------------------------------------------------------------------------------------


def make_rows(setup: Setup, num_rows: int) -> list[list[int]]:
    """`num_rows` rows of exactly `seq_len` random byte ids (0..255: no special id, no padding)."""
    g = torch.Generator().manual_seed(setup.seed)
    return torch.randint(0, 256, (num_rows, setup.seq_len), generator=g).tolist()


class StepClock:
    """`perf_counter()` at the end of every optimizer step (after the update)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def tick(self) -> None:
        self.times.append(time.perf_counter())

    def throughput(self, setup: Setup) -> float:
        """Tokens/s of the block: tokens per step / median duration of the timed steps (the
        steps after the warm-up ones; a median, so a burst of load on this shared machine that
        hits one or two steps does not move it)."""
        assert len(self.times) == setup.warmup + setup.steps, (len(self.times), setup)
        timed = self.times[setup.warmup - 1:]
        durations = [b - a for a, b in zip(timed, timed[1:])]
        return setup.tokens_per_step / statistics.median(durations)


def build_posttrain(model: torch.nn.Module, rows: list[list[int]], setup: Setup):
    samples = [Sample.from_loss_mask(r, [True] * len(r)) for r in rows]
    loader = SFTLoader(samples, batch_size=setup.batch_size, seed=setup.seed,
                       pad_id=ByteTokenizer.PAD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)
    clock = StepClock()
    trainer = Trainer(model, optimizer, data=loader, max_grad_norm=setup.max_grad_norm,
                      progress=False, seed=setup.seed, callbacks=[lambda _t, _row: clock.tick()])
    return trainer, clock


def run_posttrain_block(trainer: Trainer, clock: StepClock, setup: Setup) -> float:
    clock.times.clear()
    trainer.fit(trainer.step_count + setup.warmup + setup.steps)
    rows = trainer.metrics.tail(setup.steps)
    assert (rows["trained_tokens"] == setup.batch_size * (setup.seq_len - 1)).all()
    return clock.throughput(setup)


def hf_byte_tokenizer():
    """A transformers tokenizer with the byte tokenizer's 272 ids: TRL only reads its pad token
    (the data arrive as token ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = ByteTokenizer()
    vocab = {f"<0x{i:02X}>": i for i in range(256)}
    vocab.update({tok.token_name(i): i for i in range(256, tok.vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|pad|>",
                                   eos_token="<|eos|>", bos_token="<|bos|>")


def build_trl(folder: Path, rows: list[list[int]], setup: Setup, out_dir: Path,
              same_optimizer: bool):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    clock = StepClock()

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    config = SFTConfig(
        output_dir=str(out_dir), max_steps=setup.warmup + setup.steps,
        per_device_train_batch_size=setup.batch_size, gradient_accumulation_steps=1,
        learning_rate=setup.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=setup.max_grad_norm, max_length=setup.seq_len, packing=False,
        padding_free=False, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
        report_to=[],
        logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=setup.seed)
    optimizers = (None, None)
    if same_optimizer:
        optimizers = (torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0), None)
    trainer = SFTTrainer(model=model, args=config,
                         train_dataset=Dataset.from_dict({"input_ids": rows}),
                         processing_class=hf_byte_tokenizer(), callbacks=[Clock()],
                         optimizers=optimizers)
    return trainer, clock


def run_trl_block(trainer, clock: StepClock, setup: Setup) -> float:
    clock.times.clear()
    with contextlib.redirect_stdout(io.StringIO()):  # the end-of-train summary dict
        trainer.train()
    return clock.throughput(setup)


def check_same_model(tune_model: torch.nn.Module, hf_model: torch.nn.Module) -> float:
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf_model(ids).logits - tune_model(ids)).abs().max().item()
    assert diff < 1e-4, f"transformers and torchtune logits differ by {diff}"
    return diff


# --------------------------------------------------------------------------------------------
# Profile (optional): where each side's step time goes
# --------------------------------------------------------------------------------------------


def profile_side(run_steps) -> str:
    """torch.profiler table (CPU ops, by self time) of `run_steps()`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    flags = fields.get("Flags", "").split()
    isa = ", ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags)
    return f"{name} (family {fields.get('CPU family', '?').strip()}, model " \
           f"{fields.get('Model', '?').strip()}; {isa})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=None, help="rows per step (default 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 256)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps starting each block")
    parser.add_argument("--repeats", type=int, default=3, help="posttrain/TRL block pairs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--same-optimizer", action="store_true",
                        help="give TRL posttrain's torch.optim.AdamW instead of its fused default")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile a few steps of each side (torch.profiler)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run (< 60 s): batch 4 x 128 unless given, 1 repeat of 1 + 2 "
                        "steps, nothing written")
    parser.add_argument("--out", type=Path, default=DOCS,
                        help="folder for benchmarks_sft.md / .png (default docs/)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 2, 1, 1
    args.batch_size = args.batch_size or (4 if args.quick else 8)
    args.seq_len = args.seq_len or (128 if args.quick else 256)
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--warmup, --steps and --repeats must be >= 1")

    import transformers
    import trl

    load = os.getloadavg()
    if load[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load[0]:.1f} on {os.cpu_count()} CPUs; other processes will "
              "skew the blocks (seen: up to 5x between sides)", flush=True)
    argv_used = sys.argv[1:] if argv is None else argv

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    setup = Setup(batch_size=args.batch_size, seq_len=args.seq_len, warmup=args.warmup,
                  steps=args.steps, repeats=args.repeats, threads=args.threads)
    spec = get_preset(PRESET)
    if args.seq_len > spec.max_seq_len:
        parser.error(f"--seq-len {args.seq_len} exceeds {PRESET}'s max_seq_len {spec.max_seq_len}")

    model = build_model(spec, seed=setup.seed)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.tok_embeddings.weight.numel()
    n_nonembed = n_params - n_embed
    # Enough rows for every step of every block on one side, a multiple of the batch size.
    rows = make_rows(setup, setup.batch_size * max(64, (setup.warmup + setup.steps) * setup.repeats))

    with tempfile.TemporaryDirectory() as tmp:
        folder = save_hf_checkpoint(model, spec, Path(tmp) / "ckpt",
                                    bos_token_id=ByteTokenizer.BOS, eos_token_id=ByteTokenizer.EOS,
                                    pad_token_id=ByteTokenizer.PAD)
        trl_trainer, trl_clock = build_trl(folder, rows, setup, Path(tmp) / "trl_out",
                                           args.same_optimizer)
        diff = check_same_model(model, trl_trainer.model)
        ours, our_clock = build_posttrain(model, rows, setup)
        print(f"{PRESET}: {n_params / 1e6:.2f}M params ({n_nonembed / 1e6:.2f}M non-embedding); "
              f"max |logit diff| torchtune vs transformers {diff:.1e}; TRL optimizer "
              f"{type(trl_trainer.create_optimizer()).__name__}"
              f"{' (fused)' if trl_trainer.optimizer.defaults.get('fused') else ''}", flush=True)

        peaks, results = [], {"posttrain": [], "TRL": []}
        for r in range(setup.repeats):
            peaks.append(matmul_gflops())
            results["posttrain"].append(run_posttrain_block(ours, our_clock, setup))
            results["TRL"].append(run_trl_block(trl_trainer, trl_clock, setup))
            assert torch.get_num_threads() == setup.threads, torch.get_num_threads()
            print(f"repeat {r + 1}/{setup.repeats}: peak {peaks[-1]:6.1f} GFLOP/s | posttrain "
                  f"{results['posttrain'][-1]:7.0f} tok/s | TRL {results['TRL'][-1]:7.0f} tok/s",
                  flush=True)
        peaks.append(matmul_gflops())

        profiles = {}
        if args.profile:  # 1 warm-up + 3 profiled steps per side, after the timed blocks
            ours.fit(ours.step_count + 1)
            profiles["posttrain"] = profile_side(lambda: ours.fit(ours.step_count + 3))
            trl_trainer.args.max_steps = 1
            trl_trainer.train()
            trl_trainer.args.max_steps = 3
            profiles["TRL"] = profile_side(trl_trainer.train)

    peak = max(peaks)
    attn_flops_per_token = 6 * (spec.num_layers * setup.seq_len * spec.embed_dim
                                + spec.embed_dim * spec.vocab_size)
    table_rows = []
    for name, values in results.items():
        tps = statistics.median(values)
        mfu = 6 * n_nonembed * tps / (peak * 1e9)
        mfu_attn = (6 * n_nonembed + attn_flops_per_token) * tps / (peak * 1e9)
        table_rows.append((name, tps, min(values), max(values), mfu, mfu_attn))
    ratio = table_rows[0][1] / table_rows[1][1]
    pair_ratios = [p / t for p, t in zip(results["posttrain"], results["TRL"])]

    cpu = cpu_model()
    trl_opt = ("torch.optim.AdamW (same as posttrain)" if args.same_optimizer
               else "its default `adamw_torch_fused` (torch.optim.AdamW(fused=True))")
    setup_lines = [
        f"- CPU: {cpu}; {args.threads} threads (`torch.set_num_threads`), fp32",
        f"- Versions: Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, trl {trl.__version__}",
        f"- Model: `{PRESET}` (Qwen2, {spec.num_layers} layers, d_model {spec.embed_dim}, "
        f"{spec.num_heads} heads / {spec.num_kv_heads} KV heads, MLP {spec.intermediate_dim}, "
        f"vocab {spec.vocab_size}, tied embeddings): {n_params:,} parameters, {n_nonembed:,} "
        f"non-embedding; max |logit diff| torchtune vs transformers {diff:.1e}",
        f"- Batch: {setup.batch_size} rows x {setup.seq_len} tokens = {setup.tokens_per_step:,} "
        f"tokens per optimizer step ({setup.batch_size * (setup.seq_len - 1):,} trained), no "
        f"padding, no packing, gradient accumulation 1",
        f"- Optimizer: AdamW lr {setup.lr:g}, weight decay 0, constant lr, clip grad norm "
        f"{setup.max_grad_norm:g}; posttrain torch.optim.AdamW (for-loop on CPU), TRL {trl_opt}",
        f"- Timing: {setup.repeats} alternating block pairs (posttrain, then TRL), each block "
        f"{setup.warmup} warm-up + {setup.steps} timed optimizer steps; a block's tokens/s = "
        f"B x T / its median step time; the table gives the median, min and max over blocks",
        f"- Load average (1 min) at start / end: {load[0]:.2f} / {os.getloadavg()[0]:.2f} "
        f"on {os.cpu_count()} CPUs (other processes share this machine)",
        f"- Command: `python benchmarks/sft_throughput.py {' '.join(argv_used)}`",
        f"- Peak: best `torch.mm` 2048 x 2048 fp32 over {len(peaks)} measurements (before each "
        f"pair and at the end): {peak:.1f} GFLOP/s (all: "
        f"{', '.join(f'{p:.0f}' for p in peaks)})",
    ]
    lines = ["| trainer | tokens/s (median) | min | max | MFU (6N) | MFU incl. attention |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {n} | {t:,.0f} | {lo:,.0f} | {hi:,.0f} | {m:.0%} | {ma:.0%} |"
              for n, t, lo, hi, m, ma in table_rows]
    summary = (f"posttrain / TRL = {ratio:.2f}x (ratio of the medians; per block pair: "
               f"{', '.join(f'{x:.2f}' for x in pair_ratios)})")
    text = "\n".join(setup_lines) + "\n\n" + "\n".join(lines) + "\n\n" + summary + "\n"
    print("\n" + text)
    for name, table in profiles.items():
        print(f"--- profile: {name}, 3 steps ---\n{table}")

    if args.quick:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "benchmarks_sft.png"
    _plot(table_rows, peak, setup, png)
    md = args.out / "benchmarks_sft.md"
    md.write_text(_markdown(text, png.name))
    print(f"wrote {md} and {png}")
    return 0


def _markdown(results: str, png_name: str) -> str:
    return f"""# SFT throughput: posttrain `Trainer` vs TRL `SFTTrainer` (CPU)

Produced by `python benchmarks/sft_throughput.py` (add `--profile` for the per-operator tables).
tokens/s counts every token that goes through the model (B x T per step); trained tokens are
B x (T - 1) per step on both sides (the last position of a row has no next token), so the
trained-token rate is (T - 1) / T of it.

![SFT throughput]({png_name})

{results}"""


def _plot(table_rows, peak: float, setup: Setup, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r[0] for r in table_rows]
    values = [r[1] for r in table_rows]
    errs = [[r[1] - r[2] for r in table_rows], [r[3] - r[1] for r in table_rows]]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    bars = ax.bar(names, values, yerr=errs, capsize=4, color=["tab:blue", "tab:orange"])
    ax.bar_label(bars, labels=[f"{v:,.0f}\nMFU {r[4]:.0%}" for v, r in zip(values, table_rows)],
                 padding=3, fontsize=9)
    ax.set_ylabel("tokens / s (higher is better)")
    ax.set_ylim(0, max(r[3] for r in table_rows) * 1.3)
    ax.set_title(f"SFT step throughput, {PRESET}, B={setup.batch_size} x T={setup.seq_len}, "
                 f"fp32, {setup.threads} threads\nmatmul peak {peak:.0f} GFLOP/s; bars: median, "
                 f"whiskers: min-max of {setup.repeats} blocks", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
