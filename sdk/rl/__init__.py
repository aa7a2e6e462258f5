"""Reinforcement learning: environments (tasks), RLAlgorithm, advantages and policy losses on
verl, rollout, the replay buffer, RLTrainer, and low-bit rollout (a quantised sampler copy, the
train/infer mismatch, truncated importance sampling).
"""

from __future__ import annotations

from posttrain.rl.algorithms import (
    RLAlgorithm,
    LOSS_AGG_MODES,
    KL_ESTIMATORS,
    ROLLOUT_CORRECTIONS,
    advantage_estimators,
    policy_losses,
    is_group_estimator,
    register_advantage_estimator,
    register_policy_loss,
    step_units,
    scores_to_token_rewards,
    compute_advantages,
    sequence_advantages,
    aggregate,
    kl_loss,
    policy_loss,
    value_loss,
)
from posttrain.rl.buffer import ReplayBuffer, TRAJECTORY_FIELDS, DATAFRAME_COLUMNS
from posttrain.rl.config import verl_actor_config, verl_algo_config
from posttrain.rl.environment import (
    StepResult,
    Environment,
    EnvGroupBuilder,
    EnvDataset,
    group_rewards,
    FINISH_REASONS,
    Trajectory,
    Group,
    TextEpisode,
    run_text_episode,
    TASKS,
    get_task,
    registered_tasks,
)
from posttrain.rl.lowbit_rollout import (
    ROLLOUT_QUANTIZATIONS,
    SAMPLER_METRICS,
    ROLLOUT_IS_METRICS,
    quantized_rollout_copy,
    sampler_mismatch_metrics,
    rollout_correction_weights,
)
from posttrain.rl.rollout import collect_groups, outcome_counts
from posttrain.rl.trainer import RLTrainer, ValueHead, EXCLUDED_OUTCOMES, split_groups, make_batch
from posttrain.rl.async_rl import AsyncRLTrainer, RolloutWorker, rollout_schedule

__all__ = [
    "RLAlgorithm",
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "ROLLOUT_CORRECTIONS",
    "advantage_estimators",
    "policy_losses",
    "is_group_estimator",
    "register_advantage_estimator",
    "register_policy_loss",
    "step_units",
    "scores_to_token_rewards",
    "compute_advantages",
    "sequence_advantages",
    "aggregate",
    "kl_loss",
    "policy_loss",
    "value_loss",
    "ReplayBuffer",
    "TRAJECTORY_FIELDS",
    "DATAFRAME_COLUMNS",
    "verl_actor_config",
    "verl_algo_config",
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
    "ROLLOUT_QUANTIZATIONS",
    "SAMPLER_METRICS",
    "ROLLOUT_IS_METRICS",
    "quantized_rollout_copy",
    "sampler_mismatch_metrics",
    "rollout_correction_weights",
    "collect_groups",
    "outcome_counts",
    "RLTrainer",
    "ValueHead",
    "EXCLUDED_OUTCOMES",
    "split_groups",
    "make_batch",
    "AsyncRLTrainer",
    "RolloutWorker",
    "rollout_schedule",
]
