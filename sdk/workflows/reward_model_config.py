"""The reward-model recipe's config (`RewardModelRunConfig`; `recipes/reward_model.py`) and
the split its `held_out_fraction` sets (`split_by_question`), apart
from the run (`posttrain.workflows.reward_model`, which imports torch) so that the recipe's
config imports without the training stack: `posttrain run reward_model optim.lr=-1` answers
before torch loads. Both names are importable from `posttrain.workflows.reward_model` too.

Example:
    >>> RewardModelRunConfig(margin=-1.0)
    Traceback (most recent call last):
    ...
    ValueError: Config.margin=-1.0; must be a finite number >= 0.0
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.workflows.config import (
    BatchOptimConfig,
    EvalConfig,
    PairsConfig,
    TaskConfig,
    fail,
    finite,
    run_fields,
    seeds,
)
from posttrain.workflows.data_config import DataConfig
from posttrain.workflows.pairs_config import PairsRunConfig
from posttrain.workflows.task_checks import check_gym_task, check_seq_len

__all__ = ["RewardModelRunConfig", "split_by_question"]


@dataclass(kw_only=True)
class RewardModelRunConfig(PairsRunConfig):
    """Policy -> pairs -> Bradley-Terry reward model -> held-out pairwise accuracy: the config
    of `recipes/reward_model.py`: the stages of a `PairsRunConfig` (pairs on prompts generated
    from prompt_seed; optim.batch_size: pairs per micro-batch; adapters on the backbone, the
    head trains in full) and the reward model's split and margin. Every field has a default that
    runs. Raises ValueError in `__post_init__` naming the dotted field and what is allowed."""

    task: TaskConfig = field(default_factory=lambda: TaskConfig(eval_size=200))
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(max_new_tokens=8, every=50))
    pairs: PairsConfig = field(default_factory=lambda: PairsConfig(num_prompts=2000))
    # own pairs instead of sampled ones (then task, pairs, sampling, prompt_seed,
    # held_out_fraction are unused)
    data: DataConfig = field(default_factory=DataConfig)
    prompt_seed: int = 1
    held_out_fraction: float = 0.2
    optim: BatchOptimConfig = field(
        default_factory=lambda: BatchOptimConfig(steps=300, lr=1e-4, warmup_steps=10, batch_size=32)
    )
    margin: float = 0.0  # Bradley-Terry margin (>= 0)
    out_dir: str = "runs/reward_model"

    def check(self, at: str) -> None:
        run_fields(self, at)
        if not self.data.given:
            check_gym_task(self, at, min_eval_size=0)
        elif self.rollout.engine != "builtin":
            raise fail(
                f"{at}.rollout.engine",
                self.rollout.engine,
                "builtin with data.train (a run on own pairs samples nothing)",
            )
        elif self.data.eval is None and self.data.eval_fraction == 0:
            raise fail(
                f"{at}.data.eval_fraction",
                0.0,
                "above 0, or data.eval set: the reward model is scored on held-out pairs",
            )
        check_seq_len(self, at)
        seeds(self, at, ("prompt_seed",))
        finite(self, at, ("margin",), low=0.0)
        if not (isinstance(self.held_out_fraction, float) and 0 < self.held_out_fraction < 1):
            raise fail(f"{at}.held_out_fraction", self.held_out_fraction, "in (0, 1)")
        self.check_split(at, unsupported=("sp", "pp", "ep"))  # parallelize_reward_model
        if self.optim.loss_chunk_tokens is not None:
            raise fail(
                f"{at}.optim.loss_chunk_tokens",
                self.optim.loss_chunk_tokens,
                "None: the reward model's loss reads a scalar head on the final hidden state, "
                "with no [B, T, V] logits to chunk (sft.loss_chunk_tokens chunks its SFT stage)",
            )

    def check_own_data(self, tokenizer: Any) -> None:
        """Own pairs (`data.train`) read and tokenised as the run reads them (`own_pairs`),
        before it writes anything (`check_task_fits` calls this).

        Raises:
            ValueError: naming `data.train` / `data.eval` (see `own_pairs`)."""
        from posttrain.workflows.own_pairs import own_pairs

        own_pairs(self.data, tokenizer, max_seq_len=self.own_seq_len(), kto=False)

    def own_seq_len(self) -> int:
        """The longest own pair (tokens) the reward model reads: the model's limit (2048 where
        a folder's config.json names none)."""
        return self.model.max_seq_len() or 2048


def split_by_question(
    rows: Sequence[Mapping[str, Any]], held_out_fraction: float, *, seed: int
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """(train rows, held-out rows): a seeded `held_out_fraction` of the distinct prompts (at
    least one, at most all but one) and all their pairs are held out, so no held-out prompt is
    trained on.

    Raises:
        ValueError: if the pairs come from fewer than two prompts.
    """
    questions = sorted({r["prompt"] for r in rows})
    if len(questions) < 2:
        raise ValueError(
            f"{len(rows)} pairs from {len(questions)} prompt(s): too few to split "
            "into training and held-out pairs; raise pairs.num_prompts or "
            "pairs.samples_per_prompt, train the policy longer (sft.steps), or "
            "set pairs.reference_answer=true"
        )
    random.Random(seed).shuffle(questions)
    n_held = min(len(questions) - 1, max(1, round(held_out_fraction * len(questions))))
    held = set(questions[:n_held])
    return ([r for r in rows if r["prompt"] not in held], [r for r in rows if r["prompt"] in held])
