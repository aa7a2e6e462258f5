"""Shared by the sandbox tests: the `box` fixture and host-side process lookups.

The host-side checks read the host's own /proc, never the sandbox's report alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from posttrain.verifiers.sandbox import Sandbox, SandboxLimits, sandbox_available


@pytest.fixture(scope="module")
def box() -> Sandbox:
    """A sandbox whose wall-clock limit (60 s) a program that should finish never reaches, even
    on a loaded machine; tests of the limits pass their own."""
    reason = sandbox_available()
    if reason is not None:
        pytest.skip(f"no sandbox here: {reason}")
    return Sandbox(SandboxLimits(cpu_s=5.0, wall_s=60.0))


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
