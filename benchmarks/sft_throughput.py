"""SFT training throughput: posttrain `Trainer` vs TRL `SFTTrainer` on the same tiny-10m weights.

Both sides train the same model, side by side in one process: the posttrain `tiny-10m` preset
(Qwen2, byte vocabulary of 272, ~12M parameters, tied embeddings) built with `build_model(seed=0)`,
and the `Qwen2ForCausalLM` that transformers loads (`AutoModelForCausalLM.from_pretrained`) from
the folder `posttrain.models.hf.save_hf_checkpoint` writes; their logits are checked to agree
before timing.

Same work per optimizer step on both sides: B rows of exactly T random byte tokens (no padding, no
packing, every next token trained: B x (T - 1) trained tokens, B x T tokens through the model),
fp32, full causal attention, AdamW at the same lr (weight decay 0, betas and eps at their torch
defaults), constant lr, gradient clipping at 1.0, gradient accumulation 1, no evaluation, no
checkpoints, no logging. TRL gets pre-tokenized `input_ids` rows with `packing=False`,
`padding_free=False`, `gradient_checkpointing=False` (its default True recomputes the forward in
backward), `max_length=T`, `use_cpu=True`, `report_to=[]`, `logging_strategy="no"`,
`dataloader_num_workers=0` and otherwise its defaults (its optimizer is then `adamw_torch_fused`,
TRL's default since torch 2.8; posttrain's recipes build a plain `torch.optim.AdamW`, which on CPU
is the for-loop implementation). `--same-optimizer` gives TRL posttrain's optimizer instead.

Timing: a step's time runs from the end of the previous optimizer step to the end of this one (data
fetch, forward, backward, clipping, update and each framework's per-step bookkeeping included).
Blocks alternate, posttrain then TRL, `--repeats` times, each `--warmup` untimed + `--steps` timed
steps; a block's tokens/s = B x T / its median step time. Then `--interleave` step pairs run
alternately step by step (a posttrain step inside TRL's step-end callback), so neighbouring steps
of the two sides see the same load on this shared machine. Reported: median block, fastest step
and interleaved median, each as tokens/s and MFU. Peak:
`posttrain.core.timing.matmul_peak_flops`, measured once in the run. MFU = model FLOPs x
steps/s / peak FLOP/s by the convention of docs/benchmarks/README.md
(`posttrain.core.timing.step_flops`: 6 N + 12 L T d_attn per trained token). The report (the
printed text, docs/benchmarks/sft_throughput.md and its figure) is written by
`sft_throughput_report.py`.

Then, unless `--packed-pairs 0`, the packed comparison of `sft_packed.py`: variable-length
documents packed into rows, posttrain's packing against TRL's padding-free path, interleaved block
pairs, trained tokens/s by wall and CPU time, the first step's loss checked on both sides.

Usage:
    python benchmarks/sft_throughput.py            # writes docs/benchmarks/sft_throughput.{md,png}
    python benchmarks/sft_throughput.py --quick    # < 90 s smoke run, nothing written
    python benchmarks/sft_throughput.py --profile  # also a torch.profiler table of each side
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from sft_packed import PackedSetup, run_packed
from sft_throughput_report import PACKED, Measured, markdown, plot, results_text, side_stats
from timing import StepClock
from trl_inputs import CPU_ARGS, check_same_model, hf_byte_tokenizer, on_step_end, trl_optimizers

from posttrain.core.timing import matmul_peak_flops, non_embedding_params
from posttrain.data import Sample, SFTLoader
from posttrain.models import ByteTokenizer, build_model, get_preset, save_hf_checkpoint
from posttrain.train import Trainer

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
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
# The two sides
# --------------------------------------------------------------------------------------------


def make_rows(setup: Setup, num_rows: int) -> list[list[int]]:
    """`num_rows` rows of exactly `seq_len` random byte ids (0..255: no special id, no padding)."""
    g = torch.Generator().manual_seed(setup.seed)
    return torch.randint(0, 256, (num_rows, setup.seq_len), generator=g).tolist()


def build_posttrain(model: torch.nn.Module, rows: list[list[int]], setup: Setup):
    samples = [Sample.from_loss_mask(r, [True] * len(r)) for r in rows]
    loader = SFTLoader(
        samples, batch_size=setup.batch_size, seed=setup.seed, pad_id=ByteTokenizer.PAD
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)
    clock = StepClock()
    trainer = Trainer(
        model,
        optimizer,
        data=loader,
        max_grad_norm=setup.max_grad_norm,
        progress=False,
        seed=setup.seed,
        callbacks=[lambda _t, _row: clock.tick()],
    )
    return trainer, clock


def run_posttrain_block(trainer: Trainer, clock: StepClock, setup: Setup) -> list[float]:
    clock.times.clear()
    trainer.fit(trainer.step_count + setup.warmup + setup.steps)
    rows = trainer.metrics.tail(setup.steps)
    assert (rows["trained_tokens"] == setup.batch_size * (setup.seq_len - 1)).all()
    return clock.durations(setup)


def build_trl(
    folder: Path, rows: list[list[int]], setup: Setup, out_dir: Path, same_optimizer: bool
):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    clock = StepClock()
    config = SFTConfig(
        output_dir=str(out_dir),
        max_steps=setup.warmup + setup.steps,
        per_device_train_batch_size=setup.batch_size,
        learning_rate=setup.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=setup.max_grad_norm,
        max_length=setup.seq_len,
        packing=False,
        padding_free=False,
        seed=setup.seed,
        **CPU_ARGS,
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"input_ids": rows}),
        processing_class=hf_byte_tokenizer(),
        callbacks=[on_step_end(clock.tick)],
        optimizers=trl_optimizers(model, setup.lr, same_optimizer),
    )
    return trainer, clock


def run_trl_block(trainer, clock: StepClock, setup: Setup) -> list[float]:
    clock.times.clear()
    with contextlib.redirect_stdout(io.StringIO()):  # the end-of-train summary dict
        trainer.train()
    return clock.durations(setup)


def run_interleaved(
    ours: Trainer, our_clock: StepClock, trl_trainer, trl_clock: StepClock, setup: Setup, steps: int
) -> tuple[list[float], list[float]]:
    """One TRL `train()` of `warmup + steps` steps with one posttrain step run right after each
    of its steps (from TRL's step-end callback), so neighbouring steps of the two sides see the
    same load. TRL step i runs from posttrain step i-1's end to TRL step i's end; posttrain step
    i from there to its own end. Returns (posttrain, TRL) step seconds after the warm-up."""
    our_clock.times.clear()
    trl_clock.times.clear()
    trl_clock.then = ours.step
    max_steps = trl_trainer.args.max_steps
    trl_trainer.args.max_steps = setup.warmup + steps
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            trl_trainer.train()
    finally:
        trl_clock.then, trl_trainer.args.max_steps = None, max_steps
    trl_end, our_end = trl_clock.times, our_clock.times
    assert len(trl_end) == len(our_end) == setup.warmup + steps
    ours_s = [our_end[i] - trl_end[i] for i in range(setup.warmup, len(trl_end))]
    trl_s = [trl_end[i] - our_end[i - 1] for i in range(setup.warmup, len(trl_end))]
    return ours_s, trl_s


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=None, help="rows per step (default 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 256)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps starting each block")
    parser.add_argument("--repeats", type=int, default=3, help="posttrain/TRL block pairs")
    parser.add_argument(
        "--interleave",
        type=int,
        default=24,
        help="after the blocks, this many step pairs run alternately step by step (0: none)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--same-optimizer",
        action="store_true",
        help="give TRL posttrain's torch.optim.AdamW instead of its fused default",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after timing, profile a few steps of each side (torch.profiler)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (< 60 s): batch 2 x 64 unless given, 1 repeat of 1 + 2 "
        "steps, nothing written",
    )
    parser.add_argument(
        "--packed-pairs",
        type=int,
        default=6,
        help="interleaved block pairs of the packed comparison (sft_packed.py; 0: skip it)",
    )
    parser.add_argument("--rows", type=int, default=4, help="packed rows per step")
    parser.add_argument("--packed-len", type=int, default=512, help="tokens per packed row")
    parser.add_argument("--min-len", type=int, default=16, help="shortest document")
    parser.add_argument("--max-len", type=int, default=384, help="longest document")
    parser.add_argument("--packed-steps", type=int, default=4, help="timed steps per block")
    parser.add_argument(
        "--skip-fixed",
        action="store_true",
        help="only the packed comparison: prints its report section, writes nothing",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DOCS,
        help="folder for sft_throughput.md / .png (default docs/benchmarks/)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats, args.interleave = 2, 1, 1, 2
        args.rows, args.packed_len, args.min_len, args.max_len = 2, 64, 8, 40
        args.packed_steps, args.packed_pairs = 2, min(args.packed_pairs, 1)
    args.batch_size = args.batch_size or (2 if args.quick else 8)
    args.seq_len = args.seq_len or (64 if args.quick else 256)
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--warmup, --steps and --repeats must be >= 1")

    import transformers

    load = os.getloadavg()
    if load[0] > (os.cpu_count() or 1):
        print(
            f"warning: load average {load[0]:.1f} on {os.cpu_count()} CPUs; other processes will "
            "skew the blocks (seen: up to 5x between sides)",
            flush=True,
        )
    argv_used = sys.argv[1:] if argv is None else argv

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    setup = Setup(
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        warmup=args.warmup,
        steps=args.steps,
        repeats=args.repeats,
        threads=args.threads,
    )
    spec = get_preset(PRESET)
    if args.seq_len > spec.max_seq_len:
        parser.error(f"--seq-len {args.seq_len} exceeds {PRESET}'s max_seq_len {spec.max_seq_len}")

    model = build_model(spec, seed=setup.seed)
    n_params = sum(p.numel() for p in model.parameters())
    n_nonembed = non_embedding_params(model)
    # Enough rows for every step of every block on one side, a multiple of the batch size.
    steps_per_side = (setup.warmup + setup.steps) * setup.repeats
    rows = make_rows(setup, setup.batch_size * max(64, steps_per_side))

    peak = matmul_peak_flops()  # before any step: measured once, in thread CPU time
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_hf_checkpoint(
            model,
            spec,
            Path(tmp) / "ckpt",
            bos_token_id=ByteTokenizer.BOS,
            eos_token_id=ByteTokenizer.EOS,
            pad_token_id=ByteTokenizer.PAD,
        )
        packed = PackedSetup(
            rows=args.rows,
            seq_len=args.packed_len,
            min_len=args.min_len,
            max_len=args.max_len,
            warmup=1,
            steps=args.packed_steps,
            pairs=args.packed_pairs,
            threads=args.threads,
        )
        packed_text = None
        if args.skip_fixed:  # the packed comparison alone, on fresh weights
            text = run_packed(packed, build_model(spec, seed=setup.seed), folder, Path(tmp))
            print(PACKED.format(packed=text))  # the section the full run writes into the report
            return 0
        trl_trainer, trl_clock = build_trl(
            folder, rows, setup, Path(tmp) / "trl_out", args.same_optimizer
        )
        diff = check_same_model(model, trl_trainer.model)
        ours, our_clock = build_posttrain(model, rows, setup)
        print(
            f"{PRESET}: {n_params / 1e6:.2f}M params ({n_nonembed / 1e6:.2f}M non-embedding); "
            f"max |logit diff| torchtune vs transformers {diff:.1e}; TRL optimizer "
            f"{type(trl_trainer.create_optimizer()).__name__}"
            f"{' (fused)' if trl_trainer.optimizer.defaults.get('fused') else ''}",
            flush=True,
        )

        results: dict[str, list] = {"posttrain": [], "TRL": []}
        for r in range(setup.repeats):
            results["posttrain"].append(run_posttrain_block(ours, our_clock, setup))
            results["TRL"].append(run_trl_block(trl_trainer, trl_clock, setup))
            assert torch.get_num_threads() == setup.threads, torch.get_num_threads()
            tps = {k: setup.tokens_per_step / statistics.median(v[-1]) for k, v in results.items()}
            print(
                f"repeat {r + 1}/{setup.repeats}: posttrain "
                f"{tps['posttrain']:7.0f} tok/s | TRL {tps['TRL']:7.0f} tok/s "
                f"(load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
        inter = None
        if args.interleave:
            inter = run_interleaved(ours, our_clock, trl_trainer, trl_clock, setup, args.interleave)

        profiles = {}
        if args.profile:  # 1 warm-up + 3 profiled steps per side, after the timed blocks
            ours.fit(ours.step_count + 1)
            profiles["posttrain"] = profile_side(lambda: ours.fit(ours.step_count + 3))
            trl_trainer.args.max_steps = 1
            trl_trainer.train()
            trl_trainer.args.max_steps = 3
            profiles["TRL"] = profile_side(trl_trainer.train)
        if args.packed_pairs:  # on fresh weights: the checkpoint holds the untrained ones
            packed_text = run_packed(packed, build_model(spec, seed=setup.seed), folder, Path(tmp))

    measured = Measured(
        preset=PRESET,
        spec=spec,
        setup=setup,
        n_params=n_params,
        n_nonembed=n_nonembed,
        logit_diff=diff,
        blocks=results,
        interleaved=inter,
        peak=peak,
        same_optimizer=args.same_optimizer,
        interleave=args.interleave,
        load_start=load[0],
        argv=argv_used,
    )
    stats = side_stats(measured)
    text = results_text(measured, stats)
    print("\n" + text)
    if packed_text is not None:
        print("\n" + packed_text)
    for name, table in profiles.items():
        print(f"--- profile: {name}, 3 steps ---\n{table}")

    if args.quick:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "sft_throughput.png"
    plot(measured, stats, png)
    md = args.out / "sft_throughput.md"
    md.write_text(markdown(text, png.name, packed_text))
    print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
