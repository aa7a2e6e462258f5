"""`RLConfig`, the `rl:` section of the grpo and ppo recipes: the RL algorithm (a
`posttrain.rl.config.RLAlgorithm` preset, with the options a run may change) and its batch.

Example:
    >>> algo = RLConfig(algo="grpo", clip_ratio_high=0.28).algorithm()  # DAPO's clip-higher
    >>> algo.clip_ratio_low, algo.clip_ratio_high  # low: the preset's
    (0.2, 0.28)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from posttrain.workflows.field_checks import choice, fail, finite, ints, positive
from posttrain.workflows.stack_checks import stack_checks_deferred

if TYPE_CHECKING:  # verl loads with posttrain.rl: only RL runs pay for it
    from posttrain.rl.config import RLAlgorithm


BATCH_WHITENED = ("gae", "gdpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""verl advantage estimators that whiten over the batch's response tokens (`masked_whiten`:
an error for a mask of one token)."""


_NOT_PASSED = ("algo", "prompts_per_step")  # RLConfig fields that are not RLAlgorithm options
_PRESET_IF_NONE = ("kl_coef", "clip_ratio_low", "clip_ratio_high")  # None: the preset's value


@dataclass(kw_only=True)
class RLConfig:
    """The RL algorithm (an `RLAlgorithm` preset) and its batch: `prompts_per_step` prompts x
    `group_size` samples per step; `kl_coef` None keeps the preset's; `clip_ratio_low` and
    `clip_ratio_high`: the ratio clip range [1 - low, 1 + high] (None: the preset's, 0.2 each
    for PPO and GRPO; DAPO's clip-higher is high 0.28, Yu et al. 2025, sec. 3.1). With one
    update per batch (`ppo_epochs` 1, no `minibatch_size` below the batch) and the builtin
    engine, whose sampling log-probs are the trained policy's, the ratio is 1 and the clip
    range changes nothing; it acts from a batch's second update on, or on the sampler/trainer
    mismatch of another engine;
    `filter_groups` and `max_num_gen_batches`: DAPO's dynamic sampling,
    `overlong_buffer_len` (<= sampling.max_new_tokens; 0: off) and `overlong_penalty_factor`:
    its overlong punishment (`RLAlgorithm`)."""

    algo: str = "grpo"
    prompts_per_step: int = 16
    group_size: int = 8
    kl_coef: float | None = None
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    ppo_epochs: int = 1
    minibatch_size: int | None = None
    filter_groups: bool = False
    max_num_gen_batches: int = 4
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0

    def algorithm(self) -> RLAlgorithm:
        """The `RLAlgorithm` these settings describe."""
        from posttrain.rl.config import RLAlgorithm

        options: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _NOT_PASSED
            and not (f.name in _PRESET_IF_NONE and getattr(self, f.name) is None)
        }
        return RLAlgorithm.preset(self.algo, **options)

    def check(self, at: str) -> None:
        deferred = stack_checks_deferred()  # the algorithm presets import torch and verl's names
        if not deferred:
            from posttrain.rl.config import RLAlgorithm

            choice(f"{at}.algo", self.algo, RLAlgorithm.PRESETS)
        counts = ("prompts_per_step", "group_size", "ppo_epochs", "max_num_gen_batches")
        ints(self, at, counts, minimum=1)
        ints(self, at, ("overlong_buffer_len",), minimum=0)
        finite(self, at, ("overlong_penalty_factor",), low=0.0)
        ints(self, at, ("minibatch_size",), minimum=1, optional=True)
        if self.kl_coef is not None:
            finite(self, at, ("kl_coef",), low=0.0)
        positive(self, at, ("clip_ratio_low", "clip_ratio_high"), optional=True)
        if self.clip_ratio_low is not None:
            finite(self, at, ("clip_ratio_low",), high=1.0)  # 1 - low must stay >= 0
        if deferred:
            return
        try:
            algorithm = self.algorithm()
        except ValueError as e:  # e.g. GRPO with group_size 1: no group baseline
            bad = next((f.name for f in dataclasses.fields(self) if f.name in str(e)), None)
            where = f"{at}.{bad}={getattr(self, bad)!r}" if bad else f"{at} (algo={self.algo!r})"
            raise ValueError(f"{where}: {e}") from None
        if (
            algorithm.advantage_estimator in BATCH_WHITENED
            and self.prompts_per_step * self.group_size < 2
        ):
            raise fail(
                f"{at}.prompts_per_step",
                self.prompts_per_step,
                f"at least 2 with "
                f"group_size={self.group_size}: {algorithm.advantage_estimator!r} "
                "whitens advantages over the step's response tokens, which needs two "
                "samples (a sample may be a single token)",
            )
