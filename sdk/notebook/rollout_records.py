"""One rollout as a plain record: the columns of a rollouts frame, and every kind of rollouts
source read into them.

A source is a `ReplayBuffer`, a `Group`, a list of groups / `Trajectory`s / buffer-style dicts
(lists of them count as groups) or the lines of a rollouts file. `_trajectories` flattens it in
order; `_record` reads one trajectory, object or dict, into a dict with every column of
`FRAME_COLUMNS + TOKEN_COLUMNS` (numpy / torch values made plain, the mean advantage, the number
of sampled tokens); `_frame` makes the canonical DataFrame of such records, the same for fresh
and loaded rollouts, so a save/load round trip compares equal. What each column holds is in
`posttrain.notebook.inspector`, whose views, filters, files and regrouping stand on these records.

Example:
    >>> rows = [{"group_id": 3, "text": "7", "reward": 1.0, "outcome": "ok"},
    ...         {"group_id": 3, "text": "7.0", "reward": 0.0, "outcome": "wrong"}]
    >>> frame = _frame([_record(r) for r in _trajectories([rows])])
    >>> frame[["group_id", "sample", "completion", "reward", "outcome"]].values.tolist()
    [[3, 0, '7', 1.0, 'ok'], [3, 1, '7.0', 0.0, 'wrong']]
    >>> frame["advantage"].tolist(), frame.index.name
    ([nan, nan], 'row')
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from posttrain.rewards.verifier import Outcome
from posttrain.rl.environment import Trajectory

__all__ = ["FRAME_COLUMNS", "TOKEN_COLUMNS"]

FRAME_COLUMNS = (
    "group_id",
    "sample",
    "policy_version",
    "prompt",
    "completion",
    "answer",
    "reward",
    "outcome",
    "reason",
    "num_tokens",
    "finish_reason",
    "advantage",
    "item",
)
"""Columns of `rollouts_frame` (what each holds: the `posttrain.notebook.inspector` docstring)."""

TOKEN_COLUMNS = ("prompt_ids", "completion_ids", "logprobs", "completion_mask", "info")
"""Extra columns with `tokens=True`: what `to_groups` / `replay_step` need to rebuild groups."""

_OUTCOMES = tuple(o.value for o in Outcome)


def _trajectories(source: Any) -> list[Any]:
    """Flatten a source into trajectory objects / dicts, in order."""
    if hasattr(source, "state_dict") and hasattr(source, "to_dataframe"):  # a ReplayBuffer
        return list(source.state_dict()["items"])
    if isinstance(source, (Trajectory, Mapping)):
        return [source]
    if hasattr(source, "trajectories"):
        return list(source.trajectories)
    if isinstance(source, (str, bytes)) or not isinstance(source, Iterable):
        raise TypeError(
            f"cannot read rollouts from a {type(source).__name__}; pass a "
            "ReplayBuffer, groups, trajectories, a rollouts file or a frame"
        )
    flat = []
    for element in source:
        if hasattr(element, "trajectories"):
            flat.extend(element.trajectories)
        elif isinstance(element, (list, tuple)):
            flat.extend(element)
        else:
            flat.append(element)
    return flat


def _record(t: Any) -> dict[str, Any]:
    """A plain dict with every frame column (sample filled in by `_frame`)."""
    get = (
        (lambda k, d=None: t.get(k, d))
        if isinstance(t, Mapping)
        else (lambda k, d=None: getattr(t, k, d))
    )
    where = f"a {type(t).__name__} rollout"
    completion = get("completion", get("text"))
    missing = [
        k for k, v in (("group_id", get("group_id")), ("reward", get("reward"))) if v is None
    ]
    if get("completion_ids") is None and completion is None:
        missing.append("completion_ids or text")
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    completion_ids = _plain_list(get("completion_ids"), int)
    mask = _plain_list(get("completion_mask"), bool)
    info = dict(get("info") or {})
    item = get("item")
    if get("num_tokens") is not None:
        num_tokens = int(get("num_tokens"))
    elif completion_ids is None:
        num_tokens = 0
    else:
        num_tokens = sum(mask) if mask is not None else len(completion_ids)
    reason = get("reason")
    if reason is None:
        reason = info.get("verifier_reason") or info.get("error") or ""
    version = get("policy_version")
    return {
        "group_id": _plain(get("group_id")),
        "sample": get("sample"),
        "policy_version": None if version is None else int(version),
        "prompt": get("prompt"),
        "completion": completion,
        "answer": get("answer", item.get("answer") if isinstance(item, Mapping) else None),
        "reward": float(get("reward")),
        "outcome": _plain(get("outcome")),
        "reason": str(reason),
        "num_tokens": num_tokens,
        "finish_reason": get("finish_reason"),
        "advantage": _mean(get("advantage")),
        "item": item,
        "prompt_ids": _plain_list(get("prompt_ids"), int),
        "completion_ids": completion_ids,
        "logprobs": _plain_list(get("logprobs"), float),
        "completion_mask": mask,
        "info": info,
    }


def _frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """The canonical frame of `records` (same function for fresh and loaded rollouts, so a
    save/load round trip compares equal)."""
    samples: dict[tuple, int] = {}
    for r in records:
        key = (r["policy_version"], r["group_id"])
        if r["sample"] is None:
            r["sample"] = samples.get(key, 0)
        samples[key] = max(samples.get(key, 0), int(r["sample"]) + 1)
        r["sample"] = int(r["sample"])
        if r["advantage"] is None:
            r["advantage"] = math.nan
    columns = list(FRAME_COLUMNS + TOKEN_COLUMNS)
    frame = pd.DataFrame(records, columns=columns)
    frame.index = pd.RangeIndex(len(frame), name="row")
    frame["reward"] = frame["reward"].astype(float)
    frame["advantage"] = frame["advantage"].astype(float)
    frame["num_tokens"] = frame["num_tokens"].astype("int64")
    frame["sample"] = frame["sample"].astype("int64")
    return frame


def _check_frame(frame: pd.DataFrame) -> pd.DataFrame:
    missing = [c for c in FRAME_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(
            f"this DataFrame lacks {missing}; pass a frame from rollouts_frame / "
            "load_rollouts, or the groups, buffer or file themselves"
        )
    return frame


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):  # before str: Outcome is a str enum
        return value.value
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)


def _plain_list(value: Any, kind: type) -> list | None:
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [kind(v) for v in value]


def _mean(advantage: Any) -> float | None:
    if advantage is None:
        return None
    if isinstance(advantage, (int, float)):
        return float(advantage)
    values = _plain_list(advantage, float)
    if values is None or len(values) == 0:
        return None if values is None else math.nan
    return sum(values) / len(values)


def _isnan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)
