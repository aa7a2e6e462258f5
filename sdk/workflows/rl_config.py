"""The config of an SFT -> RL run (`posttrain.workflows.rl.run_sft_then_rl`, the grpo and ppo
recipes): `RLRunConfig`, its checks, and `RL_TINY`, the overrides the recipe tests run it with.

Apart from the run so that what only needs the config (the run's evaluation,
`posttrain.workflows.rl_evaluation`) imports it without the run; every name is still importable
from `posttrain.workflows.rl`.

Example:
    >>> RLRunConfig(rl=RLConfig(algo="grpo", group_size=1))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Config.rl.group_size=1: advantage_estimator='grpo' normalises rewards ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.workflows.config import (
    CheckpointConfig,
    ModelConfig,
    MoreSFTBaselineConfig,
    OptimConfig,
    RLConfig,
    RLEvalConfig,
    SamplingConfig,
    SFTWarmStartConfig,
    TaskConfig,
    fail,
    run_fields,
    validate,
)
from posttrain.workflows.data_config import DataConfig
from posttrain.workflows.field_checks import ints
from posttrain.workflows.logging_config import LoggingConfig
from posttrain.workflows.parallel import ParallelPlan, check_parallel, plan_of
from posttrain.workflows.quantization import (
    AdaptersConfig,
    RLQuantizationConfig,
    check_converted_run,
)
from posttrain.workflows.rewards_config import RewardsConfig
from posttrain.workflows.rollout_config import RolloutConfig
from posttrain.workflows.task_checks import check_gym_task, check_seq_len

__all__ = ["RLRunConfig", "RLRolloutConfig", "RolloutConfig", "RL_TINY"]


@dataclass(kw_only=True)
class RLRolloutConfig(RolloutConfig):
    """The RL recipes' `rollout` section: `RolloutConfig` (the engine that samples the rollouts
    and the held-out evaluations) plus `max_staleness`: a rollout sample more than that many
    weight versions behind the trainer is refused (`RLTrainer(rollout_engine=...)`; the rules
    are `posttrain.rl.engine_rollout`'s, the runbook docs/runbooks/vllm.md)."""

    max_staleness: int = 0

    def check(self, at: str) -> None:
        super().check(at)
        ints(self, at, ("max_staleness",), minimum=0)

    def trainer_options(self) -> dict[str, Any]:
        """`RLTrainer`'s rollout_engine, max_staleness and rollout_options."""
        return {
            "rollout_engine": self.engine,
            "max_staleness": self.max_staleness,
            "rollout_options": self.options(),
        }


@dataclass(kw_only=True)
class RLRunConfig:
    """SFT -> RL -> evaluation; every field has a default that runs (SFT of tiny-2m for 900
    steps on 2-term chain_sum, then 100 GRPO steps of 16 prompts x 8 samples; ~10 min on 2 CPU
    cores). `recipes/grpo.py` sets the main job's defaults (spell_backward, 64 x 8, the
    held-out curve `eval.every` and the more-SFT `baseline`). With `data.train` (own prompt
    rows) and `rewards.funcs` the run is `posttrain.workflows.rl_data`'s: the `task.*` keys are
    unused.
    Raises ValueError in `__post_init__` naming the dotted field and what is allowed."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(name="tiny-2m"))
    task: TaskConfig = field(default_factory=TaskConfig)
    # own prompt rows with rewards.funcs instead of the task (posttrain.workflows.rl_data)
    data: DataConfig = field(default_factory=DataConfig)
    eval: RLEvalConfig = field(default_factory=RLEvalConfig)
    sft: SFTWarmStartConfig = field(
        default_factory=lambda: SFTWarmStartConfig(steps=900, lr=3e-3, batch_size=64)
    )
    rl: RLConfig = field(default_factory=RLConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)  # own reward functions
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(steps=100, lr=1e-4, warmup_steps=5, min_lr_ratio=1.0)
    )
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: RLRolloutConfig = field(default_factory=RLRolloutConfig)
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every=50))
    parallel: ParallelPlan = field(default_factory=ParallelPlan)
    # LoRA / QLoRA adapters and FP8 training of the RL stage (the SFT stage trains in full);
    # a quantised sampler copy and truncated importance sampling (quantization.rollout*)
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig)
    quantization: RLQuantizationConfig = field(default_factory=RLQuantizationConfig)
    # the honest baseline: more SFT on the same demonstrations instead of RL (0 steps: none)
    baseline: MoreSFTBaselineConfig = field(default_factory=MoreSFTBaselineConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # experiment trackers
    seed: int = 0
    out_dir: str = "runs/grpo"
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self)

    def check(self, at: str) -> None:
        run_fields(self, at)
        check_seq_len(self, at)
        if self.rl.overlong_buffer_len > self.sampling.max_new_tokens:
            raise fail(
                f"{at}.rl.overlong_buffer_len",
                self.rl.overlong_buffer_len,
                f"at most sampling.max_new_tokens={self.sampling.max_new_tokens} (0: off)",
            )
        if self.data.given:
            self._check_own_prompts(at)
        else:
            check_gym_task(self, at)
        if self.model.init_from is not None and not self.data.given:
            raise fail(
                f"{at}.model.init_from",
                self.model.init_from,
                "None: the RL run on a task starts from its own SFT stage (model.name); "
                "with own prompts (data.train) it may start from a folder",
            )
        check_parallel(
            self,
            at,
            divisible=("rl.prompts_per_step", "sft.batch_size"),
            unsupported=("sp", "pp", "ep"),
        )  # see posttrain.rl.parallel
        if plan_of(self) is not None:  # rank 0 alone evaluates, on gathered weights
            for key, value in (
                ("eval.every", self.eval.every),
                ("baseline.steps", self.baseline.steps),
            ):
                if value:
                    raise fail(
                        f"{at}.{key}",
                        value,
                        "0 under a parallel plan: set eval.every=0 "
                        "baseline.steps=0 (the held-out curve and the more-SFT "
                        "baseline run in one process)",
                    )
        check_converted_run(self, at, training=("none", "fp8"))
        self.rollout.refuse(  # see posttrain.rl.engine_rollout
            at,
            [
                ("quantization.rollout", self.quantization.rollout, ("none",)),
                ("sampling.top_p", self.sampling.top_p, (1.0,)),
            ],
            planned=False,  # the trainer's ranks share one server (posttrain.rl.engine_plan)
        )

    def _check_own_prompts(self, at: str) -> None:
        """`data.train` set (`posttrain.workflows.rl_data`): reward functions score the rows,
        in one process."""
        if not self.rewards.funcs:
            raise fail(
                f"{at}.rewards.funcs",
                self.rewards.funcs,
                "at least one 'module:function' path with data.train: own prompt rows have "
                "no verifier of their own (e.g. rewards.funcs=[mypkg.rewards:accuracy])",
            )
        if plan_of(self) is not None:
            raise fail(
                f"{at}.parallel",
                str(plan_of(self)),
                "the default (one process) with data.train: own prompt rows run without a "
                "parallel plan",
            )

    def check_own_data(self, tokenizer: Any) -> None:
        """With `data.train` set, before the run writes anything (`check_task_fits`): the rows
        read and every prompt leaves room for `sampling.max_new_tokens` (training rows) and
        `eval.max_new_tokens` (held-out rows): `posttrain.workflows.prompt_rows`'s
        `check_prompts_fit`."""
        from posttrain.workflows.prompt_rows import check_prompts_fit

        check_prompts_fit(self, tokenizer)


# Overrides that make an RL recipe finish in seconds (the recipe tests run with them).
RL_TINY: dict[str, Any] = {
    "model.name": "tiny-1m",
    "task.train_size": 64,
    "task.eval_size": 8,
    "eval.max_new_tokens": 6,
    "eval.samples": 2,
    "sft.steps": 3,
    "sft.batch_size": 8,
    "optim.steps": 2,
    "optim.warmup_steps": 1,
    "rl.prompts_per_step": 2,
    "rl.group_size": 2,
    "sampling.max_new_tokens": 4,
    "checkpoint.every": 1,
    "progress": False,
    "eval.every": 0,
    "baseline.steps": 0,
}
