"""The recipes' runs and the config sections they are made of. Grouped by purpose, one module
each; the package exports the runs, their configs and the sections (`__all__`):

    the runs         sft (run_sft, the SFT warm start; its config SFTConfig in
                     sft_config), rl (run_sft_then_rl;
                     its config RLRunConfig in rl_config), preference (run_preference; its
                     config PreferenceRunConfig in preference_config), reward_model
                     (run_reward_model; its config RewardModelRunConfig in
                     reward_model_config); what they share: recipe_run (RecipeRun: a run's
                     start and end), task_data (held-out items, the checks that the data
                     fits), pairs (rejection-sampled pairs; their configs' shared sections in
                     pairs_config)
    config sections  config (ModelConfig, TaskConfig, OptimConfig, ...), config_paths
                     (validate, override, config_keys), parallel (the section is a
                     ParallelPlan; plan_of), quantization (adapters, quantised training),
                     field_checks, data_config (the `data:` section: own rows, held out;
                     own_data reads them), stack_checks (the checks that need torch or
                     reasoning-gym, deferred by `posttrain run` for a fast first answer)
    run files        reports (start_run, write_results, tables, plots), run_state (finished,
                     running, failed, interrupted, dead), lineage (lineage.json, runs_table)
    running recipes  recipes (by name, presets, overrides), sweep (arms x seeds), arms
    evaluation       evaluation (evaluate_suite: several sets, one table, regression_check),
                     eval_sets (the sets), suite_result (SuiteResult, regression_check),
                     rl_evaluation (an RL run's held-out curve, sampled pass@k, baseline)

The building blocks of a recipe of one's own are imported from their modules
(`from posttrain.workflows.reports import write_results`). The names the package exported
before it was grouped (`FORMER_NAMES`: name -> its module) still import from it;
`ParallelConfig`, the former copy of the plan's fields, is a deprecated alias of `ParallelPlan`.

The top SDK layer below `notebook`: it stands on train, preference, rl, envs and rewards, and
never imports `posttrain.notebook`. Recipes (`recipes/*.py`) import from here, never from each
other.
"""

from __future__ import annotations

from typing import Any

from posttrain.core.lazy import lazy_exports

# Imported now, not on first use: `run_state` names both a module and its function, and loading
# the module later would bind the package's `run_state` to the module (it is light: no torch).
from posttrain.workflows.run_state import RunState, recorded_run, run_state

# the config sections and the one validation path, the runs and what they share, a run's state:
EXPORTS: dict[str, list[str]] = {
    "config": [
        "BatchOptimConfig",
        "CheckpointConfig",
        "EvalConfig",
        "ModelConfig",
        "MoreSFTBaselineConfig",
        "OptimConfig",
        "PairsConfig",
        "RLConfig",
        "RLEvalConfig",
        "SamplingConfig",
        "SFTWarmStartConfig",
        "TaskConfig",
    ],
    "config_paths": ["config_keys", "override", "validate"],
    "data_config": ["DataConfig"],
    "parallel": ["ParallelPlan", "plan_of"],
    "preference": ["run_preference"],
    "preference_config": ["PreferenceRunConfig"],
    "quantization": ["AdaptersConfig", "QuantizationConfig", "RLQuantizationConfig"],
    "recipe_run": ["RecipeRun"],
    "reward_model": ["run_reward_model"],
    "reward_model_config": ["RewardModelRunConfig"],
    "rl": ["run_sft_then_rl"],
    "rl_config": ["RL_TINY", "RLRunConfig"],
    "sft": ["run_sft", "warm_start"],
    "sft_config": ["SFTConfig"],
    "task_data": ["evaluate", "held_out_items"],
}
"""The package's names -> the module that holds each: imported on first use, so `import
posttrain.workflows.sft` (an SFT or DPO run) does not load the RL stack and verl, and a recipe's
config (`SFTConfig`, `RLRunConfig`, `PreferenceRunConfig`, `RewardModelRunConfig` and their
sections) imports without torch."""

__all__ = [
    # the runs
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
    # config sections
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
    # a run's state
    "RunState",
    "run_state",
    "recorded_run",
]

FORMER_NAMES: dict[str, str] = {
    **dict.fromkeys(("ROOT", "SEED_MAX", "fail", "run_fields"), "config"),
    **dict.fromkeys(("check_parallel", "check_world_size", "model_spec"), "parallel"),
    **dict.fromkeys(
        (
            "RESUMABLE_KEYS",
            "RunInterrupted",
            "cached_pairs",
            "check_tokenizer_covers_task",
            "on_rank_zero",
            "read_table",
            "stop_if_interrupted",
            "write_table",
            "accuracy_of",
            "accuracy_table",
            "difference_line",
            "plot_curves",
            "start_run",
            "write_results",
        ),
        "reports",
    ),
    "run_status": "run_state",
    "MODES": "sft_config",
    **dict.fromkeys(("start_policy", "unsharded_policy"), "sft"),
    **dict.fromkeys(("check_seq_len", "check_gym_task"), "task_data"),
    **dict.fromkeys(
        (
            "ExactMatchSet",
            "HumanEvalSet",
            "JudgeWinRateSet",
            "RegressionError",
            "SuiteResult",
            "evaluate_suite",
            "regression_check",
        ),
        "evaluation",
    ),
}
"""Names `posttrain.workflows` exported before it was grouped by purpose -> the module that holds
each now (`posttrain.workflows.<module>`); `from posttrain.workflows import NAME` still works."""


_lookup, _ = lazy_exports(__name__, EXPORTS, former=FORMER_NAMES)


def __getattr__(name: str) -> Any:
    if name == "ParallelConfig":  # deprecated: warns, then gives ParallelPlan
        from posttrain.workflows import parallel

        return parallel.__getattr__(name)
    return _lookup(name)
