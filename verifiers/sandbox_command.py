"""What runs in the sandbox: the bubblewrap command, the launcher inside it, its limits and files.

`posttrain.verifiers.sandbox_exec` runs one program (uid slot, the pump, the sweep); this module
says what it starts, all of it fixed before the program's process exists:

- `bwrap_argv` builds the bubblewrap command: new mount, PID, network, IPC, UTS (and cgroup)
  namespaces; only /usr (and the /bin, /lib* links into it) plus a few /etc files read-only;
  private tmpfs folders at /sandbox (the program's folder, its cwd and HOME), /tmp and /dev/shm
  (each at most `TMPFS_FILES_FACTOR` times `file_size_mb`); every capability dropped except
  CAP_SETUID and CAP_SETGID, which only the launcher uses. /etc/passwd and /etc/group
  (`passwd_file`, `group_file`) name only root, the slot's uid ("sandbox") and nobody
  (nogroup); the program's environment is `PROGRAM_ENV`, nothing of the host's.
- `LAUNCHER` (run by the system python3 as pid 2 of the sandbox) forks the program's process,
  which sets the rlimits (`rlimit_args`), drops to the slot uid/gid with no supplementary groups
  and execs `/usr/bin/python3 main.py`; the launcher stays root (the program cannot signal it),
  waits, and writes the exact end of the program (exit code or signal, CPU seconds) to a status
  pipe (`parse_status` reads the line): bubblewrap itself folds a signal into an exit code of
  128 + n.
"""

from __future__ import annotations

import functools
import math
import os
import re

PYTHON = "/usr/bin/python3"
"""The interpreter that runs programs (and the launcher) inside the sandbox: the system one, which
the unprivileged uid can read (a virtualenv under /root or the checkout is not bound)."""

SANDBOX_DIR = "/sandbox"
"""The program's private folder inside the sandbox (cwd and HOME; main.py is written there)."""

TMPFS_FILES_FACTOR = 4
"""Each private tmpfs (/sandbox, /tmp, /dev/shm) holds at most this many times `file_size_mb`."""

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


def parse_status(line: str) -> tuple[str, int, float] | None:
    """("exit" | "signal", number, CPU seconds) from the launcher's status line ("exit 0 0.012",
    "signal 24 1.004"), or None for any other line ("error ...", or "" when it wrote none)."""
    match = _STATUS_RE.match(line.strip())
    if match is None:
        return None
    return match.group(1), int(match.group(2)), float(match.group(3))


def rlimit_args(
    *, cpu_s: float, memory_mb: int, file_size_mb: int, open_files: int, processes: int
) -> list[str]:
    """The launcher's rlimit arguments: triples of (RLIMIT name, soft, hard).

    RLIMIT_CPU is whole seconds (the kernel's unit): soft = ceil(cpu_s) sends SIGXCPU, hard one
    second later SIGKILL. RLIMIT_AS = memory_mb MiB, RLIMIT_FSIZE = file_size_mb MiB,
    RLIMIT_NOFILE = open_files, RLIMIT_NPROC = processes (counted per uid: enforced because the
    program runs as its own unprivileged uid), RLIMIT_CORE = 0 (no core files).
    """
    cpu = max(1, math.ceil(cpu_s))
    limits = {
        "RLIMIT_CPU": (cpu, cpu + 1),
        "RLIMIT_AS": (memory_mb << 20,) * 2,
        "RLIMIT_FSIZE": (file_size_mb << 20,) * 2,
        "RLIMIT_NOFILE": (open_files,) * 2,
        "RLIMIT_NPROC": (processes,) * 2,
        "RLIMIT_CORE": (0, 0),
    }
    return [str(v) for name, (soft, hard) in limits.items() for v in (name, soft, hard)]


def passwd_file(uid: int) -> bytes:
    """/etc/passwd of the sandbox: root, the slot's `uid` as "sandbox" (HOME /sandbox), nobody."""
    return (
        f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"sandbox:x:{uid}:{uid}:sandbox:{SANDBOX_DIR}:/usr/sbin/nologin\n"
        f"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    ).encode()


def group_file(uid: int) -> bytes:
    """/etc/group of the sandbox: root, the slot's `uid` as "sandbox", nogroup."""
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


def bwrap_argv(
    bwrap: str,
    *,
    uid: int,
    source_fd: int,
    passwd_fd: int,
    group_fd: int,
    info_fd: int,
    status_fd: int,
    tmpfs_bytes: int,
    rlimits: list[str],
) -> list[str]:
    """The full bubblewrap command line of one run (see the module docstring)."""

    def tmpfs(path: str, mode: str = "1777") -> list[str]:
        return ["--size", str(tmpfs_bytes), "--perms", mode, "--tmpfs", path]

    return [
        *[bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"],
        *["--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session"],
        *["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"],
        *["--info-fd", str(info_fd)],
        *_root_binds(),
        *["--ro-bind-data", str(passwd_fd), "/etc/passwd"],
        *["--ro-bind-data", str(group_fd), "/etc/group"],
        *["--proc", "/proc", "--dev", "/dev", *tmpfs("/dev/shm")],
        *[*tmpfs(SANDBOX_DIR), *tmpfs("/tmp")],
        *["--perms", "0644", "--file", str(source_fd), f"{SANDBOX_DIR}/main.py"],
        *["--remount-ro", "/", "--chdir", SANDBOX_DIR],
        *[PYTHON, "-I", "-S", "-c", LAUNCHER, str(status_fd), str(uid), *rlimits],
    ]


PROGRAM_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": SANDBOX_DIR,
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "USER": "sandbox",
    "LOGNAME": "sandbox",
}
"""The program's whole environment (nothing of the host's is passed)."""
