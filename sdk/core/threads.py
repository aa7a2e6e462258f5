"""How many intra-op threads a run uses and how idle OpenMP threads wait.

On a shared machine the OpenMP default (idle threads spin before they sleep) makes a run slow
down far more than its share of the CPU when another process is busy: a spinning thread steals
the core its partner needs to finish the parallel region. posttrain therefore runs OpenMP with
the PASSIVE wait policy (idle threads sleep at once) and one thread per CPU this process may run
on (the affinity mask, which Slurm and `taskset` narrow). docs/benchmarks/threads.md has the
measurements behind this choice (benchmarks/threads.py).

Precedence of the thread count: `POSTTRAIN_NUM_THREADS`, then an explicit `OMP_NUM_THREADS`, then
the affinity mask size. An explicit `OMP_WAIT_POLICY` is kept. The wait policy is read by OpenMP
when torch is imported, so it must be in the environment before that (the `posttrain` command
and the Makefile set it); the thread count also applies later (`torch.set_num_threads`).

This module imports only the standard library (torch only inside `configure_threads`).

Example:
    >>> plan = thread_plan({"POSTTRAIN_NUM_THREADS": "3"}, cpus=2)
    >>> plan.num_threads, plan.wait_policy
    (3, 'PASSIVE')
    >>> thread_plan({}, cpus=2).reason
    'affinity mask: 2 CPUs'
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

OVERRIDE = "POSTTRAIN_NUM_THREADS"
"""Environment variable that sets the intra-op thread count of a run (a positive integer)."""

WAIT_POLICY = "PASSIVE"
"""OpenMP wait policy posttrain sets unless `OMP_WAIT_POLICY` is already set."""

_POLICIES = ("PASSIVE", "ACTIVE")


@dataclass(frozen=True, kw_only=True)
class ThreadPlan:
    """The threads a run will use: `num_threads` intra-op threads (>= 1), the OpenMP
    `wait_policy` ("PASSIVE" or "ACTIVE"), and `reason` / `policy_reason`, phrases saying where
    the count and the policy came from."""

    num_threads: int
    wait_policy: str
    reason: str
    policy_reason: str


applied: ThreadPlan | None = None
"""The plan `apply_thread_env` last wrote into `os.environ` in this process (None before)."""


def available_cpus() -> int:
    """Number of CPUs this process may run on: the size of its affinity mask
    (`os.sched_getaffinity`), or `os.cpu_count()` where the platform has no affinity call."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _positive_int(name: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"{name}={value!r} is not allowed: give a positive integer "
            f"(the number of intra-op threads), or unset it"
        )
    return n


def thread_plan(environ: Mapping[str, str] | None = None, *, cpus: int | None = None) -> ThreadPlan:
    """The `ThreadPlan` for a run started with environment `environ` (default `os.environ`) on
    `cpus` CPUs (default `available_cpus()`).

    Raises:
        ValueError: if `POSTTRAIN_NUM_THREADS` or `OMP_NUM_THREADS` is set but not a positive
            integer, or `OMP_WAIT_POLICY` is not PASSIVE or ACTIVE (any case).
    """
    env = os.environ if environ is None else environ
    cpus = available_cpus() if cpus is None else cpus
    policy = env.get("OMP_WAIT_POLICY", "").strip()
    if policy and policy.upper() not in _POLICIES:
        raise ValueError(
            f"OMP_WAIT_POLICY={policy!r} is not allowed: use one of {', '.join(_POLICIES)}"
        )
    why = f"OMP_WAIT_POLICY={policy.upper()}" if policy else "posttrain's default"
    policy = policy.upper() or WAIT_POLICY
    if env.get(OVERRIDE, "").strip():
        n = _positive_int(OVERRIDE, env[OVERRIDE].strip())
        reason = f"{OVERRIDE}={n}"
    elif env.get("OMP_NUM_THREADS", "").strip():
        n = _positive_int("OMP_NUM_THREADS", env["OMP_NUM_THREADS"].strip())
        reason = f"OMP_NUM_THREADS={n}"
    else:
        n, reason = cpus, f"affinity mask: {cpus} CPU{'s' if cpus != 1 else ''}"
    return ThreadPlan(num_threads=n, wait_policy=policy, reason=reason, policy_reason=why)


def apply_thread_env(
    environ: MutableMapping[str, str] | None = None, *, cpus: int | None = None
) -> ThreadPlan:
    """Write the `thread_plan` into `environ` (default `os.environ`) for torch, when imported
    later in this process, and for child processes (a local or Slurm job inherits the
    environment): always `OMP_WAIT_POLICY`; `OMP_NUM_THREADS` only when `POSTTRAIN_NUM_THREADS`
    chose the count. A count from the affinity mask is left for each process to take from its
    own mask (OpenMP and torch default to it), so a Slurm job gets its allocation's CPUs, not
    those of the machine it was submitted from. Returns the plan; when `environ` is
    `os.environ` it is also kept as `applied`.

    Raises:
        ValueError: as `thread_plan`.
    """
    global applied
    env = os.environ if environ is None else environ
    plan = thread_plan(env, cpus=cpus)
    if plan.reason.startswith(OVERRIDE):
        env["OMP_NUM_THREADS"] = str(plan.num_threads)
    env["OMP_WAIT_POLICY"] = plan.wait_policy
    if environ is None:
        applied = plan
    return plan


def configure_threads(environ: MutableMapping[str, str] | None = None) -> ThreadPlan:
    """`apply_thread_env`, then `torch.set_num_threads(plan.num_threads)` for this process (torch
    may already be imported; the wait policy then holds only if it was set before). Returns
    the plan.

    Raises:
        ValueError: as `thread_plan`.
    """
    plan = apply_thread_env(environ)
    import torch

    torch.set_num_threads(plan.num_threads)
    return plan
