"""Rows as found, for every dataset here: the one reader of lists, DataFrames and `.jsonl` /
`.json` files, the one bad-row error with the one list of reasons, the one stats record, and the
character cap that keeps a huge row from being tokenised whole.

`read_rows` returns rows *as found*; each dataset validates them (`posttrain.data.sft`,
`posttrain.data.preference_rows`) and raises `BadRowError` naming the row, the field and a reason
from `BAD_ROW_REASONS`, or with `on_bad_row="skip"` counts it in `DataStats.skipped_by_reason`.
A file that is not UTF-8 raises ValueError naming the file, the line and the byte offset.

Example:
    >>> from posttrain.data.rows import BadRowError, DataStats
    >>> str(BadRowError(3, "chosen", "empty_response", "the chosen is empty"))
    "row 3, field 'chosen': the chosen is empty [empty_response]"
    >>> DataStats.counting("truncated").as_dict()
    {'rows': 0, 'samples': 0, 'skipped_by_reason': {}, 'truncated': 0, 'tokens': 0, 'skipped': 0}
"""

from __future__ import annotations

import dataclasses
import json
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from posttrain.data.tables import is_frame, is_missing, is_table, read_table
from posttrain.models.tokenizer import Tokenizer

__all__ = [
    "BAD_ROW_REASONS",
    "BadRowError",
    "DataStats",
    "read_rows",
    "read_json_rows",
    "read_text_file",
    "text_char_limit",
]

BAD_ROW_REASONS = (
    # any row
    "not_a_dict",  # the row is not a mapping
    "render_error",  # the tokenizer's chat template rejected the conversation
    # SFT / CPT rows (posttrain.data.sft)
    "no_messages",  # neither "messages" nor "prompt"/"completion"
    "bad_message",  # a message that is not a dict, or lacks "role" / "content"
    "non_string_content",  # content (or prompt/completion/text) is not a str
    "unknown_role",  # role outside posttrain.models.chat.ROLES
    "empty_assistant",  # an assistant turn with empty (or whitespace-only) content
    "no_assistant",  # no assistant turn at all: nothing to train
    "last_not_assistant",  # turns after the last assistant turn would be trained on nothing
    "empty_text",  # CPT: an empty (or whitespace-only) document
    # preference and KTO rows (posttrain.data.preference_rows)
    "bad_json",  # a line of a .jsonl file that is not JSON (the detail names the line)
    "missing_field",  # no prompt / chosen / rejected (KTO: completion / label)
    "non_string",  # a field that is neither a string nor the accepted message form
    "empty",  # an empty (whitespace-only) prompt
    "empty_response",  # an empty (whitespace-only) chosen, rejected or completion
    "same_response",  # chosen == rejected, surrounding whitespace ignored
    "bad_label",  # KTO label that is not a bool
    "overlong",  # prompt + response longer than max_seq_len
)
"""Reasons a row is rejected; the keys of `DataStats.skipped_by_reason`."""


class BadRowError(ValueError):
    """A malformed data row (SFT, CPT, preference or KTO). The message names the row index, the
    field when there is one, the problem and the reason: "row 2, field 'label': ... [bad_label]".

    Attributes:
        index: position of the row in its source (0-based).
        field: the offending field, or None when the row as a whole is wrong.
        reason: one of `BAD_ROW_REASONS`.
    """

    def __init__(self, index: int, field: str | None, reason: str, detail: str) -> None:
        assert reason in BAD_ROW_REASONS, reason
        where = f"row {index}" + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {detail} [{reason}]")
        self.index, self.field, self.reason = index, field, reason


@dataclass
class DataStats:
    """What a dataset read, kept, skipped, truncated and dropped.

    A count a dataset does not keep is None and left out of `as_dict()`: SFT/CPT datasets count
    truncated, dropped, split_documents and trained_tokens; preference/KTO datasets count
    response_tokens and kl_truncated. Build one with `DataStats.counting(*names)`.

    Attributes:
        rows: rows (SFT, preference, KTO) or documents (CPT) read.
        samples: samples kept (CPT: chunks; preference: pairs).
        skipped_by_reason: bad rows skipped with `on_bad_row="skip"`, by reason.
        truncated: over-long rows cut to `max_seq_len` and kept.
        dropped: over-long rows dropped (`overlong="drop"`, or truncation left no trained token).
        split_documents: CPT documents longer than `max_seq_len`, split into several chunks.
        tokens: over all kept sequences.
        trained_tokens: labels that are not IGNORE_INDEX, over all kept samples.
        response_tokens: response-mask positions, over all kept sequences.
        kl_truncated: KTO mismatched sequences cut to `max_seq_len`.
    """

    rows: int = 0
    samples: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    truncated: int | None = None
    dropped: int | None = None
    split_documents: int | None = None
    tokens: int = 0
    trained_tokens: int | None = None
    response_tokens: int | None = None
    kl_truncated: int | None = None

    @classmethod
    def counting(cls, *names: str) -> DataStats:
        """Stats that keep the optional counts `names` (starting at 0) and no other."""
        return cls(**cast("dict[str, Any]", dict.fromkeys(names, 0)))

    def add(self, name: str, n: int = 1) -> None:
        """Add `n` to the optional count `name`, which these stats must keep (`counting`)."""
        value = getattr(self, name)
        assert value is not None, f"DataStats does not count {name!r} here"
        setattr(self, name, value + n)

    @property
    def skipped(self) -> int:
        return sum(self.skipped_by_reason.values())

    def as_dict(self) -> dict[str, Any]:
        """The kept counts in field order, then "skipped" (JSON-safe)."""
        kept = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return {**kept, "skipped": self.skipped}

    def skip(self, error: BadRowError) -> None:
        """Count `error` as a skipped row."""
        self.skipped_by_reason[error.reason] = self.skipped_by_reason.get(error.reason, 0) + 1


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BadLine:
    """A .jsonl line that is not JSON, kept in its row position so that a dataset can count it
    as a bad row (reason "bad_json")."""

    detail: str


def read_text_file(path: Path) -> str:
    """The text of a UTF-8 file. Raises ValueError naming the file, the line and the byte offset
    of the first byte that is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = data.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{path}:{line_no}: not UTF-8 text (byte 0x{data[e.start]:02x} at byte "
            f"offset {e.start}: {e.reason}); data files must be UTF-8"
        ) from None


def read_json_rows(path: Path, *, keep_bad_lines: bool = False) -> list[Any]:
    """Rows of a `.json` file (one list) or a `.jsonl` file (one JSON value a line; blank lines
    are skipped).

    Args:
        keep_bad_lines: a .jsonl line that is not JSON comes back as a `BadLine` in its row
            position instead of raising.

    Raises:
        ValueError: for a file that is not UTF-8 (naming file, line and byte offset), a .json
            file that is not JSON or not a list, or a .jsonl line that is not JSON (naming file
            and line).
    """
    text = read_text_file(path)
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from e
        if not isinstance(data, list):
            raise ValueError(
                f"{path}: a .json data file must hold a list of rows, got {type(data).__name__}"
            )
        return data
    rows: list[Any] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            detail = (
                f"{path}:{line_no}: not valid JSON ({e.msg}); each line of a JSONL file "
                "must be one JSON object"
            )
            if not keep_bad_lines:
                raise ValueError(detail) from e
            rows.append(BadLine(detail))
    return rows


def read_rows(source: Any, what: str, *, keep_bad_lines: bool = False) -> list[Any]:
    """Rows as found from a list of dicts, a pandas DataFrame (cells pandas filled with NaN are
    dropped), a `.jsonl` / `.json` path, or what `posttrain.data.sources.read_records` reads
    besides (a `.parquet` / `.csv` path, a `datasets.Dataset` or one-split `DatasetDict`);
    `what` ("SFT", "preference") names the data in errors.

    Raises:
        FileNotFoundError: for a path that does not exist.
        ValueError: as `read_json_rows`, or for a source of another type.
    """
    if is_table(source):  # Parquet, CSV, HF datasets
        return read_table(source)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"{what} data file {path} does not exist")
        return read_json_rows(path, keep_bad_lines=keep_bad_lines)
    if is_frame(source):
        records = source.to_dict(orient="records")
        return [{k: v for k, v in r.items() if not is_missing(v)} for r in records]
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        return list(source)
    raise ValueError(
        f"cannot read {what} rows from a {type(source).__name__}; pass a list of "
        "dicts, a pandas DataFrame, a datasets.Dataset, or a .jsonl/.json/.parquet/.csv path"
    )


# --------------------------------------------------------------------------------------------
# The character cap
# --------------------------------------------------------------------------------------------

_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _max_token_chars(tokenizer: Tokenizer) -> int:
    """Most characters one token of `tokenizer` can stand for: its longest decoded id, + 1 for
    the word-start space a SentencePiece decoder drops from a lone piece. Cached per tokenizer."""
    try:
        return _TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max(
        len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size)
    )
    try:
        _TOKEN_CHARS[tokenizer] = longest + 1
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return longest + 1


def text_char_limit(tokenizer: Tokenizer, max_seq_len: int) -> int:
    """Characters of one text (a message, a prompt, a response) worth tokenising for a sample of
    at most `max_seq_len` tokens; the datasets cut each text to this before tokenising.

    Why the cut cannot change a kept token: a sample keeps at most the first `max_seq_len`
    tokens, so at most that many tokens of any one text. The ByteTokenizer makes one token per
    UTF-8 byte, so at least one per character, and `max_seq_len` characters would do; an HF
    tokenizer merges characters (about four per token in English), so `max_seq_len` characters
    can be far fewer than `max_seq_len` tokens. What bounds the cut is how many characters one
    token can cover, C (`_max_token_chars`: the longest decoded vocabulary entry + 1; for the
    ByteTokenizer its special names, which `encode` never makes from text, so C overshoots).
    The first `max_seq_len` tokens of a text lie in its first `max_seq_len * C` characters; the
    cut is twice that, so the word it splits (where a BPE tokenizer may tokenise differently)
    starts a full `max_seq_len * C` characters after the kept tokens unless one word alone spans
    more than `max_seq_len` tokens. A text longer than the cut has more than `2 * max_seq_len`
    tokens either way, so it stays over-long: truncated, dropped or rejected exactly as before.
    (A chat template that rewrites a message from text past the cut, such as one that drops
    everything before a later "</think>", is outside this argument.)

    Raises:
        ValueError: from the tokenizer if it cannot decode its own ids.
    """
    return 2 * max_seq_len * _max_token_chars(tokenizer)


def cap_messages(messages: Sequence[Mapping], limit: int) -> list[dict]:
    """Copies of `messages` ({"role", "content": str}) with each content cut to `limit` chars."""
    return [{**m, "content": m["content"][:limit]} for m in messages]
