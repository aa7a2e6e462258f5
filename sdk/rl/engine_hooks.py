"""What the training engine asks an RL trainer (`posttrain.train.engine.Engine`'s hooks): the
module it trains, what a checkpoint holds (policy, value head and reference weights; the replay
buffer and the rollouts an asynchronous run sampled ahead), the settings a resumed run must
match, and the progress bar's postfix.

`RLEngineHooks` is `posttrain.rl.update.RLUpdateEngine` with these hooks;
`posttrain.rl.trainer.RLTrainer` builds on it and sets the fields declared here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from posttrain.rl.buffer import ReplayBuffer
from posttrain.rl.update import RLUpdateEngine

__all__ = ["RLEngineHooks"]


class RLEngineHooks(RLUpdateEngine):
    """The RL update engine with the training engine's hooks (module docstring).

    Attributes (set by the subclass, `RLTrainer`), besides `RLUpdateEngine`'s:
        buffer: the `ReplayBuffer` (saved with every checkpoint).
        prompts_per_step: groups per step (a setting a resumed run must match).
        ahead_state: set by `posttrain.rl.async_rl.AsyncRLTrainer`: the plain state of the
            rollouts it sampled ahead of the update, saved with every checkpoint; None otherwise.
        resumed_ahead: that state read back from a resumed checkpoint, or None.
    """

    buffer: ReplayBuffer
    prompts_per_step: int
    ahead_state: Callable[[], dict] | None
    resumed_ahead: dict | None

    def _module(self) -> nn.Module:
        return self.policy.model

    def _checkpoint_module(self) -> nn.ModuleDict:
        """Policy, value head and reference in one container (a sharded checkpoint's names:
        policy.*, value_head.*, reference.*; each only when there is one)."""
        parts = {
            "policy": self.policy.model,
            "value_head": self.value_head,
            "reference": self.reference,
        }
        return nn.ModuleDict({name: m for name, m in parts.items() if m is not None})

    def _model_state(self) -> dict[str, Any]:
        return {name: m.state_dict() for name, m in self._checkpoint_module().items()}

    def _load_model_state(self, state: dict[str, Any]) -> None:
        for name, module in self._checkpoint_module().items():
            module.load_state_dict(state[name])

    def _extra_state(self) -> dict[str, Any]:
        state = {"buffer": self.buffer.state_dict()}
        if self.ahead_state is not None:
            state["ahead"] = self.ahead_state()
        return state

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        saved = state["buffer"]  # an asynchronous run's has its staleness bound
        self.buffer = ReplayBuffer(
            mode=saved["mode"],
            capacity=saved["capacity"],
            max_staleness=saved["max_staleness"],
            seed=self.seed,
        )
        self.buffer.load_state_dict(saved)
        self.resumed_ahead = state.get("ahead")

    def _fixed_settings(self) -> dict[str, Any]:
        return {"algo": repr(self.algo), "prompts_per_step": self.prompts_per_step}

    def _postfix(self, row: dict[str, Any]) -> dict[str, str]:
        return {"reward": f"{row['reward_mean']:.3f}", "acc": f"{row['accuracy']:.3f}"}
