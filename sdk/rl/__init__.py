"""Reinforcement learning: environments (tasks), RLAlgorithm, advantages and policy losses on
verl, rollout, the replay buffer, RLTrainer, and low-bit rollout (a quantised sampler copy, the
train/infer mismatch, truncated importance sampling). Grouped by purpose, one module each; the
package exports what a run is assembled from (`__all__`):

    algorithm     config (RLAlgorithm, its presets, the advantage / policy-loss names and
                  registries, verl's configs), algorithms (the tensor functions: step_units,
                  policy_loss, kl_loss, ...; `posttrain.rl.algorithms` documents each verl
                  function they call), advantages (compute_advantages)
    environments  environment (Environment, EnvGroupBuilder, Trajectory, Group, the task
                  registry)
    rollout       rollout (collect_groups), buffer (ReplayBuffer), lowbit_rollout (a quantised
                  sampler copy, mismatch metrics, truncated importance sampling)
    training      trainer (RLTrainer, ValueHead), async_rl (AsyncRLTrainer, RolloutWorker)

The algorithms' tensor functions, verl's configs and the low-bit rollout helpers are imported
from their modules; the names the package exported before it was grouped (`FORMER_NAMES`)
still import from it.
"""

from __future__ import annotations

from posttrain.core.lazy import lazy_exports
from posttrain.rl.async_rl import AsyncRLTrainer, RolloutWorker, rollout_schedule
from posttrain.rl.buffer import DATAFRAME_COLUMNS, TRAJECTORY_FIELDS, ReplayBuffer
from posttrain.rl.config import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    ROLLOUT_CORRECTIONS,
    RLAlgorithm,
    advantage_estimators,
    is_group_estimator,
    policy_losses,
    register_advantage_estimator,
    register_policy_loss,
)
from posttrain.rl.environment import (
    FINISH_REASONS,
    TASKS,
    EnvDataset,
    EnvGroupBuilder,
    Environment,
    Group,
    StepResult,
    TextEpisode,
    Trajectory,
    get_task,
    group_rewards,
    registered_tasks,
    run_text_episode,
)
from posttrain.rl.rollout import collect_groups, outcome_counts
from posttrain.rl.trainer import EXCLUDED_OUTCOMES, RLTrainer, ValueHead, make_batch, split_groups

__all__ = [
    # algorithm
    "RLAlgorithm",
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "ROLLOUT_CORRECTIONS",
    "advantage_estimators",
    "policy_losses",
    "is_group_estimator",
    "register_advantage_estimator",
    "register_policy_loss",
    # environments
    "StepResult",
    "Environment",
    "EnvGroupBuilder",
    "EnvDataset",
    "group_rewards",
    "FINISH_REASONS",
    "Trajectory",
    "Group",
    "TextEpisode",
    "run_text_episode",
    "TASKS",
    "get_task",
    "registered_tasks",
    # rollout
    "collect_groups",
    "outcome_counts",
    "ReplayBuffer",
    "TRAJECTORY_FIELDS",
    "DATAFRAME_COLUMNS",
    # training
    "RLTrainer",
    "ValueHead",
    "EXCLUDED_OUTCOMES",
    "split_groups",
    "make_batch",
    "AsyncRLTrainer",
    "RolloutWorker",
    "rollout_schedule",
]

FORMER_NAMES: dict[str, str] = {
    **dict.fromkeys(
        (
            "step_units",
            "scores_to_token_rewards",
            "compute_advantages",
            "sequence_advantages",
            "aggregate",
            "kl_loss",
            "policy_loss",
            "value_loss",
        ),
        "algorithms",
    ),
    **dict.fromkeys(("verl_actor_config", "verl_algo_config"), "config"),
    **dict.fromkeys(
        (
            "ROLLOUT_QUANTIZATIONS",
            "SAMPLER_METRICS",
            "ROLLOUT_IS_METRICS",
            "quantized_rollout_copy",
            "sampler_mismatch_metrics",
            "rollout_correction_weights",
        ),
        "lowbit_rollout",
    ),
}
"""Names `posttrain.rl` exported before it was grouped by purpose -> the module that holds each
(`posttrain.rl.<module>`); `from posttrain.rl import NAME` still works."""

__getattr__, _ = lazy_exports(__name__, {}, former=FORMER_NAMES)
