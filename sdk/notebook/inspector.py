"""Rollout inspector: see what the policy sampled, keep it and rebuild the groups it trained on.
Rescoring with an edited verifier and comparing rewards before and after live in
`posttrain.notebook.rescoring`; replaying a saved batch through one RL step in
`posttrain.notebook.replay`.

Sources: a `ReplayBuffer`, a list of `Group`s / `Trajectory`s (or buffer-style dicts, or lists
of them), a rollouts JSONL file written by `save_rollouts`, or a frame from `rollouts_frame`.

`rollouts_frame` gives one row per trajectory, index "row" (its position in the source), with
`FRAME_COLUMNS`:

    group_id        the group (prompt) id; unique only within one policy_version
    sample          position inside its group, 0..G-1
    policy_version  optimizer steps of the policy that sampled it (the RL step it came from)
    prompt          the task item's question (a `PromptTask` record's prompt; of a message
                    list, the last user turn) when known, else the prompt tokens decoded with
                    `tokenizer` (special tokens dropped), else None
    completion      the completion text (all assistant turns of a multi-turn episode)
    answer          the task item's reference answer when known, else None
    reward          float
    outcome         'ok', 'wrong', 'format_error', 'timeout' or 'error' (`verifier.Outcome`)
    reason          the verifier's reason or the rollout's error message ('' when none)
    num_tokens      sampled completion tokens (multi-turn observation tokens not counted)
    finish_reason   'stop', 'length', 'max_turns', 'error', or None when unknown
    advantage       mean advantage over the completion (buffer records); NaN when unknown
    item            the task item (question/answer/metadata dict), None when unknown

and with `tokens=True` (always in saved files) also `TOKEN_COLUMNS`: prompt_ids, completion_ids,
logprobs (per completion token, from the sampler), completion_mask (None: all sampled), info.

Trajectories do not carry their task item; pass `items=` (one per group, in order, e.g.
`[b.item for b in builders]`, or a dict group_id -> item) to get prompt text, answers and
rescoring. `save_rollouts` stores the items with the rollouts, so a saved file is
self-contained: it rescores and replays without the task.

How each kind of source is read into these columns is `posttrain.notebook.rollout_records`.

Example:
    >>> from posttrain.rl import Group, Trajectory
    >>> def traj(text, reward, outcome):
    ...     return Trajectory(group_id=0, prompt_ids=[1, 2], completion_ids=list(b"x" * len(text)),
    ...                       logprobs=[-1.0] * len(text), reward=reward, outcome=outcome,
    ...                       finish_reason="stop", text=text)
    >>> groups = [Group([traj("7", 1.0, "ok"), traj("7.0", 0.0, "wrong")])]
    >>> frame = rollouts_frame(groups, items=[{"question": "3+4=", "answer": "7"}])
    >>> frame[["prompt", "completion", "reward", "outcome", "num_tokens"]].values.tolist()
    [['3+4=', '7', 1.0, 'ok', 1], ['3+4=', '7.0', 0.0, 'wrong', 3]]
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from posttrain.notebook.rollout_records import (
    _OUTCOMES,
    FRAME_COLUMNS,
    TOKEN_COLUMNS,
    _check_frame,
    _frame,
    _isnan,
    _plain,
    _record,
    _trajectories,
)
from posttrain.rewards.verifier import Outcome
from posttrain.rl.environment import Group, Trajectory

if TYPE_CHECKING:
    from posttrain.models.tokenizer import Tokenizer

__all__ = [
    "rollouts_frame",
    "save_rollouts",
    "load_rollouts",
    "to_groups",
    "FRAME_COLUMNS",
    "TOKEN_COLUMNS",
    "ROLLOUTS_FORMAT",
]

ROLLOUTS_FORMAT = 1
"""Format version written in every line of a rollouts file (`"rollouts_format": 1`)."""


# --------------------------------------------------------------------------------------------
# Frames
# --------------------------------------------------------------------------------------------


def rollouts_frame(
    source: Any,
    *,
    items: Sequence[Any] | Mapping[Any, Any] | None = None,
    tokenizer: Tokenizer | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    outcome: str | Iterable[str] | None = None,
    min_len: int | None = None,
    max_len: int | None = None,
    tokens: bool = False,
) -> pd.DataFrame:
    """One row per trajectory of `source`, filtered (see the module docstring for columns).

    Args:
        source: a `ReplayBuffer`, a `Group`, a list of groups / trajectories / buffer-style
            dicts (lists of them count as groups), a rollouts file path, or a rollouts frame.
        items: the task items, one per group in order of first appearance (groups are keyed by
            (policy_version, group_id)), or a mapping group_id -> item. Replaces items
            already in the source.
        tokenizer: decodes the prompt tokens when no item gives the question.
        min_reward, max_reward: keep rows with min_reward <= reward <= max_reward.
        outcome: keep rows with this outcome (or any of these).
        min_len, max_len: keep rows with min_len <= num_tokens <= max_len.
        tokens: also return `TOKEN_COLUMNS`.

    Returns:
        A DataFrame indexed by "row" (the position in the unfiltered source, so filtered rows
        point back into the full frame).

    Raises:
        ValueError: for an unknown outcome name, `items` of the wrong length, a trajectory
            without group_id / completion / reward, or `tokens=True` on a frame without them.
        TypeError: for a source of another kind.
    """
    if isinstance(source, pd.DataFrame):
        frame = _check_frame(source)
    elif isinstance(source, (str, os.PathLike)):
        frame = load_rollouts(source)
    else:
        frame = _frame([_record(t) for t in _trajectories(source)])
    if items is not None:
        frame = _attach_items(frame, items)
    if tokenizer is not None:
        frame = _decode_prompts(frame, tokenizer)
    frame = _filter(
        frame,
        min_reward=min_reward,
        max_reward=max_reward,
        outcome=outcome,
        min_len=min_len,
        max_len=max_len,
    )
    if not tokens:
        return frame[list(FRAME_COLUMNS)]
    missing = [c for c in TOKEN_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(
            f"this frame has no {missing} columns; build it with tokens=True, or "
            "pass the groups, buffer or rollouts file itself"
        )
    return frame[list(FRAME_COLUMNS + TOKEN_COLUMNS)]


def _group_keys(frame: pd.DataFrame) -> list[tuple]:
    """(policy_version, group_id) of every row."""
    return list(zip(frame["policy_version"], frame["group_id"]))


def _attach_items(frame: pd.DataFrame, items: Sequence[Any] | Mapping[Any, Any]) -> pd.DataFrame:
    keys = _group_keys(frame)
    if isinstance(items, Mapping):
        row_items = [items.get(g) for _, g in keys]
    else:
        items = list(items)
        order = list(dict.fromkeys(keys))
        if len(items) != len(order):
            raise ValueError(
                f"{len(items)} items for {len(order)} groups; pass one item per "
                "group, in order (e.g. [b.item for b in builders]), or a dict "
                "group_id -> item"
            )
        position = {key: i for i, key in enumerate(order)}
        row_items = [items[position[key]] for key in keys]
    frame = frame.copy()
    frame["item"] = pd.Series(row_items, index=frame.index, dtype=object)
    frame["answer"] = [i.get("answer") if isinstance(i, Mapping) else None for i in row_items]
    questions = [_item_prompt(i) for i in row_items]
    frame["prompt"] = [q if q is not None else p for q, p in zip(questions, frame["prompt"])]
    return frame


def _item_prompt(item: Any) -> str | None:
    """The prompt text of a task item: its "question" (reasoning-gym items), else its "prompt"
    (`PromptTask` records: the string, or the last user turn's content of a message list)."""
    if not isinstance(item, Mapping):
        return None
    if item.get("question") is not None:
        return item["question"]
    prompt = item.get("prompt")
    if isinstance(prompt, list):
        users = [
            m.get("content") for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"
        ]
        return users[-1] if users else None
    return prompt if isinstance(prompt, str) else None


def _decode_prompts(frame: pd.DataFrame, tokenizer: Tokenizer) -> pd.DataFrame:
    if "prompt_ids" not in frame.columns or frame["prompt"].notna().all():
        return frame
    frame = frame.copy()
    frame["prompt"] = [
        p if p is not None and not _isnan(p) else (None if ids is None else tokenizer.decode(ids))
        for p, ids in zip(frame["prompt"], frame["prompt_ids"])
    ]
    return frame


def _filter(
    frame: pd.DataFrame, *, min_reward, max_reward, outcome, min_len, max_len
) -> pd.DataFrame:
    keep = pd.Series(True, index=frame.index)
    if min_reward is not None:
        keep &= frame["reward"] >= min_reward
    if max_reward is not None:
        keep &= frame["reward"] <= max_reward
    if outcome is not None:
        wanted = [outcome] if isinstance(outcome, (str, Outcome)) else list(outcome)
        wanted = [_plain(o) for o in wanted]
        unknown = [o for o in wanted if o not in _OUTCOMES]
        if unknown:
            raise ValueError(f"unknown outcome {unknown}; valid: {list(_OUTCOMES)}")
        keep &= frame["outcome"].isin(wanted)
    if min_len is not None:
        keep &= frame["num_tokens"] >= min_len
    if max_len is not None:
        keep &= frame["num_tokens"] <= max_len
    return frame[keep]


# --------------------------------------------------------------------------------------------
# Saving, loading, rebuilding groups
# --------------------------------------------------------------------------------------------


def save_rollouts(
    source: Any,
    path: str | os.PathLike,
    *,
    items: Sequence[Any] | Mapping[Any, Any] | None = None,
    tokenizer: Tokenizer | None = None,
    append: bool = False,
) -> int:
    """Write rollouts as JSON lines (one trajectory per line, every frame and token column, plus
    `"rollouts_format": ROLLOUTS_FORMAT`). Floats round-trip exactly; a NaN advantage is
    written as null. Items should hold JSON values (tuples come back as lists; other objects
    are written as their str).

    Args:
        source, items, tokenizer: as in `rollouts_frame` (prompt text is resolved now and
            saved, so loading needs no tokenizer).
        path: the file; its folder is created. Written atomically unless `append`.
        append: add to the file (e.g. one call per RL step) instead of replacing it.

    Returns:
        The number of rollouts written.

    Raises:
        ValueError / TypeError: as `rollouts_frame`.
    """
    if isinstance(source, pd.DataFrame) and not set(TOKEN_COLUMNS) <= set(source.columns):
        frame = rollouts_frame(source, items=items, tokenizer=tokenizer)
        for column in TOKEN_COLUMNS:  # a view frame: saved without tokens (not replayable)
            frame[column] = None
    else:
        frame = rollouts_frame(source, items=items, tokenizer=tokenizer, tokens=True)
    lines = []
    for record in frame.to_dict("records"):
        record = {
            "rollouts_format": ROLLOUTS_FORMAT,
            **{k: record.get(k) for k in FRAME_COLUMNS + TOKEN_COLUMNS},
        }
        if _isnan(record["advantage"]):
            record["advantage"] = None
        lines.append(json.dumps(record, default=_json_default) + "\n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if append:
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(lines)
    else:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)
        os.replace(tmp, path)
    return len(lines)


def load_rollouts(path: str | os.PathLike) -> pd.DataFrame:
    """Read a `save_rollouts` file: the frame of `rollouts_frame(..., tokens=True)`, index
    0..n-1 in file order.

    Raises:
        FileNotFoundError: if there is no such file.
        ValueError: for a line that is not JSON or comes from another format version.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number} is not JSON ({e})") from None
            version = record.pop("rollouts_format", None)
            if version != ROLLOUTS_FORMAT:
                raise ValueError(
                    f"{path}:{number} has rollouts_format {version!r}; this "
                    f"posttrain reads {ROLLOUTS_FORMAT}"
                )
            records.append(_record(record))
    return _frame(records)


def to_groups(source: Any) -> list[Group]:
    """Rebuild `Group`s of `Trajectory`s (what an RL step trains on) from rollouts.

    Groups are keyed by (policy_version, group_id), in order of first appearance; trajectories
    are ordered by `sample`. The reward and outcome are the source's (a frame may carry edited
    ones).

    Raises:
        ValueError: for rows without token ids / logprobs (e.g. a frame without
            `TOKEN_COLUMNS`, or buffer records without logprobs) or without a finish reason.
    """
    frame = (
        rollouts_frame(source, tokens=True)
        if not isinstance(source, pd.DataFrame)
        else _check_frame(source)
    )
    missing = [c for c in TOKEN_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(
            f"this frame has no {missing} columns: it cannot be trained on; use "
            "rollouts_frame(..., tokens=True) or load_rollouts(path)"
        )
    groups: dict[tuple, list[tuple[int, Trajectory]]] = {}
    for row, r in frame.iterrows():
        for column in ("prompt_ids", "completion_ids", "logprobs", "finish_reason"):
            if r[column] is None or _isnan(r[column]):
                raise ValueError(f"row {row} has no {column}; it cannot be trained on")
        completion = r["completion"] if isinstance(r["completion"], str) else ""
        t = Trajectory(
            group_id=r["group_id"],
            prompt_ids=list(r["prompt_ids"]),
            completion_ids=list(r["completion_ids"]),
            logprobs=list(r["logprobs"]),
            reward=float(r["reward"]),
            outcome=r["outcome"],
            finish_reason=r["finish_reason"],
            text=completion,
            policy_version=0 if r["policy_version"] is None else int(r["policy_version"]),
            info=dict(r["info"] or {}),
            completion_mask=None if r["completion_mask"] is None else list(r["completion_mask"]),
        )
        groups.setdefault((r["policy_version"], r["group_id"]), []).append((int(r["sample"]), t))
    return [
        Group([t for _, t in sorted(members, key=lambda m: m[0])]) for members in groups.values()
    ]


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, enum.Enum):
        return value.value
    return str(value)
