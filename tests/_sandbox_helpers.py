"""Shared by the sandbox tests: host-side process lookups (the `box` fixture is in
tests/verifiers/conftest.py).

The host-side checks read the host's own /proc, never the sandbox's report alone.
"""

from __future__ import annotations

import os
from pathlib import Path


def host_processes_of(uid: int) -> list[int]:
    """Host pids whose real uid is `uid`, read from the host's /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
            if int(uid_line.split()[1]) == uid:
                pids.append(int(entry))
    return pids


def host_processes_with_argv(argv: list[str]) -> list[int]:
    """Host pids whose command line is exactly `argv`."""
    want = ("\0".join(argv) + "\0").encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/cmdline").read_bytes() == want:
                    found.append(int(entry))
            except OSError:
                continue
    return found
