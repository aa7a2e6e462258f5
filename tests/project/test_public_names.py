"""The public names of each posttrain package: frozen here, each resolves, and a package grouped by
purpose keeps the names it exported before importable (`FORMER_NAMES`: name -> the module that
holds it now), as notebooks, docs and users' code import them.

A package past `MOST` public names holds two ideas: `posttrain.workflows` (64 names),
`posttrain.rl` (51) and `posttrain.data` (43) were grouped by purpose, the rest of their names
living in the modules they belong to.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import posttrain

MOST = 40
GROUPED = ("posttrain.workflows", "posttrain.rl", "posttrain.data")

PUBLIC: dict[str, list[str]] = {
    "posttrain.workflows": [
        "SFTConfig",
        "run_sft",
        "warm_start",
        "RLRunConfig",
        "run_sft_then_rl",
        "RL_TINY",
        "PreferenceRunConfig",
        "run_preference",
        "RewardModelRunConfig",
        "run_reward_model",
        "RecipeRun",
        "held_out_items",
        "evaluate",
        "ModelConfig",
        "TaskConfig",
        "DataConfig",
        "OptimConfig",
        "BatchOptimConfig",
        "SamplingConfig",
        "EvalConfig",
        "RLEvalConfig",
        "CheckpointConfig",
        "SFTWarmStartConfig",
        "MoreSFTBaselineConfig",
        "PairsConfig",
        "RLConfig",
        "AdaptersConfig",
        "QuantizationConfig",
        "RLQuantizationConfig",
        "ParallelPlan",
        "plan_of",
        "config_keys",
        "override",
        "validate",
        "RunState",
        "run_state",
        "recorded_run",
    ],
    "posttrain.rl": [
        "RLAlgorithm",
        "LOSS_AGG_MODES",
        "KL_ESTIMATORS",
        "ROLLOUT_CORRECTIONS",
        "advantage_estimators",
        "policy_losses",
        "is_group_estimator",
        "register_advantage_estimator",
        "register_policy_loss",
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
        "ReplayBuffer",
        "TRAJECTORY_FIELDS",
        "DATAFRAME_COLUMNS",
        "RLTrainer",
        "ValueHead",
        "EXCLUDED_OUTCOMES",
        "split_groups",
        "make_batch",
        "AsyncRLTrainer",
        "RolloutWorker",
        "rollout_schedule",
    ],
    "posttrain.data": [
        "BAD_ROW_REASONS",
        "BadRowError",
        "DataStats",
        "text_char_limit",
        "ON_BAD_ROW",
        "OVERLONG",
        "IGNORE_INDEX",
        "Batch",
        "Sample",
        "SFTDataset",
        "CPTDataset",
        "EpochOrderLoader",
        "SFTLoader",
        "collate_padded",
        "pack_samples",
        "stack_rows",
        "labels_from_loss_mask",
        "epoch_order",
        "load_sft_rows",
        "load_text_documents",
        "normalize_sft_row",
        "normalize_document",
        "reasoning_gym_sft_rows",
        "right_pad",
        "load_preference_rows",
        "pairs_to_kto_rows",
        "PreferenceDataset",
        "KTODataset",
        "PreferenceBatch",
        "KTOBatch",
        "PreferenceLoader",
        "render_response",
    ],
}
"""The frozen public names (`__all__`) of the grouped packages: a name added or dropped is a
decision, made here too."""


def _packages() -> list[str]:
    """Every posttrain package (a folder with an __init__), the top one included."""
    names = ["posttrain", "posttrain.envs", "posttrain.verifiers"]
    for info in pkgutil.walk_packages(posttrain.__path__, prefix="posttrain."):
        if info.ispkg and info.name not in names:
            names.append(info.name)
    return sorted(names)


PACKAGES = _packages()


@pytest.mark.parametrize("package", GROUPED)
def test_a_grouped_package_has_its_frozen_public_names_and_at_most_MOST(package):
    names = importlib.import_module(package).__all__
    assert sorted(names) == sorted(PUBLIC[package]), sorted(set(names) ^ set(PUBLIC[package]))
    assert len(names) == len(set(names)) <= MOST


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_of_a_package_resolves(package):
    module = importlib.import_module(package)
    missing = []
    for name in getattr(module, "__all__", []):
        try:
            getattr(module, name)
        except AttributeError:
            missing.append(name)
    assert not missing, f"{package}.__all__ names what it does not have: {missing}"


@pytest.mark.parametrize(
    "package, name",
    [(p, n) for p in GROUPED for n in sorted(importlib.import_module(p).FORMER_NAMES)],
)
def test_a_former_name_of_a_grouped_package_still_imports_from_it(package, name):
    module = importlib.import_module(package)
    home = importlib.import_module(f"{package}.{module.FORMER_NAMES[name]}")
    assert name not in module.__all__
    assert name in getattr(home, "__all__", [name]), f"{home.__name__} does not export {name}"
    namespace: dict = {}
    exec(f"from {package} import {name}", namespace)  # the import users and notebooks write
    assert namespace[name] is getattr(home, name)


def test_the_former_names_are_the_names_the_packages_exported_before():
    """64, 51 and 43 names before grouping: every one is public or a former name now. The
    workflows' 64 less ParallelConfig (a deprecated alias now, `ParallelPlan` in its place)
    plus the runs that moved out of their recipes (PreferenceRunConfig, run_preference,
    RewardModelRunConfig, run_reward_model), their shared start and end (RecipeRun),
    plan_of and the own-data section (DataConfig): 71."""
    counts = {p: len(PUBLIC[p]) + len(importlib.import_module(p).FORMER_NAMES) for p in GROUPED}
    assert counts == {
        "posttrain.workflows": 64 - 1 + 6 + 1 + 1,
        "posttrain.rl": 51,
        "posttrain.data": 43,
    }


def test_the_deprecated_parallel_config_is_the_plan_with_a_warning():
    from posttrain.train import ParallelPlan

    with pytest.deprecated_call(match="ParallelConfig is deprecated"):
        from posttrain.workflows import ParallelConfig
    assert ParallelConfig is ParallelPlan
    with pytest.raises(ImportError, match="cannot import name 'Nope'"):
        from posttrain.workflows import Nope  # noqa: F401
