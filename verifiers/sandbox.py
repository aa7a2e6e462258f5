"""Sandboxed execution of untrusted Python programs (policy-written code, HumanEval completions).

`Sandbox().run(source)` runs `source` as a Python 3 program (the system `/usr/bin/python3`) in a
fresh sandbox and returns an `ExecutionResult` whose `outcome` is an `ExecOutcome`; whatever the
program does (fork bomb, endless loop, memory bomb, 100 MB of output, killing its parent, a
daemon that tries to outlive the run) ends as one of these outcomes, and the host is unharmed:

    ==============  =============================================================================
    outcome         meaning
    ==============  =============================================================================
    ok              exited with code 0
    failed          exited with a non-zero code (an uncaught exception exits with 1); also a
                    source holding a NUL byte, which is not run (python3 would silently drop
                    everything after it): exit_code None, stderr says why
    timeout         ran past `wall_s` (wall clock) or `cpu_s` (CPU time, RLIMIT_CPU)
    memory          hit the address-space limit (`memory_mb`, RLIMIT_AS): MemoryError or an
                    allocation failure reported on stderr
    output_limit    wrote more than `output_bytes` to stdout or to stderr: cut there and killed
    killed          ended by a signal other than the CPU limit's
    sandbox_error   the sandbox itself failed (bubblewrap could not set up, ...); the program's
                    fault is never reported this way. `stderr` says what failed.
    ==============  =============================================================================

Isolation (each run; see docs/runbooks/sandbox.md for the measured cost and the known limits):
bubblewrap (`bwrap`, Debian package bubblewrap, installed by scripts/sandbox-up.sh) run as root
makes new mount, PID, network, IPC, UTS and cgroup namespaces. The filesystem holds only /usr
(read-only, with the /bin, /lib* links into it), a few /etc files python3 reads, a made-up
/etc/passwd, fresh /proc and /dev, and private size-limited tmpfs folders /sandbox (cwd and HOME,
where the source is written as main.py), /tmp and /dev/shm: the checkout, /work, /root and every
home are absent. The network namespace has only its own loopback (the host's 127.0.0.1 is
unreachable). The program runs as its own unprivileged uid (`UID_BASE + slot`, no
supplementary groups, no capabilities, no_new_privs) under RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE,
RLIMIT_NOFILE and RLIMIT_NPROC, with a wall-clock deadline; at the end the sandbox's pid 1 dies
and the kernel kills everything left in its PID namespace.

stdin is passed to the program; stdout and stderr are decoded as UTF-8 with errors="replace".

Where no sandbox can be made (not root, no bubblewrap, namespaces refused) `sandbox_available()`
says why and `Sandbox()` raises `SandboxUnavailable` with that reason: nothing ever runs
unsandboxed.

Example (runs the program where a sandbox can be made, and says so otherwise):
    >>> from posttrain.verifiers.sandbox import ExecOutcome, Sandbox, sandbox_available
    >>> reason = sandbox_available()          # None here when root + bubblewrap
    >>> result = Sandbox().run("print(int(input()) * 2)", stdin="21") if reason is None else None
    >>> result is None or (result.outcome, result.stdout) == (ExecOutcome.OK, "42\\n")
    True
"""

from __future__ import annotations

import math
import os
import pwd
import re
import shutil
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from enum import Enum

from posttrain.core.checks import check_number
from posttrain.verifiers import sandbox_command, sandbox_exec

__all__ = [
    "ExecOutcome",
    "ExecutionResult",
    "Sandbox",
    "SandboxLimits",
    "SandboxUnavailable",
    "limit_ranges",
    "sandbox_available",
]


class SandboxUnavailable(RuntimeError):
    """No sandbox can be made on this machine; the message says why and what would fix it."""


class ExecOutcome(str, Enum):
    """How a sandboxed program ended (see the module table). Compares equal to its string."""

    OK = "ok"
    FAILED = "failed"
    TIMEOUT = "timeout"
    MEMORY = "memory"
    OUTPUT_LIMIT = "output_limit"
    KILLED = "killed"
    SANDBOX_ERROR = "sandbox_error"

    def __str__(self) -> str:
        return self.value


_MINIMUM = {
    "cpu_s": 0.001,
    "wall_s": 0.001,
    "memory_mb": 16,
    "file_size_mb": 1,
    "open_files": 8,
    "processes": 1,
    "output_bytes": 1,
}
MAX_SECONDS = 86_400.0
"""Upper bound of `cpu_s` and `wall_s`: one day."""
MAX_MEMORY_MB = 1 << 20
"""Upper bound of `memory_mb` (1 TiB of address space)."""
MAX_FILE_SIZE_MB = 1 << 16
"""Upper bound of `file_size_mb` (64 GiB; each tmpfs then holds at most 256 GiB)."""
MAX_OUTPUT_BYTES = 1 << 30
"""Upper bound of `output_bytes` (1 GiB kept in memory per stream)."""


def _hard_limit(name: str, fallback: int) -> int:
    """This process's hard rlimit `name` (the sandbox cannot raise it), or `fallback`."""
    try:
        import resource

        hard = resource.getrlimit(getattr(resource, name))[1]
    except (ImportError, AttributeError, OSError, ValueError):
        return fallback
    return fallback if hard == resource.RLIM_INFINITY else min(hard, fallback)


def limit_ranges() -> dict[str, tuple[float, float]]:
    """The allowed (minimum, maximum) of each `SandboxLimits` field in this process.

    `open_files` and `processes` are capped by this process's hard RLIMIT_NOFILE / RLIMIT_NPROC
    (the sandbox inherits them and may not raise them) and by 2**20 / 2**22 (the kernel's
    nr_open default and PID_MAX_LIMIT); `memory_mb` and `file_size_mb` likewise by hard
    RLIMIT_AS / RLIMIT_FSIZE when those are finite.
    """
    maximum = {
        "cpu_s": MAX_SECONDS,
        "wall_s": MAX_SECONDS,
        "memory_mb": _hard_limit("RLIMIT_AS", MAX_MEMORY_MB << 20) >> 20,
        "file_size_mb": _hard_limit("RLIMIT_FSIZE", MAX_FILE_SIZE_MB << 20) >> 20,
        "open_files": _hard_limit("RLIMIT_NOFILE", 1 << 20),
        "processes": _hard_limit("RLIMIT_NPROC", 1 << 22),
        "output_bytes": MAX_OUTPUT_BYTES,
    }
    return {name: (_MINIMUM[name], maximum[name]) for name in _MINIMUM}


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Limits of one sandboxed program.

    Attributes:
        cpu_s: CPU seconds of its main process (RLIMIT_CPU, rounded up to whole seconds, the
            kernel's unit; SIGXCPU then, SIGKILL one second later) -> outcome timeout.
        wall_s: wall-clock seconds of the whole run, sandbox start-up included -> timeout.
        memory_mb: address space of each process, MiB (RLIMIT_AS) -> outcome memory. At least 16
            (python3 itself needs ~10 MiB).
        file_size_mb: largest file it may write, MiB (RLIMIT_FSIZE; Python gets OSError EFBIG).
            Each private tmpfs (/sandbox, /tmp, /dev/shm) holds at most 4 times this.
        open_files: file descriptors per process (RLIMIT_NOFILE); at least 8.
        processes: processes (and threads) its uid may have at once (RLIMIT_NPROC); at least 1.
        output_bytes: bytes kept of stdout and of stderr each; one more -> outcome
            output_limit, the stream is cut there and the program killed.

    Ranges (`limit_ranges()` gives them for this process): cpu_s and wall_s 0.001 .. 86400
    (`MAX_SECONDS`); memory_mb 16 .. 2**20 (`MAX_MEMORY_MB`); file_size_mb 1 .. 2**16
    (`MAX_FILE_SIZE_MB`); open_files 8 .. this process's hard RLIMIT_NOFILE (at most 2**20);
    processes 1 .. its hard RLIMIT_NPROC (at most 2**22); output_bytes 1 .. 2**30. The rlimit
    caps are read where the object is made: a limit built on one host and run on another with
    lower hard limits ends as sandbox_error there.

    Raises:
        TypeError: a field is not a number (bools are refused), or an int field is a float
            (a `posttrain.core.checks.FieldTypeError`, a ValueError too).
        ValueError: a field is not finite or outside its range. Both name the field, show the
            value and give the range: `SandboxLimits.memory_mb=8; must be an integer in
            [16, 1048576]`.
    """

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    file_size_mb: int = 16
    open_files: int = 64
    processes: int = 32
    output_bytes: int = 1_000_000

    def __post_init__(self) -> None:
        ranges = limit_ranges()
        for f in fields(self):
            low, high = ranges[f.name]
            check_number(
                f"SandboxLimits.{f.name}",
                getattr(self, f.name),
                integer=f.type != "float",
                low=low,
                high=high,
            )


@dataclass(frozen=True)
class ExecutionResult:
    """What one sandboxed program did.

    Attributes:
        outcome: how it ended (`ExecOutcome`).
        exit_code: its exit code when it exited by itself (`os._exit(3)` -> 3), else None.
        signal: the signal number that ended it (24 = SIGXCPU at the CPU limit; 9 = SIGKILL,
            also when the sandbox killed it at the wall-clock deadline or the output limit),
            else None.
        stdout: what it wrote to stdout (at most `output_bytes` bytes), UTF-8, errors replaced.
        stderr: the same for stderr; for sandbox_error, what failed.
        stdout_truncated: True when stdout was cut at `output_bytes`.
        wall_s: seconds of the whole run (sandbox start-up and tear-down included).
    """

    outcome: ExecOutcome
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    wall_s: float


_MEMORY_RE = re.compile(
    r"(^|\n)(\w+\.)*MemoryError\b[^\n]*\s*$|Cannot allocate memory|"
    r"std::bad_alloc|out of memory"
)


def classify(raw: sandbox_exec.RawRun, limits: SandboxLimits) -> ExecutionResult:
    """Turn what happened (`sandbox_exec.RawRun`) into an `ExecutionResult`.

    Rules, first match wins: killed by the sandbox for output -> output_limit, for the deadline
    -> timeout; no valid launcher status -> sandbox_error; SIGXCPU, or SIGKILL after at least
    the CPU limit's seconds -> timeout; exit code 0 -> ok; a failure whose stderr ends in
    MemoryError or names a failed allocation -> memory; another signal -> killed; else failed.
    """
    stdout = raw.stdout.decode("utf-8", errors="replace")
    stderr = raw.stderr.decode("utf-8", errors="replace")
    status = raw.parsed_status()
    code: int | None = None
    sig: int | None = None
    if status is not None:
        kind, number, _ = status
        code, sig = (number, None) if kind == "exit" else (None, number)
    if raw.killed_for:
        sig, code = signal.SIGKILL.value, None
        outcome = ExecOutcome.OUTPUT_LIMIT if raw.killed_for == "output" else ExecOutcome.TIMEOUT
    elif status is None:
        outcome = ExecOutcome.SANDBOX_ERROR
        what = raw.status.strip() or f"bubblewrap exited with {raw.bwrap_code} and no status"
        stderr = f"sandbox: {what}\n{stderr}"
    elif sig == signal.SIGXCPU or (
        sig == signal.SIGKILL and status[2] >= math.ceil(limits.cpu_s) - 0.05
    ):
        outcome = ExecOutcome.TIMEOUT
    elif code == 0:
        outcome = ExecOutcome.OK
    elif _MEMORY_RE.search(stderr[-2000:]):
        outcome = ExecOutcome.MEMORY
    elif sig is not None:
        outcome = ExecOutcome.KILLED
    else:
        outcome = ExecOutcome.FAILED
    return ExecutionResult(
        outcome=outcome,
        exit_code=code,
        signal=sig,
        stdout=stdout,
        stderr=stderr,
        stdout_truncated=raw.stdout_cut,
        wall_s=raw.wall_s,
    )


_NUL_MESSAGE = "SyntaxError: source code cannot contain null bytes (the program was not run)\n"
_available_here = False  # a probe succeeded in this process (failures are not cached)
_probe_lock = threading.Lock()


def _bwrap() -> str | None:
    return shutil.which("bwrap")


def _execute(source: str, stdin: str, limits: SandboxLimits) -> ExecutionResult:
    if "\x00" in source:  # python3.11 stops reading main.py at a NUL: it would run a prefix
        return ExecutionResult(
            outcome=ExecOutcome.FAILED,
            exit_code=None,
            signal=None,
            stdout="",
            stderr=_NUL_MESSAGE,
            stdout_truncated=False,
            wall_s=0.0,
        )
    bwrap = _bwrap()
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is no longer on PATH")
    try:
        raw = sandbox_exec.execute(
            bwrap,
            source,
            stdin,
            cpu_s=limits.cpu_s,
            wall_s=limits.wall_s,
            memory_mb=limits.memory_mb,
            file_size_mb=limits.file_size_mb,
            open_files=limits.open_files,
            processes=limits.processes,
            output_bytes=limits.output_bytes,
        )
    except (sandbox_exec.SlotsBusy, OSError) as exc:
        return ExecutionResult(
            outcome=ExecOutcome.SANDBOX_ERROR,
            exit_code=None,
            signal=None,
            stdout="",
            stderr=f"sandbox: {type(exc).__name__}: {exc}\n",
            stdout_truncated=False,
            wall_s=0.0,
        )
    return classify(raw, limits)


def sandbox_available() -> str | None:
    """None when programs can be sandboxed here, else the reason (a sentence saying what to do).

    Checks, in order: Linux; running as root (needed to give each program its own unprivileged
    uid, the only way RLIMIT_NPROC holds); bubblewrap on PATH; /usr/bin/python3; no account in
    the uid range programs run as; then one real sandboxed `print(1)`. A success is remembered for
    the life of the process; a failure is probed again on the next call.
    """
    global _available_here
    if _available_here:
        return None
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return (
            "the sandbox needs root (it runs each program as its own unprivileged uid; "
            f"RLIMIT_NPROC holds only after a real setuid); this process runs as uid "
            f"{os.geteuid()}"
        )
    if _bwrap() is None:
        return (
            "bubblewrap (bwrap) is not installed: run scripts/sandbox-up.sh (installs the "
            "Debian package bubblewrap)"
        )
    if not os.access(sandbox_command.PYTHON, os.X_OK):
        return f"{sandbox_command.PYTHON} is missing; the sandbox runs programs with it"
    base, top = sandbox_exec.UID_BASE, sandbox_exec.UID_BASE + sandbox_exec.UID_SLOTS
    taken = [p.pw_name for p in pwd.getpwall() if base <= p.pw_uid < top]
    if taken or base < 1000 or top > 2**32 - 2:
        return (
            f"the sandbox's uids {base}..{top - 1} must be >= 1000, < 2**32 - 2 and used by no "
            f"account (used by: {taken}); set POSTTRAIN_SANDBOX_UID_BASE to a free range"
        )
    with _probe_lock:
        if _available_here:
            return None
        result = _execute("print(1)", "", SandboxLimits(wall_s=30.0))
        if result.outcome is not ExecOutcome.OK or result.stdout != "1\n":
            return (
                f"bubblewrap could not run a sandboxed program here ({result.outcome.value}, "
                f"exit {result.exit_code}): {result.stderr.strip()[:500]}"
            )
        _available_here = True
    return None


class Sandbox:
    """Runs Python programs in fresh sandboxes, one at a time (`run`) or a bounded pool
    (`run_many`). See the module docstring for the isolation.

    Args:
        limits: the default limits of each program (`SandboxLimits`).
        max_workers: programs `run_many` runs at the same time (threads, each waiting on one
            sandbox), at least 1.

    Raises:
        SandboxUnavailable: when `sandbox_available()` gives a reason (the message is that
            reason). Also raised by `run` in a process where the sandbox cannot be made after
            the object was unpickled there.
        TypeError / ValueError: `limits` is not a SandboxLimits, or `max_workers` is not an
            int >= 1.

    Pickles (with pickle or cloudpickle): it holds only `limits` and `max_workers`; the thread
    pool is made lazily in each process. Safe to share between threads.
    """

    def __init__(self, limits: SandboxLimits = SandboxLimits(), *, max_workers: int = 4) -> None:
        if not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
        reason = sandbox_available()
        if reason is not None:
            raise SandboxUnavailable(reason)
        self.limits = limits
        self.max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(
        self, source: str, *, stdin: str = "", limits: SandboxLimits | None = None
    ) -> ExecutionResult:
        """Run `source` as a Python 3 program in a fresh sandbox and wait for it.

        Args:
            source: the program text (written to /sandbox/main.py inside; never on a command
                line).
            stdin: text passed on the program's stdin (UTF-8), then closed.
            limits: limits of this run instead of the sandbox's own.

        Returns:
            An `ExecutionResult`; every way the program can end is an outcome, not an exception
            (a source holding a NUL byte is not run: outcome failed, see the module table).

        Raises:
            TypeError: `source` or `stdin` is not a str, or `limits` not a SandboxLimits.
            SandboxUnavailable: no sandbox can be made in this process (see the class).
        """
        _check_text("source", source)
        _check_text("stdin", stdin)
        limits = self._limits(limits)
        reason = sandbox_available()
        if reason is not None:
            raise SandboxUnavailable(reason)
        return _execute(source, stdin, limits)

    def run_many(
        self, sources: Sequence[str], *, stdin: str = "", limits: SandboxLimits | None = None
    ) -> list[ExecutionResult]:
        """Run every program of `sources` (each in its own sandbox, `max_workers` at a time) with
        the same `stdin` and limits; results in input order. Arguments and errors as `run`."""
        if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence):
            raise TypeError(f"sources must be a sequence of str, got {type(sources).__name__}")
        for i, source in enumerate(sources):
            _check_text(f"sources[{i}]", source)
        _check_text("stdin", stdin)
        limits = self._limits(limits)
        if not sources:
            return []
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="sandbox")
            pool = self._pool
        futures = [pool.submit(self.run, source, stdin=stdin, limits=limits) for source in sources]
        return [future.result() for future in futures]

    def close(self) -> None:
        """Stop the worker threads of `run_many` (a later call makes new ones)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _limits(self, limits: SandboxLimits | None) -> SandboxLimits:
        if limits is None:
            return self.limits
        if not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be a SandboxLimits or None, got {type(limits).__name__}")
        return limits

    def __getstate__(self) -> dict:
        return {"limits": self.limits, "max_workers": self.max_workers}

    def __setstate__(self, state: dict) -> None:
        self.limits, self.max_workers = state["limits"], state["max_workers"]
        self._pool, self._lock = None, threading.Lock()

    def __repr__(self) -> str:
        return f"Sandbox({self.limits!r}, max_workers={self.max_workers})"


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
