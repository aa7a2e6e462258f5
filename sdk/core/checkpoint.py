"""Training checkpoints for exact resume: atomic folders, newest K kept, RNG state capture.

Layout of a run folder:

    run_dir/checkpoints/step_000012/model.pt         model.state_dict()
    run_dir/checkpoints/step_000012/train_state.pt   optimizer, scheduler, data position, RNG,
                                                     step, metrics rows (plain dicts)
    run_dir/checkpoints/step_000012/meta.json        step, format version, file names

Atomicity: a checkpoint is written into a temporary folder `.tmp-step_000012-*` next to the
final one, every file and the folder are fsync'ed, then the folder is renamed into place (one
`rename(2)`, atomic on POSIX file systems) and the parent folder fsync'ed. A crash while saving
leaves a `.tmp-*` folder that `latest_checkpoint` ignores and the next save deletes; earlier
checkpoints are untouched. One writer per run folder is assumed.

Files are written with `torch.save` and read with `weights_only=True` (tensors and plain
containers only); numpy's RNG state is stored as a tensor for that reason.

Example:
    >>> import tempfile, torch
    >>> with tempfile.TemporaryDirectory() as run_dir:
    ...     path = save_checkpoint(run_dir, 3, model_state={"w": torch.zeros(2)},
    ...                            train_state={"step": 3}, keep_last=2)
    ...     latest_checkpoint(run_dir) == path, path.name, load_checkpoint(path)["train_state"]
    (True, 'step_000003', {'step': 3})
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.core.metrics import METRICS_FILE

__all__ = ["CHECKPOINT_DIR", "FORMAT_VERSION", "check_new_run_dir", "checkpoint_name", "list_checkpoints",
           "latest_checkpoint", "save_checkpoint", "load_checkpoint", "capture_rng_state",
           "restore_rng_state"]

CHECKPOINT_DIR = "checkpoints"
"""Sub-folder of a run folder holding the `step_NNNNNN` checkpoints."""

FORMAT_VERSION = 1
"""Version of the checkpoint layout; `load_checkpoint` refuses others."""

MODEL_FILE, TRAIN_STATE_FILE, META_FILE = "model.pt", "train_state.pt", "meta.json"
_NAME = re.compile(r"^step_(\d{6,})$")
_SCRATCH_PREFIXES = (".tmp-", ".old-")


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint after `step` optimizer steps: `step_000012`."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step={step!r}; must be a non-negative integer")
    return f"step_{step:06d}"


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run folder, oldest step first. Temporary folders of an
    interrupted save, and folders without `meta.json`, are not listed."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and child.is_dir() and (child / META_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step in `run_dir`, or None if there is none."""
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """`path` itself if it is a checkpoint folder, else the latest checkpoint of run folder `path`.

    Raises:
        FileNotFoundError: if `path` is neither a checkpoint nor a run folder holding one.
    """
    path = Path(path)
    if (path / META_FILE).is_file():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"no checkpoint in {path}")
    return found


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, model_state: dict[str, Any],
                    train_state: dict[str, Any], keep_last: int | None = None,
                    meta: dict[str, Any] | None = None) -> Path:
    """Write `run_dir/checkpoints/step_NNNNNN/` atomically and return its path.

    Args:
        run_dir: the run folder (created if needed).
        step: optimizer steps taken; names the folder.
        model_state: the model's `state_dict()`.
        train_state: everything else needed to continue (plain containers and tensors).
        keep_last: afterwards delete all but the newest `keep_last` checkpoints; None keeps all.
        meta: extra JSON-serialisable facts for `meta.json` (for people and tools; not needed to
            resume).

    A checkpoint of the same step that already exists is replaced. Leftover temporary folders of
    interrupted saves are deleted.

    Raises:
        ValueError: for a bad `step` or `keep_last`.
    """
    name = checkpoint_name(step)
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r}; must be a positive integer or None (keep all)")
    root = Path(run_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        _write_torch(model_state, tmp / MODEL_FILE)
        _write_torch(train_state, tmp / TRAIN_STATE_FILE)
        record = {"format_version": FORMAT_VERSION, "step": step, "saved_at": time.time(),
                  "files": [MODEL_FILE, TRAIN_STATE_FILE], **(meta or {})}
        _write_bytes((json.dumps(record, indent=2) + "\n").encode(), tmp / META_FILE)
        _fsync_dir(tmp)
        old = None
        if final.exists():
            old = root / f".old-{name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _prune(root, keep_last)
    return final


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint folder: {"model_state", "train_state", "meta"}; tensors on CPU.

    Raises:
        FileNotFoundError: if `path` is not a complete checkpoint folder.
        ValueError: if it was written in another format version.
    """
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {META_FILE})")
    meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has checkpoint format_version={meta.get('format_version')!r}; "
                         f"this posttrain reads version {FORMAT_VERSION}")
    return {"model_state": _read_torch(path / MODEL_FILE),
            "train_state": _read_torch(path / TRAIN_STATE_FILE), "meta": meta}


# --------------------------------------------------------------------------------------------
# RNG state
# --------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """The global RNG states: Python `random`, numpy, torch CPU and (if available) every CUDA
    device. Plain containers and tensors only, so it loads with `weights_only=True`."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the global RNG states from `capture_rng_state()`'s result."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value: Any) -> Any:
    """random.setstate wants tuples; a round trip through some serialisers gives lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _write_torch(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_bytes(data: bytes, path: Path) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _read_torch(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # An object outside the weights-only allow-list (e.g. a custom data loader's state).
        # The file is this run's own checkpoint, so fall back to full unpickling, loudly.
        warnings.warn(f"{path} needs full unpickling (weights_only=False): {e}", stacklevel=3)
        return torch.load(path, map_location="cpu", weights_only=False)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep_last: int | None) -> None:
    for child in root.iterdir():
        if child.name.startswith(_SCRATCH_PREFIXES) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
    if keep_last is not None:
        for old in list_checkpoints(root.parent)[:-keep_last]:
            shutil.rmtree(old)


def check_new_run_dir(run_dir: str | os.PathLike) -> None:
    """Raise ValueError if `run_dir` already holds a run (metrics.jsonl or checkpoints).

    Recipes call it before writing anything, so a finished run is never partly overwritten by a
    new one that then refuses to start.
    """
    run_dir = Path(run_dir)
    if list_checkpoints(run_dir) or (run_dir / METRICS_FILE).exists():
        raise ValueError(f"run_dir {run_dir} already holds a run (metrics.jsonl or "
                         "checkpoints); pass resume=True to continue it, or use a new run_dir")
