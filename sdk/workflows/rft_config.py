"""The config of rejection-sampling fine-tuning (`posttrain.workflows.rft`): the `rft` section
(`RFTConfig`: rounds, samples per prompt, what is kept, the fine-tuning of each round, a time
budget), the recipe's config (`RFTRunConfig`: SFT warm start -> RFT rounds -> held-out
evaluation) and `RFT_TINY`, the overrides the recipe tests run it with.

Example:
    >>> RFTConfig(keep="best").check("Config.rft")  # what RFTRunConfig(...) raises for it
    Traceback (most recent call last):
    ...
    ValueError: Config.rft.keep='best'; must be one of all, distinct
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from posttrain.workflows.config import (
    BatchOptimConfig,
    CheckpointConfig,
    ModelConfig,
    RLEvalConfig,
    SamplingConfig,
    SFTWarmStartConfig,
    TaskConfig,
    fail,
    run_fields,
    validate,
)
from posttrain.workflows.field_checks import choice, ints, positive
from posttrain.workflows.logging_config import LoggingConfig
from posttrain.workflows.rollout_config import RolloutConfig
from posttrain.workflows.task_checks import check_gym_task, check_seq_len

__all__ = ["KEEP_RULES", "RFTConfig", "RFTRunConfig", "RFT_TINY"]

KEEP_RULES = ("all", "distinct")
"""`rft.keep`: "all" keeps every verified sample, repeats included (STaR, ReST-EM); "distinct"
keeps the first of each (prompt, completion) pair, whitespace runs collapsed
(`posttrain.data.synthetic.ExactDedup`)."""


@dataclass(kw_only=True)
class RFTConfig(BatchOptimConfig):
    """Rejection-sampling fine-tuning, `rounds` times: sample `samples_per_prompt` (k)
    completions of each of `prompts_per_round` training prompts from the current policy (the
    `sampling` section: temperature, top_p, max_new_tokens), keep the ones the task's verifier
    accepts with full credit (score >= 1.0; partial credit is not kept), by the `keep` rule
    (`KEEP_RULES`) and at most `max_per_prompt` per prompt (None: no cap; the first ones in
    sample order), then `steps` SFT steps on the kept ones (this section's optimizer fields as
    in `BatchOptimConfig`, a fresh AdamW and schedule each round, warmup min(20, steps // 10)
    unless `warmup_steps` is set).

    `budget_s` (seconds, None: none): stop once the summed step seconds reach it, the sampling
    and scoring of each round plus its SFT steps' `step_time_s` (as an RL run's `rl_train_s`
    sums its steps, which include their rollouts): checked before each round and after each
    SFT step, so the last step may run past it by one step. A round whose prompts gave no
    verified sample trains nothing and is counted as such."""

    steps: int = 50
    lr: float = 3e-4
    warmup_steps: int | None = None
    rounds: int = 4
    prompts_per_round: int = 256
    samples_per_prompt: int = 8
    keep: str = "distinct"
    max_per_prompt: int | None = None
    budget_s: float | None = None

    def check(self, at: str) -> None:
        super().check(at)
        ints(self, at, ("rounds", "prompts_per_round", "samples_per_prompt"), minimum=1)
        ints(self, at, ("max_per_prompt",), minimum=1, optional=True)
        positive(self, at, ("budget_s",), optional=True)
        choice(f"{at}.keep", self.keep, KEEP_RULES)

    def optim(self) -> BatchOptimConfig:
        """One round's `BatchOptimConfig` (`.build(params)` makes its optimizer and schedule):
        this section's optimizer fields, the warmup as a number of steps."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(BatchOptimConfig)}
        return BatchOptimConfig(**{**fields, "warmup_steps": self.warmup})


@dataclass(kw_only=True)
class RFTRunConfig:
    """SFT warm start -> RFT rounds -> held-out evaluation (`posttrain.workflows.rft.run_rft`,
    `recipes/rft.py`); every field has a default that runs (the SFT stage of the main job on
    chain_sum, then 4 rounds of 256 prompts x 8 samples and 50 SFT steps of 64).
    The run is one process (no `parallel` section) and trains in full (no adapters).
    Raises ValueError in `__post_init__` naming the dotted field and what is allowed."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(name="tiny-2m"))
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: RLEvalConfig = field(default_factory=RLEvalConfig)  # eval.every: in rounds
    sft: SFTWarmStartConfig = field(
        default_factory=lambda: SFTWarmStartConfig(steps=900, lr=3e-3, batch_size=64)
    )
    rft: RFTConfig = field(default_factory=RFTConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every=50))
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # experiment trackers
    seed: int = 0
    out_dir: str = "runs/rft"
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self)

    def check(self, at: str) -> None:
        run_fields(self, at)
        check_gym_task(self, at)
        check_seq_len(self, at)
        if self.model.init_from is not None:
            raise fail(
                f"{at}.model.init_from",
                self.model.init_from,
                "None: the RFT run starts from its own SFT stage (model.name)",
            )


# Overrides that make the RFT recipe finish in seconds (the recipe tests run with them).
RFT_TINY: dict[str, Any] = {
    "model.name": "tiny-1m",
    "task.name": "chain_sum",  # generated in milliseconds (a word task reads its word list)
    "task.options": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "task.train_size": 64,
    "task.eval_size": 8,
    "eval.max_new_tokens": 6,
    "eval.samples": 2,
    "eval.every": 1,
    "sft.steps": 3,
    "sft.batch_size": 8,
    "rft.rounds": 2,
    "rft.prompts_per_round": 4,
    "rft.samples_per_prompt": 2,
    "rft.steps": 2,
    "rft.batch_size": 4,
    "rft.warmup_steps": 1,
    "sampling.max_new_tokens": 4,
    "checkpoint.every": 1,
    "checkpoint.keep_last": 1,
    "task.eval_seed": 0,  # held out from the training seed's items: they are dropped from it
    "progress": False,
}
