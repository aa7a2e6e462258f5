"""The executors `launch` submits with: which there are, what each can provide (checked before
anything is submitted or written), each built from `launch`'s arguments, and submitit's local
executor and job made fit for a notebook.

"debug" runs the function in this process (submitit's DebugExecutor), "local" runs it as
processes on this machine, "slurm" submits it with sbatch (submitit's SlurmExecutor). The local
executor here starts the job controller in its own session, so that a Jupyter kernel interrupt
or restart (sent to the kernel's whole process group) does not stop the job, and fills in `%j`
in the controller's folder; its jobs (`QuietLocalJob`) print no traceback when a handle is still
alive as the interpreter exits.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from submitit.local.local import LocalExecutor, LocalJob

__all__ = ["EXECUTORS", "check_resources", "make_executor", "QuietLocalJob"]

EXECUTORS = ("local", "slurm", "debug")


def check_resources(
    executor, nodes, tasks_per_node, gpus_per_node, cpus_per_task, timeout_min, max_num_timeout
) -> None:
    """Raise ValueError unless `executor` is one of `EXECUTORS` and it can provide the resources
    asked for (arguments as in `posttrain.launch.submit.launch`): integer counts (nodes,
    tasks_per_node, cpus_per_task >= 1; gpus_per_node, max_num_timeout >= 0), a finite
    timeout_min > 0 (minutes), one node for "local" and "debug", one task for "debug".

    Example:
        >>> check_resources("debug", 1, 2, 0, 1, 60, 10)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: executor='debug' runs one task in this process (submitit would silently ...
    """
    if executor not in EXECUTORS:
        raise ValueError(f"executor={executor!r}; allowed: {', '.join(EXECUTORS)}")
    for arg, value, low in (
        ("nodes", nodes, 1),
        ("tasks_per_node", tasks_per_node, 1),
        ("gpus_per_node", gpus_per_node, 0),
        ("cpus_per_task", cpus_per_task, 1),
        ("max_num_timeout", max_num_timeout, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{arg}={value!r}; must be an integer >= {low}")
    if (
        not isinstance(timeout_min, (int, float))
        or isinstance(timeout_min, bool)
        or not math.isfinite(timeout_min)
        or not timeout_min > 0
    ):
        raise ValueError(f"timeout_min={timeout_min!r}; must be a finite number of minutes > 0")
    if executor in ("local", "debug") and nodes != 1:
        raise ValueError(
            f"executor={executor!r} runs on this machine only: nodes must be 1, "
            f"got {nodes} (use executor='slurm' for several nodes)"
        )
    if executor == "debug" and tasks_per_node != 1:
        raise ValueError(
            f"executor='debug' runs one task in this process (submitit would silently "
            f"run 1 of your {tasks_per_node}); use executor='local' for "
            f"tasks_per_node={tasks_per_node}"
        )


def make_executor(
    executor: str,
    log_folder: Path,
    *,
    max_num_timeout: int,
    timeout_min: float,
    nodes: int,
    tasks_per_node: int,
    gpus_per_node: int,
    cpus_per_task: int,
    partition: str | None,
    name: str,
    slurm_kwargs: dict[str, Any] | None,
):
    """The submitit executor for "local" or "slurm" writing under `log_folder` (a folder with
    `%j`), its parameters set from `launch`'s arguments (checked by `check_resources`): on Slurm
    the time limit in whole minutes (rounded up), the job name, the partition (None: the
    cluster's default) and `slurm_kwargs` by submitit's names.

    Raises:
        RuntimeError: executor="slurm" where Slurm's client commands are not installed.
        ValueError: a Slurm parameter submitit does not know (submitit's message).
    """
    if executor == "local":
        ex: Any = _LocalExecutor(log_folder, max_num_timeout=max_num_timeout)
        ex.update_parameters(
            timeout_min=timeout_min,
            nodes=nodes,
            tasks_per_node=tasks_per_node,
            gpus_per_node=gpus_per_node,
        )
        return ex
    from submitit.slurm.slurm import SlurmExecutor

    try:
        ex = SlurmExecutor(log_folder, max_num_timeout=max_num_timeout)
    except RuntimeError as e:
        raise RuntimeError(
            f"executor='slurm' needs Slurm's client commands (srun, sbatch, sacct) "
            f"on PATH and SLURM_CONF naming the cluster ({e})"
        ) from None
    params: dict[str, Any] = dict(
        time=max(1, math.ceil(timeout_min)),
        nodes=nodes,
        ntasks_per_node=tasks_per_node,
        cpus_per_task=cpus_per_task,
        job_name=name,
    )
    if gpus_per_node:
        params["gpus_per_node"] = gpus_per_node
    if partition:
        params["partition"] = partition
    params.update(ex._convert_parameters(dict(slurm_kwargs or {})))
    ex.update_parameters(**params)
    return ex


class QuietLocalJob(LocalJob):
    """submitit's LocalJob, without the traceback its `__del__` prints when a handle is still
    alive as the interpreter exits (submitit's module globals are None by then: "Exception
    ignored in LocalJob.__del__ ... TypeError"). Errors in `__del__` are never raised anyway."""

    def __del__(self) -> None:
        try:
            super().__del__()
        except (TypeError, AttributeError, ImportError):
            pass


class _LocalExecutor(LocalExecutor):
    """submitit's LocalExecutor with the job controller in its own session: a Jupyter kernel
    interrupt (SIGINT) or restart (SIGKILL) goes to the kernel's whole process group and would
    otherwise stop the job too. The controller also gets its folder with `%j` filled in, so no
    stray folder named `%j` is created."""

    def _submit_command(self, command: str) -> QuietLocalJob:
        ntasks = self.parameters.get("tasks_per_node", 1)
        n_gpus = self.parameters.get("gpus_per_node", 0)
        env = dict(os.environ)
        from posttrain.core.threads import apply_thread_env

        apply_thread_env(env)  # OpenMP's wait policy must be set before the job imports torch
        env.update(  # as submitit.local.local.start_controller (submitit 1.5.4)
            SUBMITIT_LOCAL_NTASKS=str(ntasks),
            SUBMITIT_LOCAL_COMMAND=command,
            SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * self.parameters.get("timeout_min", 2.0))),
            SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(self.parameters.get("signal_delay_s", 30))),
            SUBMITIT_LOCAL_NODEID="0",
            SUBMITIT_LOCAL_JOB_NUM_NODES="1",
            SUBMITIT_STDERR_TO_STDOUT="",
            SUBMITIT_EXECUTOR="local",
            CUDA_VISIBLE_DEVICES=",".join(str(k) for k in range(n_gpus)),
            SUBMITIT_LOCAL_WITH_SHELL="",
        )
        code = (
            "import os, sys; from pathlib import Path; "
            "from submitit.local.local import Controller; "
            "Controller(Path(sys.argv[1].replace('%j', str(os.getpid())))).run()"
        )
        process = subprocess.Popen(
            [sys.executable, "-c", code, str(self.folder)], env=env, start_new_session=True
        )
        return QuietLocalJob(
            folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks))
        )
