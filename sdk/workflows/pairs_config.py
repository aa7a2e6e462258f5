"""The sections a run that samples preference pairs from a policy and trains on them shares
(`PairsRunConfig`: the DPO-family run's `PreferenceRunConfig` and the reward-model run's
`RewardModelRunConfig` extend it), apart from the pairs' sampling (`posttrain.workflows.pairs`,
which imports torch) so that those recipes' configs import without the training stack;
`PairsRunConfig` is importable from `posttrain.workflows.pairs` too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.workflows.config import (
    BatchOptimConfig,
    CheckpointConfig,
    EvalConfig,
    ModelConfig,
    PairsConfig,
    SamplingConfig,
    SFTWarmStartConfig,
    TaskConfig,
    validate,
)
from posttrain.workflows.logging_config import LoggingConfig
from posttrain.workflows.parallel import ParallelPlan, check_parallel, plan_of
from posttrain.workflows.quantization import (
    AdaptersConfig,
    QuantizationConfig,
    check_converted_run,
)
from posttrain.workflows.rollout_config import RolloutConfig

__all__ = ["PairsRunConfig"]


@dataclass(kw_only=True)
class PairsRunConfig:
    """The sections a run that samples pairs from a policy and trains on them shares
    (`PreferenceRunConfig`, `RewardModelRunConfig`; each sets its own defaults over these and
    adds its own fields). `__post_init__` validates the whole config (`validate`: every section,
    then the subclass's `check(at)`), raising ValueError that names the dotted field."""

    # the starting policy (the pairs' sampler): model.init_from, or SFT of model.name (sft)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTWarmStartConfig = field(default_factory=SFTWarmStartConfig)
    # pairs by rejection sampling (never on a held-out question)
    pairs: PairsConfig = field(default_factory=PairsConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # the engine that samples them (and the held-out evaluations): builtin, or vllm
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # the trained model's stage (optim.batch_size: pairs, or KTO rows, per micro-batch)
    optim: BatchOptimConfig = field(default_factory=BatchOptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelPlan = field(default_factory=ParallelPlan)
    # LoRA / QLoRA adapters and FP8 training of that stage (the SFT stage trains in full)
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # experiment trackers
    seed: int = 0
    out_dir: str = "runs/pairs"
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self)

    def check_split(self, at: str, *, unsupported: tuple[str, ...]) -> None:
        """The `parallel` plan divides the batches it splits (`optim.batch_size`, and
        `sft.batch_size` when the run trains its policy) and has none of the `unsupported`
        axes; `quantization.training` is "none" or "fp8" (`check_converted_run`).

        Raises ValueError naming the dotted field under `at` and what is allowed."""
        check_parallel(
            self,
            at,
            divisible=("optim.batch_size",)
            + (("sft.batch_size",) if self.model.init_from is None else ()),
            unsupported=unsupported,
        )
        check_converted_run(self, at, training=("none", "fp8"))
        self.rollout.refuse(at, [], planned=plan_of(self) is not None)
