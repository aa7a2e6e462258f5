"""Preference optimisation on chain_sum: SFT warm start -> pairs by rejection sampling -> DPO
(or IPO, SimPO, KTO, ORPO) -> held-out greedy accuracy before and after.

Run: `posttrain run dpo --config recipes/presets/dpo_chain_sum.yaml [key=value ...]` (dotted
keys: `optim.lr=5e-5 pairs.num_prompts=4096`), or in a notebook `main(Config(loss="ipo"))`.

Stages, all on the reasoning-gym task `task.name` (the task's own question text):
  1. The starting policy: `model.init_from` (a HF folder), or the SFT warm start
     (`posttrain.workflows.sft.warm_start`, section `sft`; run folder `sft/`).
  2. Pairs: `pairs.samples_per_prompt` completions of each of `pairs.num_prompts` training
     questions from the starting policy (section `sampling`), ranked by the task's verifier;
     best vs worst where they differ (`posttrain.preference.pairs.make_preference_pairs`). The
     last `val_pairs` pairs are kept out of training for the preference metrics. KTO gets each
     pair as one desirable and one undesirable row.
  3. Reference log-probs of every pair under the starting policy (the reference), once.
  4. Training with the chosen loss (`posttrain.preference.objectives`), pair-normalised over each step.
  5. Held-out greedy accuracy of the starting and the trained policy on the same
     `task.eval_size` items (`posttrain.workflows.sft.held_out_items`, never in any training
     set), 95% Wilson intervals, and the difference with a 95% paired-bootstrap interval.

Run folder: `results.json` / `results.md`, `metrics.jsonl` (per step; eval/val_* = loss, rewards,
margin and reward accuracy on the held-out pairs), `preference_curves.png`, `pairs.jsonl`,
`eval_before.csv` / `eval_after.csv`, `checkpoints/`, `policy/` (HF format), `sft/`.

With a `parallel` plan (a job of its world size; section `parallel`): the SFT stage and the
policy are split by it, rank 0 samples the pairs (broadcast to the others) and evaluates, the
reference log-probs are computed once on the split starting policy (it is the reference), the
pairs are sharded over the data-parallel ranks (`ShardedPreferenceLoader`), and rank 0 saves
the gathered weights; only rank 0 returns the results (the others None).

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

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.core.distributed import barrier, rank_and_world_size
from posttrain.data import KTODataset, PreferenceDataset, PreferenceLoader, pairs_to_kto_rows
from posttrain.envs import ReasoningGymTask
from posttrain.preference import (ShardedPreferenceLoader, compute_reference_logps,
                                  make_preference_pairs)
from posttrain.preference.pairs import usable_pairs
from posttrain.rewards import paired_bootstrap_diff
from posttrain.train import Trainer, get_loss
from posttrain.workflows import (BatchOptimConfig, CheckpointConfig, EvalConfig, ModelConfig,
                                 PairsConfig, SamplingConfig, SFTWarmStartConfig,
                                 TaskConfig, accuracy_of, accuracy_table, check_gym_task,
                                 check_seq_len, difference_line, evaluate, fail, held_out_items,
                                 plot_curves, run_fields, start_policy, start_run, validate,
                                 write_results)
from posttrain.workflows import (cached_pairs, on_rank_zero, read_table, stop_if_interrupted,
                                 unsharded_policy, write_table)
from posttrain.preference.dpo_family import DPO_LOSS_TYPES, F_DIVERGENCE_TYPES
from posttrain.workflows.run_state import recorded_run
from posttrain.workflows.config import choice, finite, flags, ints, positive
from posttrain.workflows.sft import check_task_fits
from posttrain.workflows.parallel import ParallelPlan, check_parallel, plan_of
from posttrain.workflows.quantization import (AdaptersConfig, QuantizationConfig,
                                              check_converted_run, convert_for_training,
                                              export_adapters, trainable_parameters)

LOSSES = ("dpo", "ipo", "simpo", "kto", "orpo")
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "kto": 0.1, "orpo": 0.1}
"""beta when `Config.beta` is None (SimPO's scale is that of per-token averages)."""
LOSS_OPTIONS = {"beta": "beta", "label_smoothing": "label_smoothing", "loss_type": "dpo_loss_type",
                "f_divergence_type": "f_divergence_type",
                "f_alpha_divergence_coef": "f_alpha_divergence_coef", "gamma": "simpo_gamma",
                "length_normalize": "ipo_length_normalize",
                "desirable_weight": "kto_desirable_weight",
                "undesirable_weight": "kto_undesirable_weight"}
"""The options `build_loss` passes to the loss, and the `Config` field each comes from."""


@dataclass(kw_only=True)
class Config:
    """SFT -> rejection-sampled pairs -> preference optimisation -> evaluation. Every field has a
    default that runs (~10 min on 2 shared CPU cores). Raises ValueError in `__post_init__`
    naming the dotted field and what is allowed."""

    loss: str = "dpo"                  # dpo | ipo | simpo | kto | orpo
    beta: float | None = None          # None: DEFAULT_BETA[loss]
    label_smoothing: float = 0.0       # dpo (cDPO) and simpo
    # loss=dpo only: any DPOTrainer loss_type of TRL 1.16 or "dpop", and its f-divergence
    # (posttrain.preference.dpo_family), so a loss ablation is one config key
    dpo_loss_type: str = "sigmoid"
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    simpo_gamma: float = 1.0           # SimPO's target reward margin (>= 0)
    ipo_length_normalize: bool = True  # IPO log-ratios per token, as TRL
    kto_desirable_weight: float = 1.0  # KTO's weights of desirable / undesirable rows (> 0)
    kto_undesirable_weight: float = 1.0
    # the starting policy (also the reference): model.init_from, or SFT of model.name
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(max_new_tokens=16, every=25))
    sft: SFTWarmStartConfig = field(default_factory=SFTWarmStartConfig)
    # pairs by rejection sampling; the last val_pairs are kept out of training
    pairs: PairsConfig = field(default_factory=PairsConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    val_pairs: int = 64
    # preference optimisation (optim.batch_size: pairs, or KTO rows, per micro-batch)
    optim: BatchOptimConfig = field(default_factory=lambda: BatchOptimConfig(
        steps=150, lr=1e-4, warmup_steps=10, batch_size=32))
    max_seq_len: int = 128
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every=50))
    parallel: ParallelPlan = field(default_factory=ParallelPlan)
    # LoRA / QLoRA adapters and FP8 training of the preference stage (the SFT stage trains in full)
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    seed: int = 0
    out_dir: str = "runs/dpo"
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self)

    def check(self, at: str) -> None:
        choice(f"{at}.loss", self.loss, LOSSES)
        run_fields(self, at)
        check_gym_task(self, at)
        check_seq_len(self, at)
        ints(self, at, ("val_pairs",), minimum=1)
        prompts = min(self.pairs.num_prompts, self.task.train_size)
        if self.val_pairs >= prompts:
            which = "pairs.num_prompts" if prompts == self.pairs.num_prompts else "task.train_size"
            raise ValueError(f"{at}.val_pairs={self.val_pairs} must be below {at}.{which}="
                             f"{prompts}: the pairs come from that many training questions, "
                             "each giving at most one pair")
        finite(self, at, ("label_smoothing",))
        finite(self, at, ("simpo_gamma",), low=0.0)  # SimPO's target reward margin
        positive(self, at, ("kto_desirable_weight", "kto_undesirable_weight"))
        flags(self, at, ("ipo_length_normalize",))
        choice(f"{at}.dpo_loss_type", self.dpo_loss_type, DPO_LOSS_TYPES)
        choice(f"{at}.f_divergence_type", self.f_divergence_type, F_DIVERGENCE_TYPES)
        for name, default in (("dpo_loss_type", "sigmoid"), ("f_divergence_type", "reverse_kl"),
                              ("f_alpha_divergence_coef", 0.5)):
            if self.loss != "dpo" and getattr(self, name) != default:
                raise fail(f"{at}.{name}", getattr(self, name),
                           f"{default!r}: it is read by loss='dpo' only, not {self.loss!r}")
        if self.label_smoothing and self.loss not in ("dpo", "simpo"):
            raise fail(f"{at}.label_smoothing", self.label_smoothing,
                       f"0: it is used by dpo and simpo only, and loss={self.loss!r} would "
                       "ignore it")
        try:
            self.build_loss()
        except ValueError as e:  # "beta=0.0; must be ..." -> "Config.beta=0.0; must be ..."
            message = str(e)
            for option, name in LOSS_OPTIONS.items():
                if message.startswith(f"{option}="):
                    message = f"{at}.{name}{message.removeprefix(option)}"
                    break
            else:
                message = f"{at}: {message}"
            raise ValueError(f"{message} (loss={self.loss!r})") from None
        check_parallel(self, at, divisible=("optim.batch_size",) + (
            ("sft.batch_size",) if self.model.init_from is None else ()),
                       unsupported=("pp",))  # the split policy scores the reference
        check_converted_run(self, at, training=("none", "fp8"))

    def build_loss(self):
        """The `TrainingLoss` these settings describe."""
        beta = DEFAULT_BETA[self.loss] if self.beta is None else self.beta
        dpo = {"loss_type": self.dpo_loss_type, "f_divergence_type": self.f_divergence_type}
        if self.f_alpha_divergence_coef != 0.5:  # an error unless the divergence reads it
            dpo["f_alpha_divergence_coef"] = self.f_alpha_divergence_coef
        options = {"dpo": {"label_smoothing": self.label_smoothing, **dpo},
                   "ipo": {"length_normalize": self.ipo_length_normalize},
                   "simpo": {"gamma": self.simpo_gamma, "label_smoothing": self.label_smoothing},
                   "kto": {"desirable_weight": self.kto_desirable_weight,
                           "undesirable_weight": self.kto_undesirable_weight},
                   "orpo": {}}[self.loss]
        return get_loss(self.loss, beta=beta, **options)


# Overrides that make the recipe finish in seconds (the recipe test runs every preset with them).
# A 3-step SFT policy answers nothing right, so the task's answer joins the candidates.
TINY: dict[str, Any] = {
    "model.name": "tiny-1m", "model.init_from": None, "task.train_size": 64, "task.eval_size": 8,
    "eval.max_new_tokens": 6, "eval.every": 1, "sft.steps": 3, "sft.batch_size": 8,
    "pairs.num_prompts": 8, "pairs.samples_per_prompt": 2, "pairs.reference_answer": True,
    "sampling.max_new_tokens": 4, "val_pairs": 2, "optim.batch_size": 4, "optim.steps": 2,
    "optim.warmup_steps": 1, "checkpoint.every": 1, "progress": False}


@recorded_run
def main(cfg: Config) -> dict[str, Any] | None:
    """Run the recipe; returns the results dict also written to `out_dir/results.json` (under
    a `parallel` plan on rank 0; None on the other ranks).

    Raises ValueError before writing anything if `out_dir` already holds a run and
    `cfg.resume` is False, `cfg.parallel` does not fit the job, or the task's data does not fit
    the config (`check_task_fits`); later, if rejection sampling gives too few pairs.
    """
    start = time.perf_counter()
    check_task_fits(cfg)
    out = start_run(cfg, sub_runs=("sft",))
    plan = plan_of(cfg)
    writes = plan is None or rank_and_world_size()[0] == 0
    times: dict[str, float] = {}

    # 1. The starting policy (= the reference)
    policy, _ = start_policy(cfg, out)
    times["start_policy_s"] = time.perf_counter() - start

    # 2. Pairs by rejection sampling on training questions, ranked by the task's verifier
    items, scorer = held_out_items(cfg.task)
    task = ReasoningGymTask(name=cfg.task.name, size=cfg.task.train_size, seed=cfg.seed,
                            config=dict(cfg.task.options), held_out_size=cfg.task.eval_size,
                            held_out_seed=cfg.task.eval_seed)
    if [it["question"] for it in task.held_out()] != [it["question"] for it in items]:
        raise RuntimeError("the task's held-out items differ from the SFT stage's")
    t0 = time.perf_counter()

    def make_pairs():
        s = cfg.sampling
        rows, stats = make_preference_pairs(
            policy, task.train_items[:cfg.pairs.num_prompts], rank=task.verifier,
            n=cfg.pairs.samples_per_prompt, max_new_tokens=s.max_new_tokens,
            temperature=s.temperature, top_p=s.top_p, seed=cfg.seed,
            reference_answer=(lambda item: item["answer"]) if cfg.pairs.reference_answer
            else None)
        return rows, stats.as_dict()

    def pairs():
        return cached_pairs(out, resume=cfg.resume, make=make_pairs)

    rows, pair_stats = pairs() if plan is None else on_rank_zero(pairs)
    # a pair whose sampled answer is empty, or too long once decoded and encoded again, is data:
    # left out and counted (results["unusable_pairs"]) before the split
    rows, unusable = usable_pairs(rows, policy.tokenizer, max_seq_len=cfg.max_seq_len)
    times["pairs_s"] = time.perf_counter() - t0
    if writes:
        print(f"{policy}\npairs: {pair_stats}" + (f", unusable: {unusable}" if unusable else ""))
    if len(rows) <= cfg.val_pairs:
        raise ValueError(f"rejection sampling gave {len(rows)} usable pairs, not more than "
                         f"val_pairs={cfg.val_pairs} ({pair_stats}, unusable: {unusable}); raise "
                         "pairs.num_prompts or pairs.samples_per_prompt, or set "
                         "pairs.reference_answer=true")
    train_rows, val_rows = rows[:-cfg.val_pairs], rows[-cfg.val_pairs:]

    # 3. Datasets and reference log-probs under the starting policy
    objective = cfg.build_loss()
    if cfg.loss == "kto":
        train_rows, val_rows = pairs_to_kto_rows(train_rows), pairs_to_kto_rows(val_rows)
    dataset_cls = KTODataset if cfg.loss == "kto" else PreferenceDataset
    dataset = dataset_cls(train_rows, policy.tokenizer, max_seq_len=cfg.max_seq_len)
    val_dataset = dataset_cls(val_rows, policy.tokenizer, max_seq_len=cfg.max_seq_len)
    before_csv, max_new_tokens = out / "eval_before.csv", cfg.eval.max_new_tokens
    # adapters / FP8: the reference is the base (adapters disabled: no second copy in memory)
    converters = [str(r) for r in convert_for_training(policy.model, cfg, spec=policy.spec,
                                                       verbose=writes)]
    before_table = runtime = None
    if plan is not None:  # evaluate the plain policy (rank 0), then split it
        before_table = _before(cfg, policy, items, scorer, before_csv) if writes else None
        runtime = plan.parallelize(policy.model, spec=policy.spec)
    t0 = time.perf_counter()
    if objective.needs_reference:  # the starting policy is the reference (split, if planned)
        compute_reference_logps(policy if runtime is None else runtime, dataset)
        compute_reference_logps(policy if runtime is None else runtime, val_dataset)
    times["reference_s"] = time.perf_counter() - t0
    val_batch = val_dataset.collate(range(len(val_dataset)))

    # 4. Held-out accuracy of the starting policy, then training
    if plan is None:
        before_table = _before(cfg, policy, items, scorer, before_csv)

    def eval_fn(model: torch.nn.Module) -> dict[str, float]:
        return {f"val_{k}": v for k, v in objective.metrics(model, val_batch).items()}

    o = cfg.optim
    if plan is None:
        loader = PreferenceLoader(dataset, batch_size=o.batch_size, seed=cfg.seed)
    else:
        loader = ShardedPreferenceLoader(dataset, batch_size=o.batch_size, seed=cfg.seed,
                                         rank=runtime.data_rank, world_size=runtime.data_size)
    optimizer, schedule = o.build(trainable_parameters(policy.model))
    trainer = Trainer(policy.model, optimizer, data=loader, loss=objective,
                      lr_scheduler=schedule, grad_accum_steps=o.grad_accum_steps,
                      max_grad_norm=o.max_grad_norm, run_dir=out, eval_fn=eval_fn,
                      eval_every=cfg.eval.every, checkpoint_every=cfg.checkpoint.every,
                      keep_last=cfg.checkpoint.keep_last, progress=cfg.progress, seed=cfg.seed,
                      resume=cfg.resume, runtime=runtime)
    t0 = time.perf_counter()
    val_start = trainer.evaluate() if trainer.step_count == 0 else {}
    metrics = trainer.fit(o.steps)
    stop_if_interrupted(trainer, out, {"loss": cfg.loss, "pairs": pair_stats})
    times["train_s"] = time.perf_counter() - t0
    if plan is not None:
        policy = unsharded_policy(policy, runtime)  # every rank; then rank 0 evaluates, writes
        if not writes:
            barrier()
            return None
    plot_curves(metrics, out / "preference_curves.png",
                [(c, c) for c in ("loss", "eval/val_reward_margin", "eval/val_reward_accuracy")],
                xlabel=f"{cfg.loss} step")

    # 5. Held-out accuracy after, paired with before on the same items
    after = evaluate(policy, items, scorer, max_new_tokens=max_new_tokens)
    write_table(after.table, out / "eval_after.csv")
    diff = paired_bootstrap_diff(after.table["correct"].to_numpy(),
                                 before_table["correct"].to_numpy(), seed=cfg.seed)
    adapters = export_adapters(policy.model, cfg, out, spec=policy.spec)  # adapter/, merged
    policy.save(out / "policy")
    results = {"loss": cfg.loss, "objective": repr(objective), "model": cfg.model.name,
               "init_from": cfg.model.init_from, "params": policy.num_parameters(),
               "task_config": cfg.task.options, "pairs": pair_stats,
               "train_samples": len(dataset), "val_samples": len(val_dataset),
               "data": dataset.stats.as_dict(), "steps": o.steps,
               "before": accuracy_of(before_table), "after": after.as_dict(), "difference": diff,
               "val_at_start": val_start,
               "val_at_end": {c: float(metrics[c].dropna().iloc[-1]) for c in metrics
                              if str(c).startswith("eval/") and metrics[c].notna().any()},
               "final_train_loss": float(metrics["loss"].iloc[-1]), **times,
               "wall_s": time.perf_counter() - start, **adapters}
    if converters:
        results["converters"] = converters
    if unusable:
        results["unusable_pairs"] = unusable
    _write_results(results, out, cfg.task.name)
    if plan is not None:
        barrier()  # the other ranks return once the results are on disk
    return results


def _before(cfg: Config, policy, items, scorer, path) -> Any:
    """The held-out evaluation table of the starting policy (read back when resuming)."""
    table = read_table(path) if cfg.resume else None
    if table is None:
        table = evaluate(policy, items, scorer, max_new_tokens=cfg.eval.max_new_tokens).table
        write_table(table, path)
    return table


def _write_results(results: dict[str, Any], out: Path, task: str) -> None:
    p = results["pairs"]
    loss = results["loss"].upper()
    lines = [f"# {loss} on {task} {results['task_config']}", "",
             f"{results['objective']}, model {results['model']} "
             f"({results['params'] / 1e6:.2f}M params), {results['steps']} steps, "
             f"wall {results['wall_s']:.0f} s", "",
             f"pairs: {p['pairs']} from {p['prompts']} prompts x "
             f"{p['samples'] // max(p['prompts'], 1)} samples; skipped "
             f"{p['skipped_all_equal']} all-equal, {p['skipped_too_few']} too few usable; "
             f"excluded {p['excluded']}; {results['train_samples']} training / "
             f"{results['val_samples']} validation {'rows' if loss == 'KTO' else 'pairs'}", "",
             *accuracy_table([(f"{name} {loss}", results[name]) for name in ("before", "after")]),
             "", difference_line("after minus before", results["difference"]), "",
             "validation set, start -> end: " + ", ".join(
                 f"{k.removeprefix('eval/val_')} {v:.3f} -> "
                 f"{results['val_at_end'].get(k, float('nan')):.3f}"
                 for k, v in results["val_at_start"].items()), ""]
    write_results(out, results, "\n".join(lines))


if __name__ == "__main__":
    main(Config())
