"""The main job: SFT warm start -> GRPO -> held-out accuracy, with the honest baseline, where
the demonstrations cover only part of the task and RL has to go beyond them.

Run: `posttrain run grpo [key=value ...]` (`make run`; dotted keys: `optim.lr=1e-4
rl.group_size=16`), or in a notebook `main(Config())`. The stages, run folder and results are
those of `posttrain.workflows.rl.run_sft_then_rl`; this recipe is its main-job defaults:

  1. SFT of tiny-2m (2.22M parameters, byte tokenizer) for 300 steps of 64 at lr 1e-3 on
     reasoning-gym `spell_backward` demonstrations of 3-5 letter words (`task.demo_options`,
     the task's own question text);
  2. GRPO from that policy on 6-letter words (`task.options`; no demonstration has one), 64
     prompts x 8 samples per step, 150 steps at lr 2e-4, no KL term, reward = the task's own
     partial score (`posttrain.verifiers.reasoning_gym.task_score`), with held-out greedy
     accuracy every 25 steps (`eval_curve.csv/png`);
  3. held-out greedy accuracy, sampled pass@1 and pass@8 on 500 6-letter words after SFT and
     after GRPO, paired;
  4. the honest baseline: as much more SFT on the same demonstrations as the GRPO stage's step
     time allows (`baseline.steps`), scored and compared the same way.

Why this split: docs/benchmarks/task_split.md (the SFT policy spells 82-89% of 3-5 letter words
backward and none of 6 letters, greedy or in 8 samples, but it places some of their letters: a
partial score GRPO can learn from). What it measures, at 3 seeds: docs/benchmarks/results.md.
The main job until this split (3-5 letter words everywhere, where more SFT on the
demonstrations wins by far) is `recipes/presets/grpo_spell_backward_3to5.yaml`; the
equal-compute comparison with RFT and DPO is `benchmarks/beyond_demos.py`
(docs/benchmarks/beyond_demos.md).
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
    # no KL term: the policy must move far from its start (a 6th letter, then stopping after it)
    rl: RLConfig = field(
        default_factory=lambda: RLConfig(prompts_per_step=64, group_size=8, kl_coef=0.0)
    )
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(steps=150, lr=2e-4, warmup_steps=5, min_lr_ratio=1.0)
    )
    # 600 SFT steps take about the GRPO stage's 150 steps' time (~460 s each on 2 quiet cores)
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
