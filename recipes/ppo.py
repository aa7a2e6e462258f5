"""PPO with GAE and a value head on the main job's task: SFT warm start -> PPO -> held-out
accuracy before SFT, after SFT and after PPO.

The same stages, run folder and results as `recipes/grpo.py` (both run
`posttrain.workflows.rl.run_sft_then_rl`); only the RL section differs: `RLAlgorithm.ppo()`
(Schulman et al. 2017; GAE with lambda 0.95, clipped value loss with coefficient 0.5, a
`ValueHead` on the final hidden state), one sample per prompt (`rl.group_size` 1) and several
epochs of minibatches per batch of rollouts.

Run: `posttrain run ppo [key=value ...]` (dotted keys: `rl.ppo_epochs=4`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.workflows import RL_TINY, RLConfig, RLRunConfig

__all__ = ["Config", "TINY", "main"]


@dataclass(kw_only=True)
class Config(RLRunConfig):
    """`posttrain.workflows.RLRunConfig` with PPO's RL section and run folder."""

    rl: RLConfig = field(
        default_factory=lambda: RLConfig(
            algo="ppo", prompts_per_step=64, group_size=1, ppo_epochs=2, minibatch_size=32
        )
    )
    out_dir: str = "runs/ppo"


TINY: dict[str, Any] = {
    **RL_TINY,
    "rl.group_size": 1,
    "rl.prompts_per_step": 4,
    "rl.minibatch_size": 2,
    "rl.ppo_epochs": 2,
}


def main(cfg: Config) -> dict[str, Any]:
    """Run SFT -> PPO -> held-out evaluation; returns the results dict (also results.json)."""
    from posttrain.workflows import run_sft_then_rl  # the training stack loads at a run's start

    return run_sft_then_rl(cfg)


if __name__ == "__main__":
    main(Config())
