"""The data files a researcher's own rows may come from, by suffix (`FILE_SUFFIXES`): what
`posttrain.data.sources.read_records` reads, kept apart from it (`posttrain.data` imports torch)
so that a config's `data.train` path is checked without the training stack.

Example:
    >>> "rows.parquet".endswith(FILE_SUFFIXES), "rows.xlsx".endswith(FILE_SUFFIXES)
    (True, False)
"""

from __future__ import annotations

__all__ = ["FILE_SUFFIXES"]

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
"""The data files `posttrain.data.sources.read_records` reads (by suffix)."""
