"""Replay: run one real RL training step on saved rollouts instead of fresh samples.

`replay_step(trainer, rollouts)` rebuilds the groups with `posttrain.notebook.inspector.to_groups`
(from a `save_rollouts` file, a frame with token columns, groups or a buffer) and hands them to
the trainer's `train_on_groups`: the step's update, metrics row and callbacks are those of
`trainer.step()`, only the rollout is skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain.notebook.inspector import to_groups

if TYPE_CHECKING:
    from posttrain.rl.trainer import RLTrainer

__all__ = ["replay_step"]

_SEAM = "train_on_groups"


def replay_step(trainer: RLTrainer, rollouts: Any) -> dict[str, float]:
    """Run ONE RL training step of `trainer` on saved rollouts instead of fresh samples (to
    debug an update: a batch that produced a NaN, a spike in KL, a verifier change).

    The step is a real one: exclusion rule, advantages, minibatch updates, metrics row,
    callbacks, scheduler and `step_count` advance exactly as in `trainer.step()`; only the
    rollout is skipped. The old log-probs are the saved sampler's, so the importance ratio
    compares the current policy with the one that sampled them (1 when replaying on the same
    weights).

    Args:
        trainer: a `posttrain.rl.trainer.RLTrainer` (anything with `train_on_groups(groups)`).
        rollouts: groups, a rollouts file, a frame with token columns or a buffer (`to_groups`).

    Returns:
        The step's metrics row.

    Raises:
        TypeError: if the trainer has no `train_on_groups(groups)` method (an RLTrainer has).
        ValueError: for rollouts that cannot be trained on (`to_groups`) or token ids outside
            the policy's vocabulary.
    """
    seam = getattr(trainer, _SEAM, None)
    if not callable(seam):
        raise TypeError(
            f"replay_step needs a trainer with {_SEAM}(groups) (posttrain.rl."
            f"RLTrainer); got {type(trainer).__name__}"
        )
    groups = to_groups(rollouts)
    vocab = getattr(
        getattr(getattr(trainer, "policy", None), "tokenizer", None), "vocab_size", None
    )
    if vocab is not None:
        top = max(max(t.prompt_ids + t.completion_ids, default=0) for g in groups for t in g)
        if top >= vocab:
            raise ValueError(
                f"the rollouts hold token id {top}, outside this policy's "
                f"vocabulary (0..{vocab - 1}); were they sampled by another "
                "tokenizer?"
            )
    return seam(groups)
