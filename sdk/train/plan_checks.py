"""What is asked of a `ParallelPlan` before it splits a model: whether it fits a job's world size
and a model (`check_fits`), the two in one call returning the checked plan (`check_plan`), and
the `DeviceMesh` of a plan not checked yet (`build_mesh`).

The plan is read as a value (`posttrain.train.plan_value.PlanFields`: its fields and the sizes
derived from them); nothing here calls into `posttrain.train.parallel`. A recipe's plan is
checked against its model when its config is built (`posttrain.workflows.parallel.
check_parallel`) and against the job's world size and model, in one call, when its run starts
(`check_world_size` -> `check_plan`); the `CheckedPlan` it returns is what `parallelize` and
`CheckedPlan.build_mesh` take, and they do not come back here. A bare plan handed to
`posttrain.train.parallelize` or `plan.build_mesh()` from a notebook is checked there.

A plan is frozen, so whether it fits a world size or a model cannot change: each check runs
once per process for each (plan, world size) and (plan, model spec), compared by value, and a
later call with the same question returns at once. A check that fails is not remembered: it
raises every time.

Example:
    >>> from posttrain.models import get_preset
    >>> from posttrain.train.parallel import ParallelPlan
    >>> checked = check_plan(ParallelPlan(dp_shard=2, tp=2), world_size=4, spec="tiny-1m")
    >>> checked.world_size, checked.spec == get_preset("tiny-1m")
    (4, True)
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

from posttrain.models.specs import get_preset
from posttrain.train.plan_value import AXES, MESH_DIMS, CheckedPlan, PlanFields

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from posttrain.models.specs import ModelSpec

__all__ = ["AXES", "MESH_DIMS", "check_fits", "check_plan", "resolve_spec", "build_mesh"]


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
    plan: PlanFields, *, world_size: int | None = None, spec: ModelSpec | str | None = None
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


def check_plan(
    plan: PlanFields, *, world_size: int | None, spec: ModelSpec | str | None = None
) -> CheckedPlan:
    """Check `plan` against a job's world size and a model spec in one call (`check_fits`) and
    return it as a `CheckedPlan` (the spec resolved), which `posttrain.train.parallelize` and
    `CheckedPlan.build_mesh` take without checking again.

    Args:
        world_size: the job's number of ranks (None: not known here; checked where the plan
            meets its process group).
        spec: a `ModelSpec`, a preset name, or None (the model-dependent rules not checked).

    Raises:
        ValueError: naming the field and the allowed values (see `ParallelPlan.validate`).
    """
    check_fits(plan, world_size=world_size, spec=spec)
    return CheckedPlan(plan=plan, world_size=world_size, spec=resolve_spec(spec))


@functools.lru_cache(maxsize=256)
def _fits_world_size(plan: PlanFields, world_size: int) -> None:
    if plan.world_size != world_size:
        raise ValueError(
            f"{plan}: dp_replicate x dp_shard x tp x sp x pp x ep = "
            f"{plan.world_size}, but the world size is {world_size}; the axes "
            f"must multiply to {world_size}"
        )


@functools.lru_cache(maxsize=256)
def _fits_model(plan: PlanFields, spec: ModelSpec) -> None:
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


def build_mesh(plan: PlanFields, device_type: str = "cpu") -> DeviceMesh:
    """The job's `DeviceMesh` for a plan not checked yet, with dimensions `MESH_DIMS` (the body
    of `ParallelPlan.build_mesh`): the plan is checked against the process group's size, then
    `CheckedPlan.build_mesh`.

    Raises:
        RuntimeError: without an initialised process group.
        ValueError: if the process group's size differs from the plan's world size.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    return check_plan(plan, world_size=world).build_mesh(device_type)
