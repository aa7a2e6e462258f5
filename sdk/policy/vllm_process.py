"""The vLLM server's process: its venv, its port, its process group under a watchdog, and how
it is stopped. `posttrain.policy.vllm_server.VLLMServer` is the handle built on these.

The server runs in a process group of its own whose leader is a small watchdog (`_WATCHDOG`, run
by the venv's python): it starts the server as its child and kills the whole group as soon as
the Python process that started it is gone, however it died (its parent pid changes). `stop_group`
kills the group from the outside: SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "DEFAULT_VENV",
    "VLLMServerError",
    "VLLMUnavailable",
    "VLLMRequestError",
    "vllm_venv",
    "vllm_unavailable_reason",
    "check_port",
    "server_env",
    "start_group",
    "group_alive",
    "stop_group",
    "log_tail",
    "shm_root",
]

DEFAULT_VENV = "/var/tmp/posttrain-vllm/venv"
STAMP_NAME = "posttrain-vllm.stamp"  # written last by scripts/vllm-up.sh

# Runs in the vLLM venv as the leader of the server's process group: starts the server as its
# child and kills the whole group as soon as the process that started it is gone (its parent
# pid changes when that process dies, however it dies).
_WATCHDOG = """
import os, signal, subprocess, sys, time
parent = int(sys.argv[1])
child = subprocess.Popen(sys.argv[2:])
while child.poll() is None:
    if os.getppid() != parent:
        os.killpg(0, signal.SIGKILL)
    time.sleep(0.5)
sys.exit(child.returncode)
"""


class VLLMServerError(RuntimeError):
    """The vLLM server could not start, died, or refused a request; the message says which."""


class VLLMUnavailable(VLLMServerError):
    """No complete vLLM venv: run scripts/vllm-up.sh."""


class VLLMRequestError(VLLMServerError):
    """One HTTP request to a vLLM server failed.

    Attributes:
        status: the HTTP status the server answered with (e.g. 400 for a request it refused), or
            None when no answer came (connection refused or cut, a timeout: the server may be
            dead).
    """

    def __init__(self, message: str, *, status: int | None) -> None:
        super().__init__(message)
        self.status = status


def vllm_venv(venv: str | os.PathLike | None = None) -> Path:
    """The vLLM venv: `venv`, else `$POSTTRAIN_VLLM_VENV`, else /var/tmp/posttrain-vllm/venv."""
    return Path(venv or os.environ.get("POSTTRAIN_VLLM_VENV") or DEFAULT_VENV)


def vllm_unavailable_reason(venv: str | os.PathLike | None = None) -> str | None:
    """Why the vLLM venv cannot be used (a sentence naming the fix), or None when it is complete
    (its python and the stamp scripts/vllm-up.sh writes last are there)."""
    path = vllm_venv(venv)
    if not (path / "bin" / "python").exists() or not (path / STAMP_NAME).exists():
        return f"no complete vLLM venv at {path}: run scripts/vllm-up.sh (~8 minutes)"
    return None


def check_port(host: str, port: int | None) -> int:
    """`port` if it is free on `host`, or a free port when `port` is None."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port or 0))
        except OSError as err:
            raise VLLMServerError(
                f"port={port} on {host} is taken ({err.strerror}); pass another port, or "
                "port=None to use a free one"
            ) from None
        return int(sock.getsockname()[1])


def server_env(python: Path, kv_cache_gib: int) -> dict[str, str]:
    """The server's environment: this one without PYTHONPATH/PYTHONHOME, in the venv of `python`,
    with the dev-mode routes (`VLLM_SERVER_DEV_MODE=1`: weight reload, prefix-cache reset),
    `kv_cache_gib` GiB of CPU KV cache, offline and without usage stats."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        VIRTUAL_ENV=str(python.parent.parent),
        PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}",
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


def start_group(argv: Sequence[str], *, env: Mapping[str, str], log_path: Path) -> subprocess.Popen:
    """Start `argv` (its argv[0] a python) under the watchdog, in a new process group, with
    stdout and stderr appended to `log_path`."""
    python, *rest = argv
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [python, "-c", _WATCHDOG, str(os.getpid()), python, *rest],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )


def group_alive(pgid: int) -> bool:
    """Whether any process other than a zombie is in process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_group(proc: subprocess.Popen, shm_dir: str | None, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after `grace_s`, remove `shm_dir`."""
    pgid = proc.pid
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_alive(pgid):
                break
            time.sleep(0.1)
        else:
            continue
        break
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    if shm_dir:
        shutil.rmtree(shm_dir, ignore_errors=True)


def log_tail(log_path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def shm_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
