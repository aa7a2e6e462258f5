"""Rejection-sampling fine-tuning (RFT): sample k answers, keep the verified, fine-tune, repeat.

SFT warm start, then rounds of expert iteration on the policy's own verified answers.

Run: `posttrain run rft [key=value ...]` (dotted keys: `rft.rounds=8 rft.keep=all`), or in a
notebook `main(Config())`. The stages, run folder and results are those of
`posttrain.workflows.rft_run.run_rft`; the rounds are `posttrain.workflows.rft.rft_rounds`
(STaR, Zelikman et al. 2022; ReST-EM, Singh et al. 2023; expert iteration, Anthony et al.
2017):

  1. SFT of tiny-2m on the task (the main job's warm start: 300 steps of 64 at lr 1e-3 on
     reasoning-gym `spell_backward`, 3-5 letter words, 500 held-out words);
  2. `rft.rounds` rounds: `rft.samples_per_prompt` answers of each of `rft.prompts_per_round`
     training prompts at temperature 1, the ones the task's verifier gives full credit kept
     (`rft.keep`: "all", or "distinct" answers; at most `rft.max_per_prompt` per prompt),
     `rft.steps` SFT steps on them; per-round pass rate, kept share and tokens trained in
     metrics.jsonl, held-out greedy accuracy after each round (`eval_curve.csv/png`);
  3. held-out greedy accuracy, sampled pass@1 and pass@8 after SFT and after RFT, paired.

`rft.budget_s` stops the rounds once their summed step seconds (sampling and scoring plus SFT
steps) reach it: RFT as a baseline at the training compute of another stage (docs/guides/rft.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.workflows.config import RLEvalConfig, SFTWarmStartConfig, TaskConfig
from posttrain.workflows.rft_config import RFT_TINY, RFTConfig, RFTRunConfig

__all__ = ["Config", "TINY", "main"]


@dataclass(kw_only=True)
class Config(RFTRunConfig):
    """`posttrain.workflows.rft_run.RFTRunConfig` on the main job's task and warm start, with 5
    rounds of 256 prompts x 8 samples and 40 SFT steps of 64 each."""

    task: TaskConfig = field(
        default_factory=lambda: TaskConfig(
            name="spell_backward", options={"min_word_len": 3, "max_word_len": 5}
        )
    )
    sft: SFTWarmStartConfig = field(
        default_factory=lambda: SFTWarmStartConfig(steps=300, lr=1e-3, batch_size=64)
    )
    eval: RLEvalConfig = field(default_factory=lambda: RLEvalConfig(max_new_tokens=8, every=1))
    rft: RFTConfig = field(
        default_factory=lambda: RFTConfig(
            rounds=5, prompts_per_round=256, samples_per_prompt=8, steps=40, lr=3e-4
        )
    )
    out_dir: str = "runs/rft"


TINY: dict[str, Any] = dict(RFT_TINY)


def main(cfg: Config) -> dict[str, Any]:
    """Run SFT -> RFT rounds -> held-out evaluation; returns the results dict (also
    results.json)."""
    from posttrain.workflows.rft_run import run_rft  # the training stack loads at a run's start

    return run_rft(cfg)


if __name__ == "__main__":
    main(Config())
