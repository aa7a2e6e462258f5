"""The RL trainer's rollout engine (`RLTrainer(rollout_engine=...)`): built by name when the
first rollout needs it, given the policy's weights before every rollout, its samples' weight
versions checked against a staleness bound, closed when `fit` returns or raises.

Notation: none (groups of trajectories; versions are integers).

One step with an engine (`posttrain.policy.rollout_engine`):

    engine  = managed.sampler(policy, step)   # built at the first rollout (version = step), or
                                              # synced: the update of step - 1 is in the engine
    groups  = collect_groups(engine, ...)     # every trajectory stamped with the version that
                                              # drew it (`Trajectory.policy_version`)
    managed.check(groups, step)               # version < step - max_staleness: refused by name
    (then, for an engine apart from the policy such as vllm: the policy recomputes the old
     log-probs, the mismatch metrics and truncated IS of `posttrain.rl.lowbit_rollout`)

"builtin" samples with the policy itself (or the trainer's plain / quantised rollout copy), and
its versions are the trainer's step: today's trainer, bit for bit. "vllm" starts a server from
the policy at the first rollout (its model and log in `run_dir/vllm/`, a temporary folder
without a run_dir); after each update the next rollout first syncs it (safetensors in /dev/shm,
reload, prefix-cache reset). An engine instance passed by the caller is synced before its first
rollout and stays the caller's to close. Under a `ParallelPlan` of several ranks, "vllm" is one
server for the job: rank 0 starts and syncs it, every data rank samples its share from it, the
ranks agree on each sync's version (`posttrain.rl.engine_plan`).

Refused by name: "vllm" with `rollout_quantization` (the server samples full-precision weights),
an engine apart from the policy with top_p < 1 (a token inside the engine's top-p set but
outside the policy's has log-prob -inf under the policy: an infinite importance ratio).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from posttrain.core.checks import check_int
from posttrain.policy.engine_slot import EngineSlot
from posttrain.policy.policy import Policy
from posttrain.policy.rollout_engine import RolloutEngine
from posttrain.rl.engine_plan import SharedSlot, shared_engine_wanted
from posttrain.rl.environment import Group

if TYPE_CHECKING:
    from posttrain.train.runtime import Runtime

__all__ = ["ManagedEngine", "StaleRolloutError", "check_staleness"]


class StaleRolloutError(ValueError):
    """A rollout sample drawn with weights older than the staleness bound allows."""


def check_staleness(groups: Sequence[Group], *, version: int, max_staleness: int) -> None:
    """Refuse samples whose weight version is older than `version - max_staleness`.

    Args:
        groups: the step's groups; each trajectory's `policy_version` is the weight version
            that drew it.
        version: the trainer's current weight version (its step count).
        max_staleness: how many versions behind a sample may be (0: only the current weights).

    Raises:
        StaleRolloutError (a ValueError): naming the oldest sample's version, the current one
            and the bound, and how many samples are too old.
    """
    versions = [t.policy_version for g in groups for t in g]
    stale = [v for v in versions if v < version - max_staleness]
    if stale:
        raise StaleRolloutError(
            f"{len(stale)} of {len(versions)} rollout samples were drawn with weight version "
            f"{min(stale)} (oldest); the trainer is at version {version} and max_staleness="
            f"{max_staleness} allows versions >= {version - max_staleness}: the rollout engine "
            "did not take the latest weights (a sync that did not happen or did not count)"
        )


SYNC_PARTS = ("save", "reload", "reset")
"""The parts of a `WeightSync` that `ManagedEngine.sync_metrics` reports apart."""


class ManagedEngine:
    """The trainer's rollout engine and its rules (see the module docstring).

    Args:
        engine: a `ROLLOUT_ENGINES` name, or a `RolloutEngine` instance (the caller closes it).
        max_staleness: samples may be this many weight versions behind the trainer (>= 0).
        run_dir: the run folder (the vllm engine writes `run_dir/vllm/`), or None.
        options: the engine's start options (`VLLMEngine.start`: `startup_timeout_s`,
            `kv_cache_gib`, ...).
        rollout_quantization: the trainer's; refused with an engine apart from the policy.
        top_p: the trainer's; < 1 refused with an engine apart from the policy.
        runtime: the trainer's `Runtime`: under a plan of several ranks, "vllm" is shared by
            the ranks (`posttrain.rl.engine_plan.SharedSlot`; `sampler` and `close` are then
            collectives that every rank calls).

    Raises:
        ValueError: an unknown engine name (the allowed ones listed), a bad max_staleness, or a
            combination refused in the module docstring.
        TypeError: an engine that is neither a name nor a `RolloutEngine`.
    """

    _sync_s: float = 0.0  # seconds of sync since the last `sync_metrics`, and their parts
    _sync_parts: tuple[float, ...] = (0.0,) * len(SYNC_PARTS)

    def __init__(
        self,
        engine: str | RolloutEngine,
        *,
        max_staleness: int = 0,
        run_dir: Any = None,
        options: Mapping[str, Any] | None = None,
        rollout_quantization: str | None = None,
        top_p: float = 1.0,
        runtime: Runtime | None = None,
    ) -> None:
        self.slot: EngineSlot | SharedSlot = EngineSlot(engine, run_dir=run_dir, options=options)
        self.name, apart = self.slot.name, self.slot.apart_from_policy
        check_int("max_staleness", max_staleness, minimum=0)
        if apart and rollout_quantization is not None:
            raise ValueError(
                f"rollout_engine={self.name!r} with rollout_quantization="
                f"{rollout_quantization!r}: the engine samples the full-precision weights; "
                "allowed: rollout_quantization=None, or rollout_engine='builtin'"
            )
        if apart and top_p != 1.0:
            raise ValueError(
                f"top_p={top_p!r} with rollout_engine={self.name!r}: a token in the engine's "
                "top-p set but outside the policy's has log-prob -inf under the policy (an "
                "infinite ratio); allowed: top_p=1.0"
            )
        self.apart_from_policy = apart
        self.max_staleness = max_staleness
        if isinstance(engine, str) and shared_engine_wanted(engine, runtime):
            assert runtime is not None
            self.slot = SharedSlot(
                engine, data_rank=runtime.data_rank, run_dir=run_dir, options=options
            )

    @property
    def engine(self) -> RolloutEngine | None:
        """The engine once built (None before the first rollout and after `close`)."""
        return self.slot.engine

    def sampler(self, policy: Policy, version: int) -> RolloutEngine:
        """The engine holding `policy`'s current weights at `version`: built now (by name, from
        `policy`), or synced when its version differs (or before a given engine's first use;
        the builtin engine is always pointed at `policy`, at no cost): `EngineSlot.sampler`.
        The seconds of a sync are summed for `sync_metrics`."""
        started, before = self.engine is not None, getattr(self.engine, "last_sync", None)
        t0 = time.perf_counter()
        engine = self.slot.sampler(policy, version)
        if started and self.apart_from_policy:  # (not the start of the engine)
            self._sync_s += time.perf_counter() - t0
            done = getattr(engine, "last_sync", None)
            if done is not None and done is not before:  # a WeightSync of this call
                parts = (getattr(done, f"{p}_s", 0.0) for p in SYNC_PARTS)
                self._sync_parts = tuple(a + b for a, b in zip(self._sync_parts, parts))
        return engine

    def sync_metrics(self) -> dict[str, float]:
        """The weight sync columns of a step's metrics row: seconds spent syncing the engine
        since the last call (which they are reset by), before the rollouts of the step.

        `weight_sync_s`: wall seconds of the engine's `sync` calls; 0.0 with the builtin engine
        (its sync points it at the policy: nothing moves) and on a step whose rollout started
        the engine (a server starts from the policy's weights). With an engine that reports its
        sync split (`VLLMEngine.last_sync`, a `WeightSync`) also `weight_sync_save_s` (merge
        and safetensors in /dev/shm), `weight_sync_reload_s` and `weight_sync_reset_s`
        (prefix cache). The sync is a part of the step's `time_scoring_s`
        (`posttrain.rl.step_timing`), shown apart."""
        row = {"weight_sync_s": self._sync_s}
        if hasattr(self.engine, "last_sync"):
            row.update({f"weight_sync_{p}_s": s for p, s in zip(SYNC_PARTS, self._sync_parts)})
        self._sync_s, self._sync_parts = 0.0, (0.0,) * len(SYNC_PARTS)
        return row

    def check(self, groups: Sequence[Group], version: int) -> None:
        """`check_staleness(groups, version=version, max_staleness=self.max_staleness)`."""
        check_staleness(groups, version=version, max_staleness=self.max_staleness)

    def close(self) -> None:
        """Close an engine built here (a vllm server stops); the next rollout builds a new one.
        A caller's engine stays open."""
        self.slot.close()

    def __repr__(self) -> str:
        return (
            f"ManagedEngine({self.name!r}, max_staleness={self.max_staleness}, "
            f"engine={self.engine!r})"
        )
