"""The main job: SFT on demonstrations of part of the task -> GRPO on the rest -> held-out
accuracy, with the honest baseline (the stages of `posttrain.workflows.rl.run_sft_then_rl`).

Run: `posttrain run grpo [key=value ...]` (`make run`), or in a notebook `main(Config())`:
  1. SFT of tiny-2m for 300 steps of 64 at lr 1e-3 on reasoning-gym `spell_backward`
     demonstrations of 3-5 letter words (`task.demo_options`);
  2. GRPO on 6-letter words (`task.options`; no demonstration has one): 150 steps of 64
     prompts x 8 samples, lr 2e-4, no KL term, reward = the task's partial score, minus 1
     for an answer that reaches the 8-token limit (DAPO's overlong punishment, a 1-token
     buffer), held-out greedy accuracy every 25 steps;
  3. greedy accuracy, sampled pass@1 and pass@8 on 500 6-letter words, after SFT and GRPO;
  4. the baseline: 600 more SFT steps on the same demonstrations (about GRPO's step time).

Why this split: docs/benchmarks/task_split.md; results at 3 seeds: docs/benchmarks/results.md;
RFT and DPO at equal compute: docs/benchmarks/beyond_demos.md. The main job before this split:
`recipes/presets/grpo_spell_backward_3to5.yaml`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.workflows import (
    RL_TINY,
    MoreSFTBaselineConfig,
    OptimConfig,
    RLConfig,
    RLEvalConfig,
    RLRunConfig,
    SFTWarmStartConfig,
    TaskConfig,
)

__all__ = ["Config", "TINY", "main"]


@dataclass(kw_only=True)
class Config(RLRunConfig):
    """`posttrain.workflows.RLRunConfig` with the main job's task, GRPO batch, held-out curve and
    more-SFT baseline (about 20 minutes on 2 quiet CPU cores)."""

    task: TaskConfig = field(
        default_factory=lambda: TaskConfig(
            name="spell_backward",
            options={"min_word_len": 6, "max_word_len": 6},
            demo_options={"min_word_len": 3, "max_word_len": 5},
        )
    )
    # docs/benchmarks/results.md, "Seed spread: why the SFT stage is 300 steps at lr 1e-3"
    sft: SFTWarmStartConfig = field(
        default_factory=lambda: SFTWarmStartConfig(steps=300, lr=1e-3, batch_size=64)
    )
    eval: RLEvalConfig = field(default_factory=lambda: RLEvalConfig(max_new_tokens=8, every=25))
    rl: RLConfig = field(
        default_factory=lambda: RLConfig(
            prompts_per_step=64, group_size=8, kl_coef=0.0, overlong_buffer_len=1
        )
    )
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(steps=150, lr=2e-4, warmup_steps=5, min_lr_ratio=1.0)
    )
    baseline: MoreSFTBaselineConfig = field(
        default_factory=lambda: MoreSFTBaselineConfig(steps=600, lr=3e-4)
    )


TINY: dict[str, Any] = {**RL_TINY, "eval.every": 1, "baseline.steps": 2}


def main(cfg: Config) -> dict[str, Any]:
    """Run SFT -> GRPO -> held-out evaluation -> more-SFT baseline; returns the results dict
    (also results.json)."""
    from posttrain.workflows import run_sft_then_rl  # the training stack loads at a run's start

    return run_sft_then_rl(cfg)


if __name__ == "__main__":
    main(Config())
