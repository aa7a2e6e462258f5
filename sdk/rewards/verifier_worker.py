"""A verifier worker process: the program it runs, and the parent's handle on it
(`WorkerProcess`: start, kill, exit status), used by `posttrain.rewards.verifier_pool`.

The program: run as `python verifier_worker.py FD_IN FD_OUT PARENT_PID` with two pipe ends
inherited from the parent. Messages are pickles framed by `multiprocessing.connection.Connection`:

    =============================================  ============================================
    parent -> worker                               worker -> parent
    =============================================  ============================================
    the parent's `sys.path` (first message)        (nothing)
    ("call", index, key, load, payload)            ("loaded", index) when `load` was given, then
                                                   ("result", index, VerifierResult); or
                                                   ("load_failed", index, reason) alone
    =============================================  ============================================

`load` is None when the worker already holds the verifier `key`, else `(blob, evict_key)`:
`blob` is the verifier pickled with cloudpickle, `evict_key` one the worker may forget (the
parent decides, so both sides agree on what is cached). `payload` is `(completion, item)`,
pickled apart so that an item the worker cannot unpickle is that call's error, not a crash.
Calls run one at a time in the worker's main thread, so libraries that time themselves out
with `signal.alarm` (math-verify) work here as in a script. A call's return value is turned
into a `VerifierResult` here (`posttrain.rewards.outcome.coerce_result`): what crosses back is
always a result, never the verifier's own object, its `reason` cut to `MAX_REASON_CHARS` (a
200 MB reason would still be crossing the pipe at the deadline). After each call the worker kills
and reaps whatever processes the call left running; it is their subreaper (Linux
`PR_SET_CHILD_SUBREAPER`), so `setsid` or a dead intermediate parent does not hide them, and
`WorkerProcess.kill` finds them the same way (`descendants`). Its stdout and stderr are
`/dev/null`. The worker exits when its input pipe closes, and (Linux) the kernel kills it when
the parent's launcher thread ends (`PR_SET_PDEATHSIG`; processes started by a call running at
that moment are not killed with it).

Imports: posttrain's `core` and `rewards` packages load their re-exports on first use
(`posttrain.core.lazy`), so the worker imports only what the verifier needs, not torch (~1.2 s,
~300 MB) unless the verifier does.
"""

from __future__ import annotations

import collections
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle  # the blobs' by-value functions need it in the worker too

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PR_SET_CHILD_SUBREAPER = 36

MAX_REASON_CHARS = 4096
"""Longest `reason` a worker sends back (a longer one is cut, keeping its start and its end)."""

MAX_REPLY_BYTES = 1 << 20
"""Largest reply the parent reads from a worker; a longer one is that call's error."""


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the thread that started it ends, and to make it
    the reaper of its descendants' orphans (so that a process the verifier starts stays among
    its descendants even after `setsid` and the death of its own parent); exit now if the
    parent is already gone (it died before the request was made)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(0)


def descendants(pid: int) -> list[int]:
    """Live (non-zombie) descendants of process `pid`, read from the ppid links in `/proc`
    (Linux; [] elsewhere). A zombie runs nothing and counts as gone."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def kill_descendants(pid: int, rounds: int = 20) -> None:
    """SIGKILL every descendant of `pid`, again until none is left (one may fork meanwhile;
    the orphans of a killed one reparent to `pid`, a subreaper, and are found next round)."""
    for _ in range(rounds):
        found = descendants(pid)
        if not found:
            return
        for child in found:
            try:
                os.kill(child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _reap_children() -> bool:
    """Reap this process's ended children (as a subreaper it adopts its descendants' orphans);
    True when a child is still running (then, and only then, it has live descendants)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def end_leftovers() -> None:
    """Kill and reap whatever this worker's last call left running (cheap when nothing)."""
    if _reap_children():
        kill_descendants(os.getpid())
        _reap_children()


def capped(result):
    """`result` with a `reason` of at most `MAX_REASON_CHARS` (its start and end kept), as a
    plain `VerifierResult` when it was cut; other results are returned as they are."""
    reason = result.reason
    if len(reason) <= MAX_REASON_CHARS:
        return result
    from posttrain.rewards.outcome import VerifierResult

    keep = MAX_REASON_CHARS // 2
    cut = f" [... {len(reason) - 2 * keep} characters cut ...] "
    return VerifierResult(result.score, result.outcome, reason[:keep] + cut + reason[-keep:])


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def serve(fd_in: int, fd_out: int) -> None:
    """Answer the parent's messages until its pipe closes (see the module docstring)."""
    inbox, outbox = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    try:
        sys.path[:] = pickle.loads(inbox.recv_bytes())
    except EOFError:
        return
    from posttrain.rewards.outcome import VerifierResult, coerce_result, raised_result

    verifiers: dict[int, Callable[[Any, Any], Any]] = {}
    while True:
        try:
            _, index, key, load, payload = pickle.loads(inbox.recv_bytes())
        except EOFError:
            return
        if load is not None:
            blob, evict = load
            verifiers.pop(evict, None)
            try:
                verifiers[key] = pickle.loads(blob)
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                if not _send(outbox, ("load_failed", index, _describe(exc)[:MAX_REASON_CHARS])):
                    return
                continue
            if not _send(outbox, ("loaded", index)):
                return
        try:
            completion, item = pickle.loads(payload)
        except BaseException as exc:  # noqa: BLE001
            result = VerifierResult.failure(
                "error", f"the item did not unpickle in the worker: {_describe(exc)}"
            )
        else:
            try:
                result = coerce_result(verifiers[key](completion, item))
            except BaseException as exc:  # noqa: BLE001 - any failure of user code is data
                result = raised_result(exc)
        end_leftovers()  # a call leaves no process behind
        if not _send(outbox, ("result", index, capped(result))):
            return


def _send(outbox, reply: tuple) -> bool:
    """Send `reply`; False when the parent is gone. A result whose class (a VerifierResult
    subclass) does not pickle goes as a plain VerifierResult with the same fields."""
    try:
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001
        data = b""
    if reply[0] == "result" and (not data or len(data) > MAX_REPLY_BYTES // 2):
        kind, index, result = reply  # a subclass that does not pickle, or has large fields
        from posttrain.rewards.outcome import VerifierResult

        plain = capped(VerifierResult(result.score, result.outcome, result.reason))
        data = pickle.dumps((kind, index, plain), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        outbox.send_bytes(data)
    except OSError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# The parent's side
# --------------------------------------------------------------------------------------------

WORKER_FILE = os.path.abspath(__file__)


@dataclass(eq=False)
class WorkerProcess:
    """The parent's handle on one worker process.

    Attributes:
        proc: the `subprocess.Popen`; `proc.pid` is also its process group and session id.
        inbox, outbox: `Connection`s to (parent writes) and from (parent reads) the worker.
        loaded: keys of the verifiers it holds, least recently used first (the parent's copy
            of the worker's cache: the parent decides what it forgets).
    """

    proc: subprocess.Popen
    inbox: Connection
    outbox: Connection
    loaded: collections.OrderedDict = field(default_factory=collections.OrderedDict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls) -> WorkerProcess:
        """Start a worker (`python WORKER_FILE`, a fresh interpreter in a new session) and send
        it this process's `sys.path`. Call it from a thread that lives as long as the process
        (`Launcher`): the worker's parent-death signal fires when that thread ends.

        Raises:
            OSError: if the process cannot be started (no memory, no such interpreter).
        """
        from_parent, to_worker = os.pipe()
        from_worker, to_parent = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, WORKER_FILE, str(from_parent), str(to_parent), str(os.getpid())],
                pass_fds=(from_parent, to_parent),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            for fd in (from_parent, to_worker, from_worker, to_parent):
                os.close(fd)
            raise
        os.close(from_parent)
        os.close(to_parent)
        worker = cls(
            proc, Connection(to_worker, readable=False), Connection(from_worker, writable=False)
        )
        try:
            worker.inbox.send_bytes(dumps_message(list(sys.path)))
        except OSError:
            pass  # it died at once: its first call finds out
        return worker

    def kill(self) -> None:
        """SIGKILL the worker, every descendant it has (those that left its process group or
        session with `setsid` included: it is their subreaper) and its process group, and close
        the pipes; reap it later with `proc.wait()`.

        Once the worker has been reaped its pid may belong to another process (group), so a
        reaped worker is never signalled again: killing it twice is safe."""
        if self.proc.returncode is None:
            try:  # stopped, it starts nothing more; its descendants' orphans still come to it
                os.kill(self.pid, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
            kill_descendants(self.pid)  # those that left its group too (setsid)
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.close()

    def close(self) -> None:
        """Close this process's ends of the pipes (the worker exits when its input closes)."""
        for connection in (self.inbox, self.outbox):
            try:
                connection.close()
            except OSError:
                pass

    def exit_status(self, wait_s: float = 1.0) -> str:
        """How the worker ended ("exit code 3", "killed by SIGSEGV"), waiting up to `wait_s`."""
        try:
            code = self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return "still running"
        if code >= 0:
            return f"exit code {code}"
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"


def dumps_message(obj: Any) -> bytes:
    """`obj` pickled for a pipe: with pickle (fast), else with cloudpickle (an item holding a
    lambda or a class from a notebook cell)."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - a lambda or local class inside an item, ...
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def what_does_not_pickle(verifier: Any) -> str:
    """` (in 'name', a type)` for the first attribute, closure variable or global of
    `verifier` that cloudpickle cannot pickle, or "" when none of them fails on its own."""
    parts = list(getattr(verifier, "__dict__", {}).items())
    function = getattr(verifier, "__func__", verifier)
    code = getattr(function, "__code__", None)
    if code is not None:
        cells = getattr(function, "__closure__", None) or ()
        parts += [(name, cell.cell_contents) for name, cell in zip(code.co_freevars, cells)]
        names = getattr(function, "__globals__", {})
        parts += [(name, names[name]) for name in code.co_names if name in names]
    for name, value in parts:
        if value is verifier or isinstance(value, types.ModuleType):
            continue
        try:
            cloudpickle.dumps(value)
        except Exception:  # noqa: BLE001 - any failure names the culprit
            return f" (in {name!r}, a {type(value).__name__})"
    return ""


class Launcher:
    """One long-lived daemon thread that runs jobs in order: starting and reaping a pool's
    workers, so that their parent-death signal (sent when the *thread* that started a process
    ends) fires only when the whole process ends."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(
            target=self._serve, name="posttrain-verifier-launcher", daemon=True
        ).start()

    def _serve(self) -> None:
        while True:
            job, box = self._jobs.get()
            try:
                value = job()
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                value = exc
            if box is not None:
                box.put(value)

    def call(self, job: Callable[[], Any]) -> Any:
        """Run `job` on the launcher thread and return its value (or raise its exception)."""
        box: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((job, box))
        value = box.get()
        if isinstance(value, BaseException):
            raise value
        return value

    def post(self, job: Callable[[], Any]) -> None:
        """Run `job` on the launcher thread later; its value and exceptions are dropped."""
        self._jobs.put((job, None))


def main(argv: list[str]) -> None:
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # run by path: this folder's files must not shadow top-level modules
    fd_in, fd_out, parent_pid = (int(a) for a in argv[1:4])
    _die_with_parent(parent_pid)
    serve(fd_in, fd_out)


if __name__ == "__main__":
    main(sys.argv)
