"""A Ray node's start (`posttrain.launch.ray_node.start_node`): `ray start` tried again until its
node is up or `start_timeout_s` has passed, each failed try stopped with its whole session, the
timeout naming what the raylets said; the agent port the raylet waits for; the startup deadlines
Ray reads from the environment. `ray start` is replaced by small shell scripts (`_fake_ray_starts`)
that do what a try that comes up, exits or hangs with an aborted raylet does, so every order is
forced; the real cluster is tests/launch/test_ray_cluster.py's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from _waits import WAIT_S

import posttrain.launch.ray_node as rn

FATAL = (
    "[2026-12-06 07:27:10,786 C 11 11] (raylet) node_manager.cc:3588:  An unexpected system "
    "state has occurred. Check failed: s.has_value() Timed out waiting for file "
    "/tmp/x/dashboard_agent_listen_port_abc"
)
UP = "echo 127.0.0.1:6379 > ray_current_cluster; exec sleep 60"  # what a node that came up does
EXITS = "exit 1"  # `ray start` failing by itself
HANGS = (
    "mkdir -p s/logs && ln -sfn s session_latest && "  # the raylet aborted, `ray start`
    f'printf "%s\\n" "{FATAL}" > s/logs/raylet.out; exec sleep 60'
)  # still waits


def _fake_ray_starts(monkeypatch, scripts):
    """Make `ray start` the given shell scripts, one per try (run in the node's temp dir, in a
    session of their own); returns the list of (process, env) each try got."""
    tries = []

    def fake(args, env, temp_dir, cpus, listen_port):
        os.makedirs(temp_dir, exist_ok=True)
        process = subprocess.Popen(
            ["sh", "-c", scripts[len(tries)]], cwd=temp_dir, start_new_session=True
        )
        tries.append((process, env))
        return process

    monkeypatch.setattr(rn, "_ray_start", fake)
    monkeypatch.setattr(rn, "POLL_S", 0.05)
    # no raylet in a fake's session to lend a port to (and its first look imports Ray, ~4 s,
    # which hid how soon a try is taken as up)
    monkeypatch.setattr(rn, "lend_agent_port", lambda pid, port: False)
    return tries


def test_a_node_start_is_tried_again_until_it_is_up(monkeypatch, tmp_path):
    """Three failed tries (more than the 3 tries a start used to get): `ray start` exiting,
    a raylet that aborted while `ray start` hangs on (stopped at once, not waited out), and
    another exit; the 4th comes up and is returned running. Every try got the job's token."""
    tries = _fake_ray_starts(monkeypatch, [EXITS, HANGS, EXITS, UP])
    process = rn.start_node(
        ["--head"], token="t0", temp_dir=str(tmp_path), cpus=1, start_timeout_s=120, what="head"
    )
    try:
        assert len(tries) == 4 and tries[-1][0] is process and process.poll() is None
        assert [p.returncode for p, _ in tries[:3]] == [1, -signal.SIGKILL, 1]
        assert rn.session_pids(tries[1][0].pid) == []  # the hung try's session is gone
        assert all(env["RAY_AUTH_TOKEN"] == "t0" for _, env in tries)
    finally:
        rn.stop_node(process, "head", grace_s=0.0)


def test_a_node_is_up_only_once_its_address_is_written(monkeypatch, tmp_path):
    """Ray opens `ray_current_cluster` before it writes the address: a node whose file is still
    empty is not up (start_node returned then, and the driver's `ray.init(address="")` failed
    with "Invalid address format")."""
    opened_first = ": > ray_current_cluster; sleep 1; " + UP
    _fake_ray_starts(monkeypatch, [opened_first])
    process = rn.start_node(
        ["--head"], token="t0", temp_dir=str(tmp_path), cpus=1, start_timeout_s=120, what="head"
    )
    try:
        assert (tmp_path / "ray_current_cluster").read_text() == "127.0.0.1:6379\n"
    finally:
        rn.stop_node(process, "head", grace_s=0.0)
    assert rn.cluster_address(str(tmp_path)) == "127.0.0.1:6379"
    (tmp_path / "ray_current_cluster").write_text("")
    assert rn.cluster_address(str(tmp_path)) == rn.cluster_address(str(tmp_path / "no")) == ""


def test_the_timeout_names_an_earlier_tries_fatal_line_when_the_last_try_wrote_none(
    monkeypatch, tmp_path
):
    """The try the deadline cuts short may not have written yet: the error names the last
    fatal line any try's raylet wrote (it said "wrote no fatal line" when a loaded machine
    stretched the last try past the deadline)."""
    silent = "mkdir -p s2/logs && ln -sfn s2 session_latest && exec sleep 60"
    _fake_ray_starts(monkeypatch, [HANGS, silent])
    with pytest.raises(
        TimeoutError,
        match=r"\(2 tries of `ray start`; the last fatal line a raylet "
        r"wrote: s.has_value\(\) Timed out waiting for file",
    ):
        rn.start_node(
            ["--head"], token="t0", temp_dir=str(tmp_path), cpus=1, start_timeout_s=3, what="head"
        )


def test_a_node_not_up_within_start_timeout_s_is_an_error_naming_it(monkeypatch, tmp_path):
    tries = _fake_ray_starts(monkeypatch, [HANGS] * 100)
    start = time.monotonic()
    with pytest.raises(
        TimeoutError,
        match=(
            r"the Ray head was not up within start_timeout_s=1.5 s \(\d+ tries of `ray start`; "
            r"the last fatal line a raylet wrote: s.has_value\(\) Timed out waiting for file "
            r"/tmp/x/dashboard_agent_listen_port_abc\); on a loaded machine pass a larger "
            r"start_timeout_s"
        ),
    ):
        rn.start_node(
            ["--head"], token="t0", temp_dir=str(tmp_path), cpus=1, start_timeout_s=1.5, what="head"
        )
    # gave up soon after the deadline (how many tries fit in 1.5 s depends on the machine's load;
    # retrying is test_a_node_start_is_tried_again_until_it_is_up's)
    assert tries and time.monotonic() - start < WAIT_S
    assert all(rn.session_pids(p.pid) == [] for p, _ in tries)  # nothing left running


def test_the_raylet_gets_the_agent_port_it_waits_for(tmp_path):
    """`lend_agent_port` finds the raylet of a node's session by its command line and writes the
    dashboard agent's listen-port file it waits for, with Ray's own writer (the agent's), so
    Ray's reader parses it; an existing file (the agent was first) is left as it is."""
    session = tmp_path / "session_1"
    session.mkdir()
    fake_raylet = subprocess.Popen(  # argv[0] ".../raylet", as Ray starts it; runs a sleep
        [
            str(tmp_path / "raylet"),
            "-c",
            "import time; time.sleep(60)",
            f"--session_dir={session}",
            f"--node_id={'ab' * 28}",
        ],
        executable=sys.executable,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not rn.lend_agent_port(fake_raylet.pid, 43210):
            assert time.monotonic() < deadline, "the fake raylet never showed in its session"
            time.sleep(0.05)
        (written,) = session.glob(f"dashboard_agent_listen_port_{'ab' * 28}*")
        assert "43210" in written.read_text()
        written.write_text("5")  # as if the agent had been first
        assert rn.lend_agent_port(fake_raylet.pid, 43210)
        assert written.read_text() == "5"  # left as it was
    finally:
        rn.stop_node(fake_raylet, "fake raylet", grace_s=0.0)
    assert rn.lend_agent_port(os.getpid(), 1) is False  # no raylet in this session (yet)


def test_start_env_gives_rays_startup_deadlines_the_start_timeout(monkeypatch):
    """Each of Ray's startup deadlines with a knob gets max(Ray's default, start_timeout_s); one
    set in the environment already is kept."""
    for name in [*rn._KNOBS, "RAY_worker_niceness"]:
        monkeypatch.delenv(name, raising=False)
    env = rn.start_env("t0", 200.5)
    assert env == {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": "t0",
        "RAY_raylet_start_wait_time_s": "201",
        "RAY_gcs_server_port_wait_time_s": "201",
        "RAY_agent_register_timeout_ms": "200500",
        "RAY_worker_register_timeout_seconds": "201",
        "RAY_worker_niceness": "0",
    }
    small = rn.start_env("t0", 1)
    assert (
        small["RAY_raylet_start_wait_time_s"],
        small["RAY_gcs_server_port_wait_time_s"],
        small["RAY_agent_register_timeout_ms"],
        small["RAY_worker_register_timeout_seconds"],
    ) == ("10", "30", "30000", "60")
    monkeypatch.setenv("RAY_raylet_start_wait_time_s", "900")
    assert rn.start_env("t0", 200)["RAY_raylet_start_wait_time_s"] == "900"
    monkeypatch.setenv("RAY_worker_niceness", "5")
    assert rn.start_env("t0", 200)["RAY_worker_niceness"] == "5"
