"""The RL stage of the RL recipes (`posttrain.workflows.rl` on a reasoning-gym task,
`posttrain.workflows.rl_data` on own prompt rows): the trainer built from the config
(`rl_trainer`) and the curves of its metrics (`plot_rl_curves`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.core.distributed import rank_and_world_size
from posttrain.models.lora import has_adapters
from posttrain.policy.policy import Policy
from posttrain.rl.parallel import frozen_reference
from posttrain.rl.trainer import RLTrainer, ValueHead
from posttrain.workflows.parallel import plan_of
from posttrain.workflows.quantization import convert_for_training, trainable_parameters
from posttrain.workflows.recipe_run import RecipeRun
from posttrain.workflows.reports import plot_curves
from posttrain.workflows.rl_config import RLRunConfig

if TYPE_CHECKING:
    import pandas as pd

    from posttrain.policy.engine_slot import EngineSlot

__all__ = ["rl_trainer", "plot_rl_curves", "rollout_options"]

_CURVES = [
    ("reward_mean", "reward (mean)"),
    ("accuracy", "accuracy (outcome ok)"),
    ("kl", "KL to reference"),
    ("ppo_kl", "KL old -> new (ppo_kl)"),
]


def rl_trainer(
    run: RecipeRun,
    cfg: RLRunConfig,
    engines: EngineSlot,
    policy: Policy,
    task: Any,
    callbacks: list[Any],
) -> tuple[RLTrainer, list[str]]:
    """The RL stage's trainer of `policy` on `task` (an `EnvDataset`) with `callbacks`, and the
    reports of the converters (adapters, FP8) applied to the policy: `cfg.rl.algorithm()`,
    truncated importance sampling against a quantised sampler, the parallel plan (the policy
    and its frozen reference split the same way, here only), a value head where the algorithm
    has one, the optimizer and schedule, and the rollout engine."""
    algo, o, s = cfg.rl.algorithm(), cfg.optim, cfg.sampling
    q, plan = cfg.quantization, run.plan
    if q.rollout_correction != "none":  # truncated IS against the (quantised) sampler
        algo = dataclasses.replace(
            algo,
            rollout_correction=q.rollout_correction,
            rollout_is_threshold=q.rollout_is_threshold,
        )
    converters = [
        str(r)
        for r in convert_for_training(
            policy.model, cfg, spec=policy.spec, verbose=rank_and_world_size()[0] == 0
        )
    ]
    runtime = reference = None  # before the optimizer: the plan replaces the parameters
    if plan is not None:  # the policy and its frozen reference, split the same way, here only
        if algo.kl_coef > 0 and not has_adapters(policy.model):
            reference = frozen_reference(policy)  # the starting weights
        runtime = run.parallelize(policy.model, spec=policy.spec)
        if reference is not None:
            run.parallelize(reference, spec=policy.spec, mesh=runtime.mesh)
    value_head = ValueHead(policy.spec.embed_dim) if algo.use_value_head else None
    optimizer, schedule = o.build(trainable_parameters(policy.model, value_head))
    trainer = RLTrainer(
        policy,
        optimizer,
        task=task,
        algo=algo,
        prompts_per_step=cfg.rl.prompts_per_step,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        value_head=value_head,
        reference=reference,
        lr_scheduler=schedule,
        rollout_quantization=q.rollout_quantization(),
        loss_chunk_tokens=o.loss_chunk_tokens,
        **rollout_options(cfg, engines, policy),  # builtin, or vllm: a server in out/vllm/
        **run.trainer_options(runtime, callbacks=callbacks),
    )
    return trainer, converters


def plot_rl_curves(cfg: RLRunConfig, metrics: pd.DataFrame, out: Path) -> None:
    """rl_curves.png: the first three of `_CURVES` in the metrics, then (own reward functions)
    each function's mean `reward/<name>` in rl_reward_terms.png."""
    xlabel = f"{cfg.rl.algo} step"
    plot_curves(
        metrics, out / "rl_curves.png", [c for c in _CURVES if c[0] in metrics][:3], xlabel=xlabel
    )
    terms = [
        (c, c) for c in metrics.columns if c.startswith("reward/") and not c.endswith("/failures")
    ]
    if terms:
        plot_curves(metrics, out / "rl_reward_terms.png", terms, xlabel=xlabel)


def rollout_options(cfg: RLRunConfig, engines: EngineSlot, policy: Policy) -> dict[str, Any]:
    """`RLTrainer`'s rollout keywords: the builtin engine by name (the trainer as before); an
    engine apart from the policy (vllm) started by the run's slot from `policy` and lent to
    the trainer, which syncs it before every rollout and leaves it open for the evaluations.
    Under a parallel plan the vllm engine goes by name with its options: the trainer's ranks
    share one server (`posttrain.rl.engine_plan`; a slot's engine would be each rank's own),
    and rank 0's evaluations afterwards sample through the run's slot."""
    options = cfg.rollout.trainer_options()
    if engines.apart_from_policy and plan_of(cfg) is None:
        options.update(rollout_engine=engines.sampler(policy), rollout_options=None)
    return options
