"""SFT on packed variable-length rows: posttrain's packing against TRL `SFTTrainer`'s
padding-free path, same model, same documents, same optimizer (`sft_throughput.py --packed`).

Documents: `n` rows of random byte ids (0..255) whose lengths are drawn uniformly from
[min_len, max_len] with a seeded generator; every next token trained (a document of n tokens
trains n - 1). Packing: posttrain's own (`posttrain.data.pack_samples`: next-fit, in order, into
rows of `seq_len`; each row a block-causal [T, T] mask, position ids restarting per document,
a padding tail). One optimizer step = `rows` consecutive packed rows on both sides:

- posttrain: `SFTLoader(pack=True, batch_size=rows, seq_len=seq_len, shuffle=False)` feeding
  the `Trainer` ([rows, seq_len] per step, the padding tails included);
- TRL: one example per posttrain row (`input_ids` = its documents back to back, `seq_lengths`
  = their lengths: what TRL's own `packing=True` produces), `padding_free=True`, `packing=False`
  (so TRL keeps posttrain's rows rather than repacking them best-fit), `max_length=None`,
  `train_sampling_strategy="sequential"`: its collator flattens the step's rows into one row of
  exactly the real tokens, position ids restarting per document (transformers builds the
  block-causal mask from them for SDPA), labels -100 at every document start.

Both sides: the same weights (checked by logits), fp32, AdamW (posttrain's plain
`torch.optim.AdamW` on both sides, weight decay 0), constant lr, clipping at 1.0, no
recomputation. tokens/s counts the real trained tokens (sum of n - 1 over the step's
documents), the same number on both sides (checked against each side's own count). MFU by the
convention of docs/benchmarks/README.md (`posttrain.core.timing.step_flops`: 6 N per trained
token + 12 L d_attn x the length of its document) over `matmul_peak_flops()` measured in the run.
Timing: blocks of `warmup` untimed + `steps` timed steps, interleaved posttrain / TRL
(`pairs.run_interleaved`, one untimed warm-up block each first); each block restarts at the first
step's documents, so block k of both sides trains the same rows.
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from pairs import Run, fmt, rates, ratio_cells, run_interleaved, spread
from trl_inputs import CPU_ARGS, check_same_model, hf_byte_tokenizer, on_step_end

from posttrain.core.timing import (
    attention_dims,
    matmul_peak_flops,
    mfu,
    non_embedding_params,
    step_flops,
)
from posttrain.data import Sample, SFTLoader, pack_samples
from posttrain.models import ByteTokenizer
from posttrain.train import Trainer
from posttrain.train.losses import SFTCrossEntropy

LOSS_TOLERANCE = 1e-4
"""|posttrain - TRL| allowed for the first step's loss (nats; the loss is ~log 272 = 5.6 at
the start). Same weights and tokens in fp32, so only rounding differs: RoPE, the attention
kernel's mask (posttrain's [T, T] block mask over rows with a padding tail, transformers' mask
built from position ids over one flattened row) and the order of the token sum."""


@dataclass(frozen=True)
class PackedSetup:
    rows: int
    seq_len: int
    min_len: int
    max_len: int
    warmup: int
    steps: int
    pairs: int
    threads: int
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class Steps:
    """The documents of every step: `docs[k]` = the token lists of step k (in row order),
    `rows[k]` = their lengths row by row."""

    docs: list[list[list[int]]]
    rows: list[list[list[int]]]

    def trained(self, k: int) -> int:
        return sum(len(d) - 1 for d in self.docs[k])

    def span(self, k: int) -> int:
        """Sum over the trained tokens of their document's length (`attention_span`)."""
        return sum(len(d) * (len(d) - 1) for d in self.docs[k])


def make_documents(setup: PackedSetup, count: int) -> list[list[int]]:
    """`count` documents of random byte ids, lengths uniform in [min_len, max_len] (seeded)."""
    g = torch.Generator().manual_seed(setup.seed)
    lengths = torch.randint(setup.min_len, setup.max_len + 1, (count,), generator=g).tolist()
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def plan_steps(docs: list[list[int]], setup: PackedSetup) -> tuple[list[Sample], Steps]:
    """posttrain's packing of `docs` (next-fit, in order) cut into steps of `rows` rows; the
    samples and the documents of each of the first warmup + steps steps."""
    samples = [Sample.from_loss_mask(d, [True] * len(d)) for d in docs]
    per_row = [r.num_samples for r in pack_samples(samples, setup.seq_len, ByteTokenizer.PAD)]
    need = setup.warmup + setup.steps
    if len(per_row) < need * setup.rows:
        raise ValueError(f"{len(per_row)} packed rows; {need} steps need {need * setup.rows}")
    starts = [sum(per_row[:i]) for i in range(len(per_row) + 1)]
    row_docs = [docs[a:b] for a, b in zip(starts, starts[1:])]
    step_rows = [row_docs[k * setup.rows : (k + 1) * setup.rows] for k in range(need)]
    return samples, Steps(
        docs=[[d for row in rows for d in row] for rows in step_rows],
        rows=[[[len(d) for d in row] for row in rows] for rows in step_rows],
    )


class Ticks:
    """(perf_counter, process_time) at the end of every optimizer step, from a step callback."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []

    def tick(self) -> None:
        self.times.append((time.perf_counter(), time.process_time()))

    def run(self, setup: PackedSetup, work: float) -> Run:
        """The timed steps of the block just run (after the warm-up) as one `Run`."""
        assert len(self.times) == setup.warmup + setup.steps, len(self.times)
        (w0, c0), (w1, c1) = self.times[setup.warmup - 1], self.times[-1]
        return Run(work, w1 - w0, c1 - c0)


def build_posttrain(model, samples: list[Sample], setup: PackedSetup):
    loader = SFTLoader(
        samples,
        batch_size=setup.rows,
        shuffle=False,
        pack=True,
        seq_len=setup.seq_len,
        pad_id=ByteTokenizer.PAD,
    )
    ticks = Ticks()
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0),
        data=loader,
        max_grad_norm=setup.max_grad_norm,
        progress=False,
        seed=setup.seed,
        callbacks=[lambda _t, _row: ticks.tick()],
    )
    return trainer, ticks


def build_trl(folder: Path, steps: Steps, setup: PackedSetup, out_dir: Path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows = [row for k in range(len(steps.docs)) for row in _row_docs(steps, k)]
    dataset = Dataset.from_dict(
        {
            "input_ids": [[t for d in row for t in d] for row in rows],
            "seq_lengths": [[len(d) for d in row] for row in rows],
        }
    )
    ticks = Ticks()
    config = SFTConfig(
        output_dir=str(out_dir),
        max_steps=setup.warmup + setup.steps,
        per_device_train_batch_size=setup.rows,
        learning_rate=setup.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=setup.max_grad_norm,
        max_length=None,
        packing=False,
        padding_free=True,
        train_sampling_strategy="sequential",
        seed=setup.seed,
        **CPU_ARGS,
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=hf_byte_tokenizer(),
        callbacks=[on_step_end(ticks.tick)],
        optimizers=(torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0), None),
    )
    return trainer, ticks


def _row_docs(steps: Steps, k: int) -> list[list[list[int]]]:
    """Step k's documents grouped by row."""
    out, it = [], iter(steps.docs[k])
    for lengths in steps.rows[k]:
        out.append([next(it) for _ in lengths])
    return out


def first_step_losses(ours: Trainer, trl_trainer, steps: Steps) -> tuple[float, float, int, int]:
    """Each side's loss on the first step's rows before any update, and the trained tokens each
    side's own batch counts: (posttrain loss, TRL loss, posttrain tokens, TRL tokens)."""
    state = ours.data.state_dict()
    batch = ours.data.next_batch()
    ours.data.load_state_dict(state)
    loss = SFTCrossEntropy()
    with torch.no_grad():
        units = loss.num_units(batch)
        ours_loss = float(loss(ours.model, batch, units))
    rows = len(steps.rows[0])
    inputs = trl_trainer.data_collator([trl_trainer.train_dataset[i] for i in range(rows)])
    trl_tokens = int((inputs["labels"][..., 1:] != -100).sum())  # the model shifts labels
    with torch.no_grad():
        trl_loss = float(trl_trainer.compute_loss(trl_trainer.model, inputs))
    return ours_loss, trl_loss, int(units), trl_tokens


def measure(ours, our_ticks, trl_trainer, trl_ticks, steps: Steps, setup: PackedSetup):
    """Interleaved blocks of both sides (an untimed warm-up block each first); each block
    restarts at the first step's rows. Returns name -> Runs (work = real trained tokens)."""
    start = ours.data.state_dict()
    timed = range(setup.warmup, setup.warmup + setup.steps)
    work = sum(steps.trained(k) for k in timed)

    def posttrain(_seed: int) -> Run:
        ours.data.load_state_dict(start)
        our_ticks.times.clear()
        ours.fit(ours.step_count + setup.warmup + setup.steps)
        counted = ours.metrics.tail(setup.steps)["trained_tokens"].tolist()
        assert counted == [steps.trained(k) for k in timed], counted
        return our_ticks.run(setup, work)

    def trl(_seed: int) -> Run:
        trl_ticks.times.clear()
        with contextlib.redirect_stdout(io.StringIO()):  # the end-of-train summary dict
            trl_trainer.train()
        return trl_ticks.run(setup, work)

    return run_interleaved({"posttrain": posttrain, "TRL": trl}, setup.pairs)


def report(runs: dict[str, list[Run]], model, steps: Steps, setup: PackedSetup, checks) -> str:
    """The rows of the packed comparison (markdown) and the lines around them."""
    n, (layers, width) = non_embedding_params(model), attention_dims(model)
    timed = range(setup.warmup, setup.warmup + setup.steps)
    flops = sum(
        step_flops(
            n,
            steps.trained(k),
            span=steps.span(k),
            num_layers=layers,
            attn_dim=width,
            kind="train",
        )
        for k in timed
    )
    peak = matmul_peak_flops()
    real = sum(len(d) for k in timed for d in steps.docs[k])
    padded = setup.rows * setup.seq_len * setup.steps
    docs = [len(d) for k in timed for d in steps.docs[k]]
    ours_loss, trl_loss, ours_tokens, trl_tokens = checks
    lines = [
        f"- Documents: lengths uniform in [{setup.min_len}, {setup.max_len}] (seeded), random "
        f"byte ids; the timed steps hold {len(docs)} documents (mean length "
        f"{statistics.mean(docs):.0f}), {sum(d - 1 for d in docs) // setup.steps:,} trained "
        f"tokens per step on average",
        f"- Step: {setup.rows} packed rows of {setup.seq_len} (posttrain: {padded // setup.steps:,}"
        f" positions per step, {1 - real / padded:.1%} of them padding tails; TRL: the "
        f"{real // setup.steps:,} real tokens in one flattened row)",
        f"- Timing: {setup.pairs} interleaved block pairs (posttrain, TRL; after one untimed "
        f"block each), each block {setup.warmup} warm-up + {setup.steps} timed steps; "
        f"{setup.threads} thread(s)",
        f"- First step's loss before any update: posttrain {ours_loss:.6f}, TRL {trl_loss:.6f}"
        f" (|diff| {abs(ours_loss - trl_loss):.1e}, tolerance {LOSS_TOLERANCE:g}); trained "
        f"tokens of that step: posttrain {ours_tokens:,}, TRL {trl_tokens:,}",
        f"- MFU: (6 x {n:,} x trained tokens + 12 x {layers} x {width} x sum of each trained "
        f"token's document length) / (seconds x {peak / 1e9:.0f} GFLOP/s, "
        "`matmul_peak_flops()` in this run: one thread's rate in its CPU seconds x the threads); "
        "by wall seconds (the convention; a busy machine lowers it) and by the process's CPU "
        "seconds (the work done, whatever the load)",
        "",
        "| trainer | trained tokens/s, wall: median [min, max] | trained tokens per CPU-s | "
        "positions through the model per CPU-s | MFU, wall (median block) | MFU, CPU time |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    positions = {"posttrain": padded, "TRL": real}  # per block of `steps` steps
    for name, side in runs.items():
        wall, cpu = spread(rates(side, "wall")), spread(rates(side, "cpu"))
        per_cpu_s = statistics.median(positions[name] / r.cpu_s for r in side)
        by_wall, by_cpu = (
            mfu(flops, statistics.median(getattr(r, f) for r in side), peak_flops_per_s=peak)
            for f in ("wall_s", "cpu_s")
        )
        lines.append(
            f"| {name} | {fmt(*wall)} | {fmt(*cpu)} | {per_cpu_s:,.0f} | {by_wall:.0%} | "
            f"{by_cpu:.0%} |"
        )
    cells = ratio_cells(runs["posttrain"], runs["TRL"])
    lines += [
        "",
        f"posttrain / TRL, per block pair (trained tokens/s): wall {cells['wall']}, CPU time "
        f"{cells['cpu']}.",
    ]
    return "\n".join(lines)


def run_packed(setup: PackedSetup, model, folder: Path, tmp: Path) -> str:
    """Build both sides on the same documents, check the weights and the first step, time,
    and return the report text. `model`: posttrain's, untrained; `folder`: its HF checkpoint."""
    need = setup.warmup + setup.steps
    docs = make_documents(setup, 4 * need * setup.rows * setup.seq_len // setup.min_len)
    samples, steps = plan_steps(docs, setup)
    trl_trainer, trl_ticks = build_trl(folder, steps, setup, tmp / "trl_packed")
    diff = check_same_model(model, trl_trainer.model)
    ours, our_ticks = build_posttrain(model, samples, setup)
    checks = first_step_losses(ours, trl_trainer, steps)
    assert abs(checks[0] - checks[1]) < LOSS_TOLERANCE, checks
    assert checks[2] == checks[3] == steps.trained(0), (checks, steps.trained(0))
    print(
        f"packed: max |logit diff| {diff:.1e}; first-step loss posttrain {checks[0]:.6f} "
        f"TRL {checks[1]:.6f}; "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    runs = measure(ours, our_ticks, trl_trainer, trl_ticks, steps, setup)
    return report(runs, ours.model, steps, setup, checks)
