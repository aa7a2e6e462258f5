"""Tabular data (Parquet, CSV, a Hugging Face `datasets.Dataset` or one split of a
`DatasetDict`) as records: one dict per row, holding only the cells it has (None, NaN: a
DataFrame's or a CSV's empty cells and Parquet nulls are dropped). The lowest layer of the data
readers: `posttrain.data.rows` and `posttrain.data.sources` read tables through it.

Example:
    >>> records_of([{"prompt": "2+2=", "answer": float("nan")}])
    [{'prompt': '2+2='}]
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

__all__ = ["TABLE_SUFFIXES", "is_frame", "is_missing", "is_table", "read_table", "records_of"]

TABLE_SUFFIXES = (".parquet", ".csv")
"""The tabular data files `read_table` reads (by suffix)."""


def is_missing(value: Any) -> bool:
    """True for a cell pandas filled in (None / NaN)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def is_frame(source: Any) -> TypeGuard[Any]:
    """True for a pandas DataFrame (checked by name, so pandas is not imported)."""
    return type(source).__name__ == "DataFrame" and hasattr(source, "to_dict")


def _is_hf_dataset(source: Any) -> bool:
    return type(source).__name__ in ("Dataset", "IterableDataset") and hasattr(
        source, "column_names"
    )


def _is_hf_dataset_dict(source: Any) -> bool:
    return type(source).__name__ in ("DatasetDict", "IterableDatasetDict")


def _plain(value: Any) -> Any:
    """Python lists for the arrays that pandas holds list cells in (Parquet, Arrow)."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def records_of(rows: list[Any]) -> list[Any]:
    return [
        {str(k): _plain(v) for k, v in r.items() if not is_missing(v)}
        if isinstance(r, Mapping)
        else r
        for r in rows
    ]


def is_table(source: Any) -> bool:
    """True for what `read_table` reads: a .parquet/.csv path, a `datasets.Dataset` or a
    `DatasetDict`."""
    if isinstance(source, (str, os.PathLike)):
        return Path(source).suffix in TABLE_SUFFIXES
    return _is_hf_dataset(source) or _is_hf_dataset_dict(source)


def read_table(source: Any, *, split: str | None = None) -> list[Any]:
    """The records of a .parquet/.csv path, a `datasets.Dataset`, or the `split` of a
    `DatasetDict` (None: its only split).

    Raises:
        FileNotFoundError: for a path that does not exist.
        ValueError: for a DatasetDict without `split` among its splits (naming them), or a
            source `is_table` does not accept.
    """
    if _is_hf_dataset_dict(source):
        splits = sorted(source)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            raise ValueError(
                f"split={split!r}: the DatasetDict has splits {splits}; name one of them"
            )
        source = source[split]
    if _is_hf_dataset(source):
        return records_of(list(source))
    if not is_table(source):
        raise ValueError(f"{source!r} is not a {'/'.join(TABLE_SUFFIXES)} path or a dataset")
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # type: ignore[import-untyped]

        return records_of(pq.read_table(path).to_pylist())
    import pandas as pd

    return records_of(pd.read_csv(path, dtype=str).to_dict(orient="records"))
