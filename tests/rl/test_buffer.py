"""Tests of posttrain.rl.buffer.ReplayBuffer: consume-once, staleness, sampling, exact resume."""

from __future__ import annotations

import doctest
import enum
import io
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import pytest
import torch

import posttrain.rl.buffer as buffer_module
from posttrain.rl import DATAFRAME_COLUMNS, ReplayBuffer


class Outcome(enum.Enum):
    OK = "ok"
    TIMEOUT = "timeout"


@dataclass
class Traj:
    """Stand-in for posttrain.rl.environment.Trajectory: only the attributes the buffer reads."""

    group_id: Any
    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float
    logprobs: list[float] | None = None
    outcome: Any = Outcome.OK
    finish_reason: str | None = "stop"
    text: str | None = None
    policy_version: int | None = None
    info: dict = field(default_factory=dict)


def _traj(i: int, *, version: int | None = None, group: int | None = None) -> dict:
    return {
        "group_id": i // 4 if group is None else group,
        "prompt_ids": [1, 2],
        "completion_ids": list(range(i % 3 + 1)),
        "reward": float(i),
        "text": f"t{i}",
        "policy_version": version,
        "advantage": i / 10,
    }


def test_doctests():
    assert doctest.testmod(buffer_module).failed == 0


def test_on_policy_consumes_each_trajectory_once():
    buf = ReplayBuffer(mode="on_policy", seed=1)
    assert buf.add([_traj(i) for i in range(10)]) == 10
    seen = [t["reward"] for t in buf.sample(4)] + [t["reward"] for t in buf.sample(3)]
    seen += [t["reward"] for t in buf.drain()]
    assert sorted(seen) == [float(i) for i in range(10)] and len(buf) == 0
    assert buf.stats()["consumed"] == 10
    with pytest.raises(ValueError, match="holds 0"):
        buf.sample(1)


def test_drain_is_oldest_first_and_empties():
    buf = ReplayBuffer()
    buf.add([_traj(i) for i in range(3)])
    assert [t["uid"] for t in buf.drain()] == [0, 1, 2]
    assert buf.drain() == []


def test_off_policy_keeps_trajectories_and_returns_copies():
    buf = ReplayBuffer(mode="off_policy", seed=0)
    buf.add([_traj(i) for i in range(5)])
    batch = buf.sample(5)
    batch[0]["completion_ids"].append(99)
    assert len(buf) == 5
    assert all(99 not in t["completion_ids"] for t in buf.drain())


def test_staleness_eviction_counts():
    """max_staleness 1: at version 2, trajectories of versions 0 are evicted (2 - 0 > 1) and
    version 1 kept; at version 3 version 1 goes too. A version-0 trajectory added at version 3
    is refused and counted."""
    buf = ReplayBuffer(mode="off_policy", max_staleness=1)
    buf.add([_traj(i, version=0) for i in range(3)])  # versions 0,0,0
    buf.add([_traj(i, version=1) for i in range(3, 5)])  # versions 1,1
    assert buf.set_policy_version(1) == 0
    assert buf.set_policy_version(2) == 3 and len(buf) == 2
    buf.add(_traj(5))  # version None -> 2
    assert buf.set_policy_version(3) == 2 and len(buf) == 1
    assert buf.add(_traj(6, version=0)) == 0
    stats = buf.stats()
    assert (stats["evicted_stale"], stats["rejected_stale"], stats["size"]) == (5, 1, 1)
    assert stats["policy_version"] == 3
    with pytest.raises(ValueError, match="version"):
        buf.set_policy_version(2)


def test_capacity_evicts_oldest_and_counts():
    buf = ReplayBuffer(mode="off_policy", capacity=3)
    buf.add([_traj(i) for i in range(5)])
    assert [t["reward"] for t in buf.drain()] == [2.0, 3.0, 4.0]
    assert buf.stats()["evicted_capacity"] == 2


def test_sampling_is_deterministic():
    def draws(seed):
        buf = ReplayBuffer(mode="off_policy", seed=seed)
        buf.add([_traj(i) for i in range(20)])
        return [[t["uid"] for t in buf.sample(5)] for _ in range(3)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    buf = ReplayBuffer(mode="off_policy")
    buf.add([_traj(i) for i in range(20)])
    first = [t["uid"] for t in buf.sample(6, generator=gen_a)]
    assert first == [t["uid"] for t in buf.sample(6, generator=gen_b)]


@pytest.mark.parametrize("mode", ["on_policy", "off_policy"])
def test_state_round_trip_gives_identical_subsequent_samples(mode):
    """Save mid-run (through torch.save / weights_only load, as a checkpoint does); the restored
    buffer draws exactly what the original draws next."""
    buf = ReplayBuffer(mode=mode, max_staleness=2, capacity=50, seed=5)
    buf.add([_traj(i, version=0) for i in range(30)])
    buf.sample(4)
    buf.set_policy_version(1)
    blob = io.BytesIO()
    torch.save(buf.state_dict(), blob)
    blob.seek(0)
    restored = ReplayBuffer(mode=mode, max_staleness=2, capacity=50, seed=999)
    restored.load_state_dict(torch.load(blob, weights_only=True))

    for b in (buf, restored):
        b.add([_traj(i, version=1) for i in range(30, 35)])
    assert [t["uid"] for t in buf.sample(6)] == [t["uid"] for t in restored.sample(6)]
    assert buf.set_policy_version(3) == restored.set_policy_version(3)
    assert buf.stats() == restored.stats()
    assert buf.to_dataframe().equals(restored.to_dataframe())

    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(mode=mode, max_staleness=2, capacity=10).load_state_dict(buf.state_dict())


def test_dataframe_columns_and_values():
    buf = ReplayBuffer()
    buf.add(
        Traj(
            group_id="p0",
            prompt_ids=[1],
            completion_ids=[5, 6, 7],
            reward=1.0,
            outcome=Outcome.TIMEOUT,
            finish_reason="length",
            text="abc",
            policy_version=0,
        ),
        advantages=[[0.1, 0.2, 0.3]],
    )
    buf.add(
        {
            "group_id": "p0",
            "prompt_ids": [1],
            "completion_ids": [8],
            "reward": 0.0,
            "advantage": -0.5,
        }
    )
    df = buf.to_dataframe()
    assert tuple(df.columns) == DATAFRAME_COLUMNS
    assert df.index.name == "uid" and df.index.tolist() == [0, 1]
    row = df.loc[0]
    assert (
        row["group_id"],
        row["reward"],
        row["outcome"],
        row["length"],
        row["finish_reason"],
        row["text"],
    ) == ("p0", 1.0, "timeout", 3, "length", "abc")
    assert row["advantage"] == pytest.approx(0.2)
    assert df.loc[1, "advantage"] == -0.5 and pd.isna(df.loc[1, "outcome"])
    assert tuple(ReplayBuffer().to_dataframe().columns) == DATAFRAME_COLUMNS


def test_groups_objects_and_tensors_are_stored_as_plain_dicts():
    @dataclass
    class Group:
        trajectories: list

    group = Group(
        [
            Traj(
                group_id=torch.tensor(3),
                prompt_ids=torch.tensor([1, 2]),
                completion_ids=torch.tensor([4, 5]),
                reward=1.0,
                logprobs=torch.tensor([-0.5, -1.0]),
            )
            for _ in range(2)
        ]
    )
    buf = ReplayBuffer()
    assert buf.add([group, [_traj(0), _traj(1)]], advantages=[0.5, -0.5, 1.0, 2.0]) == 4
    first = buf.drain()[0]
    assert first["group_id"] == 3 and first["prompt_ids"] == [1, 2]
    assert first["logprobs"] == [-0.5, -1.0] and first["advantage"] == 0.5
    assert first["outcome"] == "ok" and first["info"] == {}


def test_bad_trajectories_are_refused_whole():
    buf = ReplayBuffer()
    no_adv = {k: v for k, v in _traj(0).items() if k != "advantage"}
    with pytest.raises(ValueError, match="no advantage"):
        buf.add([_traj(1), no_adv])
    assert len(buf) == 0
    with pytest.raises(ValueError, match="NaN reward"):
        buf.add({**_traj(0), "reward": float("nan")})
    with pytest.raises(ValueError, match="lacks"):
        buf.add({"group_id": 0, "reward": 1.0, "advantage": 0.0})
    with pytest.raises(ValueError, match="per-token advantages"):
        buf.add({**_traj(0), "completion_ids": [1, 2], "advantage": [0.1]})
    with pytest.raises(ValueError, match="advantages for"):
        buf.add([_traj(0)], advantages=[0.1, 0.2])
    with pytest.raises(TypeError):
        buf.add(3)
    with pytest.raises(ValueError, match="mode"):
        ReplayBuffer(mode="fifo")


def test_accepts_posttrain_environment_trajectories_and_groups():
    from posttrain.rl import Group, Trajectory

    trajs = [
        Trajectory(
            group_id="q1",
            prompt_ids=[1],
            completion_ids=[2, 3, 4],
            logprobs=[-0.1, 0.0, -0.2],
            reward=r,
            outcome="ok",
            finish_reason="stop",
            text="x",
            policy_version=2,
            completion_mask=[True, False, True],
        )
        for r in (1.0, 0.0)
    ]
    buf = ReplayBuffer(mode="off_policy")
    assert buf.add(Group(trajs), advantages=[0.7, -0.7]) == 2
    stored = buf.sample(1)[0]
    assert stored["completion_mask"] == [True, False, True] and stored["policy_version"] == 2
    assert set(stored) >= set(buffer_module.TRAJECTORY_FIELDS) | {"advantage", "uid"}
