"""The `data:` section of a recipe config (`DataConfig`: own rows instead of the task, and
how rows are held out), apart from the rows' reading and metrics
(`posttrain.workflows.own_data`, which imports torch) so that a config module imports it
without the training stack; `DataConfig` is importable from `own_data` too.

Example:
    >>> DataConfig(train="rows.jsonl").given, DataConfig().given
    (True, False)
    >>> DataConfig(eval_fraction=1.0)
    Traceback (most recent call last):
    ...
    ValueError: DataConfig.eval_fraction=1.0; must be below 1 (some rows must train)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.core.data_files import FILE_SUFFIXES
from posttrain.workflows.field_checks import fail, finite, ints, seeds

__all__ = ["DataConfig"]


def _is_dataset_dict(source: Any) -> bool:
    return type(source).__name__ in ("DatasetDict", "IterableDatasetDict")


def _check_source(value: Any, name: str) -> None:
    if value is None:  # the task's data
        return
    bad_path = isinstance(value, str) and not value.endswith(FILE_SUFFIXES)
    if bad_path or isinstance(value, (int, float, bool, bytes)):
        raise fail(
            name,
            value,
            f"a {'/'.join(FILE_SUFFIXES)} path, a pandas DataFrame, a datasets.Dataset or "
            "DatasetDict, a list of dicts, or None (the task's data)",
        )


@dataclass(kw_only=True)
class DataConfig:
    """Own data (see the module docstring); `train` None: the recipe's task."""

    train: Any = None
    eval: Any = None
    eval_fraction: float = 0.1
    split: str | None = None
    eval_split: str | None = None
    seed: int = 0
    eval_rows: int = 64

    def __post_init__(self) -> None:
        self.check("DataConfig")

    @property
    def given(self) -> bool:
        """Whether the recipe trains on these rows (`train` is set)."""
        return self.train is not None

    def check(self, at: str) -> None:
        _check_source(self.train, f"{at}.train")
        _check_source(self.eval, f"{at}.eval")
        if self.train is None and self.eval is not None:
            raise fail(f"{at}.eval", "...", "None without data.train (set data.train too)")
        finite(self, at, ("eval_fraction",), low=0.0, high=1.0)
        if self.eval_fraction == 1.0:
            raise fail(f"{at}.eval_fraction", 1.0, "below 1 (some rows must train)")
        seeds(self, at, ("seed",))
        ints(self, at, ("eval_rows",), minimum=1)
        for key, source, of in (("split", self.train, "train"), ("eval_split", self.eval, "eval")):
            name = getattr(self, key)
            if name is None:
                continue
            if not _is_dataset_dict(source):
                raise fail(
                    f"{at}.{key}",
                    name,
                    f"None: it names a split of a DatasetDict, and {at}.{of} is none",
                )
            if name not in source:
                raise fail(f"{at}.{key}", name, f"one of the DatasetDict's splits {sorted(source)}")

    def records(
        self, accepted: Sequence[str], group_of: Callable[[Any], Hashable] | None = None
    ) -> tuple[list[Any], list[Any], str]:
        """(training records, held-out records, row format) of `train` and `eval` (or
        `eval_fraction` of `train`, drawn with `seed`), the held-out ones at most `eval_rows`.

        Args:
            accepted: the row formats the recipe takes (`posttrain.data.sources.FORMATS`).
            group_of: None: `eval_fraction` of the rows is held out; else a record's group
                (e.g. its prompt): `eval_fraction` of the groups (at least one, at most all but
                one) is held out with all their rows, so no held-out group is trained on.

        Raises:
            FileNotFoundError, ValueError: as `posttrain.data.sources.load_records`, naming
                `data.train` / `data.eval`; ValueError if held-out rows are of another
                format than the training ones.
        """
        from posttrain.data.sources import load_records

        try:
            train, fmt = load_records(self.train, accepted=accepted, split=self.split)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"data.train={_shown(self.train)}: {e}") from None
        if self.eval is not None:
            try:
                held, held_fmt = load_records(self.eval, accepted=accepted, split=self.eval_split)
            except (ValueError, FileNotFoundError) as e:
                raise ValueError(f"data.eval={_shown(self.eval)}: {e}") from None
            if held_fmt != fmt and not {held_fmt, fmt} <= {"chat", "prompt_completion"}:
                raise ValueError(
                    f"data.eval holds {held_fmt} rows, data.train {fmt} rows; use one format"
                )
        else:
            keys = [i if group_of is None else group_of(r) for i, r in enumerate(train)]
            groups = list(dict.fromkeys(keys))  # in order of first appearance
            held = []
            if self.eval_fraction > 0 and len(groups) >= 2:
                n = min(len(groups) - 1, max(1, round(self.eval_fraction * len(groups))))
                random.Random(self.seed).shuffle(groups)
                chosen = set(groups[:n])
                held = [r for k, r in zip(keys, train) if k in chosen]
                train = [r for k, r in zip(keys, train) if k not in chosen]
        return train, held[: self.eval_rows], fmt


def _shown(source: Any) -> str:
    return repr(source) if isinstance(source, str) else f"<{type(source).__name__}>"
