"""How the Ray nodes of a Slurm job meet: what each task knows of the job, the port the head
listens on, the private file through which the worker nodes find the head, and the head's wait
until every node has joined. `posttrain.launch.ray_cluster` starts and stops the nodes.

Each task reads its place in the job from Slurm's environment (`_Job.from_env`: rank, local
rank, node, node index, restart count). The head's port is 61000 + job id mod 4000 or the next
free one of 64 (`default_port`): outside Linux's ephemeral ports 32768-60999 and submitit's
MASTER_PORT range 20000-60000. Once the head is up it writes its address and the job's Ray auth
token to `<submitit job folder>/ray-<job id>-<restart>.json` (0600, written atomically), which
every node sees; the first task of every other node reads it and starts a worker node, and
serves while the file exists and the head's port answers. The head then waits until one Ray
node per Slurm node is alive. docs/runbooks/ray.md ("On Slurm") has the why.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.launch.ray_node import wait_for

__all__ = ["default_port", "PORT_BASE", "PORT_SPAN"]

PORT_BASE, PORT_SPAN = 61000, 4000  # head ports: 61000-64999


def default_port(job_id: str | int) -> int:
    """The head port tried first for Slurm job `job_id`: 61000 + job id mod 4000.

    Example:
        >>> default_port(12345), default_port("4000")
        (61345, 61000)
    """
    return PORT_BASE + int(str(job_id).split("_")[0]) % PORT_SPAN


@dataclass(frozen=True)
class _Job:
    """The Slurm facts one task needs (from its environment)."""

    job_id: str
    restart: str
    rank: int
    local_rank: int
    num_nodes: int
    node: str
    node_index: int

    @classmethod
    def from_env(cls) -> _Job:
        env = os.environ
        nodes = (
            env.get("SLURM_STEP_NUM_NODES")
            or env.get("SLURM_NNODES")
            or env.get("SLURM_JOB_NUM_NODES")
            or "1"
        )
        return cls(
            job_id=env["SLURM_JOB_ID"],
            restart=env.get("SLURM_RESTART_COUNT", "0"),
            rank=int(env.get("SLURM_PROCID", "0")),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            num_nodes=int(nodes),
            node=env.get("SLURMD_NODENAME") or socket.gethostname(),
            node_index=int(env.get("SLURM_NODEID", "0")),
        )

    @property
    def temp_dir(self) -> str:
        return f"/tmp/ray-{self.job_id}-{self.node_index}"  # one per node: nodes may share a host

    def node_names(self) -> tuple[str, ...]:  # in order, by `scontrol show hostnames`
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return tuple(
                subprocess.run(
                    ["scontrol", "show", "hostnames", nodelist or self.node],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=60,
                ).stdout.split()
            )
        return (self.node,)  # scontrol failed: only this node's name is known

    def rendezvous(self) -> Path:  # in the submitit job folder (0700, seen by every node)
        from submitit import JobEnvironment

        folder = (
            JobEnvironment().paths.folder
            if os.environ.get("SUBMITIT_FOLDER")
            else os.environ.get("SLURM_SUBMIT_DIR") or os.getcwd()
        )
        return Path(folder, f"ray-{self.job_id}-{self.restart}.json")


def _await_head(rendezvous: Path, job_id: str, deadline: float) -> tuple[str, str]:
    """The head's address ("host:port") and the job's Ray auth token, once the head has written
    them to `rendezvous` (`_write_private`); TimeoutError at `deadline` (time.monotonic())."""
    info = wait_for(
        lambda: rendezvous.exists() and json.loads(rendezvous.read_text()),
        None,
        deadline,
        f"the Ray head (rank 0) of job {job_id} wrote no address to {rendezvous}; see rank 0's log",
    )
    return info["address"], info["token"]


def _alive(ray) -> int:
    return sum(1 for n in ray.nodes() if n.get("Alive"))


def _wait_nodes(
    ray, expected: int, process: subprocess.Popen, deadline: float, join_timeout_s: float
) -> int:
    wait_for(
        lambda: _alive(ray) >= expected,
        process,
        deadline,
        lambda: (
            f"only {_alive(ray)} of {expected} Ray nodes joined the head within "
            f"join_timeout_s={join_timeout_s:g} s: the first task of every node starts a worker "
            "node, so check each task's log (run.logs(stream='stderr', task=k)) for `ray start` "
            "errors, or raise join_timeout_s on a loaded cluster"
        ),
    )
    return _alive(ray)


def _pick_port(job: _Job, port: int | None) -> int:
    if port is not None and not _bindable(port):
        raise RuntimeError(
            f"port={port} is in use on {job.node}: pass another port, or "
            "port=None to take a free one derived from the job id"
        )
    first = default_port(job.job_id)
    tried = (PORT_BASE + (first - PORT_BASE + k) % PORT_SPAN for k in range(64))
    found = port or next((p for p in tried if _bindable(p)), None)
    if found is None:
        raise RuntimeError(f"no free port among 64 tried from {first} on {job.node}; pass port=")
    return found


def _bindable(port: int) -> bool:
    with socket.socket() as s, contextlib.suppress(OSError):
        s.bind(("", port))
        return True
    return False


def _port_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
        return True
    return False


def _write_private(path: Path, obj: dict[str, Any]) -> None:
    """Write JSON readable by this user only, atomically (readers never see half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)
