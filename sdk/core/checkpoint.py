"""Training checkpoints for exact resume: atomic, verified, private folders, newest K kept, RNG
state capture.

Layout of a run folder (format version 2):

    run_dir/checkpoints/step_000012/model.pt         model.state_dict()
    run_dir/checkpoints/step_000012/train_state.pt   optimizer, scheduler, data position, RNG,
                                                     step, metrics rows (plain dicts)
    run_dir/checkpoints/step_000012/meta.json        step, format version, file names
    run_dir/checkpoints/step_000012/manifest.json    size and sha256 of the three files above

Atomicity: a checkpoint is written into a temporary folder `.tmp-step_000012-*` next to the
final one, every file and the folder are fsync'ed, then the folder is renamed into place (one
`rename(2)`, atomic on POSIX file systems) and the parent folder fsync'ed. A crash while saving
leaves a `.tmp-*` folder that `latest_checkpoint` ignores and the next save deletes; earlier
checkpoints are untouched. One writer per run folder is assumed.

Never runs code: `.pt` files are read with `torch.load(weights_only=True)` and nothing else
(tensors, numbers, strings, plain containers); a file that would need any other object to
unpickle is refused (`UnsafeCheckpointError`) without being unpickled, and `save_checkpoint`
refuses (TypeError) to write state that could not be loaded that way. The RNG states are
captured as tensors and ints for that reason.

Verified: `manifest.json`, written last before the rename, holds each file's size and sha256;
`load_checkpoint` checks them and raises `CheckpointCorruptError` naming the checkpoint and the
file (a checkpoint without a manifest, written before format 2, is refused the same way).
`resolve_checkpoint` of a run folder skips corrupt checkpoints, with a warning naming them,
and returns the newest good one.

Full disk: a save the file system refuses for want of space raises `OSError(errno.ENOSPC)`
naming the checkpoints folder, the bytes the checkpoint needs (its tensors' bytes) and the
bytes free, and that the last checkpoint is untouched; the partial folder is removed first.

Private: files are written with mode 0600; the checkpoint folders, `checkpoints/`, and the run
folder when `save_checkpoint` creates it, with mode 0700.

Example:
    >>> import tempfile, torch
    >>> with tempfile.TemporaryDirectory() as run_dir:
    ...     path = save_checkpoint(run_dir, 3, model_state={"w": torch.zeros(2)},
    ...                            train_state={"step": 3}, keep_last=2)
    ...     print(latest_checkpoint(run_dir) == path, load_checkpoint(path)["train_state"])
    ...     print(sorted(f.name for f in path.iterdir()), oct(path.stat().st_mode & 0o777))
    True {'step': 3}
    ['manifest.json', 'meta.json', 'model.pt', 'train_state.pt'] 0o700
"""

from __future__ import annotations

import json
import os
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

from posttrain.core.checkpoint_files import (
    MANIFEST_FILE,
    CheckpointCorruptError,
    UnsafeCheckpointError,
    check_weights_only,
    is_disk_full,
    make_private_dir,
    no_space_error,
    read_weights_only,
    state_bytes,
    verify_manifest,
    write_manifest,
)
from posttrain.core.checkpoint_files import write_bytes as _write_bytes
from posttrain.core.checkpoint_files import write_torch as _write_torch
from posttrain.core.metrics import METRICS_FILE
from posttrain.core.run_permissions import run_modes

__all__ = [
    "CHECKPOINT_DIR",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "CheckpointCorruptError",
    "UnsafeCheckpointError",
    "check_new_run_dir",
    "checkpoint_name",
    "list_checkpoints",
    "latest_checkpoint",
    "resolve_checkpoint",
    "verify_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "capture_rng_state",
    "restore_rng_state",
    "staging_dir",
    "SHARDED_DIR",
]

CHECKPOINT_DIR = "checkpoints"
"""Sub-folder of a run folder holding the `step_NNNNNN` checkpoints."""

FORMAT_VERSION = 2
"""Version of the checkpoint layout; `load_checkpoint` refuses others. 2: manifest.json with
sha256 checksums, RNG states as tensors."""

MODEL_FILE, TRAIN_STATE_FILE, META_FILE = "model.pt", "train_state.pt", "meta.json"
SHARDED_DIR = "sharded"
"""Sub-folder of a sharded run's checkpoint: model and optimizer as torch.distributed.checkpoint
shards (model.pt then holds an empty dict)."""
_VERIFIED_FILES = (MODEL_FILE, TRAIN_STATE_FILE, META_FILE)
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
    """The complete checkpoint with the highest step in `run_dir`, or None if there is none.

    Its files are not read (so not verified): `resolve_checkpoint` and `load_checkpoint` do that.
    """
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """`path` itself if it is a checkpoint folder (not verified here: `load_checkpoint` does it
    and raises), else the newest checkpoint of run folder `path` that passes
    `verify_checkpoint`. Newer corrupt ones are skipped with a warning naming each of them and
    the one used, so a run requeued after a bad save continues from the last good checkpoint.

    Raises:
        FileNotFoundError: if `path` is neither a checkpoint nor a run folder holding one.
        CheckpointCorruptError: if every checkpoint of the run folder is corrupt (each named).
    """
    path = Path(path)
    if (path / META_FILE).is_file():
        return path
    candidates = list_checkpoints(path)
    if not candidates:
        raise FileNotFoundError(f"no checkpoint in {path}")
    corrupt = []
    for candidate in reversed(candidates):
        try:
            verify_checkpoint(candidate)
        except CheckpointCorruptError as e:
            corrupt.append(str(e))
            continue
        if corrupt:
            warnings.warn(
                f"skipping {len(corrupt)} corrupt checkpoint(s) of {path}: "
                f"{'; '.join(corrupt)}. Using {candidate}, the newest good one",
                stacklevel=2,
            )
        return candidate
    raise CheckpointCorruptError(f"every checkpoint of {path} is corrupt: {'; '.join(corrupt)}")


def verify_checkpoint(path: str | os.PathLike) -> Path:
    """Check that checkpoint folder `path` is whole: each file matches the size and sha256 in its
    manifest.json. Returns `path`. Reads every file (sha256 at about 1.5 GB/s).

    Raises:
        CheckpointCorruptError: naming the checkpoint and the file, if a file is missing,
            truncated, empty or changed, or the manifest is missing (a checkpoint written before
            format 2 cannot be verified and is refused) or unreadable.
    """
    path = Path(path)
    verify_manifest(path, required=_VERIFIED_FILES)
    return path


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model_state: dict[str, Any],
    train_state: dict[str, Any],
    keep_last: int | None = None,
    meta: dict[str, Any] | None = None,
    staged: Path | None = None,
) -> Path:
    """Write `run_dir/checkpoints/step_NNNNNN/` atomically and return its path.

    Args:
        run_dir: the run folder (created with mode 0700 if needed).
        step: optimizer steps taken; names the folder.
        model_state: the model's `state_dict()`.
        train_state: everything else needed to continue (plain containers and tensors).
        keep_last: afterwards delete all but the newest `keep_last` checkpoints; None keeps all.
        meta: extra JSON-serialisable facts for `meta.json` (for people and tools; not needed to
            resume).
        staged: a folder made by `staging_dir(run_dir, step)` that already holds more files
            (the `sharded/` folder every rank of a sharded run wrote with
            torch.distributed.checkpoint); it becomes the checkpoint, and its files are listed
            in the manifest and verified like the others.

    A checkpoint of the same step that already exists is replaced. Leftover temporary folders of
    interrupted saves are deleted. Files get mode 0600, folders 0700; manifest.json (sizes and
    sha256 of the other files) is written last, before the rename.

    Raises:
        ValueError: for a bad `step` or `keep_last`.
        TypeError: if `model_state` or `train_state` holds objects that would need full
            unpickling to load (e.g. a numpy array, a custom class), named; nothing is written.
        OSError: errno ENOSPC if the file system is full, naming the checkpoints folder, the
            bytes the checkpoint needs (its tensors' bytes) and the bytes free; the partial
            checkpoint is removed and earlier checkpoints are untouched.
    """
    name = checkpoint_name(step)
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r}; must be a positive integer or None (keep all)")
    root = Path(run_dir) / CHECKPOINT_DIR
    make_private_dir(root.parent)
    make_private_dir(root)
    final = root / name
    tmp = (
        Path(staged)
        if staged is not None
        else Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    )
    os.chmod(tmp, run_modes()[1])  # 0700 unless run_permissions says otherwise
    extra = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
    try:
        for state, file, what in (
            (model_state, MODEL_FILE, "model_state"),
            (train_state, TRAIN_STATE_FILE, "train_state"),
        ):
            _write_torch(state, tmp / file)
            check_weights_only(tmp / file, what)
        record = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "saved_at": time.time(),
            "files": [MODEL_FILE, TRAIN_STATE_FILE, *extra],
            **(meta or {}),
        }
        _write_bytes((json.dumps(record, indent=2) + "\n").encode(), tmp / META_FILE)
        write_manifest(tmp, (*_VERIFIED_FILES, *extra))
        _fsync_dir(tmp)
        old = None
        if final.exists():
            old = root / f".old-{name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException as e:
        needed = state_bytes((model_state, train_state)) + sum(
            (tmp / f).stat().st_size for f in extra if (tmp / f).is_file()
        )
        full = is_disk_full(e, root, needed)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise no_space_error(
                root, needed, f"checkpoint {name}", estimate=True, note=_last_good(run_dir)
            ) from e
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _prune(root, keep_last)
    return final


def _last_good(run_dir: str | os.PathLike) -> str:
    last = latest_checkpoint(run_dir)
    return "" if last is None else f"; the last checkpoint, {last.name}, is untouched"


def staging_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """The temporary folder (same name on every rank) in which the ranks of a sharded run write
    their shards before `save_checkpoint(..., staged=...)` completes it; a leftover of a crash
    is ignored by `latest_checkpoint` and deleted by the next save."""
    return Path(run_dir) / CHECKPOINT_DIR / f".tmp-{checkpoint_name(step)}-staged"


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint folder: {"model_state", "train_state", "meta", "sharded"}; tensors on
    CPU; "sharded" is the folder of a sharded run's torch.distributed.checkpoint, or None.

    The files are verified first (`verify_checkpoint`), then loaded with
    `torch.load(weights_only=True)` only: loading never runs code from the checkpoint.

    Raises:
        FileNotFoundError: if `path` is not a complete checkpoint folder.
        CheckpointCorruptError: naming the checkpoint and the file, if a file does not match
            manifest.json (bit flip, truncation, empty or missing file) or there is no readable
            manifest (e.g. a checkpoint written before format 2).
        UnsafeCheckpointError: naming the file, if a `.pt` file would need unpickling of objects
            outside torch's weights-only allow-list; it is not unpickled.
        ValueError: if it was written in another format version.
    """
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {META_FILE})")
    verify_checkpoint(path)
    meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has checkpoint format_version={meta.get('format_version')!r}; "
            f"this posttrain reads version {FORMAT_VERSION}"
        )
    sharded = path / SHARDED_DIR
    return {
        "model_state": read_weights_only(path / MODEL_FILE),
        "train_state": read_weights_only(path / TRAIN_STATE_FILE),
        "meta": meta,
        "sharded": sharded if sharded.is_dir() else None,
    }


# --------------------------------------------------------------------------------------------
# RNG state
# --------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """The global RNG states: Python `random`, numpy, torch CPU and (if available) every CUDA
    device, as tensors, ints, floats and strings only, so it loads with `weights_only=True`:

        python  {"version": int, "state": int64 tensor (625,), "gauss_next": float or None}
        numpy   {"kind": str, "keys": int64 tensor (624,), "pos", "has_gauss": int,
                 "cached": float}
        torch   uint8 tensor; cuda: list of uint8 tensors, one per device

    The Mersenne Twister words are below 2**32, so int64 holds them exactly.
    """
    version, words, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {
            "version": int(version),
            "state": torch.tensor(words, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the global RNG states, exactly, from `capture_rng_state()`'s result."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


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
        raise ValueError(
            f"run_dir {run_dir} already holds a run (metrics.jsonl or "
            "checkpoints); pass resume=True to continue it, or use a new run_dir"
        )
