"""The code sandbox against hostile programs: each ends as a typed outcome and leaves the host
unharmed (fork bomb, endless loop, memory bomb, escapes of the filesystem and the network, 100 MB
of output, killing its parent, a daemon that tries to outlive the run).

Every test needs a sandbox (root + bubblewrap: scripts/sandbox-up.sh) and skips with the reason
`sandbox_available()` gives when there is none. The host-side checks read the host's own /proc,
filesystem and sockets, never the sandbox's report alone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from _sandbox_helpers import host_processes_of, host_processes_with_argv
from _waits import LATE_S, wait_for

from posttrain.verifiers import sandbox_exec
from posttrain.verifiers.sandbox import ExecOutcome, SandboxLimits

CHECKOUT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# Hostile programs: a typed outcome each, the host unharmed


# A CPU second takes many wall seconds beside busy neighbours: the CPU-limit tests give the
# wall clock 600 s, so only the CPU limit can end the loop (the signal says which one did).
def test_infinite_loop_hits_the_cpu_limit(box):
    result = box.run("while True: pass", limits=SandboxLimits(cpu_s=1.0, wall_s=600.0))
    assert (result.outcome, result.signal) == (ExecOutcome.TIMEOUT, signal.SIGXCPU)
    assert 0.9 < result.wall_s < 600.0  # 1 s of CPU takes >= 1 s of wall


def test_ignoring_sigxcpu_still_ends_at_the_hard_cpu_limit(box):
    source = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
    result = box.run(source, limits=SandboxLimits(cpu_s=1.0, wall_s=600.0))
    assert (result.outcome, result.signal) == (ExecOutcome.TIMEOUT, signal.SIGKILL)
    assert 1.9 < result.wall_s < 600.0  # hard limit = soft + 1 s of CPU


def test_sleeping_past_the_wall_clock_is_a_timeout(box):
    t0 = time.monotonic()
    result = box.run("import time\ntime.sleep(600)", limits=SandboxLimits(wall_s=1.0))
    assert (result.outcome, result.exit_code, result.signal) == (ExecOutcome.TIMEOUT, None, 9)
    assert 1.0 <= result.wall_s < 1.0 + LATE_S and time.monotonic() - t0 < 1.0 + LATE_S


def test_memory_bomb(box):
    limits = SandboxLimits(memory_mb=128)
    grow = box.run(
        "chunks = []\nwhile True:\n    chunks.append(bytearray(10_000_000))", limits=limits
    )
    assert grow.outcome is ExecOutcome.MEMORY and grow.stderr.rstrip().endswith("MemoryError")
    assert box.run("x = bytearray(2**31)", limits=limits).outcome is ExecOutcome.MEMORY
    assert (
        box.run("x = bytearray(64 * 2**20)\nprint(len(x))", limits=limits).outcome is ExecOutcome.OK
    )


def test_process_limit_holds(box):
    """RLIMIT_NPROC = 8 counts the program itself: exactly 7 forks succeed (by hand: 8 - 1)."""
    source = (
        "import os, time\nn = 0\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5)\n"
        "        os._exit(0)\n    n += 1\nprint(n)"
    )
    result = box.run(source, limits=SandboxLimits(processes=8, wall_s=60.0))
    assert result.outcome is ExecOutcome.OK and result.stdout == "7\n"


def test_fork_bomb(box):
    source = (
        "import os, sys\nprint(os.getuid(), flush=True)\nwhile True:\n    try:\n"
        "        os.fork()\n    except OSError:\n        pass"
    )
    result = box.run(source, limits=SandboxLimits(wall_s=2.0, processes=16))
    assert result.outcome is ExecOutcome.TIMEOUT and 2.0 <= result.wall_s < 2.0 + LATE_S
    uid = int(result.stdout.split()[0])
    assert host_processes_of(uid) == []  # nothing of it left on the host


def test_daemonised_grandchild_does_not_outlive_the_run(box):
    # The grandchild double-forks, starts a session of its own and becomes `sleep 301.<pid>`
    # (keeping the sandbox's stdout open); the program itself exits 1.5 s later.
    argv = ["/usr/bin/sleep", f"301.{os.getpid()}"]  # unique to this test process
    source = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv({argv[0]!r}, {argv!r})\n    os._exit(0)\n"
        "time.sleep(1.5)\nprint('parent done')"
    )
    seen = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.extend(host_processes_with_argv(argv))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = box.run(source)
    finally:
        done.set()
        watcher.join()
    assert result.outcome is ExecOutcome.OK and result.stdout == "parent done\n"
    assert seen, "the grandchild never appeared on the host: the test saw nothing"
    assert result.wall_s < 1.5 + LATE_S  # did not wait for the 301 s sleep
    assert host_processes_with_argv(argv) == []  # and it is gone
    assert all(not Path(f"/proc/{pid}").exists() for pid in set(seen))


def test_a_caller_killed_mid_run_leaves_nothing_behind(box):
    """The process running the sandbox is SIGKILLed (a worker past its budget): the program and
    its own child go with it (bubblewrap's --die-with-parent, then the PID namespace)."""
    argv = ["/usr/bin/sleep", f"32.{os.getpid()}"]
    program = (
        f"import os\nif os.fork() == 0:\n    os.execv({argv[0]!r}, {argv!r})\n"
        f"os.execv({argv[0]!r}, {argv!r})"
    )
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from posttrain.verifiers.sandbox import Sandbox\n"
            "Sandbox().run(sys.stdin.read())",
        ],
        stdin=subprocess.PIPE,
        text=True,
    )
    caller.stdin.write(program)
    caller.stdin.close()
    wait_for(
        lambda: len(host_processes_with_argv(argv)) >= 2,
        what=f"the sandboxed program and its child ({' '.join(argv)}) to start",
    )
    assert len(host_processes_with_argv(argv)) == 2
    caller.kill()
    caller.wait()
    wait_for(
        lambda: not host_processes_with_argv(argv),
        what=f"the program and its child ({' '.join(argv)}) to end with their caller",
        detail=lambda: f"still running: {host_processes_with_argv(argv)}",
    )


def test_writing_outside_its_folder_fails(box):
    name = f"sandbox-escape-{os.getpid()}"
    targets = [
        "/usr/" + name,
        "/etc/" + name,
        "/" + name,
        "/etc/passwd",
        "/proc/sys/kernel/ns",
        f"{CHECKOUT}/{name}",
        "/root/" + name,
    ]
    source = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n        open(path, 'a').write('x')\n        print(path, 'WRITTEN')\n"
        "    except OSError as exc:\n        print(path, type(exc).__name__)\n"
        f"open('/sandbox/{name}', 'w').write('ok')\nopen('/tmp/{name}', 'w').write('ok')\n"
        "print('private ok')"
    )
    result = box.run(source)
    assert result.outcome is ExecOutcome.OK, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "private ok" and "WRITTEN" not in result.stdout
    assert len(lines) == len(targets) + 1
    for path in targets:  # the host's side of it
        if path != "/etc/passwd":
            assert not Path(path).exists(), path
    assert not Path("/tmp/" + name).exists() and not Path("/sandbox").exists()


def test_file_size_limit(box):
    result = box.run(
        "open('/sandbox/big', 'wb').write(b'x' * (3 * 2**20))", limits=SandboxLimits(file_size_mb=1)
    )
    assert result.outcome is ExecOutcome.FAILED and "File too large" in result.stderr


def test_checkout_and_homes_are_not_readable(box):
    paths = [
        "/work",
        str(CHECKOUT),
        __file__,
        "/root",
        "/root/.bashrc",
        "/home",
        "/run",
        "/var",
        sandbox_exec.SLOT_DIR,
        str(CHECKOUT / ".venv" / "bin" / "python"),
    ]
    source = (
        f"import os\nprint([os.path.exists(p) for p in {paths!r}])\nprint(sorted(os.listdir('/')))"
    )
    result = box.run(source)
    assert result.outcome is ExecOutcome.OK, result.stderr
    exists, top = result.stdout.splitlines()
    assert exists == str([False] * len(paths))
    assert top == str(
        sorted(["bin", "dev", "etc", "lib", "lib64", "proc", "sandbox", "sbin", "tmp", "usr"])
    )
    assert Path(__file__).exists()  # the host does see them


def test_no_network_not_even_the_hosts_loopback(box):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        listener.accept()[0].close()  # the listener really answers
    source = (
        "import socket\n"
        f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
        "    try:\n        socket.create_connection(addr, timeout=2)\n"
        "        print('CONNECTED')\n    except OSError as exc:\n"
        "        print(type(exc).__name__)\n"
        "try:\n    socket.getaddrinfo('example.com', 80)\n    print('RESOLVED')\n"
        "except OSError as exc:\n    print(type(exc).__name__)\n"
        "print([name for _, name in socket.if_nameindex()])"
    )
    try:
        result = box.run(source)
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing reached the listener
    finally:
        listener.close()
    assert result.outcome is ExecOutcome.OK, result.stderr
    assert result.stdout.splitlines() == ["ConnectionRefusedError", "OSError", "gaierror", "['lo']"]


def test_printing_100_mb_is_cut_with_bounded_host_memory(box):
    limits = SandboxLimits(output_bytes=1_000_000, wall_s=20.0)
    source = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)"
    tracemalloc.start()
    try:
        result = box.run(source, limits=limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.outcome is ExecOutcome.OUTPUT_LIMIT and result.stdout_truncated
    assert result.stdout == "x" * 1_000_000
    assert peak < 8_000_000  # 100 MB written, < 8 MB held
    flood = box.run("import sys\nsys.stderr.write('e' * 5_000_000)\nprint('x')", limits=limits)
    assert flood.outcome is ExecOutcome.OUTPUT_LIMIT and not flood.stdout_truncated
    assert len(flood.stderr) == 1_000_000


def test_killing_its_parent_and_the_host(box):
    source = (
        "import os, signal\nhost = int(input())\n"
        "for name, pid in [('parent', os.getppid()), ('init', 1), ('host', host)]:\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n        print(name, 'KILLED')\n"
        "    except OSError as exc:\n        print(name, type(exc).__name__)\n"
        "os.kill(-1, signal.SIGKILL)\nprint('still here')"
    )
    result = box.run(source, stdin=f"{os.getpid()}\n")
    assert result.outcome is ExecOutcome.OK, result.stderr
    assert result.stdout.splitlines() == [
        "parent PermissionError",
        "init PermissionError",
        "host ProcessLookupError",
        "still here",
    ]
    suicide = box.run("import os, signal\nos.killpg(0, signal.SIGKILL)")
    assert (suicide.outcome, suicide.signal) == (ExecOutcome.KILLED, signal.SIGKILL)
