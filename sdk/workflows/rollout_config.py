"""The `rollout` section of every recipe that samples (`RolloutConfig`): which rollout engine
samples from the policy's weights, and the stage's engine built from it (`RolloutConfig.slot`,
a `posttrain.policy.engine_slot.EngineSlot`).

What samples in each recipe: the held-out evaluation of every recipe (sft, dpo, reward_model,
grpo, ppo, and the SFT stage they start from), the preference pairs of dpo and reward_model,
and the rollouts of grpo and ppo (their section, `RLRolloutConfig`, adds `max_staleness`). The
demo recipe samples with the policy itself: it shows `Policy.generate` and a reload.

Example:
    >>> RolloutConfig(engine="vllm").options()
    {'startup_timeout_s': 900.0, 'kv_cache_gib': 1}
    >>> RolloutConfig(engine="vllm").refuse("Config", [("quantization.training", "qat",
    ...     ("none", "fp8"))], planned=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Config.rollout.engine='vllm'; must be builtin with quantization.training='qat' ...
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.workflows.field_checks import choice, fail, ints, positive
from posttrain.workflows.stack_checks import stack_checks_deferred

if TYPE_CHECKING:
    from posttrain.policy.engine_slot import EngineSlot

__all__ = ["RolloutConfig"]


@dataclass(kw_only=True)
class RolloutConfig:
    """What samples from the policy's weights, in every recipe that samples: `engine` "builtin"
    (`Policy.generate`) or "vllm" (a vLLM server in its own venv, scripts/vllm-up.sh; started
    from the policy at the run's first sample, its model and log in the run folder's vllm/,
    synced with the weights before every later sample, stopped when the run (or its SFT
    stage, which holds its own) ends; docs/runbooks/vllm.md). It samples the held-out
    evaluation of every recipe, the pairs of dpo and reward_model, and the rollouts of grpo and
    ppo (`posttrain.workflows.rl_config.RLRolloutConfig`). The vllm server must answer within
    `startup_timeout_s` seconds and gets `kv_cache_gib` GiB of KV cache (CPU). With `url`
    (http://host:port) the vllm engine starts no server: it attaches to the one running there
    (`VLLMServer.attach`: on this machine, with the dev-mode routes; the runbook says how to
    start one), loads the policy's weights into it and leaves it running when the run ends."""

    engine: str = "builtin"
    startup_timeout_s: float = 900.0
    kv_cache_gib: int = 1
    url: str | None = None

    def check(self, at: str) -> None:
        if not stack_checks_deferred():  # the engines' registry is the policy layer's (torch)
            from posttrain.policy.rollout_engine import ROLLOUT_ENGINES

            choice(f"{at}.engine", self.engine, ROLLOUT_ENGINES)
        ints(self, at, ("kv_cache_gib",), minimum=1)
        positive(self, at, ("startup_timeout_s",))
        if self.url is not None:
            parts = urllib.parse.urlsplit(str(self.url))
            if self.engine != "vllm" or parts.scheme not in ("http", "https") or not parts.port:
                raise fail(
                    f"{at}.url",
                    self.url,
                    "None, or http://host:port of a running vLLM server with rollout.engine=vllm",
                )

    def options(self) -> dict[str, Any] | None:
        """The engine's start options (`VLLMEngine.start`); None for the builtin engine; with
        `url`, only the server's address (the engine attaches instead of starting one)."""
        if self.engine == "builtin":
            return None
        if self.url is not None:
            return {"url": self.url}
        return {"startup_timeout_s": self.startup_timeout_s, "kv_cache_gib": self.kv_cache_gib}

    def slot(self, run_dir: str | Path) -> EngineSlot:
        """An `EngineSlot` for this engine (nothing started until its first `sampler(policy)`;
        a vllm server writes `run_dir/vllm/`): use it as a context manager, so a server stops
        when the run ends, however it ends."""
        from posttrain.policy.engine_slot import EngineSlot

        return EngineSlot(self.engine, run_dir=run_dir, options=self.options())

    def refuse(self, at: str, needs: Iterable[tuple[str, Any, Iterable[Any]]], planned: bool):
        """Refuse an engine apart from the policy (vllm) with a setting it cannot serve:
        `needs` holds (dotted key, its value, the values allowed with it), and under a parallel
        plan (`planned`) in a recipe whose ranks would each sample with an engine of their own
        (the RL trainer shares one server among its ranks, `posttrain.rl.engine_plan`; a
        held-out evaluation samples on rank 0 alone: those pass planned=False).

        Raises:
            ValueError: naming `{at}.rollout.engine`, the setting, and what is allowed.
        """
        if self.engine == "builtin":
            return
        for key, value, allowed in needs:
            allowed = tuple(allowed)
            if value not in allowed:
                raise fail(
                    f"{at}.rollout.engine",
                    self.engine,
                    f"builtin with {key}={value!r} (the {self.engine} engine samples apart "
                    f"from the policy: it needs {key}={' or '.join(map(repr, allowed))})",
                )
        if planned:
            raise fail(
                f"{at}.rollout.engine",
                self.engine,
                "builtin under a parallel plan (the vllm engine runs in one process for now)",
            )
