"""A parallel plan as a value: its fields (`PlanFields`, the base of
`posttrain.train.parallel.ParallelPlan`) and a plan checked against a job (`CheckedPlan`).

This module sits below everything that applies a plan (`plan_checks`, `sharding`, `runtime`,
`pipeline`, `plan_compat`), which read the plan through these two types: the fields and the
sizes that follow from them, never the plan's own module. As torchtitan's `ParallelDims`, a
plan is checked once against the job's world size and model, where they are known, and then
handed down as a value: `posttrain.train.plan_checks.check_plan` returns the `CheckedPlan` that
`posttrain.train.parallelize` and `CheckedPlan.build_mesh` take without checking again.

Example:
    >>> plan = PlanFields(dp_shard=2, tp=2)
    >>> plan.world_size, plan.data_parallel_size, plan.fsdp, str(plan)
    (4, 2, True, 'PlanFields(dp_shard=2, tp=2)')
    >>> PlanFields(tp=0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: PlanFields.tp=0; ...
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from posttrain.core.checks import check_fields

if TYPE_CHECKING:  # torch loads when a plan is applied, not when a config names one
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from posttrain.models.specs import ModelSpec

__all__ = ["AXES", "MESH_DIMS", "PlanFields", "CheckedPlan"]

AXES = ("dp_replicate", "dp_shard", "tp", "sp", "pp", "ep")
"""The plan's parallelism axes (fields of `ParallelPlan`)."""

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "sp", "tp")
"""Dimension names of the plan's `DeviceMesh`, outermost first."""

_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a plan's param_dtype and reduce_dtype name (attributes of `torch`)."""
_SCHEDULES = ("gpipe", "1f1b")
_NOT_COMPILED = {
    "sp": "Ulysses' all-to-alls run inside the attention call, which a fullgraph block cannot hold",
    "ep": "the experts' all-to-alls run inside the block, which a fullgraph block cannot hold",
    "pp": "compiled blocks inside pipeline stages are not verified",
}


@dataclass(kw_only=True, frozen=True)
class PlanFields:
    """The fields of a `ParallelPlan` and what follows from them (documented there); frozen,
    compared and hashed by value.

    Raises:
        ValueError: naming the field and its allowed values, for a size that is not a positive
            integer, an unknown dtype or schedule, or n_microbatches without pp > 1.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: Literal["gpipe", "1f1b"] = "1f1b"
    n_microbatches: int | None = None
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        for axis in (*AXES, "n_microbatches"):
            value = getattr(self, axis)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, axis, int(value))  # numpy integers too
        check_fields(self, AXES, integer=True, low=1)
        if self.pp_schedule not in _SCHEDULES:
            raise ValueError(
                f"{name}.pp_schedule={self.pp_schedule!r}; allowed: {', '.join(_SCHEDULES)}"
            )
        check_fields(self, ("n_microbatches",), integer=True, low=1, optional=True, note="= pp")
        if self.n_microbatches is not None and self.pp == 1:
            raise ValueError(
                f"{name}.n_microbatches={self.n_microbatches} needs pp > 1 "
                "(it is the pipeline's micro-batch count); use the trainer's "
                "grad_accum_steps for micro-batches without a pipeline"
            )
        for field in ("param_dtype", "reduce_dtype"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or value not in _DTYPES):
                raise ValueError(f"{name}.{field}={value!r}; allowed: None, {', '.join(_DTYPES)}")
        for field in ("cpu_offload", "activation_checkpointing", "compile"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{name}.{field}={getattr(self, field)!r}; must be a bool")
        if self.compile:  # posttrain.train.compile: the axes a compiled block composes with
            for axis, why in _NOT_COMPILED.items():
                if getattr(self, axis) > 1:
                    raise ValueError(
                        f"{name}.compile=True with {axis}={getattr(self, axis)}: {why}; "
                        "allowed with compile: dp_replicate, dp_shard, tp"
                    )

    @property
    def world_size(self) -> int:
        """The product of all axes: the number of ranks the plan needs."""
        return math.prod(getattr(self, name) for name in AXES)

    @property
    def is_default(self) -> bool:
        """Whether every field is at its default. Such a plan is no plan: a recipe runs as
        without its `parallel` section, and a launch of any size runs it as plain replicas;
        any other plan, one of one rank included (FSDP2 mixed precision, activation
        checkpointing), needs a job of exactly its world size."""
        return self == type(self)()

    @property
    def fsdp(self) -> bool:
        """Whether the plan applies FSDP2: some parameters are replicated over ranks that compute
        their own gradient shares (dp_replicate x dp_shard x ep x sp > 1), or it asks for FSDP2's
        mixed precision or CPU offload (then on a mesh of one rank if need be)."""
        return self.dp_replicate * self.dp_shard * self.ep * self.sp > 1 or bool(
            self.param_dtype or self.reduce_dtype or self.cpu_offload
        )

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data: dp_replicate x dp_shard x ep."""
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per step (n_microbatches, default pp)."""
        return self.n_microbatches or self.pp

    def torch_dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(param_dtype, reduce_dtype) as torch dtypes for FSDP2's MixedPrecisionPolicy; the
        reduce dtype defaults to the param dtype, None to the model's own."""
        import torch

        param = getattr(torch, self.param_dtype) if self.param_dtype else None
        return param, getattr(torch, self.reduce_dtype) if self.reduce_dtype else param

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        axes = [f"{name}={getattr(self, name)}" for name in AXES if getattr(self, name) > 1]
        return f"{type(self).__name__}({', '.join(axes) or 'one rank'})"


@dataclass(frozen=True)
class CheckedPlan:
    """A plan that fits a job: checked against its world size (where known) and its model
    (where known) by `posttrain.train.plan_checks.check_plan`, which is how one is made.
    `posttrain.train.parallelize` and `build_mesh` take it without checking again.

    Attributes:
        plan: the plan (a `ParallelPlan`).
        world_size: the number of ranks it was checked against (None: not known then, e.g. a
            process without a process group; `parallelize` checks it against the group it
            finds).
        spec: the `ModelSpec` it was checked against (None: the model-dependent rules were not
            checked).
    """

    plan: PlanFields
    world_size: int | None
    spec: ModelSpec | None

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The job's `DeviceMesh`, with dimensions `MESH_DIMS` of the plan's sizes.

        Raises:
            RuntimeError: without an initialised process group.
            ValueError: if the process group's size is not the world size the plan was
                checked against (or, checked without one, the plan's own).
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        plan = self.plan
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{plan} needs an initialised torch.distributed process group "
                "(posttrain.launch.submit starts one per task; or "
                "dist.init_process_group)"
            )
        world = dist.get_world_size()
        if world != (self.world_size or plan.world_size):
            raise ValueError(
                f"{plan} was checked for a world size of {self.world_size or plan.world_size}; "
                f"this process group has {world} ranks: check the plan again "
                "(posttrain.train.plan_checks.check_plan) with the job's world size"
            )
        sizes = tuple(getattr(plan, name) for name in MESH_DIMS)
        return init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
