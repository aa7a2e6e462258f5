"""What runs inside a job that `posttrain.launch.submit.launch` submitted: `_Call`, the pickled
callable. It joins the torch.distributed process group when the job has several tasks, defers
Slurm's warning signal to the Trainer's step boundaries (`posttrain.core.preemption`), runs
`target(cfg)` (a run in `cfg.out_dir` that raises records how it stopped and frees its folder:
`posttrain.core.run_lock.run_outcome`), checks that the result pickles, and, when submitit
checkpoints it, resubmits itself with `cfg.resume=True`. In a job of several tasks, ranks other than
0 leave after the warning signal once rank 0 has checkpointed and requeued the job.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

from submitit.core.utils import DelayedSubmission
from submitit.helpers import Checkpointable

from posttrain.core.run_lock import run_outcome
from posttrain.launch.pickling import _check_result_pickles

_LOG = logging.getLogger(__name__)


class _Call(Checkpointable):
    """What a job runs: `target(cfg)` (or `target()`), inside a process group when the job has
    several tasks (so `target` finds torch.distributed initialised and must not initialise it
    again), with the preemption signal deferred to step boundaries.

    `checkpoint()` (called by submitit on rank 0 when Slurm's warning signal arrives) resubmits
    the same call with `cfg.resume=True` if `cfg` is a dataclass with a `resume` field; any other
    cfg is resubmitted as it is, so such a function starts again from scratch.
    """

    def __init__(
        self,
        target: Callable[..., Any],
        cfg: Any,
        *,
        has_cfg: bool,
        num_tasks: int,
        gpus_per_node: int,
        master_addr: str | None,
        in_job: bool,
    ) -> None:
        self.target, self.cfg, self.has_cfg = target, cfg, has_cfg
        self.num_tasks, self.gpus_per_node = num_tasks, gpus_per_node
        self.master_addr, self.in_job = master_addr, in_job

    def __call__(self) -> Any:
        if self.in_job:
            _install_preemption(self.num_tasks)
        group = (
            _init_process_group(self.gpus_per_node, self.master_addr)
            if self.num_tasks > 1
            else None
        )
        out_dir = (
            None
            if not self.has_cfg
            else (
                self.cfg.get("out_dir")
                if isinstance(self.cfg, dict)
                else getattr(self.cfg, "out_dir", None)
            )
        )
        try:
            with run_outcome(out_dir):  # a run that raises records it and frees its folder
                result = self.target(self.cfg) if self.has_cfg else self.target()
        finally:
            if group is not None and group.is_initialized():  # unless target destroyed it
                group.destroy_process_group()
        _check_result_pickles(result)
        return result

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        return DelayedSubmission(self.resumed(), *args, **kwargs)

    def resumed(self) -> _Call:
        """The same call with `cfg.resume=True` (dataclass cfg with a `resume` field), else self."""
        if not _has_field(self.cfg, "resume"):
            return self
        new = _Call.__new__(_Call)
        new.__dict__.update(self.__dict__, cfg=dataclasses.replace(self.cfg, resume=True))
        return new


def _install_preemption(num_tasks: int) -> None:
    """Defer the warning signal to step boundaries (`posttrain.core.preemption`). In a job of
    several tasks, a rank other than 0 leaves once submitit's handler has run on it: rank 0
    checkpoints the call and requeues the whole job, so the next collective would only fail
    (and write an error as this rank's result, which a `Run` would read as a failure)."""
    import signal

    from submitit.core.job_environment import JobEnvironment

    from posttrain.core import preemption

    signum = JobEnvironment._usr_sig()
    handler = signal.getsignal(signum)
    if num_tasks > 1 and callable(handler) and not isinstance(handler, _LeaveAfterRequeue):
        signal.signal(signum, _LeaveAfterRequeue(handler))
    preemption.install(signum)


class _LeaveAfterRequeue:
    """Signal handler: submitit's (rank 0 checkpoints, requeues and exits; other ranks return),
    then, on the ranks where it returned, exit without a result (status 0)."""

    def __init__(self, handler: Callable[..., Any]) -> None:
        self.handler = handler

    def __call__(self, signum: int, frame: Any) -> None:
        self.handler(signum, frame)
        rank = os.environ.get("RANK", "?")
        print(
            f"posttrain.launch: rank {rank} leaves after the preemption signal; rank 0 "
            "has checkpointed and requeued the job",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(0)


def _has_field(cfg: Any, name: str) -> bool:
    return (
        dataclasses.is_dataclass(cfg)
        and not isinstance(cfg, type)
        and any(f.name == name for f in dataclasses.fields(cfg))
    )


def _init_process_group(gpus_per_node: int, master_addr: str | None):
    """Export MASTER_ADDR/PORT, RANK, WORLD_SIZE from submitit's view of the job and join the
    default process group (NCCL with GPUs, else gloo). Returns torch.distributed."""
    import torch
    import torch.distributed as dist
    from submitit.helpers import TorchDistributedEnvironment

    env = TorchDistributedEnvironment()
    env.master_addr = master_addr or _resolvable(env.master_addr)
    if gpus_per_node:  # one GPU per task: the local_rank-th of the node's visible devices
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        if len(visible) != 1:
            os.environ["CUDA_VISIBLE_DEVICES"] = (
                visible[env.local_rank % len(visible)] if visible else str(env.local_rank)
            )
    env.export(set_cuda_visible_devices=False, overwrite=True)
    backend = "nccl" if gpus_per_node and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)
    print(
        f"posttrain.launch: rank {env.rank}/{env.world_size} joining a {backend} process group "
        f"at {env.master_addr}:{env.master_port}",
        file=sys.stderr,
        flush=True,
    )
    dist.init_process_group(backend=backend)
    return dist


def _resolvable(host: str) -> str:
    """`host` if it resolves, else 127.0.0.1 with a warning (nodes emulated on one host have
    names such as n1 that no resolver knows)."""
    try:
        socket.getaddrinfo(host, None)
        return host
    except OSError:
        _LOG.warning(
            "posttrain.launch: master host %r does not resolve; using 127.0.0.1, which "
            "only works when every task runs on this host (pass master_addr= otherwise)",
            host,
        )
        return "127.0.0.1"
