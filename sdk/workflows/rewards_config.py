"""The RL recipes' `rewards:` section: reward functions named by import path that score the RL
task's completions in place of the task's own verifier (`posttrain.rewards.functions`).

    rewards:
      funcs: [mypkg.rewards:accuracy, mypkg.rewards:brevity]   # "module:function" paths
      weights: [1.0, 0.2]                                       # [] -> 1.0 each

Each function is called once per GRPO group in TRL's convention: `completions`, `prompts`,
`completion_ids` and the task item's other columns (`answer`, `metadata`) as keyword lists; a
function written for TRL's `GRPOTrainer(reward_funcs=...)` works unchanged. Held-out accuracy
is still measured with the task's verifier. From the command line:
`posttrain run grpo rewards.funcs=[mypkg.rewards:accuracy]`; with own prompt rows instead of the
task, `posttrain run grpo data.train=prompts.jsonl rewards.funcs=[mypkg.rewards:accuracy]`
(`posttrain.workflows.rl_data`). With several functions each one's mean is a metric per step,
`reward/<name>` (and `reward/<name>/failures`), as TRL's `rewards/<name>/mean`.

Example:
    >>> RewardsConfig(funcs=["no_such_module:fn"]).check("rewards")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: rewards.funcs[0]='no_such_module:fn'; must be ... does not import: ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from posttrain.workflows.field_checks import fail

if TYPE_CHECKING:
    from posttrain.rewards.functions import RewardFunctions

__all__ = ["RewardsConfig"]


@dataclass(kw_only=True)
class RewardsConfig:
    """Reward functions by import path and their weights (see the module docstring); no
    functions (the default): the task's own verifier scores."""

    funcs: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)

    def check(self, at: str) -> None:
        """Resolves every path now, so a typo fails before any training.

        Raises:
            ValueError: naming `funcs[i]` for a path that is malformed, does not import or is not
                callable, and `weights` for a list of another length or a non-finite weight.
        """
        from posttrain.rewards.functions import RewardFunctions, load_reward

        if not isinstance(self.funcs, (list, tuple)):
            raise fail(f"{at}.funcs", self.funcs, "a list of 'module:function' paths")
        for i, path in enumerate(self.funcs):
            try:
                load_reward(path)
            except (ValueError, TypeError) as exc:
                raise fail(
                    f"{at}.funcs[{i}]", path, f"a callable's 'module:function' path: {exc}"
                ) from None
        if not isinstance(self.weights, (list, tuple)) or (
            self.weights and len(self.weights) != len(self.funcs)
        ):
            raise fail(f"{at}.weights", self.weights, f"[] or {len(self.funcs)} numbers")
        if self.funcs:
            try:
                RewardFunctions(list(self.funcs), list(self.weights) or None)
            except (ValueError, TypeError) as exc:
                raise fail(f"{at}.weights", self.weights, f"finite numbers: {exc}") from None

    def functions(self) -> RewardFunctions:
        """The named functions with their weights, resolved (`RewardFunctions`).

        Raises:
            ValueError: when no function is named (the task's verifier scores then).
        """
        from posttrain.rewards.functions import RewardFunctions

        if not self.funcs:
            raise ValueError("rewards.funcs is empty: no reward functions to build")
        return RewardFunctions(list(self.funcs), list(self.weights) or None)

    def builder(self, prompt_column: str = "question") -> Any:
        """`item -> PromptGroupBuilder` scoring with these functions (a picklable partial), or
        None when no function is named."""
        if not self.funcs:
            return None
        import functools

        from posttrain.envs.prompt_task import PromptGroupBuilder
        from posttrain.rewards.functions import RewardFunctions

        rewards = RewardFunctions(list(self.funcs), list(self.weights) or None)
        return functools.partial(PromptGroupBuilder, rewards=rewards, prompt_column=prompt_column)
