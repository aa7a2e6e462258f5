"""PPO with GAE and a value head on the main job's task: SFT warm start -> PPO -> held-out
accuracy before SFT, after SFT and after PPO.

The same stages, run folder and results as `recipes/grpo.py` (this file reuses its `main`); only
the algorithm differs: `RLAlgorithm.ppo()` (Schulman et al. 2017; GAE with lambda 0.95, clipped
value loss with coefficient 0.5, a `ValueHead` on the final hidden state), one sample per prompt
(group_size 1) and several epochs of minibatches per batch of rollouts.

Run: `posttrain run ppo [key=value ...]`.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.cli import load_recipe

grpo = load_recipe("grpo")


@dataclass(kw_only=True)
class Config(grpo.Config):
    """`recipes/grpo.py`'s Config with PPO defaults."""

    algo: str = "ppo"
    group_size: int = 1
    prompts_per_step: int = 64
    ppo_epochs: int = 2
    minibatch_size: int | None = 32
    out_dir: str = "runs/ppo"


TINY = dict(grpo.TINY, group_size=1, prompts_per_step=4, minibatch_size=2, ppo_epochs=2)


def main(cfg: Config):
    return grpo.main(cfg)


if __name__ == "__main__":
    main(Config())
