"""How one program runs in the sandbox: the bubblewrap command, the in-sandbox launcher, the pump.

`posttrain.verifiers.sandbox` is the public face (`Sandbox`, `SandboxLimits`, outcomes); this
module holds the mechanism it uses, in the order a run goes through it:

1. `acquire_slot` takes a uid slot: an unused uid `UID_BASE + slot`, held by an exclusive
   `flock` on `SLOT_DIR/slot-N` (shared by every process on the host), so two programs running at
   the same time never share a uid and one program's processes never count against another's
   RLIMIT_NPROC.
2. `bwrap_argv` builds the bubblewrap command: new mount, PID, network, IPC, UTS (and cgroup)
   namespaces; only /usr (and the /bin, /lib* links into it) plus a few /etc files read-only;
   private tmpfs folders at /sandbox (the program's folder, its cwd and HOME), /tmp and /dev/shm;
   every capability dropped except CAP_SETUID and CAP_SETGID, which only the launcher uses.
3. `LAUNCHER` (run by the system python3 as pid 2 of the sandbox) forks the program's process,
   which sets the rlimits, drops to the slot uid/gid with no supplementary groups and execs
   `/usr/bin/python3 main.py`; the launcher stays root (the program cannot signal it), waits,
   and writes the exact end of the program (exit code or signal, CPU seconds) to a status pipe:
   bubblewrap itself folds a signal into an exit code of 128 + n.
4. `pump` feeds stdin and reads stdout/stderr incrementally (at most `output_bytes` kept per
   stream), and on the wall-clock deadline or an output overflow kills the sandbox's pid 1
   through a pidfd. When pid 1 of a PID namespace dies the kernel kills every process left in it
   and reaps them before pid 1 itself is reaped, so nothing the program started (a daemonised
   grandchild included) outlives the run.
5. `sweep_uid` then kills, as a second layer, any host process still owned by the slot's uid,
   before the slot is released.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import math
import os
import re
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

PYTHON = "/usr/bin/python3"
"""The interpreter that runs programs (and the launcher) inside the sandbox: the system one, which
the unprivileged uid can read (a virtualenv under /root or the checkout is not bound)."""

UID_BASE = int(os.environ.get("POSTTRAIN_SANDBOX_UID_BASE", "2100000000"))
"""First uid (and gid) programs run as; slot N runs as UID_BASE + N. No account may use the range
(`sandbox_available` checks). Override with the environment variable POSTTRAIN_SANDBOX_UID_BASE."""

UID_SLOTS = 256
"""Programs that can run at the same time on one host (all processes together)."""

SLOT_DIR = "/run/posttrain-sandbox"
"""Root-only folder of the slot lock files."""

SANDBOX_DIR = "/sandbox"
"""The program's private folder inside the sandbox (cwd and HOME; main.py is written there)."""

TMPFS_FILES_FACTOR = 4
"""Each private tmpfs (/sandbox, /tmp, /dev/shm) holds at most this many times `file_size_mb`."""

_CHUNK = 65_536
_GIVE_UP_S = 5.0  # after killing, how long to wait for the sandbox's pipes to close

LAUNCHER = r"""
import os, resource, signal, sys
status_fd, uid = int(sys.argv[1]), int(sys.argv[2])
limits = [(getattr(resource, name), int(soft), int(hard))
          for name, soft, hard in zip(sys.argv[3::3], sys.argv[4::3], sys.argv[5::3])]
err_r, err_w = os.pipe2(os.O_CLOEXEC)
pid = os.fork()
if pid == 0:
    try:
        os.closerange(3, err_w)
        os.closerange(err_w + 1, 65536)
        for res, soft, hard in limits:
            resource.setrlimit(res, (soft, hard))
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # ignored by this interpreter; exec keeps it
            signal.signal(sig, signal.SIG_DFL)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        os.execv(sys.executable, [sys.executable, "main.py"])
    except BaseException as exc:
        os.write(err_w, f"{type(exc).__name__}: {exc}".encode())
    os._exit(127)
os.close(err_w)
err = b""
while chunk := os.read(err_r, 4096):
    err += chunk
_, status, usage = os.wait4(pid, 0)
cpu = usage.ru_utime + usage.ru_stime
if err:
    line = "error " + err.decode(errors="replace").replace("\n", " ")
elif os.WIFSIGNALED(status):
    line = f"signal {os.WTERMSIG(status)} {cpu:.3f}"
else:
    line = f"exit {os.waitstatus_to_exitcode(status)} {cpu:.3f}"
os.write(status_fd, line.encode() + b"\n")
"""
"""Source of the launcher, run as root (CAP_SETUID/CAP_SETGID only) as `python3 -I -S -c`."""

_STATUS_RE = re.compile(r"^(exit|signal) (-?\d+) ([\d.]+)$")


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
        match = _STATUS_RE.match(self.status.strip())
        if match is None:
            return None
        return match.group(1), int(match.group(2)), float(match.group(3))


def rlimit_args(*, cpu_s: float, memory_mb: int, file_size_mb: int, open_files: int,
                processes: int) -> list[str]:
    """The launcher's rlimit arguments: triples of (RLIMIT name, soft, hard).

    RLIMIT_CPU is whole seconds (the kernel's unit): soft = ceil(cpu_s) sends SIGXCPU, hard one
    second later SIGKILL. RLIMIT_AS = memory_mb MiB, RLIMIT_FSIZE = file_size_mb MiB,
    RLIMIT_NOFILE = open_files, RLIMIT_NPROC = processes (counted per uid: enforced because the
    program runs as its own unprivileged uid), RLIMIT_CORE = 0 (no core files).
    """
    cpu = max(1, math.ceil(cpu_s))
    limits = {"RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_AS": (memory_mb << 20,) * 2,
              "RLIMIT_FSIZE": (file_size_mb << 20,) * 2, "RLIMIT_NOFILE": (open_files,) * 2,
              "RLIMIT_NPROC": (processes,) * 2, "RLIMIT_CORE": (0, 0)}
    return [str(v) for name, (soft, hard) in limits.items() for v in (name, soft, hard)]


def _passwd(uid: int) -> bytes:
    return (f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
            f"sandbox:x:{uid}:{uid}:sandbox:{SANDBOX_DIR}:/usr/sbin/nologin\n"
            f"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n").encode()


def _group(uid: int) -> bytes:
    return f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n".encode()


@functools.lru_cache(maxsize=1)
def _root_binds() -> tuple[str, ...]:
    """/usr read-only, and /bin, /sbin, /lib* as the host has them (links into /usr or binds),
    and the /etc files python3 reads. Read once per process."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--perms", "0755", "--dir", "/etc"]
    etc = ["/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives", "/etc/nsswitch.conf"]
    etc += sorted(f"/etc/{n}" for n in os.listdir("/etc") if re.fullmatch(r"python3[.\d]*", n))
    for path in etc:
        args += ["--ro-bind-try", path, path]
    return tuple(args)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    _write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def bwrap_argv(bwrap: str, *, uid: int, source_fd: int, passwd_fd: int, group_fd: int,
               info_fd: int, status_fd: int, tmpfs_bytes: int, rlimits: list[str]) -> list[str]:
    """The full bubblewrap command line of one run (see the module docstring)."""
    tmpfs = lambda path, mode="1777": ["--size", str(tmpfs_bytes), "--perms", mode,  # noqa: E731
                                       "--tmpfs", path]
    return [
        bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session",
        "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
        "--info-fd", str(info_fd),
        *_root_binds(),
        "--ro-bind-data", str(passwd_fd), "/etc/passwd",
        "--ro-bind-data", str(group_fd), "/etc/group",
        "--proc", "/proc", "--dev", "/dev", *tmpfs("/dev/shm"),
        *tmpfs(SANDBOX_DIR), *tmpfs("/tmp"),
        "--perms", "0644", "--file", str(source_fd), f"{SANDBOX_DIR}/main.py",
        "--remount-ro", "/", "--chdir", SANDBOX_DIR,
        PYTHON, "-I", "-S", "-c", LAUNCHER, str(status_fd), str(uid), *rlimits,
    ]


PROGRAM_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SANDBOX_DIR, "TMPDIR": "/tmp",
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
               "PYTHONDONTWRITEBYTECODE": "1", "USER": "sandbox", "LOGNAME": "sandbox"}
"""The program's whole environment (nothing of the host's is passed)."""


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


def execute(bwrap: str, source: str, stdin: str, *, cpu_s: float, wall_s: float, memory_mb: int,
            file_size_mb: int, open_files: int, processes: int, output_bytes: int) -> RawRun:
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
        passwd_fd, group_fd = _memfd("passwd", _passwd(uid)), _memfd("group", _group(uid))
        info_r, info_w = os.pipe2(os.O_CLOEXEC)
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        fds += [source_fd, passwd_fd, group_fd, info_r, info_w, status_r, status_w]
        argv = bwrap_argv(bwrap, uid=uid, source_fd=source_fd, passwd_fd=passwd_fd,
                          group_fd=group_fd, info_fd=info_w, status_fd=status_w,
                          tmpfs_bytes=TMPFS_FILES_FACTOR * (file_size_mb << 20),
                          rlimits=rlimit_args(cpu_s=cpu_s, memory_mb=memory_mb,
                                              file_size_mb=file_size_mb, open_files=open_files,
                                              processes=processes))
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=PROGRAM_ENV, close_fds=True,
                                pass_fds=(source_fd, passwd_fd, group_fd, info_w, status_w),
                                start_new_session=True)
        for fd in (source_fd, passwd_fd, group_fd, info_w, status_w):
            os.close(fd)
            fds.remove(fd)
        try:
            return pump(proc, stdin.encode("utf-8", errors="surrogatepass"), info_r, status_r,
                        t0=t0, deadline=deadline, output_bytes=output_bytes)
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


def pump(proc: subprocess.Popen, stdin: bytes, info_r: int, status_r: int, *, t0: float,
         deadline: float, output_bytes: int) -> RawRun:
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
                        stdin_view = stdin_view[os.write(fd, stdin_view[:_CHUNK]):]
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
    return RawRun(status=small["status"].decode(errors="replace"), killed_for=killed_for,
                  stdout=bytes(out["stdout"]), stderr=bytes(out["stderr"]),
                  stdout_cut=cut["stdout"], stderr_cut=cut["stderr"], bwrap_code=code,
                  wall_s=time.monotonic() - t0)


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
