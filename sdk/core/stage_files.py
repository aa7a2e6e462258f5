"""Stage files: what a run writes once and reads back when it resumes (held-out evaluation
tables, rejection-sampled pairs and their stats, a finished stage's results.json), each with a
record of its size, sha256 and row count, checked when it is read back.

Why: a file is written atomically (whole or absent), but it can still be cut or rewritten
after the write by another process, a full disk or a copy. A resumed DPO run whose pairs.jsonl
had lost lines used to read the rest, train on fewer pairs and exit 0; a cut evaluation table
surfaced as numpy's shape error in a paired comparison. Now such a file is refused, named.

The records of a folder live in one file, `stage_files.json` (`RECORD_FILE`):
`{"files": {name: {"bytes": int, "sha256": str, "rows" | "lines": int}}}`. A write
(`write_stage_file`) drops the file's old record, writes the file atomically, then records
it; so a file without a record is one whose write did not finish (or that was written before
files carried records). Reading (`read_stage_file`) returns the bytes only if they match:

    file absent                      -> None (the stage did not finish: it runs again)
    no record                        -> None with a warning (cannot be verified: it runs again);
                                        with required=True, the bytes with that warning
    size or sha256 differs           -> StageFileError naming the file, the rows recorded and
                                        the rows found, and what to do
    record file unreadable           -> StageFileError naming it

One writer per run folder is assumed (`posttrain.core.run_lock`); writes within a process are
serialised by a lock.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> path = Path(tempfile.mkdtemp()) / "pairs.jsonl"
    >>> write_stage_file(path, '{"a": 1}\\n{"a": 2}\\n', rows=2)
    >>> read_stage_file(path)
    b'{"a": 1}\\n{"a": 2}\\n'
    >>> _ = path.write_text('{"a": 1}\\n')        # another process cuts it
    >>> try:
    ...     read_stage_file(path)
    ... except StageFileError as e:
    ...     print(str(e).split(" when")[0].replace(str(path.parent), "DIR"))
    DIR/pairs.jsonl has 1 rows (9 bytes) where stage_files.json recorded 2 rows (18 bytes)
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, overload

from posttrain.core.checkpoint_files import write_text_atomic

__all__ = ["RECORD_FILE", "StageFileError", "write_stage_file", "read_stage_file", "count_lines"]

RECORD_FILE = "stage_files.json"
"""The file, in each folder that holds stage files, with their sizes, sha256 and row counts."""

_LOCK = threading.Lock()


class StageFileError(ValueError):
    """A stage file differs from what was written (cut, extended or changed afterwards), or the
    folder's record of its stage files is unreadable: a resumed run must not trust it."""


def count_lines(data: bytes) -> int:
    """Lines of `data` (a last line without a newline counts): the rows of a JSON Lines file,
    and the unit of a JSON document's record."""
    return len(data.splitlines())


def write_stage_file(path: str | os.PathLike, text: str, *, rows: int | None = None) -> None:
    """Write `text` (UTF-8) to `path` atomically (`write_text_atomic`: 0600, whole or absent)
    and record its size, sha256 and `rows` (a table's or a JSON Lines file's rows; None: its
    lines) in the folder's `stage_files.json`, so that `read_stage_file` can check it.

    Raises:
        ValueError: if `rows` is given and is not a non-negative int.
        StageFileError: if the folder's record file exists and is unreadable.
        OSError: if the file system refuses the write (errno ENOSPC when it is full, naming the
            folder and the bytes needed and free).
    """
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 0):
        raise ValueError(f"rows={rows!r}; must be a non-negative int (or None: count lines)")
    path = Path(path)
    data = text.encode("utf-8")
    entry: dict[str, Any] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    entry.update({"rows": rows} if rows is not None else {"lines": count_lines(data)})
    with _LOCK:
        records = _read_records(path.parent)
        if records.pop(path.name, None) is not None:  # until the new file is whole: no record
            _write_records(path.parent, records)
        write_text_atomic(path, text)
        records[path.name] = entry
        _write_records(path.parent, records)


@overload
def read_stage_file(
    path: str | os.PathLike,
    *,
    count_rows: Callable[[bytes], int] | None = None,
    required: Literal[True],
) -> bytes: ...


@overload
def read_stage_file(
    path: str | os.PathLike,
    *,
    count_rows: Callable[[bytes], int] | None = None,
    required: bool = False,
) -> bytes | None: ...


def read_stage_file(
    path: str | os.PathLike,
    *,
    count_rows: Callable[[bytes], int] | None = None,
    required: bool = False,
) -> bytes | None:
    """The bytes of stage file `path` if they are what `write_stage_file` recorded; None if the
    stage did not finish (no file, or no record: a warning names the file, whose stage then
    runs again). `count_rows(data)` counts the rows found for the error message (lines by
    default); a failure to count reads as "unreadable".

    Args:
        required: the caller has no way to run the stage again (its results are already read):
            a missing file raises FileNotFoundError, and a file without a record (written
            before stage files carried records) is returned with a warning that it is
            unverified.

    Raises:
        StageFileError: naming the file, the rows recorded and found and the sizes, if the file
            differs from its record; or naming `stage_files.json` if that is unreadable.
        FileNotFoundError: with `required`, if the file is absent.
    """
    path = Path(path)
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path} is missing: the stage that writes it did not finish")
        return None
    data = path.read_bytes()
    entry = _read_records(path.parent).get(path.name)
    if entry is None:
        what = "it is read unverified" if required else "its stage runs again"
        warnings.warn(
            f"{path} has no record in {RECORD_FILE} (written before stage files carried "
            f"records, or its write was interrupted), so it cannot be verified: {what}",
            stacklevel=2,
        )
        return data if required else None
    if len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"]:
        return data
    unit = "rows" if "rows" in entry else "lines"
    try:
        found = str((count_rows or count_lines)(data) if unit == "rows" else count_lines(data))
    except Exception:  # noqa: BLE001 - a cut quoted field, a cut UTF-8 sequence: parser gives up
        found = "unreadable"
    raise StageFileError(
        f"{path} has {found} {unit} ({len(data)} bytes) where {RECORD_FILE} recorded "
        f"{entry[unit]} {unit} ({entry['bytes']} bytes) when it was written: it was cut or "
        "changed afterwards, so a resumed run cannot trust it. Delete the file (its stage runs "
        "again) or use a new out_dir"
    )


def _read_records(folder: Path) -> dict[str, dict[str, Any]]:
    path = folder / RECORD_FILE
    if not path.is_file():
        return {}
    try:
        files = json.loads(path.read_bytes())["files"]
        ok = isinstance(files, dict) and all(
            isinstance(e, dict)
            and isinstance(e.get("bytes"), int)
            and isinstance(e.get("sha256"), str)
            and isinstance(e.get("rows", e.get("lines")), int)
            for e in files.values()
        )
    except (ValueError, KeyError, TypeError) as e:  # bad JSON or UTF-8, no "files"
        raise StageFileError(
            f"{path} is unreadable ({type(e).__name__}: {e}); it records the "
            f"stage files of {folder}: delete the folder's stage files and "
            f"{RECORD_FILE} (their stages run again) or use a new out_dir"
        ) from None
    if not ok:
        raise StageFileError(
            f'{path} is malformed (want {{"files": {{name: {{"bytes": int, '
            f'"sha256": str, "rows" or "lines": int}}}}}}); delete the '
            f"folder's stage files and {RECORD_FILE} or use a new out_dir"
        )
    return files


def _write_records(folder: Path, records: dict[str, dict[str, Any]]) -> None:
    write_text_atomic(
        folder / RECORD_FILE, json.dumps({"files": dict(sorted(records.items()))}, indent=1) + "\n"
    )
