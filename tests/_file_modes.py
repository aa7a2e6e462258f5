"""Walk a run folder and name every file and folder whose mode is not the one a
`checkpoint.permissions` setting asks for (`posttrain.core.run_permissions.PERMISSIONS`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def modes_under(folder: Path) -> dict[Path, int]:
    """Every file and folder under `folder` (itself included; links not followed) -> its mode
    bits (permission bits and setgid, `stat.S_IMODE`)."""
    found = {folder: stat.S_IMODE(os.lstat(folder).st_mode)}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root, name)
            found[path] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


def wrong_modes(folder: Path, file_mode: int, dir_mode: int) -> list[str]:
    """'path: 0o644, wants 0o660' for each entry under `folder` with another mode than
    `file_mode` (regular files) or `dir_mode` (folders); anything else but a link (whose own
    mode Linux ignores; wandb links its latest run) is named too."""
    wrong = []
    for path, mode in modes_under(folder).items():
        kind = os.lstat(path).st_mode
        if stat.S_ISLNK(kind):
            continue
        want = dir_mode if stat.S_ISDIR(kind) else file_mode if stat.S_ISREG(kind) else None
        if mode != want:
            shown = "not a file or folder" if want is None else f"wants {oct(want)}"
            wrong.append(f"{path.relative_to(folder)}: {oct(mode)}, {shown}")
    return wrong
