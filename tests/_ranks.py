"""Running a script as the ranks of a gloo process group, for the multi-process tests
(tests/core/test_distributed.py, tests/train/test_parallel_plans.py,
tests/rl/test_plans_trainers.py).

Each rank is `python SCRIPT RANK WORLD_SIZE *args` in a fresh process, with MASTER_ADDR/PORT on
a free local port and one thread, its output in `out/<log_prefix>-<rank>.log`. Inside the
script, `gloo_rank()` reads those arguments and holds the process group for the script's work.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from _waits import RUN_S


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    script: str | os.PathLike,
    world_size: int,
    out: Path,
    *args: str,
    log_prefix: str = "rank",
    expect_returncode: int = 0,
    timeout_s: float = RUN_S,
) -> None:
    """Run the ranks until all end; a rank that fails leaves the others waiting in a collective,
    so they are stopped then. Asserts that every rank exited with `expect_returncode` (-9 for
    ranks that SIGKILL themselves), showing the logs of those that did not, and says so when
    the ranks were still running after `timeout_s` (generous: a run of seconds on a quiet
    machine takes minutes beside busy neighbours)."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    logs = [out / f"{log_prefix}-{rank}.log" for rank in range(world_size)]
    expected = (None, 0, expect_returncode)
    with contextlib.ExitStack() as files:
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), str(rank), str(world_size), *args],
                env=env,
                cwd=out,
                stderr=subprocess.STDOUT,
                stdout=files.enter_context(open(logs[rank], "w")),
            )
            for rank in range(world_size)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            while (
                any(p.poll() is None for p in procs)
                and time.monotonic() < deadline
                and not any(p.poll() not in expected for p in procs)
            ):
                time.sleep(0.1)
            late = [rank for rank, p in enumerate(procs) if p.poll() is None]
            timed_out = bool(late) and time.monotonic() >= deadline
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
    failed = [
        f"{log.name}, exit code {proc.returncode} (want {expect_returncode}):\n"
        f"{log.read_text()[-4000:]}"
        for proc, log in zip(procs, logs)
        if proc.returncode != expect_returncode
    ]
    if timed_out:
        failed.insert(
            0,
            f"timed out after {timeout_s:g} s waiting for ranks {late} of "
            f"{Path(script).name} to exit (then killed)",
        )
    assert not failed, "\n\n".join(failed)


class RankArgs(NamedTuple):
    """A rank script's command line: `RANK WORLD_SIZE OUT [PHASE]`."""

    rank: int
    world_size: int
    out: Path
    phase: str | None


@contextlib.contextmanager
def gloo_rank(timeout_s: float = 90.0) -> Iterator[RankArgs]:
    """The start and end of a script that `run_ranks` runs: its arguments from sys.argv, one
    torch thread, and a gloo process group for the body of the `with`, destroyed after it also
    when the body raises. The group's `timeout_s` is short, so a rank left alone in a
    collective (its peer failed) fails instead of waiting torch's default 30 minutes."""
    import datetime

    import torch

    args = RankArgs(
        int(sys.argv[1]),
        int(sys.argv[2]),
        Path(sys.argv[3]),
        sys.argv[4] if len(sys.argv) > 4 else None,
    )
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo",
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        yield args
    finally:
        torch.distributed.destroy_process_group()
