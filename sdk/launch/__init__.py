"""Running a function or recipe from a cell: in-process, local processes or Slurm (submitit),
with live `Run` handles, requeue on preemption and reattach. A cfg's ParallelPlan is checked
against the job before submitting (`posttrain.launch.plans`).
"""

from __future__ import annotations

from posttrain.launch.run import Run, JobFailedError, RUN_FILE
from posttrain.launch.pickling import LaunchPickleError
from posttrain.launch.submit import launch, launch_array, EXECUTORS
from posttrain.launch.judge import launch_judge, JudgeJob
from posttrain.launch.ray_cluster import ray_job, RayCluster  # ray_cluster(): that module

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
