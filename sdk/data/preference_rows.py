"""Preference and KTO rows as found, and their validation: the reader (`load_preference_rows`,
`posttrain.data.rows.read_rows`), the per-field checks the datasets of
`posttrain.data.preference` use, each raising `posttrain.data.rows.BadRowError`, and
`pairs_to_kto_rows`.

Rows:
    pairs: {"prompt": str | [messages], "chosen": str | [assistant message],
            "rejected": str | [assistant message]}
    KTO:   {"prompt": ..., "completion": str | [assistant message], "label": bool}
from a list of dicts, a pandas DataFrame or a .jsonl/.json path. A bad row raises
`BadRowError` (a ValueError naming the row index, the field and a reason).

Example:
    >>> from posttrain.data.preference_rows import pairs_to_kto_rows
    >>> pairs_to_kto_rows([{"prompt": "2+2=", "chosen": "4", "rejected": "5"}])
    [{'prompt': '2+2=', 'completion': '4', 'label': True},
     {'prompt': '2+2=', 'completion': '5', 'label': False}]
    >>> pairs_to_kto_rows([{"prompt": "2+2=", "chosen": "4"}])
    Traceback (most recent call last):
    ...
    posttrain.data.rows.BadRowError: row 0, field 'rejected': has no ... [missing_field]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.data.rows import BadLine, BadRowError, read_rows
from posttrain.models.chat import ROLES

__all__ = ["load_preference_rows", "pairs_to_kto_rows"]


def load_preference_rows(source: Any) -> list[Any]:
    """Rows as found, from a list of dicts, a pandas DataFrame or a .jsonl/.json path.

    Raises:
        FileNotFoundError: for a path that does not exist.
        ValueError: for a JSONL line that is not JSON (naming file and line), a file that is not
            UTF-8 (naming file, line and byte offset), or another kind of source.
    """
    return read_rows(source, "preference")


def _check_row(row: Any, index: int, fields: str) -> None:
    """BadRowError for a broken JSONL line or a row that is not a mapping."""
    if isinstance(row, BadLine):
        raise BadRowError(index, None, "bad_json", row.detail)
    if not isinstance(row, Mapping):
        raise BadRowError(
            index, None, "not_a_dict", f"is a {type(row).__name__}, expected a dict with {fields}"
        )


def _prompt(row: Mapping, index: int, chat: bool) -> str | list[dict]:
    if "prompt" not in row:
        raise BadRowError(index, "prompt", "missing_field", "has no 'prompt'")
    prompt = row["prompt"]
    if hasattr(prompt, "tolist") and not isinstance(prompt, str):
        prompt = prompt.tolist()  # Arrow-backed frames hold message lists as arrays
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRowError(index, "prompt", "empty", "the prompt is empty")
        return [{"role": "user", "content": prompt}] if chat else prompt
    if (
        chat
        and isinstance(prompt, Sequence)
        and prompt
        and all(isinstance(m, Mapping) and isinstance(m.get("content"), str) for m in prompt)
    ):
        for j, m in enumerate(prompt):
            if m.get("role") not in ROLES:
                raise BadRowError(
                    index,
                    "prompt",
                    "render_error",
                    f"message {j} has role {m.get('role')!r}; allowed: {', '.join(ROLES)}",
                )
        if prompt[-1].get("role") == "assistant":
            raise BadRowError(
                index,
                "prompt",
                "render_error",
                "a message prompt must not end with an assistant turn",
            )
        return [{"role": m.get("role"), "content": m["content"]} for m in prompt]
    allowed = "a str or a list of {'role', 'content'} messages" if chat else "a str (chat=False)"
    raise BadRowError(
        index, "prompt", "non_string", f"is a {type(prompt).__name__}; expected {allowed}"
    )


def _response(row: Mapping, index: int, key: str) -> str:
    if key not in row:
        raise BadRowError(index, key, "missing_field", f"has no {key!r}")
    value = row[key]
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) == 1
        and isinstance(value[0], Mapping)
        and value[0].get("role") == "assistant"
    ):
        value = value[0].get("content")  # TRL's conversational form: [assistant message]
    if not isinstance(value, str):
        raise BadRowError(
            index,
            key,
            "non_string",
            f"is a {type(value).__name__}; "
            "expected a str or [{'role': 'assistant', 'content': str}]",
        )
    if not value.strip():
        raise BadRowError(index, key, "empty_response", f"the {key} is empty")
    return value


def pairs_to_kto_rows(rows: Any) -> list[dict]:
    """Each pair becomes two KTO rows: (prompt, chosen, label True), (prompt, rejected, False).

    Args:
        rows: pairs as `PreferenceDataset` reads them: a list of dicts, a DataFrame or a
            .jsonl/.json path. Fields are copied as they are; `KTODataset` validates them.

    Raises:
        BadRowError (a ValueError): for a row that is not a mapping or lacks prompt,
            chosen or rejected, naming the row.
        ValueError, FileNotFoundError: as `load_preference_rows`.
    """
    out = []
    for i, row in enumerate(load_preference_rows(rows)):
        _check_row(row, i, "prompt, chosen, rejected")
        for key in ("prompt", "chosen", "rejected"):
            if key not in row:
                raise BadRowError(i, key, "missing_field", f"has no {key!r}")
        out.append({"prompt": row["prompt"], "completion": row["chosen"], "label": True})
        out.append({"prompt": row["prompt"], "completion": row["rejected"], "label": False})
    return out
