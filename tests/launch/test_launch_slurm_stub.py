"""posttrain.launch.submit against a stub Slurm: sbatch/sacct/scancel scripts on PATH record what
was submitted and report the state written in a file, so the sbatch parameters, states, cancel and
refusals are checked without a cluster; plus, on the real local cluster (fixture
`slurm_cluster`), a job that can never start.
"""

from __future__ import annotations

import os
import time

import pytest
from _launch_helpers import Cfg, times_ten
from _waits import WAIT_S

from posttrain.launch.submit import JobFailedError, Run, launch, launch_array


@pytest.fixture
def stub_slurm(tmp_path, monkeypatch):
    """sbatch answers job 4242; sacct reports the state in `state` file; scancel records."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "state"
    state.write_text("PENDING")
    scripts = {
        "sbatch": f'[ -e {tmp_path}/refuse ] && {{ echo "sbatch: error: invalid partition" >&2; '
        f'exit 1; }}; cp "$1" {tmp_path}/last.sbatch; echo "Submitted batch job 4242"',
        "sacct": f'echo "JobID|State|NodeList"; for j in 4242 4242_0 4242_1; do '
        f'echo "$j|$(cat {state})|"; done',
        "scancel": f'echo "$@" >> {tmp_path}/scancel.log',
        "srun": "exit 1",
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    yield tmp_path, state
    from submitit.slurm.slurm import SlurmJob

    state.write_text("CANCELLED by 0")  # lets submitit's shared watcher forget the stub's jobs
    SlurmJob.watcher.update()


def test_slurm_submission_parameters_state_and_cancel(stub_slurm):
    tmp, state = stub_slurm
    run = launch(
        times_ten,
        Cfg(out_dir=str(tmp / "out")),
        executor="slurm",
        nodes=2,
        tasks_per_node=2,
        gpus_per_node=1,
        cpus_per_task=3,
        timeout_min=4.5,
        partition="debug",
        name="sweep",
        slurm_kwargs={"mem_gb": 2},
    )
    assert run.job_id == "4242" and run.num_tasks == 4
    sbatch = (tmp / "last.sbatch").read_text()
    for line in (
        "--partition=debug",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--gpus-per-node=1",
        "--cpus-per-task=3",
        "--time=5",
        "--signal=USR2@90",
        "--mem=2GB",
        "--job-name=sweep",
        f"--output={tmp}/out/launch/%j/%j_0_log.out",
    ):
        assert f"#SBATCH {line}" in sbatch, line
    assert run.state == "PENDING" and not run.done()
    assert Run.attach(tmp / "out").state == "PENDING"
    run.cancel()
    assert (tmp / "scancel.log").read_text().split() == ["4242"]
    state.write_text("CANCELLED by 0")
    run._last_force = float("-inf")
    time.sleep(0.01)  # submitit ignores a forced sacct update within 1 ms of the previous one
    assert run.state == "CANCELLED" and run.done()


def test_slurm_array_is_one_sbatch(stub_slurm):
    tmp, _ = stub_slurm
    runs = launch_array(
        times_ten,
        [1, 2],
        executor="slurm",
        folder=tmp / "sweep",
        slurm_kwargs={"array_parallelism": 1},
    )
    assert [r.job_id for r in runs] == ["4242_0", "4242_1"]
    assert "#SBATCH --array=0-1%1" in (tmp / "last.sbatch").read_text()
    assert [r.job_id for r in Run.attach_array(tmp / "sweep")] == ["4242_0", "4242_1"]
    with pytest.raises(ValueError, match="Unavailable parameter"):
        launch(times_ten, 1, executor="slurm", folder=tmp / "bad", slurm_kwargs={"gpu": 1})


def test_refused_submission_says_why_and_leaves_nothing(stub_slurm, monkeypatch):
    tmp, _ = stub_slurm
    (tmp / "refuse").touch()
    monkeypatch.delenv("SLURM_CONF", raising=False)
    with pytest.raises(RuntimeError, match="(?s)SLURM_CONF is not set.*invalid partition"):
        launch(times_ten, Cfg(out_dir=str(tmp / "new" / "out")), executor="slurm")
    assert not (tmp / "new").exists()


@pytest.mark.slurm
def test_a_job_that_can_never_start_says_why_instead_of_waiting(slurm_cluster, tmp_path):
    """64 tasks on a partition of two 4-CPU nodes: Slurm queues it with reason PartitionConfig
    forever; the Run shows the reason and wait()/result() raise."""
    run = launch(
        times_ten,
        1,
        executor="slurm",
        partition=slurm_cluster.partition,
        tasks_per_node=64,
        folder=tmp_path / "launch",
        timeout_min=1,
    )
    try:
        with pytest.raises(
            JobFailedError,
            match="can never start.*reason PartitionConfig.*stays queued: run.cancel",
        ):
            run.wait(timeout=WAIT_S)
        assert "reason='PartitionConfig'" in repr(run)
        assert "<td>PartitionConfig</td>" in run._repr_html_()
        with pytest.raises(JobFailedError, match="PartitionConfig"):
            run.result()
    finally:
        run.cancel()
