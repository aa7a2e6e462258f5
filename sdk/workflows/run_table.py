"""The table of the runs under some folders, read from their files alone (`lineage.json`,
`results.json`, the run lock and `stopped.json`): `run_rows` (a list of dicts, no pandas, no
torch: `posttrain runs` prints it) and `runs_table` (the same rows as a pandas DataFrame).
`posttrain.workflows.lineage` writes the lineage these rows read, and exports these names too.

Example:
    >>> import tempfile
    >>> run_rows(tempfile.mkdtemp())
    []
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from posttrain.workflows.run_state import run_state

__all__ = ["LINEAGE_FILE", "RUN_COLUMNS", "find_runs", "main_metric", "run_rows", "runs_table"]

LINEAGE_FILE = "lineage.json"
"""The file of a run folder that records what the run was made from
(`posttrain.workflows.lineage`)."""
_SKIP_DIRS = {"checkpoints", "policy", "adapter", "launch", "__pycache__"}


def find_runs(*folders: str | os.PathLike) -> list[Path]:
    """Every run folder (config.json + lineage.json) in or under `folders`, sub-runs included,
    in path order (checkpoints/, policy/ and adapter/ folders are not searched).

    Raises:
        ValueError: naming a folder that does not exist.
    """
    found: list[Path] = []
    for root in folders:
        root = Path(root)
        if not root.is_dir():
            raise ValueError(f"runs folder {str(root)!r} does not exist")
        for here, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
            if "config.json" in files and LINEAGE_FILE in files:
                found.append(Path(here))
    return sorted(dict.fromkeys(found))


def main_metric(results: dict[str, Any]) -> tuple[str | None, float | None]:
    """The headline number of a results.json: held-out accuracy after the last stage
    (`after_<algo>` of an RL run, `after` of SFT / DPO / reward model), else the final loss."""
    algo = results.get("algo")
    for key in ([f"after_{algo}"] if algo else []) + ["after"]:
        r = results.get(key)
        if isinstance(r, dict) and isinstance(r.get("accuracy"), (int, float)):
            return f"{key}.accuracy", float(r["accuracy"])
    for key in ("final_loss", "final_train_loss"):
        if isinstance(results.get(key), (int, float)):
            return key, float(results[key])
    return None, None


def _shown(path: Path) -> str:
    """`path` relative to the current folder when it is below it, else absolute."""
    path = path.resolve()
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd().resolve()))
    return str(path)


def _parent_path(entry: dict[str, str], run: Path) -> Path:
    relative = run / entry["path"]
    return relative if relative.exists() or not entry.get("abs") else Path(entry["abs"])


RUN_COLUMNS = (
    "run",
    "recipe",
    "started",
    "commit",
    "status",
    "error",
    "metric",
    "value",
    "parents",
)
"""The columns of `run_rows` and `runs_table`, in order."""


def run_rows(*folders: str | os.PathLike) -> list[dict[str, Any]]:
    """The runs under `folders` (default: ./runs), one dict per run folder (keys
    `RUN_COLUMNS`) sorted by start time (runs without one last), then path: run (path), recipe,
    started (UTC), commit (10 hex digits, "+dirty" for a changed checkout; the package version
    without git), status (finished, running, failed, interrupted or dead:
    `posttrain.workflows.run_state.run_state`, as a sweep's table has it), error (a failed
    run's exception line, where an interrupted one stopped, why a dead one is taken for dead),
    metric and value (`main_metric`), parents (their paths, comma-separated). Reads the
    folders' JSON files only: no torch, no pandas (`posttrain runs` prints these rows).

    Raises:
        ValueError: naming a folder that does not exist.
    """
    rows = []
    for run in find_runs(*(folders or ("runs",))):
        lineage = json.loads((run / LINEAGE_FILE).read_text())
        code = lineage.get("code", {})
        commit = (
            code["git_commit"][:10] + ("+dirty" if code.get("git_dirty") else "")
            if code.get("git_commit")
            else f"v{code.get('version')}"
        )
        path = run / "results.json"
        metric, value = (
            main_metric(json.loads(path.read_text())) if path.is_file() else (None, None)
        )
        state = run_state(run)
        rows.append(
            {
                "run": _shown(run),
                "recipe": lineage.get("recipe", {}).get("name"),
                "started": lineage.get("started"),
                "commit": commit,
                "status": state.status,
                "error": state.error,
                "metric": metric,
                "value": value,
                "parents": ", ".join(
                    _shown(_parent_path(p, run)) for p in lineage.get("parents", [])
                ),
            }
        )
    return sorted(rows, key=lambda r: (r["started"] is None, r["started"] or "", r["run"]))


def runs_table(*folders: str | os.PathLike) -> Any:
    """`run_rows(*folders)` as a pandas DataFrame (columns `RUN_COLUMNS`, one row per run).

    Raises:
        ValueError: naming a folder that does not exist.
    """
    import pandas as pd

    return pd.DataFrame(run_rows(*folders), columns=list(RUN_COLUMNS))
