"""Applying a `ParallelPlan` to a torchtune decoder: `parallelize(plan, model, spec=spec)` splits
the model in place and returns the `PlanRuntime` the trainer holds (`posttrain.train.runtime`:
sums over the data-parallel ranks, gradient syncs and norm, full weights, checkpoint shards).
`plan.parallelize(model)` calls it. It takes the plan as a value: a `CheckedPlan` (a recipe's
run start checked it against the job's world size and model in one call,
`posttrain.train.plan_checks.check_plan`), used as it is, or a bare plan (from a notebook),
checked here first. Either way the call never returns into `posttrain.train.parallel`, and a
checked plan does not go back to `plan_checks`.

Order of application (as torchtitan's `parallelize_llama` and torchtune's distributed recipes
do it), one small function per axis:

    1. broadcast every parameter from global rank 0 (all ranks start from the same weights);
    2. PP: keep this rank's pipeline stage (`posttrain.train.pipeline.split_into_stage`);
    3. TP: `torchtune.training.prepare_mha_for_tp` (heads per rank) then `parallelize_module`
       with `torchtune.models.llama3.base_llama_tp_plan()` on mesh["tp"]; with tied embeddings
       the embedding and output projection stay replicated (the tied output is not a module);
       Qwen3's per-head q/k norms see only this rank's heads, so their scales are replicated
       DTensors over the heads dimension (`SequenceParallel(sequence_dim=2)`), whose gradients
       are summed over mesh["tp"] (a plain scale would keep this rank's heads' share only);
    4. SP: Ulysses all-to-alls around each attention call, the input sliced along the sequence
       and the logits gathered back (`posttrain.train.sequence_parallel`);
    5. EP: the experts of an MoE model split over mesh["ep"] (`posttrain.train.expert_parallel`);
    6. activation checkpointing of every transformer layer (torchtune's helper), then, with
       `compile`, `torch.compile` of every block (`posttrain.train.compile.compile_blocks`);
    7. FSDP2 (`fully_shard`) of every layer, then of the root, sharded over the ranks that
       compute their own gradient shares (dp_shard, ep and sp, flattened into one mesh
       dimension "fsdp") and, with dp_replicate > 1, replicated over dp_replicate (HSDP), with
       the plan's mixed precision and CPU offload, gradient reduction set to SUM. The root
       keeps its parameters gathered after a forward for the backward that follows (FSDP2's
       default); after a forward no backward follows (under `torch.no_grad()`, or with no
       output that requires grad) it is resharded (`reshard_root_after_frozen_forward`), so
       `model.parameters()` are always the sharded parameters that receive the gradients,
       whatever ran between `parallelize` and building the optimizer.

Nothing about the plan is stored on the model: the trainer holds the runtime. The earlier
spelling, `model = plan.apply(model, spec=spec)` and `Trainer(model, ..., plan=plan)`, works for
one more release with a DeprecationWarning (`posttrain.train.plan_compat`, which also has
`full_state_dict(model_or_runtime)`).

Example (needs a process group; see tests/train/test_parallel_plans.py):

    plan = ParallelPlan(dp_shard=2, tp=2)
    runtime = plan.parallelize(build_model(spec, seed=0), spec=spec)  # splits it in place
    opt = torch.optim.AdamW(runtime.model.parameters(), lr=1e-3)     # after parallelize
    loader = SFTLoader(dataset, batch_size=8, rank=runtime.data_rank,
                       world_size=runtime.data_size)
    Trainer(runtime.model, opt, data=loader, runtime=runtime).fit(10)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from posttrain.core.distributed import flat_collective
from posttrain.models.conversion import check_plan_axes
from posttrain.train import pipeline
from posttrain.train.collectives import clip_grads_with_norm_, total_grad_norm
from posttrain.train.compile import compile_blocks
from posttrain.train.expert_parallel import (
    apply_expert_parallel,
    expert_parameters,
    sync_expert_grads,
)
from posttrain.train.optimizer_check import remember_parameters, reshard
from posttrain.train.plan_checks import check_plan
from posttrain.train.plan_value import CheckedPlan, PlanFields
from posttrain.train.runtime import PlanRuntime
from posttrain.train.sequence_parallel import apply_ulysses

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torchtune.modules import TransformerDecoder

    from posttrain.models.specs import ModelSpec

__all__ = [
    "parallelize",
    "parallelized",
    "reshard_root_after_frozen_forward",
    "reshard",
    "total_grad_norm",
    "clip_grads_with_norm_",
]


def _layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise TypeError(
            f"a ParallelPlan applies to a torchtune TransformerDecoder (a model with "
            f".layers); got {type(model).__name__}"
        )
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def parallelize(
    plan: PlanFields | CheckedPlan,
    model: TransformerDecoder,
    *,
    spec: ModelSpec | str | None = None,
    mesh: DeviceMesh | None = None,
) -> PlanRuntime:
    """Split `model` over this job's ranks according to `plan`, in place; returns the
    `PlanRuntime` the trainers take (`runtime.model is model`).

    Args:
        plan: a `posttrain.train.parallel.ParallelPlan` (checked here against the process
            group's size and `spec`), or the `CheckedPlan` of `plan_checks.check_plan` (not
            checked again, unless `spec` differs from the one it was checked against or the
            process group's size was not known then).
        model: a torchtune decoder built identically on every rank (same seed); its parameters
            are broadcast from rank 0 first, so a different init elsewhere is overwritten.
            Apply converters (LoRA, FP8, QAT) before, build the optimizer after.
        spec: its `ModelSpec` (or a preset name), for the model-dependent checks of
            `plan.validate` and the trainers' memory check (default: a checked plan's own).
        mesh: a DeviceMesh built by `plan.build_mesh()` (default: built here).

    Raises:
        ValueError: if the plan does not fit the world size or the model (`plan.validate`),
            the model already has a plan applied (`parallelized`), or a converter applied to
            it (LoRA, FP8, ...) does not support one of the plan's axes
            (`posttrain.train.converters.PLAN_AXES`).
        ValueError: for cpu_offload on a model that is on the CPU, or pp > 1 on an MoE model.
        TypeError: for a model without `.layers` (not a torchtune decoder).
        RuntimeError: without an initialised process group (a plan of one rank without FSDP2
            settings needs none: only activation checkpointing applies).
    """
    done = parallelized(model)
    if done is not None:
        raise ValueError(
            f"this model already has a ParallelPlan applied ({done}); build a fresh model"
        )
    # a converted model (LoRA, FP8, ...) allows fewer axes
    check_plan_axes(model, plan.plan if isinstance(plan, CheckedPlan) else plan)
    checked = _checked(plan, spec)
    plan, spec = checked.plan, checked.spec
    if plan.world_size == 1 and not plan.fsdp and not dist.is_initialized():
        return _parallelize_one_rank(plan, model, spec)
    layers = _layers(model)
    device = next(model.parameters()).device
    if plan.cpu_offload and device.type == "cpu":
        raise ValueError(
            "ParallelPlan.cpu_offload=True moves parameters, gradients and optimizer "
            "state from an accelerator to host memory; this model is on the CPU "
            "already: allowed cpu_offload on CPU: False"
        )
    mesh = mesh if mesh is not None else checked.build_mesh(device.type)
    remember_parameters(model, f"{plan} was applied (which replaces the parameters)")
    flat_collective(list(model.parameters()), lambda flat: dist.broadcast(flat, src=0))
    syncs = []
    pipeline_info = None
    if plan.pp > 1:
        pipeline_info = pipeline.split_into_stage(model, mesh)
        layers = _layers(model)
        if pipeline_info["tied"]:
            tied_group = pipeline.tied_group(mesh)
            syncs.append(lambda: pipeline.sync_tied_grads(model, tied_group))
    if plan.tp > 1:
        _apply_tp(model, mesh["tp"])
    if plan.sp > 1:
        apply_ulysses(model, mesh)
    ignored: set[nn.Parameter] = set()
    if plan.ep > 1:
        apply_expert_parallel(model, mesh)
        ignored = set(expert_parameters(model))
        expert_group = _group_over(mesh, ("dp_replicate", "dp_shard", "sp"))
        if expert_group is not None:
            syncs.append(lambda: sync_expert_grads(model, expert_group))
    if plan.activation_checkpointing:
        _apply_ac(model)
        layers = _layers(model)
    if plan.compile:  # after activation checkpointing, before FSDP2 (torchtitan's order)
        compile_blocks(model)
    if plan.fsdp:
        _apply_fsdp(plan, model, layers, mesh, ignored)
    dims = ("dp_replicate", "dp_shard", "ep")
    coordinate = dict(zip(_dim_names(mesh), _coordinate(mesh)))
    data_rank = (
        coordinate["dp_replicate"] * plan.dp_shard + coordinate["dp_shard"]
    ) * plan.ep + coordinate["ep"]
    data_group = mesh[dims]._flatten("data").get_group() if plan.data_parallel_size > 1 else None
    parts: dict[str, Any] = {}
    if pipeline_info is not None:
        last_tied = pipeline_info["tied"] and pipeline_info["last"]
        parts = dict(
            pipeline=pipeline.PipelineRunner(model, pipeline_info, plan),
            pp_group=pipeline_info["group"],
            tied_copy=model.tok_embeddings.weight if last_tied else None,
        )
    return PlanRuntime(
        model=model,
        plan=plan,
        mesh=mesh,
        data_rank=data_rank,
        data_group=data_group,
        fsdp=plan.fsdp,
        grad_syncs=tuple(syncs),
        spec=spec,
        **parts,
    )


def _checked(plan: PlanFields | CheckedPlan, spec: ModelSpec | str | None) -> CheckedPlan:
    """`plan` checked against this process's group and `spec`: a `CheckedPlan` as it is, when
    it was checked against both already; otherwise `plan_checks.check_plan`."""
    world = dist.get_world_size() if dist.is_initialized() else None
    if isinstance(plan, CheckedPlan):
        if (spec is None or spec == plan.spec) and (world is None or world == plan.world_size):
            return plan
        spec, plan = (plan.spec if spec is None else spec), plan.plan
    return check_plan(plan, world_size=world, spec=spec)


def parallelized(model: nn.Module) -> str | None:
    """What shows that a plan was applied to `model` (FSDP2 units, DTensor parameters,
    activation-checkpoint wrappers, a pipeline stage's forward), or None for a plain model.
    Read from the modules themselves: nothing about the plan is stored on the model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if pipeline.is_stage(model):
        return "a pipeline stage"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            return "FSDP2"
        if isinstance(module, CheckpointWrapper):
            return "activation checkpointing"
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "DTensor parameters"
    return None


def _parallelize_one_rank(
    plan: PlanFields, model: nn.Module, spec: ModelSpec | None
) -> PlanRuntime:
    """A plan of one rank without FSDP2 settings, in a process without a process group: only
    activation checkpointing and compile apply."""
    _layers(model)
    if plan.activation_checkpointing:
        _apply_ac(model)
    if plan.compile:
        compile_blocks(model)
    return PlanRuntime(
        model=model, plan=plan, mesh=None, data_rank=0, data_group=None, fsdp=False, spec=spec
    )


def _apply_ac(model: nn.Module) -> None:
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.training import set_activation_checkpointing

    set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})


def reshard_root_after_frozen_forward(root: nn.Module) -> None:
    """Reshard the FSDP2 root `root` after every forward that no backward will follow.

    FSDP2 does not reshard the root after its forward (the backward needs its parameters
    first): until a backward reshards it, the root's gathered (unsharded) parameters are
    registered in place of the sharded ones, and `root.parameters()` returns them. An optimizer
    built then holds tensors that never receive a gradient: those parameters would silently
    stay as they are. After a forward with no output that requires grad (under
    `torch.no_grad()` / `torch.inference_mode()`, or of a frozen model), this hook reshards the
    root at once, as FSDP2 does every other unit. After a forward whose outputs require grad
    the root stays gathered until their backward has begun (a frozen forward in between, as
    KTO's KL term, leaves it so); a forward with grad that is never backpropagated leaves it
    gathered, and the trainers' check (`posttrain.train.optimizer_check`) reshards it and
    names the tensors of an optimizer built meanwhile.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.utils._pytree import tree_leaves

    if not isinstance(root, FSDPModule):
        raise TypeError(
            f"reshard_root_after_frozen_forward needs an FSDP2 root (a module "
            f"fully_shard was applied to); got {type(root).__name__}"
        )
    pending = {"backward": False}

    def started_backward(grad: torch.Tensor) -> None:
        pending["backward"] = False

    def after_forward(module: nn.Module, args: Any, output: Any) -> None:
        needs_grad = [
            t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if needs_grad:
            pending["backward"] = True
            for t in needs_grad:
                t.register_hook(started_backward)
        elif not pending["backward"]:
            root.reshard()  # `module` is `root`

    root.register_forward_hook(after_forward)  # after FSDP2's own post-forward hook


def _dim_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The names of `mesh`'s dimensions (`MESH_DIMS` for `plan.build_mesh()`'s)."""
    if mesh.mesh_dim_names is None:
        raise ValueError(
            "parallelize needs a mesh with named dimensions (plan.build_mesh() "
            "names them); this one has none"
        )
    return mesh.mesh_dim_names


def _coordinate(mesh: DeviceMesh) -> tuple[int, ...]:
    """This rank's coordinate in `mesh`."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(
            f"this rank ({dist.get_rank()}) is not in the mesh given to parallelize ({mesh})"
        )
    return coordinate


def _group_over(mesh: DeviceMesh, dims: tuple[str, ...]) -> ProcessGroup | None:
    """The process group of the ranks that differ only in `dims` of `mesh` (which need not be
    adjacent), or None when that group has one rank. Collective: every rank creates every
    group, in the same order."""
    names = list(_dim_names(mesh))
    ranks = mesh.mesh.permute(
        [i for i, n in enumerate(names) if n not in dims] + [names.index(d) for d in dims]
    )
    size = math.prod(mesh[d].size() for d in dims)
    if size == 1:
        return None
    mine, _ = dist.new_subgroups_by_enumeration(ranks.reshape(-1, size).tolist())
    return mine


def _apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
    from torchtune.models.llama3 import base_llama_tp_plan
    from torchtune.training import prepare_mha_for_tp

    layer_plan: dict[str, Any] = dict(base_llama_tp_plan())
    if any(getattr(layer.attn, "q_norm", None) is not None for layer in _layers(model)):
        # q [B, T, H / tp, d] per rank: the scale is shared by all heads (the ones elsewhere too)
        for name in ("q_norm", "k_norm"):
            layer_plan[f"layers.*.attn.{name}"] = SequenceParallel(
                sequence_dim=2, use_local_output=True
            )
    if not isinstance(getattr(model, "output", None), nn.Module):
        # Tied embeddings: the output projection reuses tok_embeddings.weight through a plain
        # callable; both stay replicated (a sharded embedding would meet a replicated matmul).
        layer_plan.pop("tok_embeddings")
        layer_plan.pop("output")
    prepare_mha_for_tp(model, tp_mesh)
    parallelize_module(model, tp_mesh, layer_plan)


def _apply_fsdp(
    plan: PlanFields,
    model: nn.Module,
    layers: list[nn.Module],
    mesh: DeviceMesh,
    ignored: set[nn.Parameter],
) -> None:
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    # Parameters are replicated over every rank that computes its own share of the gradient:
    # the data-parallel ranks and the sp ranks. FSDP2 shards over (dp_shard, ep, sp) flattened,
    # and replicates over dp_replicate (HSDP).
    dp_mesh = mesh["dp_shard", "ep", "sp"]._flatten("fsdp")
    if plan.dp_replicate > 1:
        dp_mesh = mesh["dp_replicate", "fsdp"]
    param_dtype, reduce_dtype = plan.torch_dtypes()
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # fully_shard's default offload policy is OffloadPolicy() (none)
    offload_policy = CPUOffloadPolicy() if plan.cpu_offload else OffloadPolicy()
    for module in (*layers, model):  # every block, then the root
        fully_shard(
            module,
            mesh=dp_mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored_params=ignored or None,
        )
    reshard_root_after_frozen_forward(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The trainers normalise by the global token count themselves: SUM, not average.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
