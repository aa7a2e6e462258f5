"""Replay buffer of scored trajectories, with their advantages, for RL minibatches.

A trajectory is one completion of one prompt. The buffer accepts dicts or any object with the
attributes below (e.g. `posttrain.rl.environment.Trajectory`), alone, in a list, or grouped (a list
of lists, or an object with a `trajectories` attribute), and stores each as a plain dict:

    group_id        prompt/group it belongs to (str or int)
    prompt_ids      list[int]
    completion_ids  list[int]
    logprobs        list[float] per completion token from the sampler, or None
    reward          float (NaN is refused: a failed rollout needs an explicit reward)
    outcome         typed outcome, stored as its value / name (str), or None
    finish_reason   str or None ('stop', 'length', ...)
    text            completion text, or None
    policy_version  int: optimizer steps of the policy that sampled it (None: the buffer's current)
    info            dict of extras
    completion_mask list[bool] per completion token (False: observation tokens of a multi-turn
                    episode, not trained), or None (all sampled)
    advantage       float, or list[float] per completion token (from `posttrain.rl.algorithms`)
    uid             int, given by the buffer in insertion order

Plain containers only, so `state_dict()` loads with `torch.load(weights_only=True)` (as long as
`info` holds plain values too).

Modes:
    on_policy   `sample(n)` removes what it returns: every trajectory is trained on once;
                `drain()` returns (and removes) all that is left, oldest first.
    off_policy  `sample(n)` returns copies and keeps the trajectories, until they are evicted.

Eviction is counted, never silent: `set_policy_version(v)` drops trajectories sampled by a policy
more than `max_staleness` versions older than v (and `add` refuses such ones), and `capacity`
drops the oldest when exceeded. `stats()` reports the counts.

Example:
    >>> buf = ReplayBuffer(mode="on_policy", seed=0)
    >>> buf.add([{"group_id": 0, "prompt_ids": [1], "completion_ids": [2, 3], "reward": 1.0,
    ...           "advantage": 0.5}, {"group_id": 0, "prompt_ids": [1], "completion_ids": [4],
    ...           "reward": 0.0, "advantage": -0.5}])
    2
    >>> [t["reward"] for t in buf.sample(1)], len(buf), [t["reward"] for t in buf.drain()]
    ([1.0], 1, [0.0])
"""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd
import torch

from posttrain.core.checks import check_int

__all__ = ["ReplayBuffer", "TRAJECTORY_FIELDS", "DATAFRAME_COLUMNS"]

TRAJECTORY_FIELDS = (
    "group_id",
    "prompt_ids",
    "completion_ids",
    "logprobs",
    "reward",
    "outcome",
    "finish_reason",
    "text",
    "policy_version",
    "info",
    "completion_mask",
)
"""Fields read from each added trajectory (plus `advantage`)."""

DATAFRAME_COLUMNS = (
    "group_id",
    "reward",
    "outcome",
    "advantage",
    "length",
    "finish_reason",
    "policy_version",
    "text",
)
"""Columns of `ReplayBuffer.to_dataframe()` (indexed by uid)."""

_REQUIRED = ("group_id", "prompt_ids", "completion_ids", "reward")
_MODES = ("on_policy", "off_policy")
_STATE_VERSION = 1


class ReplayBuffer:
    """Trajectories with advantages, sampled in minibatches; see the module docstring.

    Args:
        mode: 'on_policy' (each trajectory consumed once) or 'off_policy' (kept until evicted).
        capacity: most trajectories held; the oldest are evicted beyond it (None: unbounded).
        max_staleness: most policy versions a trajectory may lag behind the current policy
            (0: only the current policy's); None: never evicted for staleness.
        seed: seed of the buffer's own sampling generator (saved in `state_dict`).

    Raises:
        ValueError: for an unknown mode or a bad capacity / staleness.
    """

    def __init__(
        self,
        *,
        mode: str = "on_policy",
        capacity: int | None = None,
        max_staleness: int | None = None,
        seed: int = 0,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(_MODES)}")
        check_int("capacity", capacity, minimum=1, optional=True)
        check_int("max_staleness", max_staleness, minimum=0, optional=True)
        check_int("seed", seed, minimum=0)
        self.mode, self.capacity, self.max_staleness = mode, capacity, max_staleness
        self._generator = torch.Generator().manual_seed(seed)
        self._items: list[dict[str, Any]] = []
        self._policy_version = 0
        self._next_uid = 0
        self._counts = {
            "added": 0,
            "sampled": 0,
            "consumed": 0,
            "evicted_stale": 0,
            "rejected_stale": 0,
            "evicted_capacity": 0,
        }

    # ---------------------------------------------------------------------------------------
    # Adding and evicting
    # ---------------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """Version of the policy being trained (set by `set_policy_version`)."""
        return self._policy_version

    def add(self, items: Any, *, advantages: Sequence[Any] | None = None) -> int:
        """Add trajectories; returns how many were stored (stale ones are refused and counted).

        Args:
            items: a trajectory (dict or object), or an iterable of trajectories and groups (a
                group is a list/tuple of trajectories or an object with `trajectories`).
            advantages: one per trajectory, in the flattened order (float, or a per-token
                sequence as long as its completion); if None, each trajectory's own `advantage`
                is used.

        Raises:
            ValueError: for a missing field, a NaN reward, a missing advantage, or lengths that
                disagree. Nothing is added then.
        """
        flat = list(_flatten(items))
        if advantages is not None and len(advantages) != len(flat):
            raise ValueError(f"{len(advantages)} advantages for {len(flat)} trajectories")
        records = [
            self._record(t, None if advantages is None else advantages[i], i)
            for i, t in enumerate(flat)
        ]
        stored = 0
        for record in records:
            if self._is_stale(record["policy_version"]):
                self._counts["rejected_stale"] += 1
                continue
            record["uid"] = self._next_uid
            self._next_uid += 1
            self._items.append(record)
            stored += 1
        self._counts["added"] += stored
        if self.capacity is not None and len(self._items) > self.capacity:
            overflow = len(self._items) - self.capacity
            del self._items[:overflow]
            self._counts["evicted_capacity"] += overflow
        return stored

    def set_policy_version(self, version: int) -> int:
        """Record that the trained policy is now at `version` and evict trajectories more than
        `max_staleness` versions behind it. Returns how many were evicted.

        Raises:
            ValueError: if `version` is not an int or goes backwards.
        """
        check_int("version", version, minimum=self._policy_version)
        self._policy_version = version
        kept = [t for t in self._items if not self._is_stale(t["policy_version"])]
        evicted = len(self._items) - len(kept)
        self._items = kept
        self._counts["evicted_stale"] += evicted
        return evicted

    def _is_stale(self, version: int) -> bool:
        return (
            self.max_staleness is not None and self._policy_version - version > self.max_staleness
        )

    # ---------------------------------------------------------------------------------------
    # Sampling
    # ---------------------------------------------------------------------------------------

    def sample(self, n: int, *, generator: torch.Generator | None = None) -> list[dict[str, Any]]:
        """`n` distinct trajectories drawn uniformly (in draw order).

        On-policy they are removed from the buffer; off-policy copies are returned and the
        trajectories stay. `generator` replaces the buffer's own (which then does not advance).

        Raises:
            ValueError: if `n` < 1 or more than the buffer holds.
        """
        check_int("n", n, minimum=1)
        if n > len(self._items):
            raise ValueError(
                f"asked for {n} trajectories; the buffer holds {len(self._items)} "
                f"(stats: {self.stats()})"
            )
        order = torch.randperm(len(self._items), generator=generator or self._generator)
        picked = order[:n].tolist()
        self._counts["sampled"] += n
        if self.mode == "off_policy":
            return [copy.deepcopy(self._items[i]) for i in picked]
        chosen = [self._items[i] for i in picked]
        taken = set(picked)
        self._items = [t for i, t in enumerate(self._items) if i not in taken]
        self._counts["consumed"] += n
        return chosen

    def drain(self) -> list[dict[str, Any]]:
        """Remove and return every trajectory, oldest first."""
        items, self._items = self._items, []
        self._counts["consumed"] += len(items)
        return items

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict[str, int]:
        """Counters: size, added, sampled, consumed, evicted_stale, rejected_stale,
        evicted_capacity, policy_version."""
        return {"size": len(self._items), **self._counts, "policy_version": self._policy_version}

    # ---------------------------------------------------------------------------------------
    # Persistence and inspection
    # ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: settings, trajectories, counters, policy
        version and the sampling generator's state. Plain containers and one uint8 tensor."""
        return {
            "version": _STATE_VERSION,
            "mode": self.mode,
            "capacity": self.capacity,
            "max_staleness": self.max_staleness,
            "policy_version": self._policy_version,
            "next_uid": self._next_uid,
            "counts": dict(self._counts),
            "items": copy.deepcopy(self._items),
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s result.

        Raises:
            ValueError: if it comes from another format version or a buffer with other settings.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"buffer state version {state.get('version')!r}; this posttrain reads"
                f" {_STATE_VERSION}"
            )
        for name in ("mode", "capacity", "max_staleness"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"the saved buffer had {name}={state[name]!r}, this one "
                    f"{getattr(self, name)!r}; build it with the saved settings"
                )
        self._policy_version = int(state["policy_version"])
        self._next_uid = int(state["next_uid"])
        self._counts = dict(state["counts"])
        self._items = copy.deepcopy(list(state["items"]))
        self._generator.set_state(state["generator"])

    def to_dataframe(self) -> pd.DataFrame:
        """One row per held trajectory, indexed by uid, with `DATAFRAME_COLUMNS`; `length` is the
        number of completion tokens, `advantage` the mean of per-token advantages."""
        rows = [
            {
                "group_id": t["group_id"],
                "reward": t["reward"],
                "outcome": t["outcome"],
                "advantage": _mean(t["advantage"]),
                "length": len(t["completion_ids"]),
                "finish_reason": t["finish_reason"],
                "policy_version": t["policy_version"],
                "text": t["text"],
            }
            for t in self._items
        ]
        index = pd.Index([t["uid"] for t in self._items], name="uid", dtype="int64")
        return pd.DataFrame(rows, index=index, columns=list(DATAFRAME_COLUMNS))

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer(mode={self.mode!r}, capacity={self.capacity}, max_staleness="
            f"{self.max_staleness}, size={len(self._items)}, "
            f"policy_version={self._policy_version})"
        )

    # ---------------------------------------------------------------------------------------

    def _record(self, item: Any, advantage: Any, position: int) -> dict[str, Any]:
        get = (
            (lambda k, d=None: item.get(k, d))
            if isinstance(item, Mapping)
            else (lambda k, d=None: getattr(item, k, d))
        )
        where = f"trajectory {position} ({type(item).__name__})"
        missing = [k for k in _REQUIRED if get(k) is None]
        if missing:
            raise ValueError(f"{where} lacks {missing}; a trajectory needs {list(_REQUIRED)}")
        completion_ids = _int_list(get("completion_ids"))
        reward = float(get("reward"))
        if math.isnan(reward):
            raise ValueError(
                f"{where} has a NaN reward; give failed rollouts an explicit "
                "reward and a typed outcome"
            )
        logprobs = get("logprobs")
        if logprobs is not None:
            logprobs = _float_list(logprobs)
            if len(logprobs) != len(completion_ids):
                raise ValueError(
                    f"{where} has {len(logprobs)} logprobs for "
                    f"{len(completion_ids)} completion tokens"
                )
        completion_mask = get("completion_mask")
        if completion_mask is not None:
            completion_mask = [
                bool(v)
                for v in (
                    completion_mask.tolist()
                    if isinstance(completion_mask, torch.Tensor)
                    else completion_mask
                )
            ]
            if len(completion_mask) != len(completion_ids):
                raise ValueError(
                    f"{where} has a completion_mask of {len(completion_mask)} for "
                    f"{len(completion_ids)} completion tokens"
                )
        if advantage is None:
            advantage = get("advantage")
        if advantage is None:
            raise ValueError(
                f"{where} has no advantage; compute advantages "
                "(posttrain.rl.algorithms.compute_advantages) and pass them to add()"
            )
        if isinstance(advantage, (int, float)) or (
            isinstance(advantage, torch.Tensor) and advantage.dim() == 0
        ):
            advantage = float(advantage)
        else:
            advantage = _float_list(advantage)
            if len(advantage) != len(completion_ids):
                raise ValueError(
                    f"{where} has {len(advantage)} per-token advantages for "
                    f"{len(completion_ids)} completion tokens"
                )
        version = get("policy_version")
        info = get("info")
        text = get("text")
        return {
            "group_id": _plain_id(get("group_id")),
            "prompt_ids": _int_list(get("prompt_ids")),
            "completion_ids": completion_ids,
            "logprobs": logprobs,
            "reward": reward,
            "outcome": _plain(get("outcome")),
            "finish_reason": _plain(get("finish_reason")),
            "text": None if text is None else str(text),
            "policy_version": self._policy_version if version is None else int(version),
            "info": dict(info) if info else {},
            "completion_mask": completion_mask,
            "advantage": advantage,
        }


def _flatten(items: Any) -> Iterable[Any]:
    if isinstance(items, Mapping) or hasattr(items, "completion_ids"):
        yield items
    elif hasattr(items, "trajectories"):
        for item in items.trajectories:
            yield from _flatten(item)
    elif isinstance(items, Iterable) and not isinstance(items, (str, bytes)):
        for item in items:
            yield from _flatten(item)
    else:
        raise TypeError(
            f"cannot add {type(items).__name__}: expected a trajectory (dict or "
            "object with completion_ids), or a list/group of them"
        )


def _int_list(value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return [int(v) for v in value]


def _float_list(value: Any) -> list[float]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return [float(v) for v in value]


def _plain(value: Any) -> Any:
    """Enums and other typed values as str (or their plain value), for weights-only loading."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, enum.Enum):
        return value.value if isinstance(value.value, (str, int)) else value.name
    return str(value)


def _plain_id(value: Any) -> str | int:
    if isinstance(value, torch.Tensor):
        value = value.item()
    return value if isinstance(value, (str, int)) and not isinstance(value, bool) else str(value)


def _mean(advantage: float | list[float]) -> float:
    if isinstance(advantage, list):
        return sum(advantage) / len(advantage) if advantage else float("nan")
    return advantage
