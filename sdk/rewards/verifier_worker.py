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
always a result, never the verifier's own object. The worker exits when its input pipe closes,
and (Linux) the kernel kills it when the parent's launcher thread ends (`PR_SET_PDEATHSIG`).

Imports: the worker imports posttrain's `core` and `rewards` packages without running their
`__init__` re-exports until a name defined there is asked for (`light_packages`): those pull in
torch (~1.2 s, ~300 MB), which no built-in verifier needs. A verifier that does need torch
imports it as usual.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle  # the blobs' by-value functions need it in the worker too

LIGHT_PACKAGES = ("posttrain.core", "posttrain.rewards")
"""Packages whose `__init__` runs only when a name it defines is asked for (see module doc)."""

_PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


def light_packages(names: Iterable[str] = LIGHT_PACKAGES) -> None:
    """Register each package in `sys.modules` without running its `__init__` yet.

    Its submodules import as usual (`posttrain.rewards.verifier` loads only that file and what
    it imports). The first lookup of any other name (`from posttrain.rewards import Outcome`)
    runs the real `__init__` in the same module object and returns the name, so code that
    relies on the re-exports still works, only later. A package that cannot be found, or is
    already imported, is left alone.
    """
    for name in names:
        if name in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            continue
        module = importlib.util.module_from_spec(spec)
        module.__getattr__ = _deferred_init(module, spec)   # PEP 562: only for missing names
        sys.modules[name] = module


def _deferred_init(module: types.ModuleType, spec) -> object:
    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        try:   # `from package import submodule` asks for the submodule as a name first
            return importlib.import_module(f"{spec.name}.{attr}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{spec.name}.{attr}":
                raise
        module.__dict__.pop("__getattr__", None)
        spec.loader.exec_module(module)
        return getattr(module, attr)
    return __getattr__


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the thread that started it ends; exit now if the
    parent is already gone (it died before the request was made)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(0)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def serve(fd_in: int, fd_out: int) -> None:
    """Answer the parent's messages until its pipe closes (see the module docstring)."""
    inbox, outbox = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    try:
        sys.path[:] = pickle.loads(inbox.recv_bytes())
    except EOFError:
        return
    light_packages()
    from posttrain.rewards.outcome import VerifierResult, coerce_result, raised_result

    verifiers: dict[int, object] = {}
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
            except BaseException as exc:   # noqa: BLE001 - reported to the parent
                if not _send(outbox, ("load_failed", index, _describe(exc))):
                    return
                continue
            if not _send(outbox, ("loaded", index)):
                return
        try:
            completion, item = pickle.loads(payload)
        except BaseException as exc:   # noqa: BLE001
            result = VerifierResult.failure("error", f"the item did not unpickle in the worker: "
                                                     f"{_describe(exc)}")
        else:
            try:
                result = coerce_result(verifiers[key](completion, item))
            except BaseException as exc:   # noqa: BLE001 - any failure of user code is data
                result = raised_result(exc)
        if not _send(outbox, ("result", index, result)):
            return


def _send(outbox, reply: tuple) -> bool:
    """Send `reply`; False when the parent is gone. A result whose class (a VerifierResult
    subclass) does not pickle goes as a plain VerifierResult with the same fields."""
    try:
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:   # noqa: BLE001
        kind, index, result = reply
        from posttrain.rewards.outcome import VerifierResult
        plain = VerifierResult(result.score, result.outcome, result.reason)
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
                pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL,
                start_new_session=True)
        except BaseException:
            for fd in (from_parent, to_worker, from_worker, to_parent):
                os.close(fd)
            raise
        os.close(from_parent)
        os.close(to_parent)
        worker = cls(proc, Connection(to_worker, readable=False),
                     Connection(from_worker, writable=False))
        try:
            worker.inbox.send_bytes(dumps_message(list(sys.path)))
        except OSError:
            pass   # it died at once: its first call finds out
        return worker

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (it and whatever it started) and close the
        pipes; reap it later with `proc.wait()`.

        Once the worker has been reaped its pid may belong to another process (group), so a
        reaped worker is never signalled again: killing it twice is safe."""
        if self.proc.returncode is None:
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
    except Exception:   # noqa: BLE001 - a lambda or local class inside an item, ...
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
        except Exception:   # noqa: BLE001 - any failure names the culprit
            return f" (in {name!r}, a {type(value).__name__})"
    return ""


class Launcher:
    """One long-lived daemon thread that runs jobs in order: starting and reaping a pool's
    workers, so that their parent-death signal (sent when the *thread* that started a process
    ends) fires only when the whole process ends."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="posttrain-verifier-launcher",
                         daemon=True).start()

    def _serve(self) -> None:
        while True:
            job, box = self._jobs.get()
            try:
                value = job()
            except BaseException as exc:   # noqa: BLE001 - handed back to the caller
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
        del sys.path[0]   # run by path: this folder's files must not shadow top-level modules
    fd_in, fd_out, parent_pid = (int(a) for a in argv[1:4])
    _die_with_parent(parent_pid)
    serve(fd_in, fd_out)


if __name__ == "__main__":
    main(sys.argv)
