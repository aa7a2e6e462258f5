"""`EngineSlot`: a rollout engine held for one stage of a run, whoever samples through it.

Everything that samples from a policy's weights (an RL step's rollouts, a held-out evaluation,
preference pairs, synthetic candidates, a distillation teacher) takes either a `Policy` or a
`RolloutEngine` (`posttrain.policy.rollout_engine`). A stage that names its engine ("builtin",
"vllm") holds it in a slot:

    with EngineSlot("vllm", run_dir=out) as slot:        # nothing started yet
        pairs = make_preference_pairs(slot.sampler(policy), items, rank=...)   # started here
        ...train policy...
        after = evaluate_generations(slot.sampler(policy), items, score_fn=...)  # synced
    # closed here: a server the slot started stops, however the stage ended

`sampler(policy)` builds the engine from `policy` the first time (a vllm engine writes its model
and log in `run_dir/vllm/`, a temporary folder without a run_dir), and later points it at
`policy`'s current weights: the builtin engine at no cost (it samples with the policy itself),
an engine apart from the policy by `sync` (safetensors, reload, prefix-cache reset) when the
version asked for differs from the one it holds. Weight versions count from 0 unless the caller
passes its own (an RL trainer passes its step). An engine instance given to the slot is the
caller's: synced before its first use, never closed by the slot.

Example:
    >>> from posttrain.policy import Policy
    >>> policy = Policy.from_spec("tiny-1m", seed=0)
    >>> with EngineSlot("builtin") as slot:
    ...     [c] = slot.sampler(policy).generate(["1+1="], max_new_tokens=2, temperature=0)
    ...     [d] = policy.generate(["1+1="], max_new_tokens=2, temperature=0)
    ...     c.token_ids == d.token_ids, slot.engine.version
    (True, 0)
    >>> slot.engine is None
    True
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from posttrain.policy.rollout_engine import ROLLOUT_ENGINES, RolloutEngine, build_rollout_engine

if TYPE_CHECKING:
    from posttrain.policy.policy import Policy

__all__ = ["EngineSlot"]


class EngineSlot:
    """One stage's rollout engine, built by name on first use (see the module docstring).

    Args:
        engine: a `ROLLOUT_ENGINES` name, or a `RolloutEngine` instance (the caller closes it).
        run_dir: the run folder (the vllm engine writes `run_dir/vllm/`), or None.
        options: the engine's start options (`VLLMEngine.start`: `startup_timeout_s`,
            `kv_cache_gib`, ...); the builtin engine ignores them.

    Attributes:
        name: the engine's registry name.
        apart_from_policy: whether it samples from another copy of the weights (vllm).
        engine: the engine once built (None before the first `sampler` and after `close`).

    Raises:
        ValueError: an unknown engine name (the allowed ones listed).
        TypeError: an engine that is neither a name nor a `RolloutEngine`.
    """

    def __init__(
        self,
        engine: str | RolloutEngine,
        *,
        run_dir: str | os.PathLike | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(engine, str):
            if engine not in ROLLOUT_ENGINES:
                raise ValueError(
                    f"rollout_engine={engine!r}; allowed: {', '.join(ROLLOUT_ENGINES)} "
                    "(or a RolloutEngine instance)"
                )
            self.name, self.apart_from_policy = engine, engine != "builtin"
        elif isinstance(engine, RolloutEngine):
            self.name, self.apart_from_policy = engine.name, bool(engine.apart_from_policy)
        else:
            raise TypeError(
                f"rollout_engine={engine!r}; pass one of {', '.join(ROLLOUT_ENGINES)} or an "
                "object with RolloutEngine's attributes (name, version, apart_from_policy, "
                "tokenizer, spec, generate, sync, close)"
            )
        self.engine: RolloutEngine | None = None if isinstance(engine, str) else engine
        self._owned = isinstance(engine, str)
        self._synced = False
        self._run_dir, self._options = run_dir, dict(options or {})

    def sampler(self, policy: Policy, version: int | None = None) -> RolloutEngine:
        """The engine holding `policy`'s current weights: built now (by name, from `policy`, at
        `version` or 0), or synced (to `version`, or its own version + 1) when it holds other
        weights: before a given engine's first use, when `version` differs from the engine's,
        or, without a version, at every call after the first (the caller's weights may have
        changed). The builtin engine is always pointed at `policy`, at no cost.

        Raises:
            what the engine's start or sync raises (`VLLMEngine.start`, `VLLMEngine.sync`).
        """
        if self.engine is None:
            run_dir = self._run_dir
            if run_dir is None and self.name != "builtin":
                run_dir = tempfile.mkdtemp(prefix="posttrain-rollout-")
            self.engine = build_rollout_engine(
                self.name, policy, run_dir=run_dir, version=version or 0, **self._options
            )
        elif (
            not self._synced
            or not self.apart_from_policy
            or version is None
            or self.engine.version != version
        ):
            self.engine.sync(policy, version=version)
        self._synced = True
        return self.engine

    def close(self) -> None:
        """Close an engine built here (a vllm server stops); the next `sampler` builds a new
        one. A caller's engine stays open."""
        if self._owned and self.engine is not None:
            engine, self.engine = self.engine, None
            self._synced = False
            engine.close()

    def __enter__(self) -> EngineSlot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EngineSlot({self.name!r}, engine={self.engine!r})"
