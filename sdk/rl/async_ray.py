"""Rollout workers of an `AsyncRLTrainer` on Ray (`posttrain.rl.async_rl` has the schedule):
actors that each hold a copy of the policy with a weights version (`RolloutWorker`), loading the
state dict the trainer puts in Ray's object store once per sync.

Notation: none (groups of trajectories; versions are integers).

Ray runs one actor's calls in submission order, so an actor always loads the weights submitted
before a rollout: rollout j samples with the version `rollout_schedule` gives it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from posttrain.core.checks import check_int
from posttrain.policy.policy import Policy
from posttrain.rl.rollout import collect_groups

__all__ = ["RayCall", "RayWorkers", "RolloutWorker", "check_ray"]


class RolloutWorker:
    """A rollout worker (the body of a Ray actor; also usable in-process): a `Policy` copy with
    a weights version, sampling groups with `collect_groups`.

    Args:
        policy: the `Policy` to copy (pickled to the actor); its weights are version `version`.
        version: policy version of those weights (int >= 0).
        num_threads: torch threads in this worker (int >= 1), or None to keep the default.
    """

    def __init__(self, policy: Policy, version: int = 0, num_threads: int | None = None) -> None:
        check_int("version", version, minimum=0)
        check_int("num_threads", num_threads, minimum=1, optional=True)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.policy, self.version = policy, version

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        """Load a full state dict as policy version `version`; returns the version."""
        self.policy.model.load_state_dict(state)
        self.version = version
        return version

    def collect(self, builders, seed: int, options: dict[str, Any]) -> tuple[list, int, float]:
        """`collect_groups(policy, builders, seed=seed, policy_version=self.version, **options)`.
        Returns (groups, the version sampled with, seconds spent sampling and scoring)."""
        start = time.perf_counter()
        groups = collect_groups(
            self.policy, builders, seed=seed, policy_version=self.version, **options
        )
        return groups, self.version, time.perf_counter() - start


class RayWorkers:
    """W Ray actors (`RolloutWorker`), each with a copy of `policy` at `version`; rollout j
    runs on actor j mod W. Ray runs one actor's calls in submission order, so an actor always
    loads the weights submitted before a rollout."""

    def __init__(
        self, policy: Policy, *, version: int, num_workers: int, num_cpus: float, threads: int
    ) -> None:
        import ray

        actor = ray.remote(num_cpus=num_cpus)(RolloutWorker)
        self.actors = [actor.remote(policy, version, threads) for _ in range(num_workers)]
        self._last_loads: list[Any] = []  # the latest weight-load calls

    def submit(self, step: int, builders: Sequence, seed: int, options: dict[str, Any]) -> Any:
        # ray types a method without @ray.method as the plain function; the handle's has .remote
        collect = self.actors[step % len(self.actors)].collect.remote  # type: ignore[union-attr]
        return RayCall(collect(builders, seed, options))

    def sync(self, policy: Policy, version: int) -> float:
        """Put the policy's state dict in the object store once; every actor loads it (after
        the rollouts submitted to it before). Returns 0.0: nothing is waited for here."""
        import ray

        state = ray.put({k: v.detach() for k, v in policy.model.state_dict().items()})
        self._last_loads = [  # (ray types the method as the plain function, as in submit)
            w.load_weights.remote(state, version)  # type: ignore[union-attr]
            for w in self.actors
        ]
        return 0.0

    def close(self) -> None:
        """Wait for the weight loads in flight, then end the actors."""
        import ray

        ray.get(self._last_loads)
        for worker in self.actors:  # ray's handle type (ActorProxy) is not what its kill takes
            ray.kill(worker)  # type: ignore[arg-type]
        self.actors = []


def check_ray(num_workers: int, worker_num_cpus: float) -> None:
    import ray

    if (
        not isinstance(worker_num_cpus, (int, float))
        or isinstance(worker_num_cpus, bool)
        or worker_num_cpus <= 0
    ):
        raise ValueError(f"worker_num_cpus={worker_num_cpus!r}; must be a number > 0")
    if not ray.is_initialized():
        raise RuntimeError(
            "Ray is not initialised: call ray.init(...) first (in a notebook: "
            "ray.init(num_cpus=..., include_dashboard=False))"
        )
    cpus = ray.cluster_resources().get("CPU", 0)
    if num_workers * worker_num_cpus > cpus:
        raise ValueError(
            f"num_workers={num_workers} x worker_num_cpus={worker_num_cpus} "
            f"exceeds the {cpus:g} CPUs Ray has; the actors would never start"
        )


class RayCall:
    """A Ray call in flight, read like a `concurrent.futures.Future` (`result()`)."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def result(self) -> Any:
        import ray

        return ray.get(self.ref)
