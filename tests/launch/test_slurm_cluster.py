"""The local Slurm cluster (scripts/slurm-up.sh) does what posttrain.launch.submit relies on.

Real sbatch/srun/scancel/sacct and real submitit jobs on two emulated nodes, n1 and n2. Skipped
when the cluster is not up (fixture `slurm_cluster` in conftest.py). Every wait is a polling loop
with a generous deadline: these check behaviour, not speed. Jobs a test starts are cancelled when it
ends, whatever happens.
"""

from __future__ import annotations

import subprocess
import time

import pytest
import submitit

pytestmark = pytest.mark.slurm

DEADLINE_S = 60.0


def run(*cmd: str) -> str:
    """Run a Slurm client command (SLURM_CONF comes from the fixture) and return its stdout."""
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout


def wait_until(condition, what: str, deadline_s: float = DEADLINE_S):
    """Poll `condition()` until it returns something truthy; fail after `deadline_s` seconds."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not reached after {deadline_s:.0f} s")
        time.sleep(0.25)


def sacct_state(job_id: str) -> str:
    """The job's state in accounting ('' until slurmdbd has recorded it)."""
    out = run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State")
    return out.strip().splitlines()[-1] if out.strip() else ""


@pytest.fixture
def cancel_afterwards():
    """A list to append job ids to; whatever is still in Slurm at the end of the test is
    cancelled."""
    job_ids: list[str] = []
    yield job_ids
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True, timeout=60)


@pytest.fixture
def executor(slurm_cluster, tmp_path):
    ex = submitit.AutoExecutor(folder=tmp_path / "%j")
    assert ex.cluster == "slurm"
    ex.update_parameters(slurm_partition=slurm_cluster.partition, timeout_min=5)
    return ex


def test_sbatch_job_completes_in_accounting(slurm_cluster, tmp_path, cancel_afterwards):
    job_id = run(
        "sbatch",
        "--parsable",
        f"--chdir={tmp_path}",
        "-o",
        "%j.out",
        "--wrap",
        "echo hello from $SLURMD_NODENAME",
    ).strip()
    cancel_afterwards.append(job_id)
    assert wait_until(lambda: sacct_state(job_id) == "COMPLETED", f"job {job_id} COMPLETED")
    words = (tmp_path / f"{job_id}.out").read_text().split()
    assert words[:2] == ["hello", "from"] and words[2] in slurm_cluster.nodes


def test_srun_spans_both_nodes(slurm_cluster, tmp_path):
    out = run(
        "srun",
        "-N2",
        "-n2",
        f"--chdir={tmp_path}",
        "bash",
        "-c",
        "echo $SLURMD_NODENAME $SLURM_PROCID",
    )
    # One task per node, ranks in node order (block distribution).
    assert sorted(out.strip().splitlines()) == [
        f"{node} {rank}" for rank, node in enumerate(slurm_cluster.nodes)
    ]


def test_scancel_gives_cancelled(slurm_cluster, tmp_path, cancel_afterwards):
    job_id = run(
        "sbatch", "--parsable", f"--chdir={tmp_path}", "-o", "%j.out", "--wrap", "sleep 300"
    ).strip()
    cancel_afterwards.append(job_id)
    wait_until(lambda: sacct_state(job_id) == "RUNNING", f"job {job_id} RUNNING")
    run("scancel", job_id)
    # sacct writes "CANCELLED by <uid>".
    assert wait_until(
        lambda: sacct_state(job_id).startswith("CANCELLED"), f"job {job_id} CANCELLED"
    )


def test_submitit_job_returns_its_value(executor):
    def add(a: int, b: int) -> int:  # defined here, pickled by value as a notebook cell's would be
        return a + b

    job = executor.submit(add, 2, 3)
    try:
        assert job.result() == 5
    finally:
        job.cancel(check=False)


def test_submitit_array_returns_all_values(executor):
    jobs = executor.map_array(pow, [2, 3, 4], [2, 2, 2])
    try:
        assert len({job.job_id.split("_")[0] for job in jobs}) == 1  # one sbatch --array
        assert [job.result() for job in jobs] == [4, 9, 16]
    finally:
        for job in jobs:
            job.cancel(check=False)


def test_cancelled_submitit_job_is_done(executor):
    job = executor.submit(time.sleep, 300)
    try:
        wait_until(lambda: job.state == "RUNNING", f"submitit job {job.job_id} RUNNING")
        job.cancel()
        wait_until(job.done, f"submitit job {job.job_id} done() after cancel")
        assert job.state.startswith("CANCELLED")
    finally:
        job.cancel(check=False)
