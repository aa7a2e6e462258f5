"""Rollout workers of an `AsyncRLTrainer` whose trainer samples with a rollout engine apart from
the policy (`RLTrainer(rollout_engine="vllm")`, or a caller's `VLLMEngine` over a `VLLMServer`
or a `VLLMPool`): threads of the driver process, each running `collect_groups` against the
engine. The sampling itself runs in the server's processes, so a worker holds no policy copy;
it sends the requests, plays the environments (tool calls, verifiers) and scores the groups.

Notation: none (groups of trajectories; versions are integers).

Weight versions, and why a sync waits for the rollouts in flight. vLLM runs a weight reload
(`collective_rpc("reload_weights")`) between two steps of its engine loop, whatever requests are
running (vllm/v1/engine/core.py: client calls are handled between `step`s): a request in flight
during a reload draws its first tokens with the old weights and the rest with the new ones,
under one answer. vLLM cannot say which weights drew a sample, so posttrain never lets a reload
overlap a request:

- within one call: `VLLMServer` and `VLLMPool` hold one lock for a `generate` call (until every
  answer is back) and for a `sync_weights`, so a sync waits for the call in flight and every
  answer is stamped with the version read under that lock (`VLLMEngine` maps the server's
  version to its own per sync: the stamp does not depend on when it is read);
- across a rollout (several calls: the turns of multi-turn episodes): `EngineWorkers.sync`
  first waits for every rollout in flight, then reloads. Each rollout is drawn with one
  version, the one the engine held when it was submitted, as `rollout_schedule` says; Ray
  workers get the same order from their actor queue (a load runs after the rollouts before it).

The wait costs little at one-step-off: the trainer waits for rollout k+1 at its next step
anyway, and with `max_staleness` >= 2 the rollouts ahead are waited for before each sync.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from posttrain.core.checks import check_int
from posttrain.policy.policy import Policy
from posttrain.policy.rollout_engine import RolloutEngine
from posttrain.rl.engine_rollout import ManagedEngine
from posttrain.rl.environment import EnvGroupBuilder, Group
from posttrain.rl.rollout import collect_groups

__all__ = ["EngineWorkers", "collect_with_engine"]


def collect_with_engine(
    engine: RolloutEngine,
    builders: Sequence[EnvGroupBuilder],
    seed: int,
    options: dict[str, Any],
) -> tuple[list[Group], int, float]:
    """`collect_groups(engine, builders, seed=seed, **options)`. Returns (groups, the oldest
    weight version stamped on their trajectories, seconds spent sampling and scoring)."""
    start = time.perf_counter()
    groups = collect_groups(engine, builders, seed=seed, policy_version=engine.version, **options)
    version = min(t.policy_version for g in groups for t in g)
    return groups, version, time.perf_counter() - start


class EngineWorkers:
    """`num_workers` threads sampling rollouts with the trainer's engine (see the module
    docstring); the engine is built (a vllm server started from `policy`) at the first rollout.

    Args:
        managed: the trainer's `ManagedEngine` (`RLTrainer.rollout`), apart from the policy.
        policy: the trained policy; its weights at `version` are what the engine starts with.
        version: the weight version the engine holds first (the trainer's step count).
        num_workers: threads (int >= 1): rollouts sampled and scored at once.

    Raises:
        ValueError: an engine that samples with the policy itself (its threads would read the
            weights while they are trained), or a bad `num_workers`.
    """

    def __init__(
        self, managed: ManagedEngine, policy: Policy, *, version: int, num_workers: int
    ) -> None:
        if not managed.apart_from_policy:
            raise ValueError(
                f"rollout engine {managed.name!r} samples with the trained policy itself; "
                "threads need an engine apart from it (rollout_engine='vllm')"
            )
        check_int("num_workers", num_workers, minimum=1)
        self.managed, self._policy, self._version = managed, policy, version
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="posttrain-rollout")
        self._in_flight: list[Future] = []

    def submit(
        self, step: int, builders: Sequence[EnvGroupBuilder], seed: int, options: dict[str, Any]
    ) -> Future:
        """Sample and score `builders` on a worker thread with the weights the engine holds
        now; the future's result is `collect_with_engine`'s. `step` is the rollout's (unused:
        any free thread takes it)."""
        engine = self.managed.sampler(self._policy, self._version)  # built once, then as held
        future = self._threads.submit(collect_with_engine, engine, builders, seed, options)
        self._in_flight = [f for f in self._in_flight if not f.done()] + [future]
        return future

    def sync(self, policy: Policy, version: int) -> float:
        """Wait for every rollout in flight, then give the engine `policy`'s current weights as
        `version` (`ManagedEngine.sampler`: for vllm, safetensors in /dev/shm, reload,
        prefix-cache reset). Returns the seconds spent waiting for the rollouts.

        Raises:
            what the engine's sync raises (`VLLMEngine.sync`); the engine then refuses to
            sample until a sync succeeds.
        """
        start = time.perf_counter()
        wait(self._in_flight)
        self._in_flight = []
        waited = time.perf_counter() - start
        self._policy, self._version = policy, version
        if self.managed.engine is not None:  # else the first rollout builds it from `policy`
            self.managed.sampler(policy, version)
        return waited

    def close(self) -> None:
        """Wait for the rollouts in flight, end the threads, close an engine the trainer built
        (a vllm server stops; a caller's engine stays open)."""
        wait(self._in_flight)
        self._in_flight = []
        self._threads.shutdown(wait=True)
        self.managed.close()

    def __repr__(self) -> str:
        return (
            f"EngineWorkers({self._threads._max_workers} threads, version={self._version}, "
            f"engine={self.managed.engine!r})"
        )
