"""One Ray node: `ray start --block` in its own session, tried again until it is up or
`start_timeout_s` has passed, and stopped with every process it started.

Two deadlines of Ray 2.60 end a start on a loaded machine:

* "The current node timed out during startup": the process that starts the node (`ray start`,
  or `ray.init` in-process) waits for the raylet to register with the GCS: a loop of 30 s
  (a constant in `ray/_private/node.py`) around a lookup that itself retries for
  `RAY_raylet_start_wait_time_s` (RayConfig, 10 s by default). That setting is the knob: the
  node's environment gets start_timeout_s for it.
* The raylet waits a fixed 15 s for its Python dashboard agent to write its port files and
  aborts when they are late (raylet.out: "Check failed: ... Timed out waiting for file
  <session>/dashboard_agent_listen_port_<node>"). No setting changes it (explicit agent ports
  do not either). The agent needs ~2.5 s of CPU to import; at load 12-25
  on 2 cores it wrote its ports 15-25 s after it started, and 14 of 14 tries failed this way.
  The raylet needs only the port number, and `start_node` chose it (`--dashboard-agent-listen-
  port`): `lend_agent_port` writes that file for the raylet as soon as the raylet runs (Ray's own
  `persist_port`, the agent's writer), and the agent writes the same number when it is ready.
  Should the raylet still abort (another Ray, another file), the try is stopped at once (its
  whole session) and the node started again, clean, until start_timeout_s has passed.

Ray's startup deadlines that have a knob get max(Ray's default, start_timeout_s) in the node's
environment (`start_env`; a value already set in this process's environment wins):

    RAY_raylet_start_wait_time_s         the raylet registering with the GCS (10 s)
    RAY_gcs_server_port_wait_time_s      the GCS writing its port file (node.py, 30 s)
    RAY_agent_register_timeout_ms        the raylet's wait for the runtime-env agent (30 s)
    RAY_worker_register_timeout_seconds  a worker process (an actor) registering (60 s)

The node runs in its own session: under the kernel's autogroup scheduling (the default on
Linux) its daemons share the CPU fairly with other sessions' work, not process by process.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "START_TIMEOUT_S",
    "check_timeout",
    "start_env",
    "start_node",
    "stop_node",
    "raylet_failure",
]

START_TIMEOUT_S = 600.0
"""Default seconds one Ray node may take to start, all its tries together (generous: a try
takes 15-25 s on a quiet 2-core machine; at load 11-15 tries failed after 30-45 s each and the
4th came up, 163 s after the first began)."""

POLL_S = 0.5
STOP_GRACE_S = 15.0

# Ray's startup deadlines that have a knob: name -> (Ray's default, unit factor from seconds)
WORKER_NICENESS = "RAY_worker_niceness"  # Ray's raylet setting; its default is 15

_KNOBS = {
    "RAY_raylet_start_wait_time_s": (10, 1),
    "RAY_gcs_server_port_wait_time_s": (30, 1),
    "RAY_agent_register_timeout_ms": (30_000, 1000),
    "RAY_worker_register_timeout_seconds": (60, 1),
}


def _log(message: str) -> None:
    print(f"posttrain.launch.ray_cluster: {message}", file=sys.stderr, flush=True)


def check_timeout(name: str, value: Any) -> None:
    """Raise ValueError unless `value` is a finite number of seconds > 0 (not a bool)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name}={value!r}; must be a finite number of seconds > 0")


def auth_env(token: str) -> dict[str, str]:
    """The environment that makes Ray (daemons and driver) use token authentication."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def start_env(token: str, start_timeout_s: float) -> dict[str, str]:
    """Environment additions for a `ray start` of this job: the auth token, Ray's startup
    deadlines that have a knob set to max(Ray's default, start_timeout_s), and the workers'
    niceness at 0, each unless this process's environment sets it.

    Ray starts its workers at nice 15 by default, to keep them behind the driver. Here the
    workers (rollout workers, verifiers) are the job's compute: at nice 15 any process at the
    default nice 0 beside them takes nearly all the CPU (a rollout worker beside four busy
    loops on 2 cores got 12 s of CPU in 16 minutes).

    Example:
        >>> env = start_env("t0", 120)
        >>> env["RAY_gcs_server_port_wait_time_s"], env["RAY_agent_register_timeout_ms"]
        ('120', '120000')
        >>> start_env("t0", 5)["RAY_worker_register_timeout_seconds"]  # never below Ray's 60
        '60'
        >>> env["RAY_worker_niceness"]
        '0'
    """
    env = auth_env(token)
    for name, (default, unit) in _KNOBS.items():
        env[name] = os.environ.get(name) or str(max(default, math.ceil(start_timeout_s * unit)))
    env[WORKER_NICENESS] = os.environ.get(WORKER_NICENESS) or "0"
    return env


_FATAL = re.compile(r"^\[[^\]]* [CF] \d+ \d+\] \(raylet\) (.*)$", re.MULTILINE)


def raylet_failure(temp_dir: str | os.PathLike) -> str | None:
    r"""The last fatal line of the raylet of the newest session under `temp_dir` (what follows
    "Check failed:" when it says that, at most 300 characters), or None when it wrote none.

    Example:
        >>> import tempfile
        >>> logs = Path(tempfile.mkdtemp(), "session_latest", "logs")
        >>> logs.mkdir(parents=True)
        >>> _ = (logs / "raylet.out").write_text(
        ...     "[2026-12-06 07:27:10,786 I 11 11] (raylet) main.cc:1: fine\n"
        ...     "[2026-12-06 07:27:10,786 C 11 11] (raylet) node_manager.cc:3576:  A bug. "
        ...     "Check failed: s.has_value() Timed out waiting for file /tmp/x/port_1\n")
        >>> raylet_failure(logs.parent.parent)
        's.has_value() Timed out waiting for file /tmp/x/port_1'
    """
    with contextlib.suppress(OSError):
        log = Path(temp_dir, "session_latest", "logs", "raylet.out").read_text(errors="replace")
        fatal = _FATAL.findall(log)
        if fatal:
            return fatal[-1].split("Check failed:", 1)[-1].strip()[:300]
    return None


def start_node(
    args: list[str], *, token: str, temp_dir: str, cpus: int, start_timeout_s: float, what: str
) -> subprocess.Popen:
    """`ray start --block` with `args`, tried again until its node is up (its address is in
    `temp_dir/ray_current_cluster` then: `cluster_address`) or `start_timeout_s` has passed.

    Args:
        args: the node's own `ray start` arguments (["--head", "--port", ...] or
            ["--address", ...]).
        token: the job's Ray auth token.
        temp_dir: Ray's temp dir for this node (short: Ray's socket paths must stay < 108 bytes).
        cpus: CPUs the node offers.
        start_timeout_s: seconds for all tries together.
        what: the node, for messages ("head", "worker node on n2").

    Returns the running `ray start` process (its session holds the node's processes).

    A try fails when `ray start` exits or the raylet writes a fatal line; it is stopped (its
    whole session) and the next one starts while time is left.

    Raises:
        TimeoutError: the node was not up within start_timeout_s; names the setting, the number
            of tries and the last fatal line a raylet wrote, when one did (the last try may be
            cut short by the deadline before its raylet writes).
    """
    ready, latest = Path(temp_dir, _ADDRESS_FILE), Path(temp_dir, "session_latest")
    deadline, tries = time.monotonic() + start_timeout_s, 0
    said = None  # the last fatal line any try's raylet wrote (the last try may be cut short)
    while True:
        ready.unlink(missing_ok=True)
        latest.unlink(missing_ok=True)  # Ray links it to this try's session when it makes one
        tries += 1
        listen_port, lent = free_port(), [False]
        process = _ray_start(args, start_env(token, start_timeout_s), temp_dir, cpus, listen_port)

        def up() -> Any:  # called only by this iteration's wait_for
            lent[0] = lent[0] or lend_agent_port(process.pid, listen_port)  # noqa: B023
            return cluster_address(temp_dir) or raylet_failure(temp_dir)

        try:
            wait_for(up, process, deadline, "")
            if cluster_address(temp_dir):
                return process
            raise RuntimeError("the raylet aborted")
        except (RuntimeError, TimeoutError) as e:
            failure = raylet_failure(temp_dir)
            said = failure or said
            stop_node(process, what, grace_s=0.0)  # a failed try: nothing in it to keep
            if isinstance(e, RuntimeError) and time.monotonic() < deadline:
                _log(
                    f"`ray start` of the {what} failed (try {tries}; raylet: "
                    f"{failure or 'no fatal line'}); trying again"
                )
                continue
            last = f"the last fatal line a raylet wrote: {said}" if said else "no fatal line"
            raise TimeoutError(
                f"the Ray {what} was not up within start_timeout_s={start_timeout_s:g} s "
                f"({tries} {'try' if tries == 1 else 'tries'} of `ray start`; {last}); on a "
                "loaded machine pass a larger start_timeout_s (ray_cluster, ray_job)"
            ) from None
        except BaseException:
            stop_node(process, what)
            raise


_ADDRESS_FILE = "ray_current_cluster"  # the node writes its host:port there once it is up


def cluster_address(temp_dir: str) -> str:
    """The `host:port` a node started with `temp_dir` wrote once it was up, or "" while it has
    not. Ray opens the file before it writes the address, so an empty file is not up yet (a
    driver that read it then got `ray.init(address="")`: "Invalid address format")."""
    try:
        return Path(temp_dir, _ADDRESS_FILE).read_text().strip()
    except FileNotFoundError:
        return ""


def wait_for(
    condition: Callable[[], Any],
    process: subprocess.Popen | None,
    deadline: float,
    timeout_message: str | Callable[[], str],
) -> Any:
    """`condition()` once truthy; RuntimeError if `process` exits, TimeoutError past deadline."""
    while not (value := condition()):
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"`ray start` exited with status {process.returncode} before "
                "its node was up; its output is in this task's log"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(timeout_message() if callable(timeout_message) else timeout_message)
        time.sleep(POLL_S)
    return value


def lend_agent_port(sid: int, port: int) -> bool:
    """Write the dashboard agent's listen-port file that the raylet of session `sid` waits for
    (with Ray's own `persist_port`, which the agent itself uses), unless it exists. The port
    was chosen by `start_node` and given to the agent, which binds it and writes the same
    number once it has imported Ray; the raylet has it 15 s sooner than that on a loaded
    machine.

    Returns True when there is nothing (more) to do: written, present, or this Ray has no such
    file (then the retries must do); False while the raylet has not started yet.
    """
    try:
        # not in the stub of Ray's compiled core (ray/_raylet.pyi), present in the module
        from ray._raylet import (  # type: ignore[attr-defined]
            DASHBOARD_AGENT_LISTEN_PORT_NAME,
            persist_port,
        )
    except ImportError:
        return True
    raylet = next(
        (a for a in map(_cmdline, session_pids(sid)) if a and Path(a[0]).name == "raylet"), None
    )
    if raylet is None:
        return False
    flags = dict(a[2:].split("=", 1) for a in raylet if a.startswith("--") and "=" in a)
    session_dir, node_id = flags.get("session_dir"), flags.get("node_id")
    if not (session_dir and node_id):
        return True
    name = f"{DASHBOARD_AGENT_LISTEN_PORT_NAME}_{node_id}"
    try:
        if not any(f.name.startswith(name) for f in Path(session_dir).iterdir()):
            persist_port(session_dir, node_id, DASHBOARD_AGENT_LISTEN_PORT_NAME, port)
    except OSError:
        return False
    return True


def _cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return (
            Path("/proc", str(pid), "cmdline")
            .read_bytes()
            .decode(errors="replace")
            .split("\0")[:-1]
        )
    return []


def _ray_start(
    args: list[str], env: dict[str, str], temp_dir: str, cpus: int, listen_port: int
) -> subprocess.Popen:
    """`ray start --block`, own session, output to the task's log, the agent's listen port
    `listen_port`, its other ports from the OS."""
    os.makedirs(temp_dir, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        *args,
        "--num-cpus",
        str(cpus),
        "--temp-dir",
        temp_dir,
        "--block",
        "--disable-usage-stats",
        "--dashboard-agent-listen-port",
        str(listen_port),
        "--dashboard-agent-grpc-port",
        str(free_port()),
        "--metrics-export-port",
        str(free_port()),
        "--runtime-env-agent-port",
        str(free_port()),
    ]
    return subprocess.Popen(
        cmd,
        env={**os.environ, **env},
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        preexec_fn=_die_with_parent(),
    )


def _die_with_parent() -> Callable[[], None]:
    """A preexec_fn: SIGKILL to the child when its task dies (scancel, time limit: no `finally`
    runs); `ray start --block` gives its daemons the same death signal (SIGTERM took > 30 s)."""
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the task died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def stop_node(process: subprocess.Popen, what: str, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to `ray start` (up to `grace_s` to stop; 0: none), then SIGKILL to what is left
    of its session (Ray's daemons and workers)."""
    graceful = grace_s > 0
    if process.poll() is None and graceful:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            graceful = False
            _log(f"the Ray {what} did not stop within {grace_s:g} s of SIGTERM; killing")
    deadline = time.monotonic() + (5.0 if graceful else 0.0)  # workers leave after the raylet
    while (left := session_pids(process.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:  # `ray start` itself too: it leads the session
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 5.0  # SIGKILL is sent, not yet done: wait for the exits
    while session_pids(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def session_pids(sid: int) -> list[int]:
    """Live processes (not zombies) of session `sid`, from /proc (Linux)."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path("/proc", entry, "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == sid:  # state ppid pgrp sid
            pids.append(int(entry))
    return pids


def free_port() -> int:
    """A TCP port the OS has free now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def reread_ray_config() -> None:
    """Ray caches RAY_AUTH_MODE when imported and the auth token when first used; read both
    again after a change (a second cluster in the same process has another token), as Ray's
    own `authentication_token_setup` does (ray 2.60; elsewhere the env must do)."""
    with contextlib.suppress(ImportError, AttributeError):
        from ray._raylet import Config  # type: ignore[attr-defined]  # absent from the stub

        Config.initialize("")
    with contextlib.suppress(ImportError, AttributeError):
        from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

        AuthenticationTokenLoader.instance().reset_cache()
