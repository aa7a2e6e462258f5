"""Per-step training metrics: in memory as a pandas DataFrame, on disk as JSONL, optionally in
TensorBoard (through `posttrain.core.trackers.TensorBoardTracker`, so a run that also has a
TensorBoard tracker writes one event stream).

A row is a flat dict of numbers keyed by name, with an integer "step". `MetricsLog` is what the
`Trainer` writes to; `read_metrics` reads a run's `metrics.jsonl` back (in another process, or
after the run).

Example:
    >>> log = MetricsLog()
    >>> log.append({"step": 1, "loss": 2.5})
    >>> log.append({"step": 2, "loss": 2.0})
    >>> log.frame()["loss"].tolist()
    [2.5, 2.0]
"""

from __future__ import annotations

import json
import numbers
import os
from pathlib import Path
from typing import IO, Any

import pandas as pd

from posttrain.core.checkpoint_files import make_private_dir
from posttrain.core.run_permissions import run_modes
from posttrain.core.trackers import TENSORBOARD_DIR, TensorBoardTracker

__all__ = ["METRICS_FILE", "TENSORBOARD_DIR", "MetricsLog", "read_metrics"]

METRICS_FILE = "metrics.jsonl"
"""File name of the per-step rows inside a run folder (one JSON object per line)."""


class MetricsLog:
    """Rows of metrics, one per step, kept in memory and mirrored to disk.

    Args:
        run_dir: folder for `metrics.jsonl` (and `tensorboard/`); None keeps rows in memory only.
            Created on the first write.
        tensorboard: also write every numeric value as a TensorBoard scalar (tag = key,
            global_step = row["step"]) under `run_dir/tensorboard`, through the same event
            stream as a `TensorBoardTracker` of the run folder (one writer; a scalar the
            tracker wrote at a step is not written twice).

    `metrics.jsonl` gets the run's file mode (`posttrain.core.run_permissions.run_modes`),
    whatever the umask.

    Raises:
        ValueError: from `append`, if a row has no integer "step".
    """

    def __init__(
        self, run_dir: str | os.PathLike | None = None, *, tensorboard: bool = False
    ) -> None:
        self.run_dir = None if run_dir is None else Path(run_dir)
        if tensorboard and self.run_dir is None:
            raise ValueError("tensorboard=True needs a run_dir to write event files into")
        self.tensorboard = tensorboard
        self.rows: list[dict[str, Any]] = []
        self._tensorboard = (
            TensorBoardTracker(self.run_dir) if tensorboard and self.run_dir else None
        )

    @property
    def path(self) -> Path | None:
        """`run_dir / metrics.jsonl`, or None without a run_dir."""
        return None if self.run_dir is None else self.run_dir / METRICS_FILE

    def append(self, row: dict[str, Any]) -> None:
        """Keep `row`, append it to `metrics.jsonl` (flushed) and to TensorBoard."""
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"a metrics row needs an integer 'step', got {step!r}")
        row = dict(row)
        self.rows.append(row)
        if self.run_dir is not None and self.path is not None:
            make_private_dir(self.run_dir)
            with _open_run_file(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if self._tensorboard is not None:
            numbers_ = {k: float(v) for k, v in row.items() if k != "step" and _is_number(v)}
            self._tensorboard.log(numbers_, step)

    def reset(self, rows: list[dict[str, Any]]) -> None:
        """Replace all rows (on resume: the rows saved with the checkpoint). Rewrites
        `metrics.jsonl` atomically, dropping rows a killed run wrote after its last checkpoint,
        and makes TensorBoard discard events after the last kept step."""
        self.rows = [dict(r) for r in rows]
        if self.run_dir is not None and self.path is not None and (self.rows or self.path.exists()):
            make_private_dir(self.run_dir)
            tmp = self.path.with_name(f".{METRICS_FILE}.{os.getpid()}.tmp")
            with _open_run_file(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.rows)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        if self._tensorboard is not None:
            self._tensorboard.purge((self.rows[-1]["step"] + 1) if self.rows else 0)

    def frame(self) -> pd.DataFrame:
        """All rows as a DataFrame (one row per step; columns missing from a row are NaN)."""
        return pd.DataFrame(self.rows)

    def close(self) -> None:
        """Leave the TensorBoard event stream (closed when no tracker of the folder holds it;
        a later `append` opens it again)."""
        if self._tensorboard is not None:
            self._tensorboard.finish()


def _open_run_file(path: Path, mode: str) -> IO[str]:
    """`open(path, mode)` (text, UTF-8) for a file created with the run's file mode, exactly."""
    file_mode = run_modes()[0]
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    fd = os.open(path, flags, file_mode)
    try:
        if os.fstat(fd).st_size == 0:  # just created (or empty): the mode, whatever the umask
            os.fchmod(fd, file_mode)
        return os.fdopen(fd, mode, encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


def read_metrics(path: str | os.PathLike) -> pd.DataFrame:
    """The rows of a run folder's `metrics.jsonl` (or of that file given directly), also while
    a job is writing it: a partly written last line (what a running or killed job leaves) is
    left out.

    Raises:
        FileNotFoundError: if there is no such file.
        ValueError: a line other than the last is not a JSON object (names the file and line).
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # no newline yet: the writer is mid-line
                break
            raise ValueError(
                f"{path}:{number} is not a JSON row ({e}); the file is corrupt there"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number} is a JSON {type(row).__name__}, not a row object")
        rows.append(row)
    return pd.DataFrame(rows)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
