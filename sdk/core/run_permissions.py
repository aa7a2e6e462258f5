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

The modes are exact, whatever the umask. The setting travels in the environment, so ranks a
launch spawns and jobs submitted from it (which inherit the environment) write with the same
modes, and checkpoints saved later in the run too. It applies to what is created while it is
set: an existing folder keeps its mode. The folder's group is the one the file system gives
(the parent folder's with setgid, else the user's primary group).

Example:
    >>> import os
    >>> with run_permissions("group"):
    ...     oct(run_modes()[0]), oct(run_modes()[1])
    ('0o640', '0o750')
    >>> run_modes() == (0o600, 0o700) or os.environ.get(ENV) is not None
    True
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ENV", "PERMISSIONS", "run_modes", "run_permissions"]

ENV = "POSTTRAIN_RUN_PERMISSIONS"
"""The environment variable that holds the setting (unset: private)."""

PERMISSIONS: dict[str, tuple[int, int]] = {
    "private": (0o600, 0o700),
    "group": (0o640, 0o750),
    "shared": (0o660, 0o2770),
}
"""Setting -> (file mode, folder mode)."""


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


@contextmanager
def run_permissions(setting: str) -> Iterator[None]:
    """Create run files and folders with `setting`'s modes inside the block (by setting
    `POSTTRAIN_RUN_PERMISSIONS`, which processes started inside inherit); restores the variable
    afterwards.

    Raises:
        ValueError: naming the setting and the allowed values.
    """
    check_permissions(setting, "run.permissions")
    before = os.environ.get(ENV)
    os.environ[ENV] = setting
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
