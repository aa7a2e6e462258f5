"""Preference optimisation on chain_sum: SFT warm start -> pairs by rejection sampling -> DPO
(or IPO, SimPO, KTO, ORPO) -> held-out greedy accuracy before and after.

Run: `posttrain run dpo --config recipes/presets/dpo_chain_sum.yaml [key=value ...]`, or in a
notebook `main(Config(loss="ipo"))`.

Stages, all on reasoning-gym chain_sum (the task's own question text):
  1. The starting policy: `init_from` (a HF folder), or SFT with `recipes/sft.py` (its `main`,
     unchanged; run folder `sft/`).
  2. Pairs: `samples_per_prompt` completions of each of `num_prompts` training questions from
     the starting policy (temperature `sample_temperature`), ranked by the task's verifier; best
     vs worst where they differ (`posttrain.preference.pairs.make_preference_pairs`). The last
     `val_pairs` pairs are kept out of training for the preference metrics. KTO gets each pair
     as one desirable and one undesirable row.
  3. Reference log-probs of every pair under the starting policy (the reference), once.
  4. Training with the chosen loss (`posttrain.preference.objectives`), pair-normalised over each step.
  5. Held-out greedy accuracy of the starting and the trained policy on the same `eval_size`
     items (`sft.held_out_items`, never in any training set), 95% Wilson intervals, and the
     difference with a 95% paired-bootstrap interval.

Run folder: `results.json` / `results.md`, `metrics.jsonl` (per step; eval/val_* = loss, rewards,
margin and reward accuracy on the held-out pairs), `preference_curves.png`, `pairs.jsonl`,
`eval_before.csv` / `eval_after.csv`, `checkpoints/`, `policy/` (HF format), `sft/`.

Measured once with recipes/presets/dpo_chain_sum.yaml (= these defaults; 2-core CPU shared with
other jobs, torch on 1 thread; wall 589 s: SFT 348 s, pairs 84 s, reference 6 s, DPO 144 s):
the 1.02M-parameter SFT policy answers 5.0% [3.4, 7.3] of 500 held-out items; its 16,384 samples
on 2,048 training questions are right 4.7% of the time, giving 523 pairs (1,525 questions had
all 8 samples equally scored); after 150 DPO steps (459 training pairs, ~10 epochs) held-out
greedy accuracy is 5.0% [3.4, 7.3], a difference of +0.0 points (95% CI [-2.2, +2.2]). On the 64
validation pairs the implicit reward margin rose from 0 to 0.058 and reward accuracy to 62.5%;
both rewards fell (chosen -0.18, rejected -0.24): the policy lowered the likelihood of both.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from posttrain.cli import load_recipe
from posttrain.core import (require_finite, require_folder, require_int,
                                     require_positive)
from posttrain.envs import ReasoningGymTask
from posttrain.rewards import paired_bootstrap_diff
from posttrain.train import get_loss
from posttrain.models import PRESETS
from posttrain.policy import Policy
from posttrain.data import (KTODataset, PreferenceDataset, PreferenceLoader,
                                       pairs_to_kto_rows)
from posttrain.preference import compute_reference_logps, make_preference_pairs
from posttrain.core import check_new_run_dir
from posttrain.train import Trainer, warmup_cosine_schedule

sft = load_recipe("sft")

LOSSES = ("dpo", "ipo", "simpo", "kto", "orpo")
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "kto": 0.1, "orpo": 0.1}
"""beta when `Config.beta` is None (SimPO's scale is that of per-token averages)."""


@dataclass(kw_only=True)
class Config:
    """SFT -> rejection-sampled pairs -> preference optimisation -> evaluation. Every field has a
    default that runs (~10 min on 2 shared CPU cores). Raises ValueError in `__post_init__`
    naming the field and what is allowed."""

    loss: str = "dpo"                  # dpo | ipo | simpo | kto | orpo
    beta: float | None = None          # None: DEFAULT_BETA[loss]
    label_smoothing: float = 0.0       # dpo (cDPO) and simpo
    simpo_gamma: float = 1.0           # SimPO's target reward margin
    ipo_length_normalize: bool = True  # IPO log-ratios per token, as TRL
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0
    # the starting policy (also the reference)
    model: str = "tiny-1m"
    init_from: str | None = None       # a HF folder; None: run the SFT stage
    task_config: dict = field(default_factory=lambda: {
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    train_size: int = 20000
    eval_size: int = 500
    eval_seed: int = 10_000
    eval_max_new_tokens: int = 16
    sft_steps: int = 400
    sft_lr: float = 2e-3
    sft_batch_size: int = 64
    # pairs by rejection sampling
    num_prompts: int = 2048
    samples_per_prompt: int = 8
    sample_temperature: float = 1.0
    sample_max_new_tokens: int = 8
    reference_answer_candidate: bool = False   # the task's answer joins the candidates
    val_pairs: int = 64
    # preference optimisation
    batch_size: int = 32               # pairs (KTO: rows) per micro-batch
    grad_accum_steps: int = 1
    num_steps: int = 150
    lr: float = 1e-4
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    max_grad_norm: float | None = 1.0
    max_seq_len: int = 128
    eval_every: int = 25
    checkpoint_every: int = 50
    seed: int = 0
    out_dir: str = "runs/dpo"
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"Config.loss={self.loss!r}; allowed: {', '.join(LOSSES)}")
        if self.init_from is None and self.model not in PRESETS:
            raise ValueError(f"Config.model={self.model!r}; allowed presets: "
                             f"{', '.join(sorted(PRESETS))} (or set init_from to a HF folder)")
        require_folder(self, "init_from")
        require_int(self, ("train_size", "eval_size", "eval_max_new_tokens", "sft_steps",
                           "sft_batch_size", "num_prompts", "sample_max_new_tokens", "val_pairs",
                           "batch_size", "grad_accum_steps", "num_steps", "max_seq_len"),
                    minimum=1)
        require_int(self, ("warmup_steps", "eval_every", "checkpoint_every"), minimum=0)
        require_int(self, ("samples_per_prompt",), minimum=2)  # best vs worst
        if self.warmup_steps > self.num_steps:
            raise ValueError(f"Config.warmup_steps={self.warmup_steps} exceeds "
                             f"num_steps={self.num_steps}")
        if self.val_pairs >= self.num_prompts:
            raise ValueError(f"Config.val_pairs={self.val_pairs} must be below num_prompts="
                             f"{self.num_prompts}: each prompt gives at most one pair")
        require_positive(self, ("lr", "sft_lr", "sample_temperature"))
        require_positive(self, ("max_grad_norm",), optional=True)
        require_finite(self, ("label_smoothing", "simpo_gamma", "kto_desirable_weight",
                              "kto_undesirable_weight", "min_lr_ratio"))
        if self.label_smoothing and self.loss not in ("dpo", "simpo"):
            raise ValueError(f"Config.label_smoothing={self.label_smoothing!r} is used by dpo and "
                             f"simpo only; loss={self.loss!r} would ignore it: set it to 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"Config.min_lr_ratio={self.min_lr_ratio!r}; must be in [0, 1]")
        try:
            self.build_loss()
        except ValueError as e:
            raise ValueError(f"Config (loss={self.loss!r}): {e}") from None

    def build_loss(self):
        """The `TrainingLoss` these settings describe."""
        beta = DEFAULT_BETA[self.loss] if self.beta is None else self.beta
        options = {"dpo": {"label_smoothing": self.label_smoothing},
                   "ipo": {"length_normalize": self.ipo_length_normalize},
                   "simpo": {"gamma": self.simpo_gamma, "label_smoothing": self.label_smoothing},
                   "kto": {"desirable_weight": self.kto_desirable_weight,
                           "undesirable_weight": self.kto_undesirable_weight},
                   "orpo": {}}[self.loss]
        return get_loss(self.loss, beta=beta, **options)


# Overrides that make the recipe finish in seconds (the recipe test runs every preset with them).
# A 3-step SFT policy answers nothing right, so the task's answer joins the candidates.
TINY = dict(model="tiny-1m", init_from=None, train_size=64, eval_size=8, eval_max_new_tokens=6,
            sft_steps=3, sft_batch_size=8, num_prompts=8, samples_per_prompt=2,
            sample_max_new_tokens=4, reference_answer_candidate=True, val_pairs=2, batch_size=4,
            num_steps=2, warmup_steps=1, eval_every=1, checkpoint_every=1, progress=False)


def main(cfg: Config) -> dict[str, Any]:
    """Run the recipe; returns the results dict also written to `out_dir/results.json`.

    Raises ValueError before writing anything if `out_dir` already holds a run and
    `cfg.resume` is False, and if rejection sampling gives too few pairs.
    """
    start = time.perf_counter()
    out = Path(cfg.out_dir)
    if not cfg.resume:
        check_new_run_dir(out)
        check_new_run_dir(out / "sft")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    torch.manual_seed(cfg.seed)
    times: dict[str, float] = {}

    # 1. The starting policy (= the reference)
    sft_cfg, _ = sft.warm_start(
        out, model=cfg.model, task_config=cfg.task_config, train_size=cfg.train_size,
        eval_size=cfg.eval_size, eval_seed=cfg.eval_seed, batch_size=cfg.sft_batch_size,
        steps=cfg.sft_steps, lr=cfg.sft_lr, max_new_tokens=cfg.eval_max_new_tokens,
        seed=cfg.seed, progress=cfg.progress, resume=cfg.resume, train=cfg.init_from is None)
    start_folder = Path(cfg.init_from) if cfg.init_from is not None else out / "sft" / "policy"
    policy = Policy.from_pretrained(start_folder)
    times["start_policy_s"] = time.perf_counter() - start

    # 2. Pairs by rejection sampling on training questions, ranked by the task's verifier
    items, scorer = sft.held_out_items(sft_cfg)
    task = ReasoningGymTask(name="chain_sum", size=cfg.train_size, seed=cfg.seed,
                            config=dict(cfg.task_config), held_out_size=cfg.eval_size,
                            held_out_seed=cfg.eval_seed)
    if [it["question"] for it in task.held_out()] != [it["question"] for it in items]:
        raise RuntimeError("the task's held-out items differ from the SFT recipe's")
    pairs_path = out / "pairs.jsonl"
    t0 = time.perf_counter()
    if cfg.resume and pairs_path.is_file():
        rows = [json.loads(line) for line in pairs_path.read_text().splitlines()]
        pair_stats = json.loads((out / "pair_stats.json").read_text())
    else:
        rows, stats = make_preference_pairs(
            policy, task.train_items[:cfg.num_prompts], rank=task.verifier,
            n=cfg.samples_per_prompt, max_new_tokens=cfg.sample_max_new_tokens,
            temperature=cfg.sample_temperature, seed=cfg.seed,
            reference_answer=(lambda item: item["answer"]) if cfg.reference_answer_candidate
            else None)
        pair_stats = stats.as_dict()
        pairs_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "pair_stats.json").write_text(json.dumps(pair_stats, indent=2))
    times["pairs_s"] = time.perf_counter() - t0
    print(f"{policy}\npairs: {pair_stats}")
    if len(rows) <= cfg.val_pairs:
        raise ValueError(f"rejection sampling gave {len(rows)} pairs, not more than val_pairs="
                         f"{cfg.val_pairs} ({pair_stats}); raise num_prompts or "
                         "samples_per_prompt, or set reference_answer_candidate=True")
    train_rows, val_rows = rows[:-cfg.val_pairs], rows[-cfg.val_pairs:]

    # 3. Datasets and reference log-probs under the starting policy
    objective = cfg.build_loss()
    if cfg.loss == "kto":
        train_rows, val_rows = pairs_to_kto_rows(train_rows), pairs_to_kto_rows(val_rows)
    dataset_cls = KTODataset if cfg.loss == "kto" else PreferenceDataset
    dataset = dataset_cls(train_rows, policy.tokenizer, max_seq_len=cfg.max_seq_len)
    val_dataset = dataset_cls(val_rows, policy.tokenizer, max_seq_len=cfg.max_seq_len)
    t0 = time.perf_counter()
    if objective.needs_reference:
        compute_reference_logps(policy, dataset)
        compute_reference_logps(policy, val_dataset)
    times["reference_s"] = time.perf_counter() - t0
    val_batch = val_dataset.collate(range(len(val_dataset)))

    # 4. Held-out accuracy of the starting policy, then training
    before_csv = out / "eval_before.csv"
    if cfg.resume and before_csv.is_file():
        before_table = pd.read_csv(before_csv)
    else:
        before_table = sft.evaluate(policy, sft_cfg, items, scorer).table
        before_table.to_csv(before_csv, index=False)

    def eval_fn(model: torch.nn.Module) -> dict[str, float]:
        return {f"val_{k}": v for k, v in objective.metrics(model, val_batch).items()}

    loader = PreferenceLoader(dataset, batch_size=cfg.batch_size, seed=cfg.seed)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=cfg.lr, weight_decay=0.0)
    schedule = warmup_cosine_schedule(optimizer, warmup_steps=cfg.warmup_steps,
                                      total_steps=cfg.num_steps, min_lr_ratio=cfg.min_lr_ratio)
    trainer = Trainer(policy.model, optimizer, data=loader, loss=objective,
                      lr_scheduler=schedule, grad_accum_steps=cfg.grad_accum_steps,
                      max_grad_norm=cfg.max_grad_norm, run_dir=out, eval_fn=eval_fn,
                      eval_every=cfg.eval_every, checkpoint_every=cfg.checkpoint_every,
                      progress=cfg.progress, seed=cfg.seed, resume=cfg.resume)
    t0 = time.perf_counter()
    val_start = trainer.evaluate() if trainer.step_count == 0 else {}
    metrics = trainer.fit(cfg.num_steps)
    times["train_s"] = time.perf_counter() - t0
    _plot_curves(metrics, out / "preference_curves.png", cfg.loss)

    # 5. Held-out accuracy after, paired with before on the same items
    after = sft.evaluate(policy, sft_cfg, items, scorer)
    after.table.to_csv(out / "eval_after.csv", index=False)
    before = _as_result(before_table)
    diff = paired_bootstrap_diff(after.table["correct"].to_numpy(),
                                 before_table["correct"].to_numpy(), seed=cfg.seed)
    policy.save(out / "policy")
    results = {"loss": cfg.loss, "objective": repr(objective), "model": cfg.model,
               "init_from": cfg.init_from, "params": policy.num_parameters(),
               "task_config": cfg.task_config, "pairs": pair_stats,
               "train_samples": len(dataset), "val_samples": len(val_dataset),
               "data": dataset.stats.as_dict(), "steps": cfg.num_steps,
               "before": before, "after": after.as_dict(), "difference": diff,
               "val_at_start": val_start,
               "val_at_end": {c: float(metrics[c].dropna().iloc[-1]) for c in metrics
                              if str(c).startswith("eval/") and metrics[c].notna().any()},
               "final_train_loss": float(metrics["loss"].iloc[-1]), **times,
               "wall_s": time.perf_counter() - start}
    _write_results(results, out)
    return results


def _as_result(table: pd.DataFrame) -> dict[str, float]:
    from posttrain.rewards import wilson_interval

    successes, n = int(table["correct"].sum()), len(table)
    low, high = wilson_interval(successes, n)
    return {"accuracy": successes / n, "ci_low": low, "ci_high": high, "num_items": n}


def _write_results(results: dict[str, Any], out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    p, d = results["pairs"], results["difference"]
    loss = results["loss"].upper()
    lines = [f"# {loss} on chain_sum {results['task_config']}", "",
             f"{results['objective']}, model {results['model']} "
             f"({results['params'] / 1e6:.2f}M params), {results['steps']} steps, "
             f"wall {results['wall_s']:.0f} s", "",
             f"pairs: {p['pairs']} from {p['prompts']} prompts x "
             f"{p['samples'] // max(p['prompts'], 1)} samples; skipped "
             f"{p['skipped_all_equal']} all-equal, {p['skipped_too_few']} too few usable; "
             f"excluded {p['excluded']}; {results['train_samples']} training / "
             f"{results['val_samples']} validation {'rows' if loss == 'KTO' else 'pairs'}", "",
             "| held-out (greedy) | accuracy | 95% Wilson CI | items |", "|---|---|---|---|"]
    for name in ("before", "after"):
        r = results[name]
        lines.append(f"| {name} {loss} | {r['accuracy']:.3f} | [{r['ci_low']:.3f}, "
                     f"{r['ci_high']:.3f}] | {r['num_items']} |")
    lines += ["", f"after minus before: {d['difference']:+.3f} (95% CI [{d['ci_low']:+.3f}, "
              f"{d['ci_high']:+.3f}], {d['method']}, same {d['num_items']} items)", "",
              "validation set, start -> end: " + ", ".join(
                  f"{k.removeprefix('eval/val_')} {v:.3f} -> "
                  f"{results['val_at_end'].get(k, float('nan')):.3f}"
                  for k, v in results["val_at_start"].items()), ""]
    (out / "results.md").write_text("\n".join(lines))
    print("\n".join(lines))


def _plot_curves(metrics: pd.DataFrame, path: Path, loss: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [(c, c) for c in ("loss", "eval/val_reward_margin", "eval/val_reward_accuracy")
               if c in metrics]
    fig, axes = plt.subplots(1, len(columns), figsize=(4 * len(columns), 3), squeeze=False)
    for ax, (column, label) in zip(axes[0], columns):
        data = metrics[["step", column]].dropna()
        ax.plot(data["step"], data[column], lw=1, marker="." if column != "loss" else None)
        ax.set_xlabel(f"{loss} step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main(Config())
