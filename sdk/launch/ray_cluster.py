"""A Ray cluster inside a Slurm allocation, started and stopped by the job itself.

Every task of the job enters `ray_cluster()` (`ray_job(fn)` does it for `launch`): rank 0
starts the Ray head on the allocation's first node and is the driver; the first task of every
other node starts a Ray worker node; the driver waits for all of them, runs the body, and on
leaving it (also on an exception) stops the worker nodes, then the head. Outside Slurm (no
SLURM_JOB_ID) it starts one head node on this host for this process and connects to it: the
same notebook code runs.

Every node is one `ray start --block` in its own session, tried again until it is up or
`start_timeout_s` has passed (`posttrain.launch.ray_node`: Ray 2.60's fixed startup deadlines
fail on a loaded machine), stopped with its whole session, never with `ray stop` (it stops every
Ray on the host). Slurm (`posttrain.launch.ray_rendezvous`: how the nodes meet): head port
61000 + job id mod 4000 (or the next free one); the head's address and the job's Ray auth token
go to `<submitit job folder>/ray-<job id>-<restart>.json` (0600) for the worker nodes; Ray's
temp dir is `/tmp/ray-<job id>-<node index>`. Outside Slurm: a free port, temp dir
`/tmp/ray-p<pid>`, a fresh token. docs/runbooks/ray.md ("On Slurm", "Starting Ray on a loaded
machine") has the why.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from posttrain.core.checks import check_int
from posttrain.launch.job import _resolvable
from posttrain.launch.ray_node import (
    START_TIMEOUT_S,
    STOP_GRACE_S,
    _log,
    auth_env,
    check_timeout,
    cluster_address,
    free_port,
    reread_ray_config,
    start_node,
    stop_node,
    wait_for,
)
from posttrain.launch.ray_rendezvous import (
    _alive,
    _await_head,
    _bindable,
    _Job,
    _pick_port,
    _port_open,
    _wait_nodes,
    _write_private,
    default_port,
)

__all__ = [
    "RayCluster",
    "ray_cluster",
    "ray_job",
    "current_cluster",
    "default_port",
    "START_TIMEOUT_S",
]

_CURRENT: RayCluster | None = None


@dataclass(frozen=True)
class RayCluster:
    """What `ray_cluster` started, as seen by one task.

    Attributes:
        address: "host:port" of the head (None on idle tasks).
        nodes: the job's node names (this host's in-process; () on idle tasks).
        is_driver: True on the task connected to Ray (rank 0; always True outside Slurm).
        role: "head" (rank 0), "worker" (first task of another node), "idle" or "local"
            (outside Slurm).
        start_s: seconds from entering `ray_cluster` until every node had joined (driver).
        temp_dir: Ray's temp dir on this node.
    """

    address: str | None
    nodes: tuple[str, ...]
    is_driver: bool
    role: str
    start_s: float
    temp_dir: str

    @property
    def num_nodes(self) -> int:
        """Ray nodes of the cluster (= nodes of the job)."""
        return len(self.nodes)


def current_cluster() -> RayCluster | None:
    """The `RayCluster` of the `ray_cluster` block this process is in, else None."""
    return _CURRENT


@contextlib.contextmanager
def ray_cluster(
    num_cpus_per_node: int | None = None,
    port: int | None = None,
    join_timeout_s: float = 180.0,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Iterator[RayCluster]:
    """Start Ray for this job (or in this process outside Slurm), yield it, stop it on exit.

    Inside a Slurm job enter it on every task. Rank 0 starts the head, connects
    (`ray.init(address=...)`) and yields once every node has joined; the first task of each
    other node starts a worker node, yields at once with `is_driver` False and on leaving the
    block serves its node until the driver is done. Guard the work with `if cluster.is_driver:`
    (`ray_job` does). Outside Slurm: a head node on this host (no dashboard) that this
    process connects to; `ray.shutdown()` and the node's end when the block ends.

    Args:
        num_cpus_per_node: CPUs each Ray node offers (int >= 1). None: Slurm's
            SLURM_CPUS_ON_NODE inside a job, this process's usable CPUs outside.
        port: the head's port (1024-65535). None: `default_port(job id)`, or the next free
            port above it (outside Slurm: a free port); a port given here that is taken is an
            error.
        join_timeout_s: seconds (finite, > 0) the driver waits, once its head is up, for
            every other node to join; worker nodes start then, so it includes their start.
        start_timeout_s: seconds (finite, > 0) one node may take to start, all its tries of
            `ray start` together (`posttrain.launch.ray_node`); a worker node waits for the
            head's address up to start_timeout_s + join_timeout_s.

    Raises:
        ValueError: num_cpus_per_node < 1, a port outside 1024-65535, or a join_timeout_s or
            start_timeout_s that is not a finite number > 0 (checked before anything starts).
        ImportError: Ray is not installed.
        RuntimeError: Ray already initialised here (outside Slurm), or a nested `ray_cluster`;
            the port given is taken.
        TimeoutError: a node was not up within start_timeout_s (names it, the tries and the
            raylet's last fatal line); not every node joined within join_timeout_s (says how
            many of how many did); on a worker node, the head's address never appeared.

    Example (as the function of `launch(fn, executor="slurm", nodes=2)`; outside Slurm it is
    one node on this host, ~15-25 s to start on a quiet 2-core machine):
        >>> def fn():
        ...     with ray_cluster(num_cpus_per_node=4) as cluster:
        ...         if cluster.is_driver:
        ...             return ray.cluster_resources()["CPU"]
        >>> launch(fn, executor="slurm", nodes=2).results()  # doctest: +SKIP
        [8.0, None]
        >>> ray_cluster(num_cpus_per_node=0).__enter__()
        Traceback (most recent call last):
        ...
        ValueError: num_cpus_per_node=0; must be an integer >= 1 or None
    """
    global _CURRENT
    _check_args(num_cpus_per_node, port, join_timeout_s, start_timeout_s)
    _import_ray()
    if _CURRENT is not None:
        raise RuntimeError("ray_cluster() is already active in this process; nest no second one")
    start = time.monotonic()
    manager = (
        _in_slurm(num_cpus_per_node, port, join_timeout_s, start_timeout_s, start)
        if os.environ.get("SLURM_JOB_ID")
        else _local(num_cpus_per_node, port, start_timeout_s, start)
    )
    with manager as cluster:
        _CURRENT = cluster
        try:
            yield cluster
        finally:
            _CURRENT = None


def ray_job(
    fn: Callable[..., Any],
    *,
    num_cpus_per_node: int | None = None,
    port: int | None = None,
    join_timeout_s: float = 180.0,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Callable[..., Any]:
    """`fn` wrapped to run inside `ray_cluster(...)`: on the driver it returns `fn(*args)`, on the
    other tasks it serves its Ray node until the driver is done and returns None. For `launch`.

    Args:
        fn: what the driver runs with Ray connected; it must pickle (see `launch`).
        num_cpus_per_node, port, join_timeout_s, start_timeout_s: as in `ray_cluster`
            (checked here, at once).

    Returns a picklable callable with fn's name (`launch` names the job after it).
    Raises TypeError if fn is not callable, ValueError as `ray_cluster`.

    Example:
        >>> job = ray_job(len)
        >>> job.__name__, job.options["join_timeout_s"]  # launch(job, executor="slurm", ...)
        ('len', 180.0)
    """
    if not callable(fn):
        raise TypeError(f"fn={fn!r} is not callable; pass the function to run with Ray")
    _check_args(num_cpus_per_node, port, join_timeout_s, start_timeout_s)
    return _RayJob(
        fn,
        dict(
            num_cpus_per_node=num_cpus_per_node,
            port=port,
            join_timeout_s=join_timeout_s,
            start_timeout_s=start_timeout_s,
        ),
    )


class _RayJob:
    """What `ray_job` returns: `fn` run by the driver inside `ray_cluster(**options)`."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]) -> None:
        self.fn, self.options = fn, options
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with ray_cluster(**self.options) as cluster:
            if cluster.is_driver:
                return self.fn(*args, **kwargs)
        return None


def _check_args(
    num_cpus_per_node: Any, port: Any, join_timeout_s: Any, start_timeout_s: Any
) -> None:
    check_int("num_cpus_per_node", num_cpus_per_node, minimum=1, optional=True)
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535
    ):
        raise ValueError(
            f"port={port!r}; must be an integer in 1024-65535 (a port that needs no "
            "root) or None to derive one from the Slurm job id (a free one "
            "outside Slurm)"
        )
    check_timeout("join_timeout_s", join_timeout_s)
    check_timeout("start_timeout_s", start_timeout_s)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(
            f"ray_cluster needs Ray, not installed for {sys.executable}: pip "
            "install 'ray[default]' (in every node's environment)"
        ) from None
    return ray


# No dashboard, no autoscaler monitor (the cluster is as large as it was started): two Python
# processes fewer importing Ray beside the raylet's dashboard agent in its fixed 15 s window.
_HEAD_ARGS = ["--head", "--include-dashboard", "false", "--no-monitor"]


@contextlib.contextmanager
def _local(
    num_cpus: int | None, port: int | None, start_timeout_s: float, start: float
) -> Iterator[RayCluster]:
    """One head node on this host for this process (its own session and token), connected."""
    ray = _import_ray()
    if ray.is_initialized():
        raise RuntimeError(
            "Ray is already initialised in this process: call ray.shutdown() "
            "first, or use that Ray without ray_cluster()"
        )
    if port is not None and not _bindable(port):
        raise RuntimeError(
            f"port={port} is in use on this host: pass another port, or "
            "port=None to take a free one"
        )
    token, temp_dir = secrets.token_hex(32), f"/tmp/ray-p{os.getpid()}"
    process = start_node(
        [
            *_HEAD_ARGS,
            "--port",
            str(port or free_port()),
            "--dashboard-port",
            str(free_port()),
            "--ray-client-server-port",
            str(free_port()),
        ],
        token=token,
        temp_dir=temp_dir,
        cpus=num_cpus or len(os.sched_getaffinity(0)),
        start_timeout_s=start_timeout_s,
        what="head on this host",
    )
    try:
        address = cluster_address(temp_dir)  # host:port
        with _connected(ray, address, token):
            yield RayCluster(
                address=address,
                nodes=(socket.gethostname(),),
                is_driver=True,
                role="local",
                start_s=time.monotonic() - start,
                temp_dir=temp_dir,
            )
    finally:
        stop_node(process, "head on this host")


@contextlib.contextmanager
def _connected(ray, address: str, token: str, on_leave: Callable[[], Any] = lambda: None):
    """This process as the driver of the cluster at `address` (token auth in its environment
    while connected; the environment as it was afterwards). `on_leave()` runs while still
    connected, before `ray.shutdown()`."""
    saved = {k: os.environ.get(k) for k in auth_env(token)}
    connected = False
    try:
        os.environ.update(auth_env(token))
        reread_ray_config()
        ray.init(address=address)
        connected = True
        yield
    finally:
        if connected:
            with contextlib.suppress(Exception):  # teardown goes on whatever the GCS says
                on_leave()
            ray.shutdown()
        os.environ.update({k: v for k, v in saved.items() if v is not None})  # as it was
        for key in [k for k, v in saved.items() if v is None]:
            os.environ.pop(key, None)
        reread_ray_config()


@contextlib.contextmanager
def _in_slurm(
    num_cpus: int | None,
    port: int | None,
    join_timeout_s: float,
    start_timeout_s: float,
    start: float,
) -> Iterator[RayCluster]:
    job = _Job.from_env()
    cpus = num_cpus or int(os.environ.get("SLURM_CPUS_ON_NODE") or len(os.sched_getaffinity(0)))
    if job.rank == 0:
        with _head(job, cpus, port, join_timeout_s, start_timeout_s, start) as cluster:
            yield cluster
    elif job.local_rank == 0:
        with _worker(
            job, cpus, start + start_timeout_s + join_timeout_s, start_timeout_s, start
        ) as cluster:
            yield cluster
    else:
        yield RayCluster(
            address=None, nodes=(), is_driver=False, role="idle", start_s=0.0, temp_dir=job.temp_dir
        )


@contextlib.contextmanager
def _head(
    job: _Job,
    cpus: int,
    port: int | None,
    join_timeout_s: float,
    start_timeout_s: float,
    start: float,
) -> Iterator[RayCluster]:
    ray = _import_ray()
    host, port, token = _resolvable(job.node), _pick_port(job, port), secrets.token_hex(32)
    address, rendezvous = f"{host}:{port}", job.rendezvous()
    _log(f"job {job.job_id}: starting the Ray head at {address} for {job.num_nodes} node(s)")
    process = start_node(
        [
            *_HEAD_ARGS,
            "--port",
            str(port),
            "--dashboard-port",
            str(free_port()),
            "--ray-client-server-port",
            str(free_port()),
        ],
        token=token,
        temp_dir=job.temp_dir,
        cpus=cpus,
        start_timeout_s=start_timeout_s,
        what="head",
    )
    try:
        _write_private(rendezvous, {"address": address, "token": token})  # workers start now

        def leave() -> None:
            rendezvous.unlink(missing_ok=True)  # the workers stop first: their cue
            wait_for(lambda: _alive(ray) <= 1, None, time.monotonic() + STOP_GRACE_S, "")

        with _connected(ray, address, token, on_leave=leave):
            joined = _wait_nodes(
                ray, job.num_nodes, process, time.monotonic() + join_timeout_s, join_timeout_s
            )
            elapsed = time.monotonic() - start
            _log(
                f"job {job.job_id}: Ray cluster of {joined} node(s) up at {address} after "
                f"{elapsed:.1f} s"
            )
            yield RayCluster(
                address=address,
                nodes=job.node_names(),
                is_driver=True,
                role="head",
                start_s=elapsed,
                temp_dir=job.temp_dir,
            )
    finally:
        rendezvous.unlink(missing_ok=True)
        stop_node(process, "head")


@contextlib.contextmanager
def _worker(
    job: _Job, cpus: int, deadline: float, start_timeout_s: float, start: float
) -> Iterator[RayCluster]:
    rendezvous = job.rendezvous()
    address, token = _await_head(rendezvous, job.job_id, deadline)
    host, port = address.rsplit(":", 1)[0], int(address.rsplit(":", 1)[1])
    _log(f"job {job.job_id}: starting a Ray worker node on {job.node}, joining {address}")
    process = start_node(
        ["--address", address],
        token=token,
        temp_dir=job.temp_dir,
        cpus=cpus,
        start_timeout_s=start_timeout_s,
        what=f"worker node on {job.node}",
    )
    try:
        yield RayCluster(
            address=address,
            nodes=(job.node,),
            is_driver=False,
            role="worker",
            start_s=time.monotonic() - start,
            temp_dir=job.temp_dir,
        )
        # serve until the driver is done (file gone, or 3 missed answers) or this node exits
        misses = 0
        while process.poll() is None and misses < 3 and rendezvous.exists():
            misses = 0 if _port_open(host, port) else misses + 1
            time.sleep(1.0)
        if process.poll() is not None:
            _log(
                f"job {job.job_id}: the Ray worker node on {job.node} exited (status "
                f"{process.returncode}) before the driver was done"
            )
    finally:
        stop_node(process, f"worker node on {job.node}")
