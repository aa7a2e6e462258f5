"""One live process per run folder: an advisory lock (`fcntl.flock`) on `run_dir/.posttrain.lock`,
and the record of how a run that did not finish stopped (`run_dir/stopped.json`).

A trainer claims its run folder when it starts (rank 0 only: the other ranks of the same job
share the folder). The lock belongs to the process and the kernel drops it when the process
ends, however it ends (SIGKILL, a node lost), so a requeued Slurm job or a rerun after a crash
takes the folder over, while a second live process (a resume started while the first run still
trains) is refused with the first one's pid and host. Inside one process a folder is claimed
once and stays claimed until the run ends (`run_outcome`, `release_run_dir`): a notebook that
builds a new trainer on the same folder (a re-run cell) just continues.

Whether a run is alive is asked of the lock itself (`lock_holder`), never of the pid written in
the lock file: a killed process that its parent has not reaped yet still has its pid (a zombie)
but no longer holds the lock, and a pid can be reused. A process that ends a run without
finishing it, by an exception or a Ctrl-C, records how in `stopped.json` on its way out
(`run_outcome`), and releases the folder, so that a notebook kernel that stays alive after
its run failed does not keep the run "running".

Example:
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> claim_run_dir(folder) == claim_run_dir(folder)   # the same process: claimed once
    True
    >>> lock_holder(folder) == "this process"
    True
    >>> try:
    ...     with run_outcome(folder):
    ...         raise RuntimeError("diverged at step 3")
    ... except RuntimeError:
    ...     pass
    >>> lock_holder(folder) is None, read_stopped(folder)["error"]
    (True, 'RuntimeError: diverged at step 3')
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import traceback
import warnings
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from posttrain.core.checkpoint_files import make_private_dir, write_text_atomic
from posttrain.core.run_permissions import apply_run_modes, run_modes

__all__ = [
    "LOCK_FILE",
    "STOPPED_FILE",
    "RunDirInUseError",
    "claim_run_dir",
    "lock_holder",
    "read_stopped",
    "release_run_dir",
    "run_outcome",
]

LOCK_FILE = ".posttrain.lock"
STOPPED_FILE = "stopped.json"
CLAIM_RETRY_S = 1.0
"""How long a claim retries a taken lock before refusing: `lock_holder`, asked from another
process (`posttrain runs`, a sweep's table), holds the lock for a few microseconds."""

_HELD: dict[str, int] = {}  # resolved run folder -> the open, locked file descriptor
_BUSY = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


class RunDirInUseError(RuntimeError):
    """Another live process holds the run folder (its pid and host are in the message)."""


def claim_run_dir(run_dir: str | os.PathLike) -> Path:
    """Claim `run_dir` for this process (creating the folder), or raise if another holds it.
    A new claim removes the `stopped.json` of an earlier attempt (the run goes on now).

    Returns:
        The lock file's path.

    Raises:
        RunDirInUseError: if another live process holds the folder's lock (tried for
            `CLAIM_RETRY_S` seconds).
    """
    folder = Path(run_dir).resolve()
    path = folder / LOCK_FILE
    if str(folder) in _HELD:
        return path
    make_private_dir(folder)  # a run folder this creates is 0700, like its checkpoints
    fd = os.open(path, os.O_RDWR | os.O_CREAT, run_modes()[0])  # 0600 unless run_permissions
    deadline = time.monotonic() + CLAIM_RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as err:
            if err.errno in _BUSY and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if err.errno not in _BUSY:
                raise
            raise RunDirInUseError(
                f"run_dir {folder} is in use by another live process ({holder}); wait for it "
                "to finish or stop it (Run.cancel / scancel) before resuming, or use a new "
                "run_dir"
            ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    _HELD[str(folder)] = fd
    (folder / STOPPED_FILE).unlink(missing_ok=True)
    return path


def release_run_dir(run_dir: str | os.PathLike) -> bool:
    """Give up this process's claim of `run_dir` (the lock is dropped; the lock file stays).
    Returns whether this process held it."""
    fd = _HELD.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        os.close(fd)
    return fd is not None


def lock_holder(run_dir: str | os.PathLike) -> str | None:
    """Who holds `run_dir`'s lock now: "this process", the holder another live process wrote
    ("pid N on host H"; "unknown" if it wrote nothing yet), or None when no live process holds
    it (no lock file, or a lock nobody holds: its owner ended, however). Asked of the lock
    (a non-blocking `flock` that is released at once), so it is right for a killed process
    that is not reaped yet and for a reused pid, and, where the file system supports flock
    across hosts, for another host. A lock file this user cannot open counts as held."""
    folder = Path(run_dir).resolve()
    if str(folder) in _HELD:
        return "this process"
    path = folder / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    except PermissionError:
        return "unknown (the lock file is not readable by this user)"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in _BUSY:
            raise
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)  # closing drops the probe's lock, if it got it
    return None


def read_stopped(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The `stopped.json` of `run_dir` (see `run_outcome`), or None if it has none (or an
    unreadable one: it is written atomically, so that is another program's file)."""
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((Path(run_dir) / STOPPED_FILE).read_text())
        return record if isinstance(record, dict) else None
    return None


def _error_line(exc: BaseException) -> str:
    """The first line of the exception as a traceback ends: "RuntimeError: diverged",
    "posttrain.train.losses.NonFiniteLossError: ..." (at most 300 characters)."""
    kind = type(exc)
    name = (
        kind.__qualname__
        if kind.__module__ in ("builtins", "__main__")
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    lines = str(exc).strip().splitlines()
    return (f"{name}: {lines[0]}" if lines else name)[:300]


@contextlib.contextmanager
def run_outcome(run_dir: str | os.PathLike | None) -> Iterator[None]:
    """Run the block as the run in `run_dir` (None: just run it). If the block raises while
    this process holds the folder (the run started here: `claim_run_dir`), `stopped.json`
    records how the run stopped: status "interrupted" for a KeyboardInterrupt (Ctrl-C, a
    stage's `RunInterrupted`), else "failed", with the exception line ("RuntimeError:
    diverged"), the last lines of the traceback, the time (UTC), pid and host; a block that
    raises before the run claimed its folder leaves the folder as it was, and so does
    `sys.exit` (a preempted job that leaves to be requeued). However the block ends, if this
    process holds the folder, every file and folder in it gets the modes of the run's setting
    (`posttrain.core.run_permissions.apply_run_modes`: for what libraries wrote with modes of
    their own), and the claim is released. The exception propagates unchanged.

    Nested blocks on one folder (the command line or a job around a recipe's entry point)
    record once: the innermost releases the claim, so the outer ones find none.
    """
    if run_dir is None:
        yield
        return
    folder = Path(run_dir).resolve()
    try:
        yield
    except BaseException as exc:
        if str(folder) in _HELD and not isinstance(exc, SystemExit):
            record = {
                "status": "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed",
                "error": _error_line(exc),
                "traceback": traceback.format_exception(exc)[-6:],
                "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "pid": os.getpid(),
                "host": socket.gethostname(),
            }
            with contextlib.suppress(OSError):  # never hide the run's own exception
                write_text_atomic(folder / STOPPED_FILE, json.dumps(record, indent=2))
        raise
    finally:
        if str(folder) in _HELD:
            _apply_run_modes(folder)
        release_run_dir(folder)


def _apply_run_modes(folder: Path) -> None:
    try:
        apply_run_modes(folder)
    except OSError as e:  # never hide the run's own exception: warned
        warnings.warn(f"could not set the modes of {folder}'s files: {e}", stacklevel=3)
