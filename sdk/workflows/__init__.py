"""Recipe building blocks: the typed config sections every recipe nests (`ModelConfig`,
`TaskConfig`, `OptimConfig`, ..., the `parallel` section, a `ParallelPlan`), the one validation path and dotted
overrides, the SFT stage (`run_sft`, the warm start other recipes begin with), the SFT -> RL
run (`run_sft_then_rl`), the start/end of a run (config echo, results.json/results.md, the
curves plot) and its state (`run_state`: finished, running, failed, interrupted, dead).

The top SDK layer below `notebook`: it stands on train, preference, rl, envs and rewards, and
never imports `posttrain.notebook`. Recipes (`recipes/*.py`) import from here, never from each
other.
"""

from __future__ import annotations

from posttrain.workflows.config import (
    ROOT,
    SEED_MAX,
    BatchOptimConfig,
    CheckpointConfig,
    EvalConfig,
    ModelConfig,
    MoreSFTBaselineConfig,
    OptimConfig,
    PairsConfig,
    RLConfig,
    RLEvalConfig,
    SamplingConfig,
    SFTWarmStartConfig,
    TaskConfig,
    config_keys,
    fail,
    override,
    run_fields,
    validate,
)
from posttrain.workflows.parallel import (
    ParallelPlan,
    check_parallel,
    check_world_size,
    model_spec,
    plan_of,
)
from posttrain.workflows.quantization import (
    AdaptersConfig,
    QuantizationConfig,
    RLQuantizationConfig,
)
from posttrain.workflows.reports import (
    RESUMABLE_KEYS,
    RunInterrupted,
    cached_pairs,
    check_tokenizer_covers_task,
    on_rank_zero,
    read_table,
    stop_if_interrupted,
    write_table,
    accuracy_of,
    accuracy_table,
    difference_line,
    plot_curves,
    start_run,
    write_results,
)
from posttrain.workflows.run_state import RunState, recorded_run, run_state, run_status
from posttrain.workflows.sft import (
    MODES,
    SFTConfig,
    check_seq_len,
    evaluate,
    held_out_items,
    run_sft,
    start_policy,
    unsharded_policy,
    warm_start,
)
from posttrain.workflows.rl import RL_TINY, RLRunConfig, check_gym_task, run_sft_then_rl
from posttrain.workflows.preference import PreferenceRunConfig, run_preference
from posttrain.workflows.reward_model import RewardModelRunConfig, run_reward_model
from posttrain.workflows.recipe_run import RecipeRun
from posttrain.workflows.evaluation import (ExactMatchSet, HumanEvalSet, JudgeWinRateSet,
                                            RegressionError, SuiteResult, evaluate_suite,
                                            regression_check)

__all__ = [
    "RESUMABLE_KEYS",
    "RunInterrupted",
    "cached_pairs",
    "check_tokenizer_covers_task",
    "on_rank_zero",
    "read_table",
    "stop_if_interrupted",
    "write_table",
    "ROOT", "SEED_MAX", "BatchOptimConfig", "CheckpointConfig", "EvalConfig", "ModelConfig",
    "MoreSFTBaselineConfig", "OptimConfig", "PairsConfig", "ParallelPlan", "RLConfig", "RLEvalConfig", "SamplingConfig",
    "SFTWarmStartConfig", "TaskConfig", "config_keys", "fail", "override", "run_fields",
    "validate", "check_parallel", "check_world_size", "model_spec", "plan_of",
    "AdaptersConfig", "QuantizationConfig", "RLQuantizationConfig",
    "accuracy_of", "accuracy_table", "difference_line", "plot_curves", "start_run",
    "write_results",
    "MODES", "SFTConfig", "check_seq_len", "evaluate", "held_out_items", "run_sft",
    "start_policy", "unsharded_policy", "warm_start",
    "RL_TINY", "RLRunConfig", "check_gym_task", "run_sft_then_rl",
    "PreferenceRunConfig", "run_preference", "RewardModelRunConfig", "run_reward_model",
    "RecipeRun",
    "ExactMatchSet", "HumanEvalSet", "JudgeWinRateSet", "RegressionError", "SuiteResult",
    "evaluate_suite", "regression_check",
    "RunState", "recorded_run", "run_state", "run_status",
]


def __getattr__(name: str):
    if name == "ParallelConfig":  # deprecated: warns, then gives ParallelPlan
        from posttrain.workflows import parallel

        return parallel.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
