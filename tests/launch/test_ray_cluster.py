"""posttrain.launch.ray_cluster: bad input is refused before anything starts (a node's start
and its retries are tests/launch/test_ray_node.py's); outside Slurm it is one head node on this
host that the process connects to; on the real local Slurm cluster (scripts/slurm-up.sh, fixture
`slurm_cluster`, skipped when it is not up) a job submitted with `launch(ray_job(fn), nodes=2)`
runs a Ray head on n1 and a worker node on n2, its remote tasks run on both, two
AsyncRLTrainer steps run with one rollout actor on each node, and no process of the job is left
once it has ended.

The test outside Slurm and the Slurm job do not overlap: on the loaded 2-core machine three Ray
nodes starting at once made the in-process raylet miss Ray's fixed 30 s registration deadline.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

import posttrain.launch.ray_cluster as rc
import posttrain.launch.ray_node as rn
from posttrain.launch import RayCluster, Run, launch, ray_job
from posttrain.launch.ray_cluster import current_cluster, default_port, ray_cluster

# As in a notebook: the job cannot import this test module, so its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

DEADLINE_S = 240.0  # for the Slurm job to end; fails the test, never skips it


def where(_: int) -> dict:
    """A remote task's report: its process, host and Slurm node (inherited by Ray's workers
    from the task that started their Ray node)."""
    import ray

    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
        "ray_node": ray.get_runtime_context().get_node_id(),
    }


def report_nodes(cfg: dict) -> dict:
    """The job's function (run by the driver inside ray_cluster): one task pinned to every Ray
    node, plus a few unpinned ones."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=1)(where)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    refs = [
        remote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(i)
        for i, n in enumerate(nodes)
    ]
    pinned = ray.get(refs)
    rl = _async_rl_round() if cfg.get("async_rl") else None
    cluster = current_cluster()
    return {
        "driver_pid": os.getpid(),
        "driver_node": os.environ.get("SLURMD_NODENAME"),
        "job_id": os.environ["SLURM_JOB_ID"],
        "num_ray_nodes": len(nodes),
        "cpus": ray.cluster_resources().get("CPU"),
        "pinned": pinned,
        "rl": rl,
        "ray_node_ids": sorted(n["NodeID"] for n in nodes),
        "cluster": cluster,
        "echo": cfg["echo"],
    }


def _async_rl_round() -> dict:
    """Two steps of AsyncRLTrainer (tiny-1m, GRPO, one-step-off) with 2 rollout actors of
    2 CPUs each: on a cluster of 2 nodes x 2 CPUs that is one actor on each node."""
    import torch

    from posttrain.envs import chain_sum_task
    from posttrain.policy import Policy
    from posttrain.rl import RLAlgorithm, RLTrainer
    from posttrain.rl.async_rl import AsyncRLTrainer

    start = time.monotonic()
    torch.set_num_threads(1)
    policy = Policy.from_spec("tiny-1m", seed=0)
    trainer = RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=1e-2),
        task=chain_sum_task(size=16, held_out_size=2),
        algo=RLAlgorithm.grpo(group_size=2, kl_coef=0.0),
        prompts_per_step=2,
        max_new_tokens=4,
        progress=False,
        seed=3,
    )
    runner = AsyncRLTrainer(
        trainer, num_workers=2, max_staleness=1, worker_num_cpus=2, num_threads=1
    )
    try:
        rows = runner.fit(2)
    finally:
        runner.close()
    return {
        "staleness": [r["staleness"] for r in rows],
        "policy_version": [r["policy_version"] for r in rows],
        "step_count": trainer.step_count,
        "seconds": time.monotonic() - start,
    }


def job_processes(job_id: str) -> list[str]:
    """Live processes whose environment says SLURM_JOB_ID=job_id (every process a job's tasks
    started inherits it, Ray's daemons and workers included), as 'pid cmdline'."""
    needle = f"SLURM_JOB_ID={job_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path("/proc", entry, "environ").read_bytes().split(b"\0")
            stat = Path("/proc", entry, "stat").read_text()
            cmd = Path("/proc", entry, "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if needle in env and stat.rsplit(")", 1)[-1].split()[0] != "Z":
            found.append(f"{entry} {cmd.decode(errors='replace')[:120]}")
    return found


@pytest.fixture(scope="module")
def ray_slurm_job(slurm_cluster, tmp_path_factory):
    """`report_nodes` on 2 nodes x 1 task through launch(ray_job(...)), submitted at once."""
    folder = tmp_path_factory.mktemp("ray_cluster") / "launch"
    run = launch(
        ray_job(report_nodes, num_cpus_per_node=2, join_timeout_s=180),
        {"echo": 7, "async_rl": True},
        executor="slurm",
        partition=slurm_cluster.partition,
        nodes=2,
        tasks_per_node=1,
        timeout_min=8,
        folder=folder,
        slurm_kwargs={"setup": ["export OMP_NUM_THREADS=1 RAY_USAGE_STATS_ENABLED=0"]},
    )
    submitted = time.monotonic()
    yield run, submitted
    if not run.done():
        run.cancel()


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_cpus_per_node=0), "num_cpus_per_node=0; must be an integer >= 1"),
        (dict(num_cpus_per_node=2.5), "num_cpus_per_node=2.5"),
        (dict(port=80), "port=80; must be an integer in 1024-65535"),
        (dict(port=70000), "port=70000"),
        (dict(port=True), "port=True"),
        (dict(join_timeout_s=0), "join_timeout_s=0; must be a finite number"),
        (dict(join_timeout_s=float("inf")), "join_timeout_s=inf"),
        (dict(start_timeout_s=0), "start_timeout_s=0; must be a finite number of seconds > 0"),
        (dict(start_timeout_s=float("nan")), "start_timeout_s=nan"),
        (dict(start_timeout_s=True), "start_timeout_s=True"),
        (dict(start_timeout_s="60"), "start_timeout_s='60'"),
    ],
)
def test_bad_input_is_refused_before_ray_starts(kwargs, match, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    with pytest.raises(ValueError, match=match), ray_cluster(**kwargs):
        pass
    with pytest.raises(ValueError, match=match):
        ray_job(len, **kwargs)


def test_ray_job_refuses_a_non_callable_and_keeps_the_name():
    with pytest.raises(TypeError, match="not callable"):
        ray_job(42)
    job = ray_job(report_nodes)
    assert job.__name__ == "report_nodes" and job.__wrapped__ is report_nodes
    assert cloudpickle.loads(cloudpickle.dumps(job)).options == job.options


def test_missing_ray_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match="ray_cluster needs Ray.*pip install"), ray_cluster():
        pass


def test_default_port_is_outside_the_ephemeral_and_master_port_ranges():
    ports = {default_port(j) for j in range(0, 100_000, 7)}
    assert min(ports) == 61000 and max(ports) <= 64999  # ephemeral: 32768-60999
    assert default_port(12345) == 61345 and default_port("12345_3") == 61345


def test_port_taken_is_skipped_or_refused():
    job = rc._Job(
        job_id="123", restart="0", rank=0, local_rank=0, num_nodes=1, node="n1", node_index=0
    )
    with socket.socket() as busy:
        busy.bind(("", default_port("123")))
        busy.listen()
        assert rc._pick_port(job, None) == default_port("123") + 1
        with pytest.raises(RuntimeError, match=f"port={default_port('123')} is in use on n1"):
            rc._pick_port(job, default_port("123"))


class _FakeRay:
    def __init__(self, alive: int, dead: int = 0):
        self._nodes = [{"Alive": True}] * alive + [{"Alive": False}] * dead

    def nodes(self):
        return self._nodes


class _Running:
    returncode = None

    def poll(self):
        return None


def test_join_timeout_names_how_many_joined_of_how_many():
    assert rc._wait_nodes(_FakeRay(3), 3, _Running(), time.monotonic() + 5, 5) == 3
    with pytest.raises(
        TimeoutError,
        match=r"only 1 of 3 Ray nodes joined the head within "
        r"join_timeout_s=0.2 s",
    ):
        rc._wait_nodes(_FakeRay(1, dead=2), 3, _Running(), time.monotonic() + 0.2, 0.2)


def test_other_tasks_of_a_node_start_nothing(monkeypatch):
    """A task that is neither rank 0 nor the first of its node yields at once, as idle."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setattr(rc, "start_node", lambda *a, **k: pytest.fail("started Ray"))
    with ray_cluster() as cluster:
        assert (cluster.role, cluster.is_driver, cluster.temp_dir) == (
            "idle",
            False,
            "/tmp/ray-77-0",
        )


def test_stop_kills_what_is_left_in_the_session(monkeypatch):
    """`_stop`: SIGTERM to the process, then SIGKILL to everything left in its session (here a
    shell and two children that all ignore SIGTERM)."""
    child = subprocess.Popen(
        ["sh", "-c", "trap '' TERM; sleep 60 & sleep 60 & wait"], start_new_session=True
    )
    deadline = time.monotonic() + 10
    while len(rn.session_pids(child.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(rn.session_pids(child.pid)) == 3
    rn.stop_node(child, "test", grace_s=0.5)
    assert child.returncode == -9 and rn.session_pids(child.pid) == []


# ----------------------------------------------------------------------------- outside Slurm


@pytest.mark.slow
def test_outside_slurm_it_is_one_node_on_this_host_and_gone_after(monkeypatch):
    """A head node in a session of its own that this process drives; the body raising still
    shuts Ray down and stops every process of that session; the environment is as before; a
    second cluster after it connects with its own token."""
    import ray

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    assert not ray.is_initialized()
    with pytest.raises(ZeroDivisionError), ray_cluster(num_cpus_per_node=2) as cluster:
        assert current_cluster() is cluster
        assert (cluster.role, cluster.is_driver) == ("local", True)
        assert ray.get_runtime_context().gcs_address == cluster.address
        assert cluster.num_nodes == 1 and ray.cluster_resources()["CPU"] == 2
        pid = ray.get(ray.remote(num_cpus=1)(lambda: os.getpid()).remote())
        node_session = os.getsid(pid)  # ran in one of the node's worker processes
        assert pid != os.getpid() and node_session != os.getsid(0)
        with pytest.raises(RuntimeError, match="already active"), ray_cluster():
            pass
        1 / 0  # the body raises: Ray is shut down all the same
    assert not ray.is_initialized() and current_cluster() is None
    assert rn.session_pids(node_session) == [] and "RAY_AUTH_TOKEN" not in os.environ
    # a second cluster in the same process, with its own token (Ray caches the first one)
    with ray_cluster(num_cpus_per_node=1) as second:
        assert ray.get_runtime_context().gcs_address == second.address != cluster.address
        assert ray.get(ray.remote(num_cpus=1)(lambda: 7).remote()) == 7
    # a Ray the caller started is not taken over
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="already initialised"), ray_cluster():
        pass


# ----------------------------------------------------------------------------- inside Slurm


@pytest.mark.slurm
def test_ray_cluster_spans_the_allocation_and_is_gone_after(ray_slurm_job, slurm_cluster):
    run, submitted = ray_slurm_job
    assert isinstance(run, Run) and run.target == "test_ray_cluster.report_nodes"
    results = run.results()
    ended = time.monotonic() - submitted
    assert run.state == "COMPLETED"
    value, other = results
    assert other is None  # the worker node's task serves, returns nothing
    assert value["echo"] == 7
    # one Ray node per Slurm node, 2 CPUs each
    assert value["num_ray_nodes"] == len(slurm_cluster.nodes) == 2 and value["cpus"] == 4
    cluster = value["cluster"]
    assert isinstance(cluster, RayCluster) and cluster.role == "head" and cluster.is_driver
    assert (
        cluster.nodes == tuple(slurm_cluster.nodes)
        and cluster.temp_dir == f"/tmp/ray-{value['job_id']}-0"
    )
    assert (
        cluster.address.endswith(f":{default_port(value['job_id'])}")
        or 61000 <= int(cluster.address.rsplit(":", 1)[1]) <= 64999
    )
    pinned = value["pinned"]
    assert sorted(p["ray_node"] for p in pinned) == value["ray_node_ids"]
    assert sorted(p["slurm_node"] for p in pinned) == ["n1", "n2"]  # ran on both nodes
    assert all(p["pid"] != value["driver_pid"] for p in pinned)  # in Ray's workers
    assert value["driver_node"] == "n1"  # rank 0 runs the head on the first node
    rl = value["rl"]  # one AsyncRLTrainer round across the two nodes
    assert rl["step_count"] == 2 and rl["staleness"] == [0, 1] and rl["policy_version"] == [0, 0]
    log = run.logs(stream="stderr", tail=None)
    assert "Ray cluster of 2 node(s) up" in log
    assert "starting a Ray worker node on n2" in run.logs(stream="stderr", tail=None, task=1)
    # nothing the job started survives it: Ray's daemons and workers are gone
    deadline = time.monotonic() + 15
    while job_processes(value["job_id"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job_processes(value["job_id"]) == []
    assert not any(Path(f"/proc/{p['pid']}").exists() for p in pinned)
    assert not list(Path(run.log_folder.parent).glob("*/ray-*.json"))  # rendezvous removed
    print(
        f"\nRay cluster of 2 nodes up in {cluster.start_s:.1f} s inside the job; async RL "
        f"round {rl['seconds']:.1f} s; submit to result {ended:.0f} s"
    )
