"""Running a function or recipe from a cell: in-process, local processes or Slurm (submitit),
with live `Run` handles, requeue on preemption and reattach. A cfg's ParallelPlan is checked
against the job before submitting (`posttrain.launch.plans`).
"""

from __future__ import annotations

from posttrain.launch.executors import EXECUTORS
from posttrain.launch.judge import JudgeJob, launch_judge
from posttrain.launch.pickling import LaunchPickleError
from posttrain.launch.ray_cluster import RayCluster, ray_job  # ray_cluster(): that module
from posttrain.launch.run import JobFailedError, Run
from posttrain.launch.run_record import RUN_FILE
from posttrain.launch.submit import launch, launch_array

__all__ = [
    "launch_judge",
    "JudgeJob",
    "Run",
    "JobFailedError",
    "RUN_FILE",
    "launch",
    "launch_array",
    "LaunchPickleError",
    "EXECUTORS",
    "ray_job",
    "RayCluster",
]
