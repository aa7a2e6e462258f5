"""A researcher's own data, from wherever it lives, as records (a list of dicts), and which row
format those records are in.

Sources (`read_records`): a `.jsonl` / `.json` / `.parquet` / `.csv` path, a pandas DataFrame,
a Hugging Face `datasets.Dataset` (or one split of a `DatasetDict`, named by `split`), or a list
of dicts. Missing cells (None, NaN: a DataFrame's or a CSV's empty cells, Parquet nulls) are
dropped from their record, so a record holds only the columns it has.

Row formats (`detect_format`), by the columns the records hold:

    chat               messages: [{"role", "content"}, ...]            (OpenAI chat, SFT)
    prompt_completion  prompt, completion                              (SFT; exact match)
    text               text                                            (continued pretraining)
    preference         prompt, chosen, rejected (str or message lists, as TRL's)  (DPO family)
    prompt             prompt (+ answer and any other columns, kept)  (RL prompts)

A format matches when the records hold its columns; of several matches the one whose columns
hold the others' wins (prompt/chosen/rejected is preference, not prompt). Two matches neither
of which holds the other (e.g. both `messages` and `text`) are ambiguous: a ValueError names
the columns found and the formats accepted, as does a set of columns no format matches.

Example:
    >>> records, fmt = load_records([{"prompt": "2+2=", "completion": "4"}], accepted=SFT_FORMATS)
    >>> fmt, records
    ('prompt_completion', [{'prompt': '2+2=', 'completion': '4'}])
    >>> load_records([{"question": "2+2="}], accepted=SFT_FORMATS)
    Traceback (most recent call last):
    ...
    ValueError: cannot tell the row format: the rows have columns ['question']; accepted \
formats: chat (columns messages), prompt_completion (columns prompt, completion)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.core.data_files import FILE_SUFFIXES  # importable from here too
from posttrain.data.rows import read_json_rows
from posttrain.data.tables import is_frame, is_table, read_table, records_of

__all__ = [
    "FORMATS",
    "SFT_FORMATS",
    "CPT_FORMATS",
    "PREFERENCE_FORMATS",
    "PROMPT_FORMATS",
    "FILE_SUFFIXES",
    "read_records",
    "detect_format",
    "load_records",
    "load_prompt_records",
]

FORMATS: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
    "preference": ("prompt", "chosen", "rejected"),
    "prompt": ("prompt",),
}
"""Each row format and the columns that identify it."""

SFT_FORMATS = ("chat", "prompt_completion")
CPT_FORMATS = ("text",)
PREFERENCE_FORMATS = ("preference",)
PROMPT_FORMATS = ("prompt",)


def read_records(source: Any, *, split: str | None = None) -> list[Any]:
    """The records of `source` (see the module docstring for the sources), each a dict of the
    columns it has; a .jsonl line or a list element that is not a dict is returned as found
    (the datasets reject it with its row index).

    Args:
        split: the split of a `DatasetDict` to read (None: its only split).

    Raises:
        FileNotFoundError: for a path that does not exist.
        ValueError: for a path of another suffix (naming the suffixes read), a DatasetDict
            without `split` among its splits (naming them), bad JSON or UTF-8 (naming the
            file and line), or a source of another type.
    """
    if is_table(source):
        return read_table(source, split=split)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.suffix not in FILE_SUFFIXES:
            raise ValueError(
                f"{str(source)!r}: a data file must end in one of {', '.join(FILE_SUFFIXES)}"
            )
        if not path.is_file():
            raise FileNotFoundError(f"data file {path} does not exist")
        return records_of(read_json_rows(path))
    if is_frame(source):
        return records_of(source.to_dict(orient="records"))
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        return records_of(list(source))
    raise ValueError(
        f"cannot read records from a {type(source).__name__}; pass a "
        f"{'/'.join(FILE_SUFFIXES)} path, a pandas DataFrame, a datasets.Dataset (or a "
        "DatasetDict with split=...), or a list of dicts"
    )


def _accepted_text(accepted: Sequence[str]) -> str:
    return ", ".join(f"{f} (columns {', '.join(FORMATS[f])})" for f in accepted)


def detect_format(records: Sequence[Any], accepted: Sequence[str] = tuple(FORMATS)) -> str:
    """The row format of `records`, one of `accepted` (names of `FORMATS`), from the columns
    the dict records hold together (their union).

    Raises:
        ValueError: for no records, columns that match no accepted format or are ambiguous,
            or a format the caller does not accept; each names the columns found and the
            formats accepted with their columns.
    """
    unknown = [f for f in accepted if f not in FORMATS]
    if unknown:
        raise ValueError(f"accepted={unknown}: unknown formats; choose from {sorted(FORMATS)}")
    if not records:
        raise ValueError(f"no rows to read; accepted formats: {_accepted_text(accepted)}")
    columns: set[str] = set()
    for r in records:
        if isinstance(r, Mapping):
            columns.update(map(str, r))
    matches = [f for f in FORMATS if set(FORMATS[f]) <= columns]
    best = [m for m in matches if all(set(FORMATS[o]) <= set(FORMATS[m]) for o in matches)]
    found = f"the rows have columns {sorted(columns)}"
    if matches and not best:
        raise ValueError(
            f"ambiguous row format: {found}, which match {', '.join(matches)}; keep the "
            f"columns of one format: {_accepted_text(accepted)}"
        )
    if not best:
        raise ValueError(
            f"cannot tell the row format: {found}; accepted formats: {_accepted_text(accepted)}"
        )
    if best[0] not in accepted:
        raise ValueError(
            f"{found}: {best[0]} rows, not accepted here; accepted formats: "
            f"{_accepted_text(accepted)}"
        )
    return best[0]


def load_records(
    source: Any, *, accepted: Sequence[str] = tuple(FORMATS), split: str | None = None
) -> tuple[list[Any], str]:
    """`read_records(source, split=split)` and their `detect_format(records, accepted)`.

    Raises:
        FileNotFoundError, ValueError: as those two.
    """
    records = read_records(source, split=split)
    return records, detect_format(records, accepted)


def load_prompt_records(source: Any, *, split: str | None = None) -> list[dict]:
    """RL prompt records: dicts with a "prompt" (a str, or a list of {"role", "content"}
    messages) and every other column (answers, metadata) kept as found; rows with
    prompt/completion give their completion as the "answer" where they have none.

    Raises:
        FileNotFoundError, ValueError: as `load_records`, and ValueError naming the row index
            for a row that is not a dict or whose prompt is empty or not a str / message list.
    """
    records = read_records(source, split=split)
    detect_format(records, ("prompt", "prompt_completion"))
    out = []
    for i, r in enumerate(records):
        prompt = r.get("prompt") if isinstance(r, Mapping) else None
        text = isinstance(prompt, str) and bool(prompt.strip())
        chat = isinstance(prompt, list) and bool(prompt)
        if not text and not (chat and all(isinstance(m, Mapping) for m in prompt or [])):
            raise ValueError(
                f"row {i}: 'prompt' must be a non-empty str or a list of "
                f"{{'role', 'content'}} messages, got {prompt!r:.80}"
            )
        record = dict(r)
        if "completion" in record:
            record.setdefault("answer", record["completion"])
        out.append(record)
    return out
