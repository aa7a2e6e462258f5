"""Real processes in tests: one that owns a run folder (run-state tests: lineage, sweeps), and
a run killed with SIGKILL at a step it reports (kill-and-resume tests: the run is a script
started with `_ranks.start_script`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _ranks import ScriptProcess
from _waits import RUN_S, wait_for

_HOLD = (
    "import sys, time; from pathlib import Path\n"
    "from posttrain.core.run_lock import claim_run_dir\n"
    "claim_run_dir(sys.argv[1]); Path(sys.argv[1], 'held').write_text('1'); time.sleep(600)"
)


def hold_run_dir(folder: Path) -> subprocess.Popen:
    """Start a process that claims `folder` with `claim_run_dir` and sleeps; returns once it
    holds the lock (it writes `folder/held` after the claim). The caller kills it."""
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)])
    wait_for(
        lambda: (folder / "held").exists() or child.poll() is not None,
        what=f"a child process to claim {folder}",
    )
    assert child.poll() is None, f"the child that should hold {folder} exited ({child.returncode})"
    return child


def finish(proc: ScriptProcess, timeout: float = RUN_S) -> str:
    """The output of `proc` (stdout with stderr) once it has exited 0; fails the test if not,
    also when it still runs after `timeout` s (then it is killed)."""
    if proc.wait(timeout) is None:
        proc.kill()
        proc.wait()
        pytest.fail(f"{proc.log} still running after {timeout:g} s:\n{proc.output()}")
    assert proc.returncode == 0, proc.output()
    return proc.output()


def kill_after(proc: ScriptProcess, run_dir: Path, step: int, timeout: float = RUN_S) -> None:
    """Wait until the run reports `step` in `run_dir/progress` (it then sleeps), and SIGKILL it.
    Fails the test, naming the folder and step, if it exits first or `timeout` s pass."""
    marker = run_dir / "progress"

    def reached() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"the run in {run_dir} exited before step {step}:\n{proc.output()}")
        return marker.exists() and marker.read_text() == str(step)

    try:
        wait_for(reached, what=f"the run in {run_dir} to report step {step}", timeout=timeout)
    except BaseException:
        proc.kill()
        raise
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
