"""Asynchronous RL on Ray: rollout workers that sample with a known weights version feed an
`RLTrainer`, whose update of step k overlaps the rollout of step k+1 (one-step-off, as in verl's
one-step-off-policy recipe and AReaL's bounded staleness).

Notation: s = `max_staleness` (policy versions a consumed group may lag the trainer), W = number
of rollout workers, k = a step index; the trainer's version is its `step_count` (optimizer steps
of the policy = updates done), a trajectory's `policy_version` the version its sampler held.

The schedule (`rollout_schedule` computes it without Ray):

    rollout j  is submitted once the trainer's version >= j - s, to worker j mod W, with the
               weights the workers hold at that moment and the synchronous trainer's inputs for
               step j: builders = task.builders(j, prompts_per_step), seed = seed x 1_000_003 + j
    step k     submit every rollout up to k + s -> wait for rollout k's groups -> check the
               bound (trainer version - policy_version <= s) -> `RLTrainer.train_on_groups` ->
               ray.put(state_dict) once -> every worker loads it (version k + 1)

Ray runs one actor's calls in submission order, so a worker always loads the weights submitted
before a rollout. With s = 0 every rollout waits for the previous update: the run is
`RLTrainer.step` repeated, bitwise on CPU (same builders, seeds and weights; the workers use the
driver's torch thread count by default, since the float sums of a matmul depend on it). With
s = 1 rollout k+1 samples with the weights of version k while update k runs.

The trainer's replay buffer becomes an on-policy `ReplayBuffer(max_staleness=s)` (its state
kept): its `rejected_stale` / `evicted_stale` counters stay 0 unless the bound is broken, and
the bound is also checked (RuntimeError) before a group is trained on. `consumed` records
(step, trainer version, policy version) of every consumed group.

Checkpoints and resume: the trainer's checkpoints (`checkpoint_every`, Ctrl-C, preemption) also
hold the rollouts sampled ahead of the update, steps k+1 .. k+s after update k, with the policy
version each was sampled with and `consumed` (`state_dict`): the checkpoint waits for them (at
a checkpoint the update and those rollouts overlap, the next rollout does not). A trainer built
with `resume=` and then wrapped here trains on them first, so a run killed after a checkpoint
and resumed continues exactly as if it had not stopped, at any s (bitwise on CPU, fixed
threads). The workers start with the checkpoint's weights, its version.

Works from a notebook cell: start Ray first (`posttrain.launch.ray_cluster.ray_cluster()`, or
`ray.init(...)` in the kernel). Not covered: a `ParallelPlan` policy and low-bit rollout.

Example (the schedule only; `docs/guides/async_rl.md` has a run with Ray):
    >>> [(j, v) for j, v, _ in rollout_schedule(4, max_staleness=1)]
    [(0, 0), (1, 0), (2, 1), (3, 2)]
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from posttrain.core.checks import check_int
from posttrain.policy.policy import Policy
from posttrain.rl.buffer import ReplayBuffer
from posttrain.rl.environment import Group, Trajectory
from posttrain.rl.rollout import collect_groups
from posttrain.rl.trainer import RLTrainer

__all__ = ["AsyncRLTrainer", "RolloutWorker", "rollout_schedule", "step_seed"]

AHEAD_STATE_VERSION = 1


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of step `step` for a trainer seeded `seed` (what `RLTrainer.step` gives
    `collect_groups`): seed x 1_000_003 + step."""
    return seed * 1_000_003 + step


def rollout_schedule(
    num_steps: int, *, max_staleness: int, start: int = 0
) -> list[tuple[int, int, int]]:
    """Which weights each rollout samples with under the one-step-off schedule.

    Args:
        num_steps: steps to schedule (int >= 1).
        max_staleness: s (int >= 0): rollout j is submitted when the trainer's version is
            max(start, j - s).
        start: the trainer's version (step_count) when the run starts (int >= 0).

    Returns:
        (step j, policy version of its rollout, trainer version when it is trained = j) for
        j = start, ..., start + num_steps - 1; lag = j - version <= s.

    Raises:
        ValueError: for a non-integer or out-of-range argument.
    """
    check_int("num_steps", num_steps, minimum=1)
    check_int("max_staleness", max_staleness, minimum=0)
    check_int("start", start, minimum=0)
    return [(j, max(start, j - max_staleness), j) for j in range(start, start + num_steps)]


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


class AsyncRLTrainer:
    """Runs an `RLTrainer`'s steps with rollouts on Ray actors, up to `max_staleness` steps
    ahead of the update (see the module docstring for the schedule and for resume).

    Args:
        trainer: a built `RLTrainer` (no `ParallelPlan`, no `rollout_quantization`, the builtin
            rollout engine); its update path (`train_on_groups`: exclusion, advantages, buffer,
            optimizer, metrics, checkpoints) is used as it is. Built with `resume=`, the
            rollouts its checkpoint holds are trained on first.
        num_workers: W, rollout actors (int >= 1); rollout j runs on worker j mod W.
        max_staleness: s (int >= 0); 0 reproduces `RLTrainer.step` exactly, 1 is one-step-off.
        worker_num_cpus: Ray CPUs reserved per actor (float > 0).
        num_threads: torch threads per worker (None: the driver's `torch.get_num_threads()`).

    Attributes:
        consumed: one dict per consumed group: step, trainer_version, policy_version, lag
            (restored on resume).
        workers: the Ray actor handles.

    Raises:
        RuntimeError: if Ray is not initialised (call `ray.init(...)` first).
        TypeError: if `trainer` is not an `RLTrainer`.
        ValueError: for a plan or low-bit rollout on the trainer, a bad count, more CPUs asked
            for the workers than Ray has, or a resumed checkpoint whose rollouts lag the
            trainer by more than max_staleness (or come from another format version).
    """

    def __init__(
        self,
        trainer: RLTrainer,
        *,
        num_workers: int = 1,
        max_staleness: int = 1,
        worker_num_cpus: float = 1.0,
        num_threads: int | None = None,
    ) -> None:
        import ray

        if not isinstance(trainer, RLTrainer):
            raise TypeError(f"trainer is a {type(trainer).__name__}; pass an RLTrainer")
        if trainer.runtime.plan is not None:
            raise ValueError(
                f"AsyncRLTrainer supports a policy without a ParallelPlan only; "
                f"this trainer's runtime has {trainer.runtime.plan}"
            )
        if trainer.rollout_quantization is not None:
            raise ValueError(
                f"rollout_quantization={trainer.rollout_quantization!r}; "
                "AsyncRLTrainer supports None only"
            )
        if trainer.rollout.name != "builtin":
            raise ValueError(
                f"rollout_engine={trainer.rollout.name!r}; AsyncRLTrainer's workers sample with "
                "the builtin engine only"
            )
        check_int("num_workers", num_workers, minimum=1)
        check_int("max_staleness", max_staleness, minimum=0)
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
        self.trainer, self.max_staleness = trainer, max_staleness
        self.consumed: list[dict[str, int]] = []
        self._pending: dict[int, _Rollout] = {}  # step -> its rollout, submitted or restored
        if trainer.resumed_ahead is not None:
            self._load_state_dict(trainer.resumed_ahead)
        threads = torch.get_num_threads() if num_threads is None else num_threads
        actor = ray.remote(num_cpus=worker_num_cpus)(RolloutWorker)
        self.workers = [
            actor.remote(trainer.policy, trainer.step_count, threads) for _ in range(num_workers)
        ]
        state = trainer.buffer.state_dict()  # its counters carry on under the bound
        trainer.buffer = ReplayBuffer(
            mode="on_policy", max_staleness=max_staleness, seed=trainer.seed
        )
        trainer.buffer.load_state_dict({**state, "max_staleness": max_staleness})
        trainer.buffer.set_policy_version(trainer.step_count)
        trainer.ahead_state, trainer.resumed_ahead = self.state_dict, None
        self._version = trainer.step_count  # version the workers hold
        self._last_loads: list[Any] = []  # the latest weight-load calls

    def _submit_due(self) -> None:
        """Submit every rollout j <= trainer version + s not yet submitted."""
        t = self.trainer
        options = dict(
            group_size=t.algo.group_size,
            max_new_tokens=t.max_new_tokens,
            temperature=t.temperature,
            top_p=t.top_p,
            verifier_timeout_s=t.verifier_timeout_s,
        )
        first = max(self._pending, default=t.step_count - 1) + 1
        for j in range(first, t.step_count + self.max_staleness + 1):
            builders = t.task.builders(j, t.prompts_per_step)
            worker = self.workers[j % len(self.workers)]
            # ray types a method without @ray.method as the plain function; the handle's has .remote
            collect = worker.collect.remote  # type: ignore[union-attr]
            self._pending[j] = _Rollout(
                builders, ref=collect(builders, step_seed(t.seed, j), options)
            )

    def step(self) -> dict[str, float]:
        """One step: submit due rollouts, wait for this step's groups, train on them, sync the
        weights. Returns `RLTrainer`'s metrics row plus policy_version, staleness (trainer
        version - policy_version), rollout_wait_s (time blocked on the rollout), worker_rollout_s
        (the worker's sampling time) and weight_sync_s. These five are added after the trainer
        recorded the row: they are in the returned row, not in its callbacks or metrics log.

        Raises:
            RuntimeError: if the groups are older than the bound (a scheduling bug).
        """
        t, start = self.trainer, time.perf_counter()
        self._submit_due()
        rollout = self._pending.pop(t.step_count)
        groups, version, worker_s = rollout.result()
        waited = time.perf_counter() - start
        lag = t.step_count - version
        if lag > self.max_staleness or any(
            traj.policy_version != version for g in groups for traj in g
        ):
            raise RuntimeError(
                f"step {t.step_count}: groups of policy version {version}, "
                f"max_staleness={self.max_staleness}"
            )
        self.consumed += [
            {
                "step": t.step_count,
                "trainer_version": t.step_count,
                "policy_version": version,
                "lag": lag,
            }
            for _ in groups
        ]
        row = t.train_on_groups(groups, builders=rollout.builders, start=start, rollout_s=waited)
        sync = time.perf_counter()
        self._sync_weights()
        row.update(
            policy_version=version,
            staleness=lag,
            rollout_wait_s=waited,
            worker_rollout_s=worker_s,
            weight_sync_s=time.perf_counter() - sync,
        )
        return row

    def _sync_weights(self) -> None:
        """Put the policy's state dict in the object store once; every worker loads it."""
        import ray

        state = ray.put({k: v.detach() for k, v in self.trainer.policy.model.state_dict().items()})
        self._version = self.trainer.step_count
        self._last_loads = [  # (ray types the method as the plain function, as in _submit_due)
            w.load_weights.remote(state, self._version)  # type: ignore[union-attr]
            for w in self.workers
        ]

    def fit(self, num_steps: int) -> list[dict[str, float]]:
        """Take steps until the trainer's `step_count == num_steps` (int >= 0), as
        `RLTrainer.fit` does (a resumed run continues to the same total); returns the rows of
        the steps taken. At the end a checkpoint is saved when `checkpoint_every` is set and
        the last step has none. Rollouts submitted ahead of the last step are waited for and
        dropped by `close`."""
        check_int("num_steps", num_steps, minimum=0)
        rows = [self.step() for _ in range(self.trainer.step_count, num_steps)]
        every = self.trainer.checkpoint_every
        if rows and every and self.trainer.step_count % every:
            self.trainer.save_checkpoint()
        return rows

    def state_dict(self) -> dict[str, Any]:
        """The rollouts sampled ahead of the update (waited for), with the policy version each
        was sampled with, and `consumed`: what a checkpoint adds for this runner (plain
        containers, so it loads with `torch.load(weights_only=True)`)."""
        rollouts = []
        for j in sorted(self._pending):
            groups, version, worker_s = self._pending[j].result()
            rollouts.append(
                {
                    "step": j,
                    "policy_version": version,
                    "worker_rollout_s": worker_s,
                    "groups": [[dataclasses.asdict(t) for t in g] for g in groups],
                }
            )
        return {
            "version": AHEAD_STATE_VERSION,
            "max_staleness": self.max_staleness,
            "rollouts": rollouts,
            "consumed": [dict(c) for c in self.consumed],
        }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        t = self.trainer
        if state.get("version") != AHEAD_STATE_VERSION:
            raise ValueError(
                f"the checkpoint's rollouts have format version "
                f"{state.get('version')!r}; this posttrain reads "
                f"{AHEAD_STATE_VERSION}"
            )
        for saved in state["rollouts"]:
            if saved["step"] - saved["policy_version"] > self.max_staleness:
                raise ValueError(
                    f"the checkpoint holds the rollout of step {saved['step']} sampled with "
                    f"policy version {saved['policy_version']} (it was saved with "
                    f"max_staleness={state['max_staleness']}); max_staleness="
                    f"{self.max_staleness} would refuse it: resume with max_staleness >= "
                    f"{saved['step'] - saved['policy_version']}"
                )
            groups = _groups_from_state(saved["groups"])
            self._pending[saved["step"]] = _Rollout(
                t.task.builders(saved["step"], t.prompts_per_step),
                done=(groups, saved["policy_version"], saved["worker_rollout_s"]),
            )
        self.consumed = [dict(c) for c in state["consumed"]]

    def close(self) -> None:
        """Wait for in-flight calls, then end the worker actors."""
        import ray

        ray.get([r.ref for r in self._pending.values() if r.ref is not None] + self._last_loads)
        self._pending.clear()
        for worker in self.workers:  # ray's handle type (ActorProxy) is not what its kill takes
            ray.kill(worker)  # type: ignore[arg-type]
        self.workers = []
        if self.trainer.ahead_state == self.state_dict:
            self.trainer.ahead_state = None


class _Rollout:
    """One step's rollout: its builders and the worker call in flight (`ref`), or its result
    (groups, policy version, worker seconds) once fetched or restored from a checkpoint."""

    def __init__(self, builders: Sequence, *, ref: Any = None, done: tuple | None = None):
        self.builders, self.ref, self._done = builders, ref, done

    def result(self) -> tuple[list[Group], int, float]:
        if self._done is None:
            import ray

            self._done, self.ref = ray.get(self.ref), None
        return self._done


def _groups_from_state(state: list[list[dict[str, Any]]]) -> list[Group]:
    """`Group`s from `AsyncRLTrainer.state_dict`'s plain form (one dict per trajectory)."""
    return [Group([Trajectory(**t) for t in group]) for group in state]
