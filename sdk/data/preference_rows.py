"""Preference and KTO rows as found, and their validation: readers (`load_preference_rows`),
`PreferenceRowError` with the reasons a row is rejected, the per-field checks the datasets of
`posttrain.data.preference` use, and `pairs_to_kto_rows`.

Rows:
    pairs: {"prompt": str | [messages], "chosen": str | [assistant message],
            "rejected": str | [assistant message]}
    KTO:   {"prompt": ..., "completion": str | [assistant message], "label": bool}
from a list of dicts, a pandas DataFrame or a .jsonl/.json path. A bad row raises
`PreferenceRowError` (a ValueError naming the row index, the field and a reason).

Example:
    >>> from posttrain.data.preference_rows import pairs_to_kto_rows
    >>> pairs_to_kto_rows([{"prompt": "2+2=", "chosen": "4", "rejected": "5"}])
    [{'prompt': '2+2=', 'completion': '4', 'label': True},
     {'prompt': '2+2=', 'completion': '5', 'label': False}]
    >>> pairs_to_kto_rows([{"prompt": "2+2=", "chosen": "4"}])
    Traceback (most recent call last):
    ...
    posttrain.data.preference_rows.PreferenceRowError: row 0, field 'rejected': has no ... [missing_field]
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.data.sft import load_sft_rows
from posttrain.models.chat import ROLES

__all__ = ["PREFERENCE_BAD_ROW_REASONS", "PreferenceRowError", "load_preference_rows",
           "pairs_to_kto_rows"]

PREFERENCE_BAD_ROW_REASONS = (
    "bad_json",        # a line of a .jsonl file that is not JSON (the reason names the line)
    "not_a_dict",      # the row is not a mapping
    "missing_field",   # no prompt / chosen / rejected (KTO: completion / label)
    "non_string",      # a field that is neither a string nor the accepted message form
    "empty",           # an empty (whitespace-only) prompt
    "empty_response",  # an empty (whitespace-only) chosen, rejected or completion
    "same_response",   # chosen == rejected, surrounding whitespace ignored
    "bad_label",       # KTO label that is not a bool
    "render_error",    # the tokenizer's chat template rejected the conversation
    "overlong",        # prompt + response longer than max_seq_len
)
"""Reasons a row is rejected; the keys of
`posttrain.data.preference.PreferenceStats.skipped_by_reason`."""


class PreferenceRowError(ValueError):
    """A malformed preference or KTO row. Attributes: `index` (0-based row position), `field`
    (the offending field or None), `reason` (one of `PREFERENCE_BAD_ROW_REASONS`)."""

    def __init__(self, index: int, field: str | None, reason: str, detail: str) -> None:
        assert reason in PREFERENCE_BAD_ROW_REASONS, reason
        where = f"row {index}" + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {detail} [{reason}]")
        self.index, self.field, self.reason = index, field, reason


def load_preference_rows(source: Any) -> list[Any]:
    """Rows as found, from a list of dicts, a pandas DataFrame or a .jsonl/.json path.

    Raises:
        FileNotFoundError: for a path that does not exist.
        ValueError: for a JSONL line that is not JSON (naming file and line), or another kind
            of source.
    """
    rows = _read_rows(source)
    for row in rows:
        if isinstance(row, _BadLine):
            raise ValueError(row.detail)
    return rows


@dataclass(frozen=True)
class _BadLine:
    """A .jsonl line that is not JSON, kept in its row position so a dataset can skip it."""

    detail: str


def _read_rows(source: Any) -> list[Any]:
    """`load_preference_rows`, but a broken JSONL line comes back as a `_BadLine`."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"preference data file {source} does not exist")
        if path.suffix == ".json":
            return load_sft_rows(path)
        rows: list[Any] = []
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                rows.append(_BadLine(f"{path}:{line_no}: not valid JSON ({e.msg}); each line of "
                                     "a JSONL file must be one JSON object"))
        return rows
    if type(source).__name__ == "DataFrame" or (
            isinstance(source, Sequence) and not isinstance(source, (str, bytes))):
        return load_sft_rows(source)
    raise ValueError(f"cannot read preference rows from a {type(source).__name__}; pass a list "
                     "of dicts, a pandas DataFrame, or a .jsonl/.json path")


def _check_row(row: Any, index: int, fields: str) -> None:
    """PreferenceRowError for a broken JSONL line or a row that is not a mapping."""
    if isinstance(row, _BadLine):
        raise PreferenceRowError(index, None, "bad_json", row.detail)
    if not isinstance(row, Mapping):
        raise PreferenceRowError(index, None, "not_a_dict", f"is a {type(row).__name__}, "
                                 f"expected a dict with {fields}")


def _prompt(row: Mapping, index: int, chat: bool) -> str | list[dict]:
    if "prompt" not in row:
        raise PreferenceRowError(index, "prompt", "missing_field", "has no 'prompt'")
    prompt = row["prompt"]
    if hasattr(prompt, "tolist") and not isinstance(prompt, str):
        prompt = prompt.tolist()   # Arrow-backed frames hold message lists as arrays
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PreferenceRowError(index, "prompt", "empty", "the prompt is empty")
        return [{"role": "user", "content": prompt}] if chat else prompt
    if chat and isinstance(prompt, Sequence) and prompt and all(
            isinstance(m, Mapping) and isinstance(m.get("content"), str) for m in prompt):
        for j, m in enumerate(prompt):
            if m.get("role") not in ROLES:
                raise PreferenceRowError(index, "prompt", "render_error", f"message {j} has role "
                                         f"{m.get('role')!r}; allowed: {', '.join(ROLES)}")
        if prompt[-1].get("role") == "assistant":
            raise PreferenceRowError(index, "prompt", "render_error", "a message prompt must not "
                                     "end with an assistant turn")
        return [{"role": m.get("role"), "content": m["content"]} for m in prompt]
    allowed = "a str or a list of {'role', 'content'} messages" if chat else "a str (chat=False)"
    raise PreferenceRowError(index, "prompt", "non_string",
                             f"is a {type(prompt).__name__}; expected {allowed}")


def _response(row: Mapping, index: int, key: str) -> str:
    if key not in row:
        raise PreferenceRowError(index, key, "missing_field", f"has no {key!r}")
    value = row[key]
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    if (isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 1
            and isinstance(value[0], Mapping) and value[0].get("role") == "assistant"):
        value = value[0].get("content")   # TRL's conversational form: [assistant message]
    if not isinstance(value, str):
        raise PreferenceRowError(index, key, "non_string", f"is a {type(value).__name__}; "
                                 "expected a str or [{'role': 'assistant', 'content': str}]")
    if not value.strip():
        raise PreferenceRowError(index, key, "empty_response", f"the {key} is empty")
    return value


def pairs_to_kto_rows(rows: Any) -> list[dict]:
    """Each pair becomes two KTO rows: (prompt, chosen, label True), (prompt, rejected, False).

    Args:
        rows: pairs as `PreferenceDataset` reads them: a list of dicts, a DataFrame or a
            .jsonl/.json path. Fields are copied as they are; `KTODataset` validates them.

    Raises:
        PreferenceRowError (a ValueError): for a row that is not a mapping or lacks prompt,
            chosen or rejected, naming the row.
        ValueError, FileNotFoundError: as `load_preference_rows`.
    """
    out = []
    for i, row in enumerate(load_preference_rows(rows)):
        _check_row(row, i, "prompt, chosen, rejected")
        for key in ("prompt", "chosen", "rejected"):
            if key not in row:
                raise PreferenceRowError(i, key, "missing_field", f"has no {key!r}")
        out.append({"prompt": row["prompt"], "completion": row["chosen"], "label": True})
        out.append({"prompt": row["prompt"], "completion": row["rejected"], "label": False})
    return out
