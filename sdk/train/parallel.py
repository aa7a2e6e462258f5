"""Parallel plans: how a model is split over the ranks of a job.

A `ParallelPlan` names the size of each parallelism axis; their product is the world size:

    dp_replicate  data parallel, full replicas (with dp_shard > 1: HSDP, replicate x shard)
    dp_shard      data parallel, parameters, gradients and optimizer state sharded (FSDP2)
    tp            tensor parallel inside each layer (torchtune's Llama TP plan, which fits
                  qwen2's module names: attention q/k/v colwise + output rowwise, MLP w1/w3
                  colwise + w2 rowwise)
    sp            sequence parallel (Ulysses: verl's all-to-all of sequence <-> heads)
    pp            pipeline stages (torch.distributed.pipelining, GPipe or 1F1B)
    ep            expert parallel (the experts of an MoE model split over ranks)

Ranks that differ only in their dp_replicate, dp_shard or ep coordinate see different data
(`data_parallel_size` of them); ranks that differ only in tp, sp or pp share a batch. The
`DeviceMesh` has all six dimensions, in the order `MESH_DIMS` (outermost first: pipeline stages
are the most distant ranks, tensor-parallel ones the nearest), size-1 dimensions included.

Loss normalisation: the trainers divide the summed token loss by the number of trained tokens
in the whole step (all micro-batches, all data-parallel ranks); FSDP2 is told to SUM gradients
(`set_gradient_divide_factor(1.0)`) rather than average them, so a plan's gradient is the
single-process gradient of the global batch up to float rounding.

Checked before any process group exists (`validate`): sizes are positive integers, their
product equals the world size, tp and sp divide the head counts, pp does not exceed the number
of layers, ep divides the number of experts of an MoE model (and is 1 for a dense model). The
fields are checked when the plan is made; it is frozen, so each check against a world size or a
model runs once per process and is remembered (`posttrain.train.plan_checks`).

`plan.parallelize(model)` hands the plan to `posttrain.train.sharding.parallelize`, which splits
the model and returns its `PlanRuntime`; it asks `plan_checks` (the remembered checks, the mesh)
and reads the plan as a value, so the walk never comes back here.

Example:
    >>> from posttrain.models import get_preset
    >>> plan = ParallelPlan(dp_shard=2, tp=2)
    >>> plan.world_size, plan.data_parallel_size
    (4, 2)
    >>> plan.validate(world_size=4, spec=get_preset("tiny-1m"))
    >>> ParallelPlan(tp=3).validate(  # doctest: +NORMALIZE_WHITESPACE
    ...     world_size=3, spec=get_preset("tiny-1m"))
    Traceback (most recent call last):
    ...
    ValueError: ParallelPlan.tp=3 must divide num_heads=4 and num_kv_heads=2 of the model;
    allowed tp: 1, 2
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from posttrain.core.checks import check_fields
from posttrain.train import plan_checks, sharding
from posttrain.train.plan_checks import AXES, MESH_DIMS
from posttrain.train.plan_compat import apply_plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from posttrain.models.specs import ModelSpec
    from posttrain.train.runtime import PlanRuntime

__all__ = ["ParallelPlan", "MESH_DIMS", "AXES"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SCHEDULES = ("gpipe", "1f1b")


@dataclass(kw_only=True, frozen=True)
class ParallelPlan:
    """How a model and its training state are split over the ranks of a job.

    Args:
        dp_replicate: data-parallel replicas (HSDP's replicate dimension when dp_shard > 1).
        dp_shard: FSDP2 shards of parameters, gradients and optimizer state.
        tp: tensor-parallel ranks per layer (must divide num_heads and num_kv_heads).
        sp: Ulysses sequence-parallel ranks (must divide num_heads and num_kv_heads).
        pp: pipeline stages (at most num_layers).
        ep: expert-parallel ranks (must divide num_experts; 1 for a dense model).
        pp_schedule: "gpipe" or "1f1b".
        n_microbatches: micro-batches per pipeline step (default: pp).
        param_dtype: FSDP2 mixed precision: the dtype parameters are gathered in for compute
            ("float32", "bfloat16", "float16"; None: the model's own). Setting it (or
            reduce_dtype, cpu_offload) applies FSDP2 even without data-parallel ranks (a mesh of
            one rank: mixed precision on a single device).
        reduce_dtype: FSDP2 mixed precision: the dtype of gradient reduction (None: param_dtype).
        cpu_offload: FSDP2 keeps parameters, gradients and optimizer state on CPU.
        activation_checkpointing: recompute each transformer layer's activations in backward.

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

    def __post_init__(self) -> None:
        for name in (*AXES, "n_microbatches"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))  # numpy integers too
        check_fields(self, AXES, integer=True, low=1)
        if self.pp_schedule not in _SCHEDULES:
            raise ValueError(
                f"ParallelPlan.pp_schedule={self.pp_schedule!r}; allowed: {', '.join(_SCHEDULES)}"
            )
        check_fields(self, ("n_microbatches",), integer=True, low=1, optional=True, note="= pp")
        if self.n_microbatches is not None and self.pp == 1:
            raise ValueError(
                f"ParallelPlan.n_microbatches={self.n_microbatches} needs pp > 1 "
                "(it is the pipeline's micro-batch count); use the trainer's "
                "grad_accum_steps for micro-batches without a pipeline"
            )
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value not in _DTYPES):
                raise ValueError(
                    f"ParallelPlan.{name}={value!r}; allowed: None, {', '.join(_DTYPES)}"
                )
        for name in ("cpu_offload", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ParallelPlan.{name}={getattr(self, name)!r}; must be a bool")

    # ------------------------------------------------------------------ sizes
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
        return self == ParallelPlan()

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
        param = _DTYPES[self.param_dtype] if self.param_dtype else None
        return param, _DTYPES[self.reduce_dtype] if self.reduce_dtype else param

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        axes = [f"{name}={getattr(self, name)}" for name in AXES if getattr(self, name) > 1]
        return f"ParallelPlan({', '.join(axes) or 'one rank'})"

    # ------------------------------------------------------------------ validation
    def validate(
        self, *, world_size: int | None = None, spec: ModelSpec | str | None = None
    ) -> None:
        """Check the plan against a world size and a model spec before any process starts.
        Each check that passes is remembered for the process (the plan is frozen), so asking
        again is free (`posttrain.train.plan_checks.check_fits`).

        Args:
            world_size: the job's number of ranks (None: not checked).
            spec: a `posttrain.models.ModelSpec` or a preset name (None: model-dependent rules
                not checked).

        Raises:
            ValueError: naming the field and the allowed values: a bad world_size or spec; the
                product differs from world_size; tp does not divide num_heads, num_kv_heads and
                the embedding and MLP widths; sp does not divide the heads per tp rank; pp
                exceeds num_layers; ep > 1 on a model without experts, or ep does not divide
                num_experts; tp or pp > 1 on an MoE model.
        """
        plan_checks.check_fits(self, world_size=world_size, spec=spec)

    # ------------------------------------------------------------------ building
    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The job's `DeviceMesh` with dimensions `MESH_DIMS` (needs an initialised default
        process group of `world_size` ranks; `posttrain.train.plan_checks.build_mesh`).

        Raises:
            RuntimeError: without an initialised process group.
            ValueError: if the process group's size differs from the plan's world size.
        """
        return plan_checks.build_mesh(self, device_type)

    def parallelize(
        self,
        model: nn.Module,
        *,
        spec: ModelSpec | str | None = None,
        mesh: DeviceMesh | None = None,
    ) -> PlanRuntime:
        """Split `model` over the ranks in place and return its `PlanRuntime`
        (`posttrain.train.sharding.parallelize`), which the trainers take as `runtime=`.

        Build the optimizer after this, over `runtime.model.parameters()`: FSDP2 and TP replace
        the parameters by DTensors (no-grad forwards in between, e.g. to look at logits, leave
        them in place; the trainers refuse an optimizer over other tensors, by name).
        """
        return sharding.parallelize(self, model, spec=spec, mesh=mesh)

    def apply(
        self,
        model: nn.Module,
        *,
        spec: ModelSpec | str | None = None,
        mesh: DeviceMesh | None = None,
    ) -> nn.Module:
        """Deprecated (one release): `runtime = plan.parallelize(model, spec=spec)` and pass
        `runtime=runtime` to the trainer. Splits `model` in place and returns it; its runtime is
        recorded for `plan_state(model)` and for trainers given the model (and `plan=`) only
        (`posttrain.train.plan_compat`)."""
        return apply_plan(self, model, spec=spec, mesh=mesh, _stacklevel=4)
