"""SFT and continued pretraining (CPT) of a policy with held-out accuracy before and after: the
`recipes/sft.py` run (`SFTConfig`, `run_sft`) and the SFT warm start that the GRPO, PPO, DPO and
reward-model recipes begin with (`warm_start`).

Data: `task.name` is a reasoning-gym task (questions kept exactly as the task gives them) or a
JSONL/JSON file (SFT rows with "messages" or "prompt"/"completion"; CPT rows with "text"); or
the `data` section (`DataConfig`, `posttrain.workflows.own_data`): own rows from a
JSONL/JSON/Parquet/CSV file, a DataFrame or a HF dataset, with held-out rows whose validation
loss (and greedy exact match) is recorded before and after training and every `eval.every`
steps; the `task.*` keys are then unused.
Held-out items: `task.eval_size` distinct questions generated from `task.eval_seed`
(`held_out_items`); the training rows drop every one of those questions.

Several processes (`posttrain.launch` with more than one task, which initialises
torch.distributed): data-parallel training of the same global batch; rank 0 evaluates and writes.
With a `parallel` plan (a `ParallelPlan`) the policy is split by it before the optimizer is
built, the loader shards over the plan's data-parallel ranks, and after training every rank
gathers the full weights (`unsharded_policy`) so that rank 0 evaluates and saves a plain policy.

Example:
    >>> cfg = SFTConfig(optim=BatchOptimConfig(steps=5, warmup_steps=20))
    Traceback (most recent call last):
    ...
    ValueError: Config.optim.warmup_steps=20 exceeds Config.optim.steps=5; lower warmup_steps
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from posttrain.core.stage_files import read_stage_file
from posttrain.data.loader import SFTLoader
from posttrain.policy.policy import Policy
from posttrain.train.losses import SFTCrossEntropy
from posttrain.train.plan_compat import runtime_of
from posttrain.train.runtime import Runtime
from posttrain.train.trainer import Trainer
from posttrain.verifiers.reasoning_gym_gold import GoldReport
from posttrain.workflows.config import (
    BatchOptimConfig,  # noqa: F401  (the module's example)
    CheckpointConfig,
    EvalConfig,
    ModelConfig,
    SFTWarmStartConfig,
)
from posttrain.workflows.own_data import DataConfig, HeldOut, own_data
from posttrain.workflows.quantization import (
    convert_for_training,
    export_adapters,
    finish_quantized,
    trainable_parameters,
)
from posttrain.workflows.recipe_run import RecipeRun
from posttrain.workflows.reports import (
    accuracy_of,
    accuracy_table,
    plot_curves,
    read_table,
    validation_lines,
    write_table,
)
from posttrain.workflows.rollout_config import RolloutConfig
from posttrain.workflows.run_state import recorded_run
from posttrain.workflows.sft_config import MODES, SFTConfig

# the task's data, here before they had a module of their own
from posttrain.workflows.task_data import (
    PROBE_ITEMS,
    build_dataset,
    check_seq_len,
    check_task_fits,
    evaluate,
    held_out_items,
)

if TYPE_CHECKING:
    from reasoning_gym.dataset import ProceduralDataset  # the task's items and scorer

    from posttrain.policy.engine_slot import EngineSlot

__all__ = [
    "SFTConfig",
    "run_sft",
    "warm_start",
    "start_policy",
    "held_out_items",
    "evaluate",
    "check_seq_len",
    "check_task_fits",
    "unsharded_policy",
    "MODES",
    "PROBE_ITEMS",
    "build_dataset",
]


def warm_start(
    cfg: Any,
    out: Path,
    *,
    folder: str = "sft",
    init_from: Path | None = None,
    sft: SFTWarmStartConfig | None = None,
    data: DataConfig | None = None,
) -> dict[str, Any] | None:
    """The SFT stage of a recipe whose `cfg` has `model`, `task`, `eval`, `sft`
    (`SFTWarmStartConfig`), `seed`, `progress` and `resume`: `run_sft` into `out/folder` (the
    policy lands in `out/folder/policy`), or, when resuming a run whose stage finished, its saved
    results. Returns the SFT results dict.

    `init_from` (a policy folder) replaces the fresh `cfg.model.name` policy and `sft` replaces
    `cfg.sft` (an `SFTWarmStartConfig`: optimizer settings and demonstrations; its `optim()` is
    the stage's `optim` section): the RL recipes' more-SFT baseline continues the warm start's
    policy this way on the same demonstrations (`MoreSFTBaselineConfig.warm_start`). `data`
    (a `DataConfig`) trains on those rows instead of the task (`posttrain.workflows.own_pairs`:
    the chosen responses of own preference pairs).

    Under a parallel plan, as `run_sft`, only rank 0 returns the results (the others None).
    """
    sft = cfg.sft if sft is None else sft
    task = cfg.task
    if sft.demonstrations is not None:  # the first N items of the same generator
        task = dataclasses.replace(task, train_size=sft.demonstrations)
    model = ModelConfig(
        name=cfg.model.name, init_from=None if init_from is None else str(init_from)
    )
    rollout = RolloutConfig(  # the engine of its evaluation: the recipe's (an RL one's too)
        **{f.name: getattr(cfg.rollout, f.name) for f in dataclasses.fields(RolloutConfig)}
    )
    sft_cfg = SFTConfig(
        model=model,
        task=task,
        data=DataConfig() if data is None else data,
        eval=EvalConfig(max_new_tokens=cfg.eval.max_new_tokens),
        optim=sft.optim(),
        checkpoint=CheckpointConfig(every=max(1, sft.steps // 10)),
        seed=cfg.seed,
        out_dir=str(out / folder),
        resume=cfg.resume,
        progress=cfg.progress,
        parallel=cfg.parallel,
        rollout=rollout,
    )
    done = _finished_results(out / folder) if cfg.resume else None
    return done if done is not None else run_sft(sft_cfg)


def _finished_results(out: Path) -> dict[str, Any] | None:
    """The results of a finished stage in `out`; None if it did not finish, was interrupted, or
    its held-out table `eval_after.csv` (which later stages read) is gone: the stage then runs
    again from its last checkpoint.

    Raises:
        StageFileError: if `results.json` or `eval_after.csv` was cut or changed after it was
            written (`posttrain.core.stage_files`).
    """
    data = read_stage_file(out / "results.json")
    results = None if data is None else json.loads(data)
    if results is None or results.get("interrupted"):
        return None
    return None if "after" in results and read_table(out / "eval_after.csv") is None else results


def start_policy(cfg: Any, out: Path) -> tuple[Policy, dict[str, Any] | None]:
    """The policy a preference or reward-model recipe starts from: `cfg.model.init_from` (a HF
    folder), or the SFT warm start's (`warm_start`, which also returns its results)."""
    if cfg.model.init_from is not None:
        return Policy.from_pretrained(cfg.model.init_from), None
    results = warm_start(cfg, out)
    return Policy.from_pretrained(out / "sft" / "policy"), results


def unsharded_policy(policy: Policy, runtime: Runtime | None = None) -> Policy:
    """A plain `Policy` with the full weights of `policy` (a collective when its model is split
    by a ParallelPlan, whose `runtime` is given: every rank calls it and gets the copy; `policy`
    itself otherwise), for evaluation and `save` on rank 0.

    Raises:
        ValueError: for a policy split by a plan given without its runtime.
    """
    runtime = runtime_of(policy.model) if runtime is None else runtime
    if runtime.plan is None:
        return policy
    from posttrain.models.specs import build_model

    param = next(policy.model.parameters())
    model = build_model(policy.spec, device=param.device, dtype=param.dtype, seed=0)
    model.load_state_dict(runtime.full_state_dict())
    return Policy(model, policy.tokenizer, policy.spec)


@recorded_run
def run_sft(cfg: SFTConfig) -> dict[str, Any] | None:
    """Run SFT/CPT; returns the results dict also written to `out_dir/results.json`.

    Under an initialised `torch.distributed` process group (`posttrain.launch`), the ranks train
    data-parallel (`cfg.optim.batch_size` is the global batch and must be divisible by the world
    size), or under `cfg.parallel`'s plan when it has one (the batch divisible by its
    data-parallel size); rank 0 alone writes (config, evaluations, plot, policy, results) while
    the others wait at a barrier, and only rank 0 returns the results; the other ranks return
    None.

    Raises ValueError before writing anything if `out_dir` already holds a run and
    `cfg.resume` is False (on every rank: all of them read the folder before rank 0 writes),
    or the task's data does not fit the config (`check_task_fits`).
    """
    run = RecipeRun.start(cfg, data_parallel=True)
    with cfg.rollout.slot(run.out) as engines:  # a vllm server stops when the run ends
        return _train(run, cfg, engines)


def _train(run: RecipeRun, cfg: SFTConfig, engines: EngineSlot) -> dict[str, Any] | None:
    """`run_sft` after its start: `engines` samples the held-out evaluations (rank 0)."""
    out, plan, writes = run.out, run.plan, run.writes
    policy = (
        Policy.from_pretrained(cfg.model.init_from)
        if cfg.model.init_from
        else Policy.from_spec(cfg.model.name, seed=cfg.seed)
    )
    held: HeldOut | None = None
    if cfg.data.given:
        items, ds, gold, dropped = [], None, GoldReport(cfg.task.name), 0
        dataset, held, row_format = own_data(cfg, policy.tokenizer)
        name = f"{_source_name(cfg.data.train)} ({row_format} rows)"
    else:
        items, ds = held_out_items(cfg.task) if cfg.task.eval_size else ([], None)
        gold, name = GoldReport(cfg.task.name), cfg.task.name
        dataset, dropped = build_dataset(
            cfg, policy.tokenizer, {it["question"] for it in items}, gold
        )
    results: dict[str, Any] = {
        "mode": cfg.mode,
        "dataset": name,
        "steps": cfg.optim.steps,
        "data": dataset.stats.as_dict(),
        "held_out_rows_dropped": dropped,
    }
    chat = cfg.mode == "sft"
    if writes:
        print(
            f"{policy}\n{cfg.mode} data: {dataset.stats.as_dict()}, "
            f"{dropped} rows dropped as held-out questions"
            + (f", gold check: {gold}" if gold.checked else "")
        )
        before = read_table(out / "eval_before.csv") if items and cfg.resume else None
        if before is not None:  # a resumed run: the evaluation before training is done
            results["before"] = accuracy_of(before)
        elif items:
            before = evaluate(
                engines.sampler(policy),
                items,
                ds,
                max_new_tokens=cfg.eval.max_new_tokens,
                chat=chat,
            )
            write_table(before.table, out / "eval_before.csv")
            results["before"] = before.as_dict()
        if held is not None:
            results["validation"] = {"rows": len(held), "before": _held_out(held, policy)}

    # The loader shards each global batch over the ranks of the process group, if there is one
    # (under a plan: over its data-parallel ranks, after the plan split the policy).
    o = cfg.optim
    # adapters, FP8 or QAT (when the config sets them), before the plan and the optimizer
    reports = convert_for_training(policy.model, cfg, spec=policy.spec, verbose=writes)
    if reports:
        results["converters"] = [str(r) for r in reports]
    runtime = None
    rank: int | None = None  # None: SFTLoader's default (the process group's, or one process)
    world_size: int | None = None
    if plan is not None:
        runtime = run.parallelize(policy.model, spec=policy.spec)
        rank, world_size = runtime.data_rank, runtime.data_size
    loader = SFTLoader(
        dataset,
        batch_size=o.batch_size,
        seed=cfg.seed,
        pack=cfg.pack,
        seq_len=cfg.max_seq_len if cfg.pack else None,
        rank=rank,
        world_size=world_size,
    )
    optimizer, schedule = o.build(trainable_parameters(policy.model))
    trainer = Trainer(
        policy.model,
        optimizer,
        data=loader,
        loss=SFTCrossEntropy(loss_chunk_tokens=o.loss_chunk_tokens),
        lr_scheduler=schedule,
        grad_accum_steps=o.grad_accum_steps,
        eval_fn=None if held is None else (lambda model: held.metrics(model, policy.spec)),
        eval_every=cfg.eval.every if held is not None else 0,
        **run.trainer_options(runtime),
    )
    metrics = trainer.fit(o.steps)
    run.stop_if_interrupted(trainer, results)
    policy = unsharded_policy(policy, trainer.runtime)  # every rank, under a plan
    if run.others_return():
        return None
    if held is not None and "validation" in results:
        results["validation"]["after"] = _held_out(held, policy, engines)
    _finish(run, policy, cfg, metrics, items, ds, results, engines)
    return run.done(results)


def _source_name(source: Any) -> str:
    return str(source) if isinstance(source, (str, Path)) else f"a {type(source).__name__}"


def _held_out(held: HeldOut, policy: Policy, engines: EngineSlot | None = None) -> dict:
    """Own data's held-out metrics of `policy` (greedy answers by `engines` where given)."""
    was_training = policy.model.training
    policy.model.eval()
    try:
        sampler = None if engines is None else engines.sampler(policy)
        return held.metrics(policy.model, policy.spec, sampler)
    finally:
        policy.model.train(was_training)


def _finish(
    run: RecipeRun,
    policy: Policy,
    cfg: SFTConfig,
    metrics: pd.DataFrame,
    items: list[dict],
    ds: ProceduralDataset,
    results: dict[str, Any],
    engines: EngineSlot,
) -> None:
    """After training (rank 0): plot, held-out accuracy (sampled by `engines`), policy and
    results files."""
    out = run.out
    results["final_loss"] = float(metrics["loss"].iloc[-1])
    results["tokens_per_s"] = float(metrics["tokens_per_s"].median())
    plot_curves(
        metrics,
        out / "loss.png",
        [("loss", "loss (token mean)")],
        xlabel="optimizer step",
        log_y=True,
    )
    if items:
        after = evaluate(
            engines.sampler(policy),
            items,
            ds,
            max_new_tokens=cfg.eval.max_new_tokens,
            chat=cfg.mode == "sft",
        )
        write_table(after.table, out / "eval_after.csv")
        results["after"] = after.as_dict()
    evaluate_after = (
        (
            lambda p: evaluate(
                p, items, ds, max_new_tokens=cfg.eval.max_new_tokens, chat=cfg.mode == "sft"
            )
        )
        if items
        else None
    )
    results.update(finish_quantized(policy, cfg, out, evaluate_after))  # QAT: convert, evaluate
    # LoRA: the adapter alone (adapter/), then merged into the base that policy/ holds
    results.update(export_adapters(policy.model, cfg, out, spec=policy.spec))
    policy.save(out / "policy")
    lines = [
        f"# {results['mode']} on {results['dataset']}, {results['steps']} steps",
        "",
        f"final loss {results['final_loss']:.4f}, median {results['tokens_per_s']:.0f} "
        "trained tokens/s",
        "",
    ]
    if "validation" in results:
        lines += validation_lines(results["validation"])
    if "after" in results:
        lines += accuracy_table(
            [(k, results.get(k)) for k in ("before", "after", "after_converted")]
        )
    run.write(results, "\n".join(lines) + "\n")
