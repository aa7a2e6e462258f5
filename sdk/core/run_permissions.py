"""Who may read a run folder: `private` (the default), `group` or `shared`.

Run folders, checkpoints and job folders are created owner-only. On a team's cluster, set the
environment variable `POSTTRAIN_RUN_PERMISSIONS` (or use `run_permissions` around a run) to let
the folder's group read them too; every file and folder posttrain creates for a run then gets:

========= ============ ============== ===========================================
setting   files        folders        who
========= ============ ============== ===========================================
private   0600         0700           the owner only (default)
group     0640         0750           the owner; the group reads
shared    0660         2770           the owner and the group read and write; new
                                      files keep the folder's group (setgid)
========= ============ ============== ===========================================

Three mechanisms give every file its mode, for the whole run of a recipe (its entry point
enters `run_permissions` and `posttrain.core.run_lock.run_outcome`:
`posttrain.workflows.run_state.recorded_run`):

- posttrain's own writers (checkpoints, run records, the run lock, metrics.jsonl) create files
  and folders with the modes of `run_modes()`, exact whatever the umask;
- everything else a run writes into its folder with plain `open()` or `mkdir()` (DCP shards from
  torch.distributed.checkpoint, TensorBoard event files, MLflow's artifacts, W&B offline files,
  matplotlib plots, tokenizer and HF export files) gets 0666 or 0777 minus the process umask,
  so `run_permissions` sets the umask to `UMASKS[setting]`, which leaves the table's modes
  (shared folders get their setgid bit from the run folder: Linux gives a folder made inside a
  setgid folder the bit too). The umask is the process's, so other threads of the process that
  create files while a run goes get it too (as with the environment);
- what libraries create with modes of their own, which a umask can only narrow
  (`tempfile.mkdtemp`'s 0700 folders, safetensors' 0600 weights, SQLite's 0644 databases), is
  set by `apply_run_modes(run_dir)` when the run ends, however it ends (`run_outcome`, only
  if the run claimed the folder: a refused run touches nothing).

Code that trains outside a recipe (a `Trainer` in a notebook cell) gets the first mechanism
only, unless it runs inside `with run_permissions(...)` and calls `apply_run_modes` at the end.

The setting travels in the environment, so ranks a launch spawns and jobs submitted from it
(which inherit the environment and enter the block again) write with the same modes, and
checkpoints saved later in the run too. It applies to what is created while it is set, and
to the entries inside the run folder when the run ends; the run folder itself, if it existed
before, keeps its mode. The folder's group is the one the file system gives (the parent
folder's with setgid, else the user's primary group).

Example:
    >>> import os
    >>> with run_permissions("group"):
    ...     oct(run_modes()[0]), oct(run_modes()[1]), oct(current_umask())
    ('0o640', '0o750', '0o27')
    >>> run_modes() == (0o600, 0o700) or os.environ.get(ENV) is not None
    True
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "ENV",
    "PERMISSIONS",
    "UMASKS",
    "apply_run_modes",
    "current_umask",
    "run_modes",
    "run_permissions",
]

ENV = "POSTTRAIN_RUN_PERMISSIONS"
"""The environment variable that holds the setting (unset: private)."""

PERMISSIONS: dict[str, tuple[int, int]] = {
    "private": (0o600, 0o700),
    "group": (0o640, 0o750),
    "shared": (0o660, 0o2770),
}
"""Setting -> (file mode, folder mode)."""

UMASKS: dict[str, int] = {"private": 0o077, "group": 0o027, "shared": 0o007}
"""Setting -> the process umask while a run goes: 0666 and 0777 (what plain `open()` and
`mkdir()` ask for) minus it are the setting's file and folder modes."""


def check_permissions(value: object, field: str = ENV) -> str:
    """`value` if it is one of `PERMISSIONS`' names.

    Raises:
        ValueError: naming `field`, the value and the allowed values.
    """
    if not isinstance(value, str) or value not in PERMISSIONS:
        allowed = ", ".join(PERMISSIONS)
        raise ValueError(f"{field}={value!r}; allowed values: {allowed}")
    return value


def run_modes() -> tuple[int, int]:
    """(file mode, folder mode) of the current setting: `POSTTRAIN_RUN_PERMISSIONS`, private if
    unset or empty.

    Raises:
        ValueError: if the variable holds another value, naming it and the allowed values.
    """
    value = os.environ.get(ENV) or "private"
    return PERMISSIONS[check_permissions(value)]


def current_umask() -> int:
    """The process umask (read by setting it and putting it back at once)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def apply_run_modes(folder: str | os.PathLike) -> int:
    """Give every file and folder inside `folder` (not `folder` itself, whose mode its creator
    chose) the current setting's modes (`run_modes()`); an executable file keeps its execute
    bits for those who may read it. Links are neither followed nor changed, and entries of
    another owner are left as they are (only the owner may change a mode). A missing `folder`
    is nothing to do. Returns how many entries it changed.

    Raises:
        ValueError: if `POSTTRAIN_RUN_PERMISSIONS` holds an unknown setting.
    """
    file_mode, dir_mode = run_modes()
    uid, changed = os.getuid(), 0
    for root, dirs, files in os.walk(str(folder)):
        for name in dirs + files:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
                if st.st_uid != uid or stat.S_ISLNK(st.st_mode):
                    continue
                if stat.S_ISDIR(st.st_mode):
                    want = dir_mode
                elif st.st_mode & stat.S_IXUSR:
                    want = file_mode | (file_mode & 0o444) >> 2
                else:
                    want = file_mode
                if stat.S_IMODE(st.st_mode) != want:
                    os.chmod(path, want)
                    changed += 1
            except FileNotFoundError:  # removed meanwhile (a temporary file)
                continue
    return changed


@contextmanager
def run_permissions(setting: str | None = None) -> Iterator[None]:
    """Create run files and folders with `setting`'s modes inside the block: sets
    `POSTTRAIN_RUN_PERMISSIONS` (which processes started inside inherit) and the process umask
    to `UMASKS[setting]`; restores both afterwards. None: the environment's setting (private if
    unset), so the umask follows it too.

    Raises:
        ValueError: naming the setting and the allowed values.
    """
    if setting is None:
        setting = os.environ.get(ENV) or "private"
        check_permissions(setting)
    else:
        check_permissions(setting, "run.permissions")
    before = os.environ.get(ENV)
    os.environ[ENV] = setting
    mask_before = os.umask(UMASKS[setting])
    try:
        yield
    finally:
        os.umask(mask_before)
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
