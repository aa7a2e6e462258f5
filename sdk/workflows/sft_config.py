"""The SFT / CPT recipe's config (`SFTConfig`; `recipes/sft.py`), apart from the run
(`posttrain.workflows.sft`, which imports torch) so that the recipe's config imports without the
training stack: `posttrain run sft optim.lrr=1` answers before torch loads. Both names are
importable from `posttrain.workflows.sft` too.

Example:
    >>> SFTConfig(mode="dpo")
    Traceback (most recent call last):
    ...
    ValueError: Config.mode='dpo'; must be one of sft, cpt
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.workflows.config import (
    BatchOptimConfig,
    CheckpointConfig,
    EvalConfig,
    ModelConfig,
    TaskConfig,
    choice,
    fail,
    flags,
    run_fields,
    validate,
)
from posttrain.workflows.data_config import DataConfig
from posttrain.workflows.logging_config import LoggingConfig
from posttrain.workflows.parallel import ParallelPlan, check_parallel
from posttrain.workflows.quantization import (
    AdaptersConfig,
    QuantizationConfig,
    check_converted_run,
)
from posttrain.workflows.rollout_config import RolloutConfig
from posttrain.workflows.task_checks import check_seq_len

__all__ = ["SFTConfig", "MODES"]

MODES = ("sft", "cpt")


@dataclass(kw_only=True)
class SFTConfig:
    """SFT/CPT configuration; every field has a default that runs (400 steps of 64 on 2-term,
    1-2-digit chain_sum). `rollout` picks the engine of the held-out evaluation before and after
    training (a run without held-out items, `task.eval_size=0`, samples nothing). Raises
    ValueError in `__post_init__` naming the dotted field."""

    mode: str = "sft"  # sft | cpt (plain text, every token trained)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)  # own rows instead of the task
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: BatchOptimConfig = field(default_factory=BatchOptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelPlan = field(default_factory=ParallelPlan)
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    max_seq_len: int = 128
    pack: bool = False
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # experiment trackers
    seed: int = 0
    out_dir: str = "runs/sft"
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self)

    def check(self, at: str) -> None:
        choice(f"{at}.mode", self.mode, MODES)
        check_seq_len(self, at)
        run_fields(self, at)
        flags(self, at, ("pack",))
        check_parallel(self, at, divisible=("optim.batch_size",))
        check_converted_run(self, at)
        if self.eval.every and not self.data.given:
            raise fail(
                f"{at}.eval.every",
                self.eval.every,
                "0: a task's SFT has no validation set (own data, data.train, holds rows out)",
            )
        if self.eval.every and not self.parallel.is_default:
            raise fail(
                f"{at}.eval.every",
                self.eval.every,
                "0 under a parallel plan (rank 0 scores the held-out rows after training)",
            )
        if not self.data.given and self.task.eval_size and self.task.is_file:
            raise ValueError(
                f"{at}.task.eval_size > 0 needs a reasoning-gym task (its scorer); "
                f"got the file {self.task.name!r}: set task.eval_size=0"
            )
        if self.rollout.engine != "builtin" and not self.task.eval_size and not self.data.given:
            raise fail(
                f"{at}.rollout.engine",
                self.rollout.engine,
                "builtin with task.eval_size=0 (the engine samples the held-out evaluation; "
                "this run samples nothing)",
            )
        self.rollout.refuse(  # the evaluation after training samples the converted model
            at,
            [("quantization.training", self.quantization.training, ("none",))],
            planned=False,  # under a plan, rank 0 alone evaluates (one engine)
        )
