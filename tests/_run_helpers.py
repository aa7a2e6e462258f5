"""A real process that owns a run folder, for the run-state tests (lineage, sweeps)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import wait_for

_HOLD = ("import sys, time; from pathlib import Path\n"
         "from posttrain.core.run_lock import claim_run_dir\n"
         "claim_run_dir(sys.argv[1]); Path(sys.argv[1], 'held').write_text('1'); time.sleep(600)")


def hold_run_dir(folder: Path) -> subprocess.Popen:
    """Start a process that claims `folder` with `claim_run_dir` and sleeps; returns once it
    holds the lock (it writes `folder/held` after the claim). The caller kills it."""
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)])
    wait_for(lambda: (folder / "held").exists() or child.poll() is not None,
             what=f"a child process to claim {folder}")
    assert child.poll() is None, f"the child that should hold {folder} exited ({child.returncode})"
    return child
