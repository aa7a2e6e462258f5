"""How one program runs in the sandbox: its uid slot, bubblewrap started and pumped, the sweep.

`posttrain.verifiers.sandbox` is the public face (`Sandbox`, `SandboxLimits`, outcomes); this
module holds the mechanism it uses, in the order a run goes through it. What it starts (the
bubblewrap command, the launcher inside it, the rlimits, /etc/passwd and /etc/group, the
environment) is `posttrain.verifiers.sandbox_command`.

1. `acquire_slot` takes a uid slot: an unused uid `UID_BASE + slot`, held by an exclusive
   `flock` on `SLOT_DIR/slot-N` (shared by every process on the host), so two programs running at
   the same time never share a uid and one program's processes never count against another's
   RLIMIT_NPROC.
2. `execute` starts bubblewrap with `sandbox_command.bwrap_argv` (the program's source and the
   slot's /etc/passwd and /etc/group handed over as memfds); inside it `LAUNCHER` runs the
   program as the slot's uid under its rlimits and writes how it ended to a status pipe.
3. `pump` feeds stdin and reads stdout/stderr incrementally (at most `output_bytes` kept per
   stream), and on the wall-clock deadline or an output overflow kills the sandbox's pid 1
   through a pidfd. When pid 1 of a PID namespace dies the kernel kills every process left in it
   and reaps them before pid 1 itself is reaped, so nothing the program started (a daemonised
   grandchild included) outlives the run.
4. `sweep_uid` then kills, as a second layer, any host process still owned by the slot's uid,
   before the slot is released.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import re
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

from posttrain.verifiers.sandbox_command import (
    PROGRAM_ENV,
    TMPFS_FILES_FACTOR,
    bwrap_argv,
    group_file,
    parse_status,
    passwd_file,
    rlimit_args,
)

UID_BASE = int(os.environ.get("POSTTRAIN_SANDBOX_UID_BASE", "2100000000"))
"""First uid (and gid) programs run as; slot N runs as UID_BASE + N. No account may use the range
(`sandbox_available` checks). Override with the environment variable POSTTRAIN_SANDBOX_UID_BASE."""

UID_SLOTS = 256
"""Programs that can run at the same time on one host (all processes together)."""

SLOT_DIR = "/run/posttrain-sandbox"
"""Root-only folder of the slot lock files."""

_CHUNK = 65_536
_GIVE_UP_S = 5.0  # after killing, how long to wait for the sandbox's pipes to close


@dataclass(frozen=True)
class RawRun:
    """What happened, before it is classified (`sandbox.classify`).

    Attributes:
        status: the launcher's line ("exit 0 0.012", "signal 24 1.004", "error ...") or "" when
            it wrote none (the sandbox failed to start, or was killed).
        killed_for: "" when the sandbox ended by itself, else "wall" or "output".
        stdout, stderr: the bytes kept (at most `output_bytes` each).
        stdout_cut, stderr_cut: True when the stream was cut at `output_bytes`.
        bwrap_code: bubblewrap's own exit status (its errors say where setup failed).
        wall_s: seconds from starting bubblewrap to the end of the sandbox.
    """

    status: str
    killed_for: str
    stdout: bytes
    stderr: bytes
    stdout_cut: bool
    stderr_cut: bool
    bwrap_code: int | None
    wall_s: float

    def parsed_status(self) -> tuple[str, int, float] | None:
        """("exit" | "signal", number, CPU seconds) from the launcher's line, or None."""
        return parse_status(self.status)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    _write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class SlotsBusy(RuntimeError):
    """Every uid slot stayed taken until the run's deadline."""


def acquire_slot(deadline: float) -> tuple[int, int]:
    """(slot, lock fd): an exclusive flock on a free slot, waiting until `deadline` if all are
    taken. Close the fd to release it. Raises SlotsBusy at the deadline."""
    os.makedirs(SLOT_DIR, mode=0o700, exist_ok=True)
    start = os.getpid() % UID_SLOTS
    while True:
        for i in range(UID_SLOTS):
            slot = (start + i) % UID_SLOTS
            fd = os.open(f"{SLOT_DIR}/slot-{slot}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return slot, fd
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
        if time.monotonic() >= deadline:
            raise SlotsBusy(f"all {UID_SLOTS} sandbox uid slots stayed busy")
        time.sleep(0.01)


def execute(
    bwrap: str,
    source: str,
    stdin: str,
    *,
    cpu_s: float,
    wall_s: float,
    memory_mb: int,
    file_size_mb: int,
    open_files: int,
    processes: int,
    output_bytes: int,
) -> RawRun:
    """Run `source` once in a fresh sandbox and return what happened (unclassified).

    Raises:
        SlotsBusy: no uid slot freed up within `wall_s`.
        OSError: bubblewrap could not be started at all.
    """
    t0 = time.monotonic()
    deadline = t0 + wall_s
    slot, slot_fd = acquire_slot(deadline)
    uid = UID_BASE + slot
    fds: list[int] = [slot_fd]
    try:
        source_fd = _memfd("main.py", source.encode("utf-8", errors="surrogatepass"))
        passwd_fd, group_fd = _memfd("passwd", passwd_file(uid)), _memfd("group", group_file(uid))
        info_r, info_w = os.pipe2(os.O_CLOEXEC)
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        fds += [source_fd, passwd_fd, group_fd, info_r, info_w, status_r, status_w]
        argv = bwrap_argv(
            bwrap,
            uid=uid,
            source_fd=source_fd,
            passwd_fd=passwd_fd,
            group_fd=group_fd,
            info_fd=info_w,
            status_fd=status_w,
            tmpfs_bytes=TMPFS_FILES_FACTOR * (file_size_mb << 20),
            rlimits=rlimit_args(
                cpu_s=cpu_s,
                memory_mb=memory_mb,
                file_size_mb=file_size_mb,
                open_files=open_files,
                processes=processes,
            ),
        )
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=PROGRAM_ENV,
            close_fds=True,
            pass_fds=(source_fd, passwd_fd, group_fd, info_w, status_w),
            start_new_session=True,
        )
        for fd in (source_fd, passwd_fd, group_fd, info_w, status_w):
            os.close(fd)
            fds.remove(fd)
        try:
            return pump(
                proc,
                stdin.encode("utf-8", errors="surrogatepass"),
                info_r,
                status_r,
                t0=t0,
                deadline=deadline,
                output_bytes=output_bytes,
            )
        finally:
            if proc.poll() is None:  # only if pump itself failed: never leave it running
                proc.kill()
                proc.wait()
    finally:
        try:
            sweep_uid(uid)
        finally:
            for fd in fds:
                os.close(fd)


def sweep_uid(uid: int) -> int:
    """SIGKILL every host process owned by `uid` (a slot's uid, used by nothing else while the
    slot is held) and return how many were found. The PID namespace already kills everything a
    program starts, so this second layer normally finds none; it costs ~0.2 ms (one stat per
    /proc entry)."""
    found = 0
    for _ in range(10):
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}").st_uid == uid:
                        pids.append(int(entry))
                except OSError:
                    continue
        live = 0
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:  # the pid may have been reused between the scan and the pidfd: check again
                if os.stat(f"/proc/{pid}").st_uid == uid and not _is_zombie(pid):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    live += 1
            except OSError:
                pass
            finally:
                os.close(pidfd)
        found += live
        if not live:
            return found
        time.sleep(0.01)
    return found


def _is_zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"


def pump(
    proc: subprocess.Popen,
    stdin: bytes,
    info_r: int,
    status_r: int,
    *,
    t0: float,
    deadline: float,
    output_bytes: int,
) -> RawRun:
    """Feed stdin, collect output, status and bubblewrap's info until the sandbox is gone.

    Reads are incremental (64 KiB chunks); at most `output_bytes` per stream are kept, and the
    first byte over that kills the sandbox. The deadline kills it too.
    """
    sel = selectors.DefaultSelector()
    out = {"stdout": bytearray(), "stderr": bytearray()}
    cut = {"stdout": False, "stderr": False}
    small = {"info": bytearray(), "status": bytearray()}
    stdin_view = memoryview(stdin)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    if stdin_view:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
    else:
        proc.stdin.close()
    sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
    sel.register(info_r, selectors.EVENT_READ, "info")
    sel.register(status_r, selectors.EVENT_READ, "status")
    bwrap_pidfd = os.pidfd_open(proc.pid)
    sel.register(bwrap_pidfd, selectors.EVENT_READ, "exit")
    killed_for, exited, init_pidfd, given_up = "", False, -1, math.inf
    try:
        while not exited or sel.get_map():
            now = time.monotonic()
            if now >= deadline and not killed_for:
                killed_for = "wall"
                init_pidfd = _kill(proc, small["info"], init_pidfd)
            if killed_for and given_up == math.inf:
                given_up = now + _GIVE_UP_S
            if now >= given_up:  # never seen with a PID namespace; do not hang on it either
                proc.kill()
                break
            events = sel.select(timeout=max((given_up if killed_for else deadline) - now, 0.0))
            for key, _ in events:
                name, fd = key.data, key.fd
                if name == "exit":
                    exited = True
                    sel.unregister(fd)
                elif name == "stdin":
                    try:
                        stdin_view = stdin_view[os.write(fd, stdin_view[:_CHUNK]) :]
                    except (BrokenPipeError, BlockingIOError) as exc:
                        if isinstance(exc, BrokenPipeError):
                            stdin_view = stdin_view[:0]
                    if not stdin_view:
                        sel.unregister(fd)
                        proc.stdin.close()
                else:
                    data = os.read(fd, _CHUNK)
                    if not data:
                        sel.unregister(fd)
                    elif name in small:
                        small[name] += data
                        if name == "info" and init_pidfd < 0:
                            init_pidfd = _open_init_pidfd(small["info"])
                    else:
                        room = output_bytes - len(out[name])
                        out[name] += data[:room]
                        if len(data) > room:
                            cut[name] = True
                            if not killed_for:
                                killed_for = "output"
                                init_pidfd = _kill(proc, small["info"], init_pidfd)
                                given_up = time.monotonic() + _GIVE_UP_S
        code = proc.wait()
        if init_pidfd >= 0:  # killed: wait until pid 1 (and with it the namespace) is gone
            _wait_readable(init_pidfd, 5.0)
    finally:
        sel.close()
        os.close(bwrap_pidfd)
        if init_pidfd >= 0:
            os.close(init_pidfd)
        if not proc.stdin.closed:
            proc.stdin.close()
        proc.stdout.close()
        proc.stderr.close()
    return RawRun(
        status=small["status"].decode(errors="replace"),
        killed_for=killed_for,
        stdout=bytes(out["stdout"]),
        stderr=bytes(out["stderr"]),
        stdout_cut=cut["stdout"],
        stderr_cut=cut["stderr"],
        bwrap_code=code,
        wall_s=time.monotonic() - t0,
    )


def _open_init_pidfd(info: bytearray) -> int:
    """A pidfd of the sandbox's pid 1 (from bubblewrap's info JSON), or -1 while not known."""
    match = re.search(rb'"child-pid"\s*:\s*(\d+)', info)
    if match is None:
        return -1
    try:
        return os.pidfd_open(int(match.group(1)))
    except ProcessLookupError:
        return -1


def _kill(proc: subprocess.Popen, info: bytearray, init_pidfd: int) -> int:
    """SIGKILL the sandbox's pid 1 (the kernel then kills the whole PID namespace); before pid 1
    is known, bubblewrap itself (its --die-with-parent then kills pid 1)."""
    if init_pidfd < 0:
        init_pidfd = _open_init_pidfd(info)
    if init_pidfd >= 0:
        try:
            signal.pidfd_send_signal(init_pidfd, signal.SIGKILL)
            return init_pidfd
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
    return init_pidfd


def _wait_readable(fd: int, timeout_s: float) -> None:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        sel.select(timeout=timeout_s)
