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

from typing import TYPE_CHECKING

from posttrain.train.plan_value import AXES, MESH_DIMS, PlanFields

if TYPE_CHECKING:  # torch loads when a plan is checked or applied, not when a config names one
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from posttrain.models.specs import ModelSpec
    from posttrain.train.runtime import PlanRuntime

__all__ = ["ParallelPlan", "MESH_DIMS", "AXES"]


class ParallelPlan(PlanFields):
    """How a model and its training state are split over the ranks of a job.

    The fields, their checks and the sizes that follow from them (`world_size`, `fsdp`,
    `data_parallel_size`, `microbatches`, `is_default`, `torch_dtypes()`) are those of its
    value type, `posttrain.train.plan_value.PlanFields`, which the modules that apply a plan
    read; this class adds what a notebook asks of a plan: `validate`, `build_mesh`,
    `parallelize` (`posttrain.train.check_plan` returns it checked, as a `CheckedPlan`).

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
        compile: `torch.compile` each transformer block (after activation checkpointing, before
            FSDP2; `posttrain.train.compile`); not with sp, ep or pp > 1.

    Raises:
        ValueError: naming the field and its allowed values, for a size that is not a positive
            integer, an unknown dtype or schedule, or n_microbatches without pp > 1.
    """

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
        from posttrain.train import plan_checks

        plan_checks.check_fits(self, world_size=world_size, spec=spec)

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The job's `DeviceMesh` with dimensions `MESH_DIMS` (needs an initialised default
        process group of `world_size` ranks; `posttrain.train.plan_checks.build_mesh`).

        Raises:
            RuntimeError: without an initialised process group.
            ValueError: if the process group's size differs from the plan's world size.
        """
        from posttrain.train import plan_checks

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
        from posttrain.train import sharding

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
        from posttrain.train.plan_compat import apply_plan

        return apply_plan(self, model, spec=spec, mesh=mesh, _stacklevel=4)
