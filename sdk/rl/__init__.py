"""Reinforcement learning: environments (tasks), RLAlgorithm, advantages and policy losses on
verl, rollout, the replay buffer and RLTrainer.
"""

from __future__ import annotations

from posttrain.rl.algorithms import (
    RLAlgorithm,
    LOSS_AGG_MODES,
    KL_ESTIMATORS,
    advantage_estimators,
    policy_losses,
    is_group_estimator,
    register_advantage_estimator,
    register_policy_loss,
    step_units,
    scores_to_token_rewards,
    compute_advantages,
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
from posttrain.rl.rollout import collect_groups, outcome_counts
from posttrain.rl.trainer import RLTrainer, ValueHead, EXCLUDED_OUTCOMES, split_groups, make_batch

__all__ = [
    "RLAlgorithm",
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "advantage_estimators",
    "policy_losses",
    "is_group_estimator",
    "register_advantage_estimator",
    "register_policy_loss",
    "step_units",
    "scores_to_token_rewards",
    "compute_advantages",
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
    "collect_groups",
    "outcome_counts",
    "RLTrainer",
    "ValueHead",
    "EXCLUDED_OUTCOMES",
    "split_groups",
    "make_batch",
]
