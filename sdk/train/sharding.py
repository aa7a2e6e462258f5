"""Applying a `ParallelPlan` to a torchtune decoder, and the collectives the trainers need under
one: sums over the data-parallel ranks, the gradient norm of DTensor gradients, gradient sync
across micro-batches, and full (unsharded) weights for export.

Order of application (as torchtitan and torchtune's distributed recipes do it):

    1. broadcast every parameter from global rank 0 (all ranks start from the same weights);
    2. TP: `torchtune.training.prepare_mha_for_tp` (heads per rank) then `parallelize_module`
       with `torchtune.models.llama3.base_llama_tp_plan()` on mesh["tp"]; with tied embeddings
       the embedding and output projection stay replicated (the tied output is not a module);
    3. SP: Ulysses all-to-alls around each attention call, the input sliced along the sequence
       and the logits gathered back (`posttrain.train.sequence_parallel`);
    4. activation checkpointing of every transformer layer (torchtune's helper);
    5. FSDP2 (`fully_shard`) of every layer, then of the root, sharded over the ranks that
       compute their own gradient shares (dp_shard, ep and sp, flattened into one mesh
       dimension "fsdp") and, with dp_replicate > 1, replicated over dp_replicate (HSDP), with
       the plan's mixed precision and CPU offload, gradient reduction set to SUM. The root
       keeps its parameters gathered after a forward for the backward that follows (FSDP2's
       default); after a forward no backward follows (under `torch.no_grad()`, or with no
       output that requires grad) it is resharded (`reshard_root_after_frozen_forward`), so
       `model.parameters()` are always the sharded parameters that receive the gradients,
       whatever ran between `plan.apply` and building the optimizer.

Example (needs a process group; see tests/test_parallel_plans.py):

    plan = ParallelPlan(dp_shard=2, tp=2)
    model = plan.apply(build_model(spec, seed=0), spec=spec)   # in place, returns it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)       # after apply
    Trainer(model, opt, data=loader, plan=plan).fit(10)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from posttrain.core.distributed import flat_collective
from posttrain.models.conversion import check_plan_axes
from posttrain.train.optimizer_check import remember_parameters, reshard

__all__ = ["apply_plan", "check_plan", "clip_grads_with_norm_", "PlanState", "plan_state", "total_grad_norm",
           "set_gradient_sync", "reshard", "reshard_root_after_frozen_forward",
           "full_state_dict", "sum_over_data_ranks"]



@dataclass(frozen=True)
class PlanState:
    """What `apply_plan` leaves on a model (`plan_state(model)`).

    Attributes:
        plan: the ParallelPlan applied.
        mesh: its DeviceMesh (dimensions `MESH_DIMS`).
        data_rank: this rank's index among the data-parallel ranks (0..data_parallel_size-1).
        data_group: the process group of the ranks that see different data and share this
            rank's tp/sp/pp coordinates (sums of token counts and losses go over it).
        fsdp: whether FSDP2 was applied (data_parallel_size > 1).
        grad_sync: called after the step's last backward to reduce the gradients no wrapper
            reduced (expert weights over the ranks that hold the same experts; the two copies
            of a tied embedding matrix on the first and last pipeline stage), or None.
        pipeline: the `PipelineRunner` of this rank's stage (pp > 1), or None.
        pp_group: the pipeline group (the gradient norm sums over its stages), or None.
        tied_copy: the last stage's copy of a tied embedding matrix (left out of the norm).
        spec: the model's ModelSpec when `apply_plan` was given one (the memory check uses it).
    """

    plan: Any
    mesh: Any
    data_rank: int
    data_group: Any
    fsdp: bool
    grad_sync: Any = None
    pipeline: Any = None
    pp_group: Any = None
    tied_copy: Any = None
    spec: Any = None


def plan_state(model: nn.Module) -> PlanState | None:
    """The `PlanState` of a model a plan was applied to; None for a plain model."""
    return getattr(model, "_posttrain_plan_state", None)


def _layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise TypeError(f"a ParallelPlan applies to a torchtune TransformerDecoder (a model with "
                        f".layers); got {type(model).__name__}")
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def apply_plan(plan: Any, model: nn.Module, *, spec: Any = None, mesh: Any = None) -> nn.Module:
    """Split `model` over this job's ranks according to `plan`, in place; returns `model`.

    Args:
        plan: a `posttrain.train.parallel.ParallelPlan`.
        model: a torchtune decoder built identically on every rank (same seed); its parameters
            are broadcast from rank 0 first, so a different init elsewhere is overwritten.
        spec: its `ModelSpec`, for the model-dependent checks of `plan.validate`.
        mesh: a DeviceMesh built by `plan.build_mesh()` (default: built here).

    Raises:
        ValueError: if the plan does not fit the world size or the model (`plan.validate`), or
            the model already has a plan, or a converter applied to it (LoRA, FP8, ...) does
            not support one of the plan's axes (`posttrain.train.converters.PLAN_AXES`).
        ValueError: for cpu_offload on a model that is on the CPU, or pp > 1 on an MoE model.
        RuntimeError: without an initialised process group.
    """
    if plan_state(model) is not None:
        raise ValueError("this model already has a ParallelPlan applied; build a fresh model")
    check_plan_axes(model, plan)  # a converted model (LoRA, FP8, ...) allows fewer axes
    plan.validate(world_size=dist.get_world_size() if dist.is_initialized() else None, spec=spec)
    if isinstance(spec, str):
        from posttrain.models.specs import get_preset

        spec = get_preset(spec)
    if plan.world_size == 1 and not plan.fsdp and not dist.is_initialized():
        return _apply_one_rank(plan, model, spec)
    layers = _layers(model)
    device = next(model.parameters()).device
    if plan.cpu_offload and device.type == "cpu":
        raise ValueError("ParallelPlan.cpu_offload=True moves parameters, gradients and optimizer "
                         "state from an accelerator to host memory; this model is on the CPU "
                         "already: allowed cpu_offload on CPU: False")
    mesh = mesh if mesh is not None else plan.build_mesh(device.type)
    remember_parameters(model, f"{plan} was applied (which replaces the parameters)")
    flat_collective(list(model.parameters()), lambda flat: dist.broadcast(flat, src=0))
    syncs = []
    pipeline_info = None
    if plan.pp > 1:
        from posttrain.train import pipeline

        pipeline_info = pipeline.split_into_stage(model, mesh)
        layers = _layers(model)
        if pipeline_info["tied"]:
            group = pipeline.tied_group(mesh)
            syncs.append(lambda: pipeline.sync_tied_grads(model, group))
    if plan.tp > 1:
        _apply_tp(model, mesh["tp"])
    if plan.sp > 1:
        from posttrain.train.sequence_parallel import apply_ulysses

        apply_ulysses(model, mesh)
    ignored: set[nn.Parameter] = set()
    if plan.ep > 1:
        from posttrain.train.expert_parallel import (apply_expert_parallel, expert_parameters,
                                                     sync_expert_grads)

        apply_expert_parallel(model, mesh)
        ignored = set(expert_parameters(model))
        group = _group_over(mesh, ("dp_replicate", "dp_shard", "sp"))
        if group is not None:
            syncs.append(lambda: sync_expert_grads(model, group))
    if plan.activation_checkpointing:
        from torchtune.modules import TransformerSelfAttentionLayer
        from torchtune.training import set_activation_checkpointing

        set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
        layers = _layers(model)
    fsdp = plan.fsdp
    if fsdp:
        _apply_fsdp(plan, model, layers, mesh, ignored)
    dims = ("dp_replicate", "dp_shard", "ep")
    coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    data_rank = ((coordinate["dp_replicate"] * plan.dp_shard + coordinate["dp_shard"]) * plan.ep
                 + coordinate["ep"])
    data_group = mesh[dims]._flatten("data").get_group() if plan.data_parallel_size > 1 else None
    state = dict(plan=plan, mesh=mesh, data_rank=data_rank, data_group=data_group, fsdp=fsdp,
                 spec=spec,
                 grad_sync=(lambda: [sync() for sync in syncs]) if syncs else None)
    if pipeline_info is not None:
        from posttrain.train.pipeline import PipelineRunner

        last_tied = pipeline_info["tied"] and pipeline_info["last"]
        state.update(pipeline=PipelineRunner(model, pipeline_info, plan),
                     pp_group=pipeline_info["group"],
                     tied_copy=model.tok_embeddings.weight if last_tied else None)
    model._posttrain_plan_state = PlanState(**state)
    return model


def _apply_one_rank(plan: Any, model: nn.Module, spec: Any) -> nn.Module:
    """A plan of one rank without FSDP2 settings, in a process without a process group: only
    activation checkpointing applies."""
    _layers(model)
    if plan.activation_checkpointing:
        from torchtune.modules import TransformerSelfAttentionLayer
        from torchtune.training import set_activation_checkpointing

        set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    model._posttrain_plan_state = PlanState(plan=plan, mesh=None, data_rank=0, data_group=None,
                                            fsdp=False, spec=spec)
    return model


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
    from torch.utils._pytree import tree_leaves

    pending = {"backward": False}

    def started_backward(grad: torch.Tensor) -> None:
        pending["backward"] = False

    def after_forward(module: nn.Module, args: Any, output: Any) -> None:
        needs_grad = [t for t in tree_leaves(output)
                      if isinstance(t, torch.Tensor) and t.requires_grad]
        if needs_grad:
            pending["backward"] = True
            for t in needs_grad:
                t.register_hook(started_backward)
        elif not pending["backward"]:
            module.reshard()

    root.register_forward_hook(after_forward)  # after FSDP2's own post-forward hook


def _group_over(mesh: Any, dims: tuple[str, ...]) -> Any:
    """The process group of the ranks that differ only in `dims` of `mesh` (which need not be
    adjacent), or None when that group has one rank. Collective: every rank creates every
    group, in the same order."""
    names = list(mesh.mesh_dim_names)
    ranks = mesh.mesh.permute([i for i, n in enumerate(names) if n not in dims]
                              + [names.index(d) for d in dims])
    size = math.prod(mesh[d].size() for d in dims)
    if size == 1:
        return None
    mine, _ = dist.new_subgroups_by_enumeration(ranks.reshape(-1, size).tolist())
    return mine


def _apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtune.models.llama3 import base_llama_tp_plan
    from torchtune.training import prepare_mha_for_tp

    layer_plan = dict(base_llama_tp_plan())
    if not isinstance(getattr(model, "output", None), nn.Module):
        # Tied embeddings: the output projection reuses tok_embeddings.weight through a plain
        # callable; both stay replicated (a sharded embedding would meet a replicated matmul).
        layer_plan.pop("tok_embeddings")
        layer_plan.pop("output")
    prepare_mha_for_tp(model, tp_mesh)
    parallelize_module(model, tp_mesh, layer_plan)


def _apply_fsdp(plan: Any, model: nn.Module, layers: list[nn.Module], mesh: Any,
                ignored: set[nn.Parameter]) -> None:
    from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                        fully_shard)

    # Parameters are replicated over every rank that computes its own share of the gradient:
    # the data-parallel ranks and the sp ranks. FSDP2 shards over (dp_shard, ep, sp) flattened,
    # and replicates over dp_replicate (HSDP).
    dp_mesh = mesh["dp_shard", "ep", "sp"]._flatten("fsdp")
    if plan.dp_replicate > 1:
        dp_mesh = mesh["dp_replicate", "fsdp"]
    param_dtype, reduce_dtype = plan.torch_dtypes()
    options = dict(mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype,
                                                                reduce_dtype=reduce_dtype),
                   ignored_params=ignored or None)
    if plan.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    reshard_root_after_frozen_forward(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The trainers normalise by the global token count themselves: SUM, not average.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def sum_over_data_ranks(model: nn.Module, value: torch.Tensor) -> torch.Tensor:
    """SUM of a tensor over the data-parallel ranks of `model`'s plan (a copy; `value` itself
    with one data rank)."""
    state = plan_state(model)
    if state is None or state.data_group is None:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, group=state.data_group)
    return value


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """FSDP2: reduce gradients in this backward (`enabled`, the step's last micro-batch) or
    keep accumulating them unsharded (earlier micro-batches). No-op for a model without FSDP."""
    state = plan_state(model)
    if state is not None and state.fsdp:
        model.set_requires_gradient_sync(enabled)


def total_grad_norm(grads: list[torch.Tensor], state: PlanState | None = None) -> torch.Tensor:
    """Global L2 norm of gradients that may be DTensors on different meshes (FSDP2 shards,
    TP shards, replicated plain tensors): one `get_total_norm` per mesh, each made whole with
    `full_tensor()`, combined as sqrt(sum of squares); under pipeline parallelism the squares
    are summed over the stages, a tied embedding matrix counted once. Returns a plain 0-dim
    float tensor."""
    from torch.distributed.tensor import DTensor

    skip = state.tied_copy.grad if state is not None and state.tied_copy is not None else None
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        if g is skip:
            continue
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    squares = []
    for key, members in groups.items():
        norm = torch.nn.utils.get_total_norm(members, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.double() ** 2)
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    if state is not None and state.pp_group is not None:
        dist.all_reduce(total, group=state.pp_group)
    return total.sqrt().to(torch.float32)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded `state_dict()` of a model under a plan, on CPU, on every rank (collective:
    every rank must call it); the plain state dict for a model without a plan. Use it to export
    a sharded run (`posttrain.models.save_hf_checkpoint` on rank 0)."""
    if plan_state(model) is None:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=False))
    state = {k: v.detach().cpu() for k, v in state.items()}
    pp_group = plan_state(model).pp_group
    if pp_group is not None:  # each stage holds some of the names: merge them
        stages: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, state, group=pp_group)
        state = {k: v for stage in stages for k, v in stage.items()}
    return state


def check_plan(model: nn.Module, plan: Any) -> None:
    """A trainer's check that `plan` (when given) is the plan applied to `model`. Whether the
    optimizer holds the model's current parameters is checked for every trainer, with or
    without a plan, by `posttrain.train.optimizer_check.check_optimizer`.

    Raises:
        ValueError: if `plan` is given but was not applied to `model`, or another plan was.
    """
    state = plan_state(model)
    if plan is not None and state is None:
        raise ValueError(f"{plan} was not applied to the model: call model = plan.apply(model, "
                         "spec=spec) first, then build the optimizer over model.parameters()")
    if plan is not None and state.plan != plan:
        raise ValueError(f"the model was split by {state.plan}, not by the given {plan}")


def clip_grads_with_norm_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients (DTensors on any mesh, or plain) by min(1, max_norm / (total_norm +
    1e-6)), the coefficient of `torch.nn.utils.clip_grads_with_norm_`, in place on each rank's
    local shard (a scalar scale needs no communication)."""
    from torch.distributed.tensor import DTensor

    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    torch._foreach_mul_(local, coef.to(local[0].device))
