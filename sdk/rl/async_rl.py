"""Asynchronous RL: rollout workers that sample with a known weights version feed an
`RLTrainer`, whose update of step k overlaps the rollout of step k+1 (one-step-off, as in verl's
one-step-off-policy recipe and AReaL's bounded staleness).

Notation: s = `max_staleness` (policy versions a consumed group may lag the trainer), K =
`sync_every` (updates between two weight syncs), W = number of rollout workers, k = a step
index; the trainer's version is its `step_count` (optimizer steps of the policy = updates done),
a trajectory's `policy_version` the version of the weights that drew it.

The workers, by the trainer's rollout engine:

- "builtin": Ray actors (`RolloutWorker`), each with its own copy of the policy; a sync puts the
  state dict in Ray's object store once and every actor loads it. Start Ray first.
- an engine apart from the policy ("vllm", or a caller's `VLLMEngine` over a server or a
  `VLLMPool`): W threads of this process sampling from the engine
  (`posttrain.rl.async_engine.EngineWorkers`, which says why a sync first waits for the
  rollouts in flight); a sync is the engine's (for vllm: /dev/shm, reload, prefix-cache reset).
  Ray is not needed. The policy recomputes the old log-probs and logs the mismatch with the
  engine's (`posttrain.rl.engine_rollout`).

The schedule (`rollout_schedule` computes it without Ray):

    rollout j  is submitted once the workers hold weights of a version >= j - s (and the trainer's
               version >= j - s), to worker j mod W, with the synchronous trainer's inputs for
               step j: builders = task.builders(j, prompts_per_step), seed = seed x 1_000_003 + j
    step k     submit every rollout due -> wait for rollout k's groups -> refuse a sample older
               than k - s (`check_staleness`, by name) -> `RLTrainer.train_on_groups` -> when
               k + 1 is a multiple of K: sync the workers' weights (version k + 1)

With K = 1 (the default) rollout j samples with version max(start, j - s). A K > 1 leaves the
workers up to K - 1 updates behind, so it needs s >= K - 1 (refused by name otherwise: the step
whose weights are never synced could not be sampled). With s = 0 every rollout waits for the
previous update: the run is `RLTrainer.step` repeated, bitwise on CPU with Ray workers (same
builders, seeds and weights; the workers use the driver's torch thread count by default, since
the float sums of a matmul depend on it). With s = 1 rollout k+1 samples with the weights of
version k while update k runs.

The trainer's replay buffer becomes an on-policy `ReplayBuffer(max_staleness=s)` (its state
kept), and the trainer's rollout engine takes the bound s (`RLTrainer.rollout.max_staleness`).
`consumed` records (step, trainer version, policy version) of every consumed group.

Checkpoints and resume: the trainer's checkpoints (`checkpoint_every`, Ctrl-C, preemption) also
hold the rollouts sampled ahead of the update, steps k+1 .. k+s after update k, with the policy
version each was sampled with and `consumed` (`state_dict`): the checkpoint waits for them (at
a checkpoint the update and those rollouts overlap, the next rollout does not). A trainer built
with `resume=` and then wrapped here trains on them first, so a run killed after a checkpoint
and resumed continues exactly as if it had not stopped, at any s (bitwise on CPU with Ray
workers, fixed threads). The workers start with the checkpoint's weights, its version: with
K > 1 that is what an uninterrupted run's workers hold only at a step that is a multiple of K
(`checkpoint_every` a multiple of K), otherwise the resumed run samples fresher weights.

Works from a notebook cell. Not covered: a `ParallelPlan` policy and low-bit rollout.

Example (the schedule only; `docs/guides/async_rl.md` has a run with Ray):
    >>> [(j, v) for j, v, _ in rollout_schedule(4, max_staleness=1)]
    [(0, 0), (1, 0), (2, 1), (3, 2)]
    >>> [(j, v) for j, v, _ in rollout_schedule(5, max_staleness=1, sync_every=2)]
    [(0, 0), (1, 0), (2, 2), (3, 2), (4, 4)]
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from posttrain.core.checks import check_int
from posttrain.rl.async_engine import EngineWorkers
from posttrain.rl.async_ray import RayWorkers, RolloutWorker, check_ray
from posttrain.rl.buffer import ReplayBuffer
from posttrain.rl.environment import Group, Trajectory
from posttrain.rl.trainer import RLTrainer

__all__ = ["AsyncRLTrainer", "RolloutWorker", "rollout_schedule", "step_seed"]

AHEAD_STATE_VERSION = 1


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of step `step` for a trainer seeded `seed` (what `RLTrainer.step` gives
    `collect_groups`): seed x 1_000_003 + step."""
    return seed * 1_000_003 + step


def rollout_schedule(
    num_steps: int, *, max_staleness: int, start: int = 0, sync_every: int = 1
) -> list[tuple[int, int, int]]:
    """Which weights each rollout samples with under the one-step-off schedule.

    Args:
        num_steps: steps to schedule (int >= 1).
        max_staleness: s (int >= 0): rollout j is submitted once the workers hold a version
            >= j - s.
        start: the trainer's version (step_count) when the run starts (int >= 0); the workers
            start with its weights.
        sync_every: K (int >= 1, at most s + 1): the workers get the weights of every version
            that is a multiple of K (after the update that reaches it).

    Returns:
        (step j, policy version of its rollout, trainer version when it is trained = j) for
        j = start, ..., start + num_steps - 1: the version is `start` if j - s <= start, else
        the first multiple of K >= j - s; lag = j - version <= s.

    Raises:
        ValueError: for a non-integer or out-of-range argument, or K > s + 1.
    """
    check_int("num_steps", num_steps, minimum=1)
    check_int("max_staleness", max_staleness, minimum=0)
    check_int("start", start, minimum=0)
    check_sync_every(sync_every, max_staleness)
    s, k = max_staleness, sync_every
    return [  # -(-a // k) * k: the first multiple of k >= a
        (j, start if j - s <= start else -(-(j - s) // k) * k, j)
        for j in range(start, start + num_steps)
    ]


def check_sync_every(sync_every: int, max_staleness: int) -> None:
    """Refuse a `sync_every` (K) whose weights would lag more than `max_staleness` (s) allows:
    between two syncs the workers fall up to K - 1 versions behind."""
    check_int("sync_every", sync_every, minimum=1)
    if sync_every - 1 > max_staleness:
        raise ValueError(
            f"sync_every={sync_every} with max_staleness={max_staleness}: between two syncs the "
            f"rollout weights fall up to sync_every - 1 = {sync_every - 1} versions behind the "
            f"trainer, which the bound refuses; allowed: max_staleness >= {sync_every - 1}, or "
            f"sync_every <= {max_staleness + 1}"
        )


class AsyncRLTrainer:
    """Runs an `RLTrainer`'s steps with rollouts on workers (Ray actors, or threads sampling
    from the trainer's vllm engine), up to `max_staleness` steps ahead of the update (see the
    module docstring for the schedule and for resume). Closes with `close()` or a `with` block.

    Args:
        trainer: a built `RLTrainer` (no `ParallelPlan`, no `rollout_quantization`); its update
            path (`train_on_groups`: exclusion, advantages, buffer, optimizer, metrics,
            checkpoints) is used as it is. Its rollout engine picks the workers: "builtin" Ray
            actors; an engine apart from the policy ("vllm") threads sampling from it (the
            server starts at the first rollout and stops at `close`; a caller's engine stays
            open). Built with `resume=`, the rollouts its checkpoint holds are trained on first.
        num_workers: W, rollout actors or threads (int >= 1); rollout j runs on worker j mod W.
        max_staleness: s (int >= 0); 0 reproduces `RLTrainer.step` exactly, 1 is one-step-off.
        sync_every: K (int >= 1, at most s + 1): the workers' weights are synced after every
            K-th update (at versions that are multiples of K).
        worker_num_cpus: Ray CPUs reserved per actor (float > 0; None: 1.0); Ray workers only.
        num_threads: torch threads per actor (None: the driver's `torch.get_num_threads()`);
            Ray workers only.

    Attributes:
        consumed: one dict per consumed group: step, trainer_version, policy_version (the
            oldest of its trajectories'), lag (restored on resume).
        workers: the Ray actor handles ([] with threads).

    Raises:
        RuntimeError: Ray workers without Ray initialised (call `ray.init(...)` first).
        TypeError: if `trainer` is not an `RLTrainer`.
        ValueError: for a plan or low-bit rollout on the trainer, a bad count, `sync_every` >
            `max_staleness` + 1, more CPUs asked for the workers than Ray has,
            `worker_num_cpus` or `num_threads` with threads, or a resumed checkpoint whose
            rollouts lag the trainer by more than max_staleness (or come from another format
            version).
    """

    def __init__(
        self,
        trainer: RLTrainer,
        *,
        num_workers: int = 1,
        max_staleness: int = 1,
        sync_every: int = 1,
        worker_num_cpus: float | None = None,
        num_threads: int | None = None,
    ) -> None:
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
        check_int("num_workers", num_workers, minimum=1)
        check_int("max_staleness", max_staleness, minimum=0)
        check_sync_every(sync_every, max_staleness)
        threaded = trainer.rollout.apart_from_policy
        if threaded:
            for name, value in (("worker_num_cpus", worker_num_cpus), ("num_threads", num_threads)):
                if value is not None:
                    raise ValueError(
                        f"{name}={value!r} with rollout engine {trainer.rollout.name!r}: its "
                        f"workers are threads of this process sampling from the engine; {name} "
                        "sets Ray actors (rollout_engine='builtin'); allowed: None"
                    )
        else:
            check_ray(num_workers, 1.0 if worker_num_cpus is None else worker_num_cpus)
        self.trainer, self.max_staleness, self.sync_every = trainer, max_staleness, sync_every
        self.consumed: list[dict[str, int]] = []
        self._pending: dict[int, _Rollout] = {}  # step -> its rollout, submitted or restored
        if trainer.resumed_ahead is not None:
            self._load_state_dict(trainer.resumed_ahead)
        self._version = trainer.step_count  # version the workers hold
        self._lane: RayWorkers | EngineWorkers
        if threaded:
            self._lane = EngineWorkers(
                trainer.rollout, trainer.policy, version=self._version, num_workers=num_workers
            )
        else:
            self._lane = RayWorkers(
                trainer.policy,
                version=self._version,
                num_workers=num_workers,
                num_cpus=1.0 if worker_num_cpus is None else worker_num_cpus,
                threads=torch.get_num_threads() if num_threads is None else num_threads,
            )
        trainer.rollout.max_staleness = max_staleness
        state = trainer.buffer.state_dict()  # its counters carry on under the bound
        trainer.buffer = ReplayBuffer(
            mode="on_policy", max_staleness=max_staleness, seed=trainer.seed
        )
        trainer.buffer.load_state_dict({**state, "max_staleness": max_staleness})
        trainer.buffer.set_policy_version(trainer.step_count)
        trainer.ahead_state, trainer.resumed_ahead = self.state_dict, None

    @property
    def workers(self) -> list[Any]:
        """The Ray actor handles ([] when the workers are threads)."""
        return self._lane.actors if isinstance(self._lane, RayWorkers) else []

    def _submit_due(self) -> None:
        """Submit every rollout j not yet submitted with j - s <= the version the workers hold
        (then also <= the trainer's version)."""
        t = self.trainer
        options = t.collect_options()
        first = max(self._pending, default=t.step_count - 1) + 1
        for j in range(first, self._version + self.max_staleness + 1):
            builders = t.task.builders(j, t.prompts_per_step)
            call = self._lane.submit(j, builders, step_seed(t.seed, j), options)
            self._pending[j] = _Rollout(builders, pending=call)

    def step(self) -> dict[str, float]:
        """One step: submit due rollouts, wait for this step's groups, train on them, sync the
        weights when due. Returns `RLTrainer`'s metrics row plus policy_version, staleness
        (trainer version - policy_version), rollout_wait_s (time blocked on the rollout),
        worker_rollout_s (the worker's sampling time), sync_wait_s (with threads: time waiting
        for the rollouts in flight before a sync) and weight_sync_s (0.0 when no sync was due).
        These are added after the trainer recorded the row: they are in the returned row, not
        in its callbacks or metrics log.

        Raises:
            StaleRolloutError (a ValueError): a sample older than the bound (nothing of the
                step applied); what the workers or the engine raised.
        """
        t, start = self.trainer, time.perf_counter()
        self._submit_due()
        rollout = self._pending.pop(t.step_count)
        groups, version, worker_s = rollout.result()
        waited = time.perf_counter() - start
        t.rollout.check(groups, t.step_count)  # `check_staleness`: refused by name
        lag = t.step_count - version
        self.consumed += [
            {
                "step": t.step_count,
                "trainer_version": t.step_count,
                "policy_version": (oldest := min(traj.policy_version for traj in g)),
                "lag": t.step_count - oldest,
            }
            for g in groups
        ]
        row = t.train_on_groups(groups, builders=rollout.builders, start=start, rollout_s=waited)
        sync_wait = sync_s = 0.0
        if t.step_count % self.sync_every == 0:
            sync = time.perf_counter()
            sync_wait = self._lane.sync(t.policy, t.step_count)
            sync_s, self._version = time.perf_counter() - sync - sync_wait, t.step_count
        row.update(
            policy_version=version,
            staleness=lag,
            rollout_wait_s=waited,
            worker_rollout_s=worker_s,
            sync_wait_s=sync_wait,
            weight_sync_s=sync_s,
        )
        return row

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
        """Wait for the rollouts in flight (their results dropped), then end the workers (and
        an engine the trainer built: a vllm server stops)."""
        for rollout in self._pending.values():
            rollout.wait()
        self._pending.clear()
        self._lane.close()
        if self.trainer.ahead_state == self.state_dict:
            self.trainer.ahead_state = None

    def __enter__(self) -> AsyncRLTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Rollout:
    """One step's rollout: its builders and the worker call in flight (`pending`: a Future or
    a `RayCall`), or its result (groups, policy version, worker seconds) once fetched or
    restored from a checkpoint."""

    def __init__(self, builders: Sequence, *, pending: Any = None, done: tuple | None = None):
        self.builders, self.pending, self._done = builders, pending, done

    def result(self) -> tuple[list[Group], int, float]:
        if self._done is None:
            self._done, self.pending = self.pending.result(), None
        return self._done

    def wait(self) -> None:
        """Wait until the call has ended, without raising what it raised."""
        if self.pending is not None:
            try:
                self.result()
            except Exception:  # noqa: BLE001 - a dropped rollout's failure is not the caller's
                self.pending = None


def _groups_from_state(state: list[list[dict[str, Any]]]) -> list[Group]:
    """`Group`s from `AsyncRLTrainer.state_dict`'s plain form (one dict per trajectory)."""
    return [Group([Trajectory(**t) for t in group]) for group in state]
