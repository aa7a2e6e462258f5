"""What is asked of a `ParallelPlan` before it splits a model: whether it fits a job's world size
and a model (`check_fits`), the `DeviceMesh` it runs on (`build_mesh`), and whether a model
already has a plan applied (`parallelized`).

`ParallelPlan.validate` and `ParallelPlan.build_mesh` (`posttrain.train.parallel`) and
`posttrain.train.sharding.parallelize` both call these, so a plan's walk goes one way:
`ParallelPlan.parallelize` -> `sharding.parallelize` -> here and `posttrain.train.runtime`,
and the plan's own module is crossed once. The plan is read as a value (its fields and the
sizes derived from them); nothing here calls back into it.

A plan is frozen, so whether it fits a world size or a model cannot change: each check runs
once per process for each (plan, world size) and (plan, model spec), compared by value, and a
later call with the same question returns at once. A recipe's plan is checked against its model
when its config is built (`posttrain.workflows.parallel.check_parallel`) and against the world
size when its run starts (`check_world_size`); `parallelize` and `build_mesh` ask again and get
the remembered answer. A check that fails is not remembered: it raises every time.

Example:
    >>> from posttrain.models import get_preset
    >>> from posttrain.train.parallel import ParallelPlan
    >>> check_fits(ParallelPlan(dp_shard=2, tp=2), world_size=4, spec=get_preset("tiny-1m"))
    >>> check_fits(ParallelPlan(dp_shard=2), world_size=3)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: ParallelPlan(dp_shard=2): dp_replicate x dp_shard x tp x sp x pp x ep = 2, but
    the world size is 3; the axes must multiply to 3
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from posttrain.models.specs import get_preset
from posttrain.train.pipeline import is_stage

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from posttrain.models.specs import ModelSpec
    from posttrain.train.parallel import ParallelPlan

__all__ = ["AXES", "MESH_DIMS", "check_fits", "resolve_spec", "build_mesh", "parallelized"]

AXES = ("dp_replicate", "dp_shard", "tp", "sp", "pp", "ep")
"""The plan's parallelism axes (fields of `ParallelPlan`)."""

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "sp", "tp")
"""Dimension names of the plan's `DeviceMesh`, outermost first."""


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def resolve_spec(spec: ModelSpec | str | None) -> ModelSpec | None:
    """`spec` as a `ModelSpec` (a preset name looked up), or None.

    Raises:
        ValueError: for an unknown preset name or something that is not a model spec.
    """
    if isinstance(spec, str):
        spec = get_preset(spec)
    if spec is not None and not all(hasattr(spec, f) for f in ("num_heads", "num_layers")):
        raise ValueError(
            f"spec={spec!r}; must be a posttrain.models.ModelSpec (e.g. "
            "get_preset('tiny-1m')), a preset name, or None"
        )
    return spec


def check_fits(
    plan: ParallelPlan, *, world_size: int | None = None, spec: ModelSpec | str | None = None
) -> None:
    """Check `plan` against a job's world size and a model spec (the body of
    `ParallelPlan.validate`, which documents the rules); each passed check is remembered for
    the process (see the module docstring).

    Raises:
        ValueError: naming the field and the allowed values (see `ParallelPlan.validate`).
    """
    if world_size is not None and (
        not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1
    ):
        raise ValueError(
            f"world_size={world_size!r}; must be a positive integer (the job's "
            "number of ranks) or None"
        )
    spec = resolve_spec(spec)
    if world_size is not None:
        _fits_world_size(plan, world_size)
    if spec is not None:
        try:
            hash(spec)
        except TypeError:  # a spec-like object that is not a frozen ModelSpec: not remembered
            _fits_model.__wrapped__(plan, spec)
            return
        _fits_model(plan, spec)


@functools.lru_cache(maxsize=256)
def _fits_world_size(plan: ParallelPlan, world_size: int) -> None:
    if plan.world_size != world_size:
        raise ValueError(
            f"{plan}: dp_replicate x dp_shard x tp x sp x pp x ep = "
            f"{plan.world_size}, but the world size is {world_size}; the axes "
            f"must multiply to {world_size}"
        )


@functools.lru_cache(maxsize=256)
def _fits_model(plan: ParallelPlan, spec: ModelSpec) -> None:
    heads = math.gcd(spec.num_heads, spec.num_kv_heads)
    if spec.num_heads % plan.tp or spec.num_kv_heads % plan.tp:
        raise ValueError(
            f"ParallelPlan.tp={plan.tp} must divide num_heads={spec.num_heads} "
            f"and num_kv_heads={spec.num_kv_heads} of the model; allowed tp: "
            f"{_divisors(heads)}"
        )
    widths = math.gcd(spec.embed_dim, spec.intermediate_dim)
    if widths % plan.tp:
        raise ValueError(
            f"ParallelPlan.tp={plan.tp} must divide embed_dim={spec.embed_dim} "
            f"and intermediate_dim={spec.intermediate_dim}; allowed tp: "
            f"{_divisors(math.gcd(widths, heads))}"
        )
    local_heads = spec.num_heads // plan.tp
    if local_heads % plan.sp:  # k and v are expanded to num_heads before the all-to-all
        raise ValueError(
            f"ParallelPlan.sp={plan.sp} must divide the attention heads per "
            f"tensor-parallel rank (num_heads={spec.num_heads} / tp={plan.tp} = "
            f"{local_heads}; Ulysses scatters heads); allowed sp: "
            f"{_divisors(local_heads)}"
        )
    if plan.pp > spec.num_layers:
        raise ValueError(
            f"ParallelPlan.pp={plan.pp} exceeds the model's num_layers="
            f"{spec.num_layers}; allowed pp: 1..{spec.num_layers}"
        )
    experts = getattr(spec, "num_experts", 0) or 0
    if plan.ep > 1 and not experts:
        raise ValueError(
            f"ParallelPlan.ep={plan.ep} needs a model with experts; this model "
            "is dense (num_experts=0): allowed ep: 1"
        )
    if experts and experts % plan.ep:
        raise ValueError(
            f"ParallelPlan.ep={plan.ep} must divide num_experts={experts}; "
            f"allowed ep: {_divisors(experts)}"
        )
    if experts and plan.tp > 1:
        raise ValueError(
            f"ParallelPlan.tp={plan.tp} with an MoE model: the tensor-parallel "
            "plan splits dense MLPs only (split experts with ep); allowed tp "
            "for MoE models: 1"
        )
    if experts and plan.pp > 1:
        raise ValueError(
            f"ParallelPlan.pp={plan.pp} with an MoE model: the pipeline's loss "
            "has no load-balancing term; allowed pp for MoE models: 1"
        )


def build_mesh(plan: ParallelPlan, device_type: str = "cpu") -> DeviceMesh:
    """The job's `DeviceMesh` for `plan`, with dimensions `MESH_DIMS` (the body of
    `ParallelPlan.build_mesh`; needs an initialised default process group of the plan's world
    size).

    Raises:
        RuntimeError: without an initialised process group.
        ValueError: if the process group's size differs from the plan's world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{plan} needs an initialised torch.distributed process group "
            "(posttrain.launch.submit starts one per task; or "
            "dist.init_process_group)"
        )
    check_fits(plan, world_size=dist.get_world_size())
    sizes = tuple(getattr(plan, name) for name in MESH_DIMS)
    return init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)


def parallelized(model: nn.Module) -> str | None:
    """What shows that a plan was applied to `model` (FSDP2 units, DTensor parameters,
    activation-checkpoint wrappers, a pipeline stage's forward), or None for a plain model.
    Read from the modules themselves: nothing about the plan is stored on the model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if is_stage(model):
        return "a pipeline stage"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            return "FSDP2"
        if isinstance(module, CheckpointWrapper):
            return "activation checkpointing"
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "DTensor parameters"
    return None
