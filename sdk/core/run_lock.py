"""One live process per run folder: an advisory lock (`fcntl.flock`) on `run_dir/.posttrain.lock`.

A trainer claims its run folder when it starts (rank 0 only: the other ranks of the same job
share the folder). The lock belongs to the process and the kernel drops it when the process
ends, however it ends (SIGKILL, a node lost), so a requeued Slurm job or a rerun after a crash
takes the folder over, while a second live process (a resume started while the first run still
trains) is refused with the first one's pid and host. Inside one process a folder is claimed
once and stays claimed: a notebook that builds a new trainer on the same folder (a re-run cell)
just continues.

Example:
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> claim_run_dir(folder) == claim_run_dir(folder)   # the same process: claimed once
    True
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from posttrain.core.checkpoint_files import make_private_dir

__all__ = ["LOCK_FILE", "RunDirInUseError", "claim_run_dir"]

LOCK_FILE = ".posttrain.lock"

_HELD: dict[str, int] = {}   # resolved run folder -> the open, locked file descriptor


class RunDirInUseError(RuntimeError):
    """Another live process holds the run folder (its pid and host are in the message)."""


def claim_run_dir(run_dir: str | os.PathLike) -> Path:
    """Claim `run_dir` for this process (creating the folder), or raise if another holds it.

    Returns:
        The lock file's path.

    Raises:
        RunDirInUseError: if another live process holds the folder's lock.
    """
    folder = Path(run_dir).resolve()
    path = folder / LOCK_FILE
    if str(folder) in _HELD:
        return path
    make_private_dir(folder)  # a run folder this creates is 0700, like its checkpoints
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        raise RunDirInUseError(
            f"run_dir {folder} is in use by another live process ({holder}); wait for it to "
            "finish or stop it (Run.cancel / scancel) before resuming, or use a new run_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    _HELD[str(folder)] = fd
    return path
