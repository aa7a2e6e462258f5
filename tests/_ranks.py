"""Running a script as the ranks of a gloo process group, for the multi-process tests
(tests/core/test_distributed.py, tests/train/test_parallel_plans.py,
tests/rl/test_plans_trainers.py).

Each rank runs `SCRIPT RANK WORLD_SIZE *args` as `python SCRIPT ...` would, in a process of its
own, with MASTER_ADDR/PORT on a free local port and one thread, its output in
`out/<log_prefix>-<rank>.log`. Inside the script, `gloo_rank()` reads those arguments and holds
the process group for the script's work.

The processes are forked (`start_script`) from one server process per test session that has
imported torch, torchtune, posttrain and verl once (tests/_fork_preload.py): a fresh interpreter
spends ~3-8 s of CPU on those imports before its first line of work, and the suite starts ~30
ranks. A forked rank gets a fresh `__main__`, `sys.argv`, environment, working directory and
output files, exits with the script's exit code (an uncaught exception: 1, with its traceback in
the log; a signal: minus its number, as with `subprocess`), and runs the `atexit` handlers.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
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
    fresh: bool = False,
) -> None:
    """Run the ranks until all end; a rank that fails leaves the others waiting in a collective,
    so they are stopped then. Asserts that every rank exited with `expect_returncode` (-9 for
    ranks that SIGKILL themselves), showing the logs of those that did not, and says so when
    the ranks were still running after `timeout_s` (generous: a run of seconds on a quiet
    machine takes minutes beside busy neighbours). `fresh`: each rank is a fresh interpreter
    (`python SCRIPT ...`, ~3-8 s of CPU in imports) instead of a fork of the preloaded server,
    for what a rank's own imports decide (which packages a code path loads)."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    logs = [out / f"{log_prefix}-{rank}.log" for rank in range(world_size)]
    expected = (None, 0, expect_returncode)
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(
                _start_fresh(script, [str(rank), str(world_size), *args], env, out, logs[rank])
                if fresh
                else start_script(script, [str(rank), str(world_size), *args], env, out, logs[rank])
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


def _start_fresh(
    script: str | os.PathLike, argv: list[str], env: dict[str, str], cwd: Path, log: Path
) -> subprocess.Popen:
    """`python SCRIPT *argv` as a fresh interpreter, stdout and stderr to the file `log`."""
    with open(log, "wb") as output:
        return subprocess.Popen(
            [sys.executable, os.fspath(script), *argv],
            env=env,
            cwd=cwd,
            stdout=output,
            stderr=subprocess.STDOUT,
        )


def _run_script(
    script: str, argv: list[str], env: dict[str, str], cwd: str, log: str, stderr_log: str | None
) -> None:
    """The forked process: `python SCRIPT *argv` with `env` in `cwd`, stdout to `log`, stderr
    to `stderr_log` (None: to `log` too)."""
    for fd, path in ((1, log), (2, stderr_log or log)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    preload = sys.modules.get("_fork_preload")
    added = {} if preload is None else preload.ADDED_ENV
    os.environ.clear()
    os.environ.update({**added, **env})
    os.chdir(cwd)
    if "OMP_NUM_THREADS" in env and "torch" in sys.modules:
        # a fresh interpreter reads it when torch loads; the server loaded torch before
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    if "ray._raylet" in sys.modules:
        # Ray reads its config (the auth mode and token of a cluster started after the server
        # loaded it) from the environment when it loads: read it again from this one
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    sys.argv = [script, *argv]
    fresh = sys.path[1:] if preload is None else preload.FRESH_SYS_PATH
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *fresh]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()


class ScriptProcess(contextlib.AbstractContextManager):
    """A process `start_script` forked, with `subprocess.Popen`'s `pid`, `poll`, `wait`, `kill`
    and `returncode` (minus the signal's number when a signal ended it). Leaving its `with`
    kills it if it still runs and waits for it."""

    def __init__(self, process: multiprocessing.process.BaseProcess, log: Path, stderr_log: Path):
        self._process = process
        self.log, self.stderr_log = log, stderr_log

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()

    def output(self) -> str:
        """What the process wrote to stdout so far (and to stderr, unless it has a file of its
        own)."""
        return self.log.read_text(errors="replace")

    def __exit__(self, *exc: object) -> None:
        if self._process.exitcode is None:
            self._process.kill()
        self._process.join()


def _start_fork_server() -> None:
    """Start the session's fork server (once) in this folder, so that it imports `_fork_preload`.

    Python 3.11's forkserver does not apply the `sys_path` it is handed: its `sys.path` is a
    fresh interpreter's, whose first entry is its working directory, and it skips a preload
    module it cannot import without a word. Started from another folder (pytest runs in the
    checkout's root) it would find no `_fork_preload`, and every forked script would import
    torch, torchtune, posttrain and verl itself (tests/train/test_parallel_plans.py checks that
    forked ranks hold verl). Forked scripts take their own working directory (`_run_script`)."""
    global _fork_server_started
    if _fork_server_started:
        return
    from multiprocessing import forkserver

    here, previous = os.path.dirname(os.path.abspath(__file__)), os.getcwd()
    os.chdir(here)
    try:
        forkserver.ensure_running()
    finally:
        os.chdir(previous)
    _fork_server_started = True


_fork_server_started = False


def start_script(
    script: str | os.PathLike,
    argv: list[str],
    env: dict[str, str],
    cwd: str | os.PathLike,
    log: str | os.PathLike,
    stderr_log: str | os.PathLike | None = None,
) -> ScriptProcess:
    """Start `python SCRIPT *argv` with environment `env` (the whole of it, as `Popen`'s `env`)
    in `cwd`, its stdout to the file `log` and its stderr to `stderr_log` (None: to `log`; both
    files are emptied first), forked from the session's fork server (started on first use; it
    imports `_fork_preload` first)."""
    for path in {os.fspath(log), os.fspath(stderr_log or log)}:
        Path(path).write_bytes(b"")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["_fork_preload"])
    _start_fork_server()
    process = context.Process(
        target=_run_script,
        args=(
            os.fspath(script),
            list(argv),
            dict(env),
            os.fspath(cwd),
            os.fspath(log),
            None if stderr_log is None else os.fspath(stderr_log),
        ),
        name=f"{Path(script).name} {' '.join(argv)}",
    )
    process.start()
    return ScriptProcess(process, Path(log), Path(stderr_log or log))


def run_script(
    script: str | os.PathLike, argv: list[str], folder: Path, timeout_s: float = RUN_S
) -> subprocess.CompletedProcess:
    """`subprocess.run([python, SCRIPT, *argv], capture_output=True, text=True)` through
    `start_script` (this environment and working directory, the output files in `folder`); a
    script still running after `timeout_s` is killed and its `returncode` is None."""
    out, err = folder / f"{Path(script).stem}.stdout", folder / f"{Path(script).stem}.stderr"
    with start_script(script, argv, dict(os.environ), os.getcwd(), out, err) as proc:
        returncode = proc.wait(timeout_s)
    return subprocess.CompletedProcess(
        [sys.executable, os.fspath(script), *argv],
        returncode,  # type: ignore[arg-type]
        out.read_text(errors="replace"),
        err.read_text(errors="replace"),
    )


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
