"""Preference optimisation on a reasoning-gym task: SFT warm start -> pairs by rejection
sampling -> DPO (or IPO, SimPO, KTO, ORPO) -> held-out greedy accuracy before and after. The run
of `recipes/dpo.py` (`PreferenceRunConfig`, `run_preference`).

Stages, all on the reasoning-gym task `task.name` (the task's own question text):
  1. The starting policy: `model.init_from` (a HF folder), or the SFT warm start
     (`posttrain.workflows.sft.warm_start`, section `sft`; run folder `sft/`).
  2. Pairs (`posttrain.workflows.pairs`): `pairs.samples_per_prompt` completions of each of
     `pairs.num_prompts` training questions from the starting policy (section `sampling`),
     ranked by the task's verifier; best vs worst where they differ. The last `val_pairs` pairs
     are kept out of training for the preference metrics. KTO gets each pair as one desirable
     and one undesirable row.
  3. Held-out greedy accuracy of the starting policy, and reference log-probs of every pair
     under it (the reference), once.
  4. Training with the chosen loss (`posttrain.preference.objectives`), pair-normalised over
     each step: `optim.steps` steps, or fewer with `budget_s` (stages 2-4 together, in
     seconds: an equal-compute baseline of an RL run's `rl_train_s`).
  5. Held-out greedy accuracy of the trained policy on the same `task.eval_size` items
     (`held_out_items`, never in any training set), 95% Wilson intervals, and the difference
     with a 95% paired-bootstrap interval; with `eval.samples` k > 0, sampled pass@1 and
     pass@k of the starting and trained policies and their paired difference
     (`posttrain.workflows.rl_evaluation.sampled_evaluations`, as the RL and RFT runs).

Run folder: `results.json` / `results.md`, `metrics.jsonl` (per step; eval/val_* = loss, rewards,
margin and reward accuracy on the held-out pairs), `preference_curves.png`, `pairs.jsonl`,
`eval_before.csv` / `eval_after.csv` (`eval_sampled_after_{sft,LOSS}.csv`), `checkpoints/`,
`policy/` (HF format), `sft/`.

Own pairs (`data.train`, section `data`; `posttrain.workflows.own_pairs`): the user's rows
replace stages 1-2 and 5: the starting policy (and reference) is `model.init_from`, or the SFT
warm start on the training rows' chosen responses (DPO paper, section 4); `data.eval` or
`data.eval_fraction` of the prompts are held out; no task item is sampled or scored. The
held-out metrics, TRL's `DPOTrainer` evaluation metrics (loss, rewards, margin, reward accuracy:
defined in `posttrain.workflows.own_pairs`), are recorded every `eval.every` steps
(metrics.jsonl `eval/val_*`) and before and after training (results.json "validation").

With a `parallel` plan (a job of its world size; section `parallel`): the SFT stage and the
policy are split by it, rank 0 samples the pairs (broadcast to the others) and evaluates (the
starting policy before the split), the reference log-probs are computed once on the split
starting policy (it is the reference), the pairs are sharded over the data-parallel ranks
(`ShardedPreferenceLoader`), and rank 0 saves the gathered weights; only rank 0 returns the
results (the others None).

Example:
    >>> PreferenceRunConfig(loss="ipo", label_smoothing=0.1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Config.label_smoothing=0.1; must be 0: it is used by dpo and simpo only, ...
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from posttrain.data import KTODataset, PreferenceDataset, pairs_to_kto_rows
from posttrain.policy.policy import Policy
from posttrain.preference import compute_reference_logps
from posttrain.rewards import paired_bootstrap_diff
from posttrain.train import Trainer
from posttrain.workflows.own_pairs import (
    held_out_metrics,
    own_pairs,
    own_pairs_markdown,
    own_start_policy,
)
from posttrain.workflows.pairs import pair_loader, sampled_pairs
from posttrain.workflows.preference_config import (  # importable from here too
    DEFAULT_BETA,
    LOSSES,
    PreferenceRunConfig,
)
from posttrain.workflows.quantization import (
    convert_for_training,
    export_adapters,
    trainable_parameters,
)
from posttrain.workflows.recipe_run import RecipeRun
from posttrain.workflows.reports import (
    accuracy_of,
    accuracy_table,
    demo_split_lines,
    difference_line,
    plot_curves,
    read_table,
    write_table,
)
from posttrain.workflows.rl_evaluation import sampled_evaluations, sampled_lines
from posttrain.workflows.run_state import recorded_run
from posttrain.workflows.sft import start_policy, unsharded_policy
from posttrain.workflows.task_data import evaluate, held_out_items, training_task

if TYPE_CHECKING:
    from posttrain.policy.engine_slot import EngineSlot

__all__ = ["PreferenceRunConfig", "run_preference", "LOSSES", "DEFAULT_BETA"]


@recorded_run
def run_preference(cfg: PreferenceRunConfig) -> dict[str, Any] | None:
    """Run SFT -> pairs -> preference optimisation -> evaluation; returns the results dict also
    written to `out_dir/results.json` (under a `parallel` plan on rank 0; None on the other
    ranks).

    Raises:
        ValueError: before writing anything if `out_dir` already holds a run and `cfg.resume`
            is False, `cfg.parallel` does not fit the job, or the task's data does not fit the
            config (`check_task_fits`); later, if rejection sampling gives too few pairs.
    """
    run = RecipeRun.start(cfg, sub_runs=("sft",))
    with cfg.rollout.slot(run.out) as engines:  # a vllm server stops when the run ends
        return _run(run, cfg, engines)


def _run(run: RecipeRun, cfg: PreferenceRunConfig, engines: EngineSlot) -> dict[str, Any] | None:
    """`run_preference` after its start: `engines` samples the pairs and the held-out
    evaluations (rank 0)."""
    out, plan = run.out, run.plan
    times: dict[str, float] = {}

    # 1-2. The starting policy (= the reference) and the pairs: own rows, or sampled from it
    items: list[dict] = []
    scorer, pair_stats, source = None, None, None
    unusable: dict[str, int] = {}
    if cfg.data.given:
        own = own_pairs(
            cfg.data, cfg.model.tokenizer(), max_seq_len=cfg.max_seq_len, kto=cfg.loss == "kto"
        )
        policy, _ = own_start_policy(cfg, out, own)
        times["start_policy_s"] = run.seconds()
        dataset, val_dataset, source = own.train, own.held, own.name
        if run.writes:
            print(f"{policy}\n{source}: {dataset.stats.as_dict()}")
    else:
        policy, _ = start_policy(cfg, out)
        times["start_policy_s"] = run.seconds()
        items, scorer = held_out_items(cfg.task)
        t0 = time.perf_counter()
        dataset, val_dataset, pair_stats, unusable = _sampled(run, cfg, policy, items, engines)
        times["pairs_s"] = time.perf_counter() - t0

    # 3. Held-out accuracy and reference log-probs of the starting policy
    objective = cfg.build_loss()
    # adapters / FP8: the reference is the base (adapters disabled: no second copy in memory)
    converters = [
        str(r)
        for r in convert_for_training(policy.model, cfg, spec=policy.spec, verbose=run.writes)
    ]
    # the plain policy, evaluated before a plan splits it (rank 0 alone evaluates)
    before_table = _before(cfg, policy, items, scorer, out, engines) if run.writes else None
    runtime = None if plan is None else run.parallelize(policy.model, spec=policy.spec)
    t0 = time.perf_counter()
    if objective.needs_reference:  # the starting policy is the reference (split, if planned)
        for scored in (dataset, val_dataset):
            if scored is not None:
                compute_reference_logps(
                    policy if runtime is None else runtime,
                    scored,
                    chunk_tokens=cfg.optim.loss_chunk_tokens,
                )
    times["reference_s"] = time.perf_counter() - t0
    val_batch = None if val_dataset is None else val_dataset.collate(range(len(val_dataset)))

    # 4. Training
    def eval_fn(model: torch.nn.Module) -> dict[str, float]:
        return {f"val_{k}": v for k, v in objective.metrics(model, val_batch).items()}

    o = cfg.optim
    loader = pair_loader(dataset, batch_size=o.batch_size, seed=cfg.seed, runtime=runtime)
    optimizer, schedule = o.build(trainable_parameters(policy.model))
    trainer = Trainer(
        policy.model,
        optimizer,
        data=loader,
        loss=objective,
        lr_scheduler=schedule,
        grad_accum_steps=o.grad_accum_steps,
        eval_fn=None if val_batch is None else eval_fn,
        eval_every=0 if val_batch is None else cfg.eval.every,
        **run.trainer_options(runtime),
    )
    t0 = time.perf_counter()
    val_start = trainer.evaluate() if trainer.step_count == 0 and val_batch is not None else {}
    budget = (
        None
        if cfg.budget_s is None
        else cfg.budget_s - sum(times.get(k, 0.0) for k in ("pairs_s", "reference_s"))
    )
    metrics = trainer.fit(o.steps, budget_s=budget)
    if metrics.empty and budget is not None and not trainer.interrupted:
        raise ValueError(
            f"budget_s={cfg.budget_s} was spent before the first step (pairs "
            f"{times.get('pairs_s', 0.0):.1f} s, reference {times['reference_s']:.1f} s): raise "
            "budget_s, or lower pairs.num_prompts or pairs.samples_per_prompt"
        )
    run.stop_if_interrupted(
        trainer, {"loss": cfg.loss, **({"pairs": pair_stats} if source is None else {})}
    )
    val_end = trainer.evaluate() if val_batch is not None and cfg.data.given else {}
    times["train_s"] = time.perf_counter() - t0
    policy = unsharded_policy(policy, trainer.runtime)  # under a plan: every rank gathers
    if run.others_return():
        return None
    assert before_table is not None  # this process writes (run.writes): it evaluated before
    plot_curves(
        metrics,
        out / "preference_curves.png",
        [(c, c) for c in ("loss", "eval/val_reward_margin", "eval/val_reward_accuracy")],
        xlabel=f"{cfg.loss} step",
    )

    # 5. Held-out accuracy after, paired with before on the same items
    if items:
        sampler = engines.sampler(policy)
        after = evaluate(sampler, items, scorer, max_new_tokens=cfg.eval.max_new_tokens)
        write_table(after.table, out / "eval_after.csv")
        diff = paired_bootstrap_diff(
            after.table["correct"].to_numpy(), before_table["correct"].to_numpy(), seed=cfg.seed
        )
        start = out / "sft" / "policy" if cfg.model.init_from is None else cfg.model.init_from
        sampled, _ = sampled_evaluations(
            cfg, out, items, scorer, policy, engines, stage=cfg.loss, start=Path(start)
        )
    adapters = export_adapters(policy.model, cfg, out, spec=policy.spec)  # adapter/, merged
    policy.save(out / "policy")
    results: dict[str, Any] = {
        "loss": cfg.loss,
        "objective": repr(objective),
        "model": cfg.model.name,
        "init_from": cfg.model.init_from,
        "params": policy.num_parameters(),
    }
    if source is not None:  # own pairs: held-out preference metrics, no task items
        results["dataset"] = source
    else:
        results.update(**cfg.task.report(), pairs=pair_stats)
    results.update(
        train_samples=len(dataset),
        val_samples=0 if val_dataset is None else len(val_dataset),
        data=dataset.stats.as_dict(),
        steps=trainer.step_count,  # fewer than optim.steps when budget_s stopped it
    )
    if source is not None:
        results["validation"] = held_out_metrics(val_dataset, val_start, val_end)
    else:
        results.update(
            before=accuracy_of(before_table),
            after=after.as_dict(),
            difference=diff,
            **sampled,
            val_at_start=val_start,
            val_at_end={
                c: float(metrics[c].dropna().iloc[-1])
                for c in metrics
                if str(c).startswith("eval/") and metrics[c].notna().any()
            },
        )
    results.update(
        final_train_loss=float(metrics["loss"].iloc[-1]), **times, wall_s=run.seconds(), **adapters
    )
    if converters:
        results["converters"] = converters
    if unusable:
        results["unusable_pairs"] = unusable
    markdown = (
        own_pairs_markdown(results)
        if source is not None
        else _results_markdown(results, cfg.task.name)
    )
    run.write(results, markdown)
    return run.done(results)


def _sampled(
    run: RecipeRun,
    cfg: PreferenceRunConfig,
    policy: Policy,
    items: list[dict],
    engines: EngineSlot,
) -> tuple[Any, Any, dict[str, Any], dict[str, int]]:
    """Stage 2 on the task: pairs by rejection sampling on training questions (never one of
    the held-out `items`), ranked by the task's verifier; the last `val_pairs` held out.
    Returns (training dataset, held-out dataset, pair statistics, unusable pairs by reason).
    Raises ValueError if rejection sampling gives no more than `val_pairs` usable pairs."""
    task = training_task(cfg, size=cfg.task.train_size, seed=cfg.seed, held_out=items)
    rows, pair_stats, unusable = sampled_pairs(
        run,
        policy,
        task,
        max_seq_len=cfg.max_seq_len,
        stats_file="pair_stats.json",
        engines=engines,
    )
    if run.writes:
        print(f"{policy}\npairs: {pair_stats}" + (f", unusable: {unusable}" if unusable else ""))
    if len(rows) <= cfg.val_pairs:
        raise ValueError(
            f"rejection sampling gave {len(rows)} usable pairs, not more than "
            f"val_pairs={cfg.val_pairs} ({pair_stats}, unusable: {unusable}); raise "
            "pairs.num_prompts or pairs.samples_per_prompt, or set "
            "pairs.reference_answer=true"
        )
    train_rows: Sequence[Mapping[str, Any]] = rows[: -cfg.val_pairs]
    val_rows: Sequence[Mapping[str, Any]] = rows[-cfg.val_pairs :]
    if cfg.loss == "kto":
        train_rows, val_rows = pairs_to_kto_rows(train_rows), pairs_to_kto_rows(val_rows)
    dataset_cls = KTODataset if cfg.loss == "kto" else PreferenceDataset
    dataset = dataset_cls(train_rows, policy.tokenizer, max_seq_len=cfg.max_seq_len)
    val_dataset = dataset_cls(val_rows, policy.tokenizer, max_seq_len=cfg.max_seq_len)
    return dataset, val_dataset, pair_stats, unusable


def _before(
    cfg: PreferenceRunConfig,
    policy: Policy,
    items: list[dict],
    scorer: Any,
    out: Path,
    engines: EngineSlot,
) -> pd.DataFrame:
    """The held-out evaluation table of the starting policy, `eval_before.csv` (read back when
    resuming), sampled by `engines`; an empty table without `items` (own pairs)."""
    if not items:
        return pd.DataFrame()
    path = out / "eval_before.csv"
    table = read_table(path) if cfg.resume else None
    if table is None:
        sampler = engines.sampler(policy)
        table = evaluate(sampler, items, scorer, max_new_tokens=cfg.eval.max_new_tokens).table
        write_table(table, path)
    return table


def _results_markdown(results: dict[str, Any], task: str) -> str:
    p = results["pairs"]
    loss = results["loss"].upper()
    lines = [
        f"# {loss} on {task} {results['task_config']}",
        "",
        *demo_split_lines(results, "pair prompts"),
        f"{results['objective']}, model {results['model']} "
        f"({results['params'] / 1e6:.2f}M params), {results['steps']} steps, "
        f"wall {results['wall_s']:.0f} s",
        "",
        f"pairs: {p['pairs']} from {p['prompts']} prompts x "
        f"{p['samples'] // max(p['prompts'], 1)} samples; skipped "
        f"{p['skipped_all_equal']} all-equal, {p['skipped_too_few']} too few usable; "
        f"excluded {p['excluded']}; {results['train_samples']} training / "
        f"{results['val_samples']} validation {'rows' if loss == 'KTO' else 'pairs'}",
        "",
        *accuracy_table([(f"{name} {loss}", results[name]) for name in ("before", "after")]),
        "",
        difference_line("after minus before", results["difference"]),
        "",
        *sampled_lines(results, results["loss"], loss),
        "validation set, start -> end: "
        + ", ".join(
            f"{k.removeprefix('eval/val_')} {v:.3f} -> "
            f"{results['val_at_end'].get(k, float('nan')):.3f}"
            for k, v in results["val_at_start"].items()
        ),
        "",
    ]
    return "\n".join(lines)
