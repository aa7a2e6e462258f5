"""Preference training under a `ParallelPlan`: the data-parallel preference loader, the padding
batch an empty share gets, and the reward model (backbone + scalar head) split by a plan.

Notation: B = pairs (or KTO rows) of a batch, W = data-parallel ranks.

The DPO family needs nothing else: the policy is split with `runtime = plan.parallelize(model,
spec=spec)` and trained by `Trainer(runtime.model, ..., runtime=runtime)` like SFT; the
reference log-probabilities are computed once, up front, by
`posttrain.preference.reference.compute_reference_logps`, which accepts the runtime of a
reference split by the same plan (each data-parallel rank scores its share of the batches, the
values are summed over the data ranks). A separate frozen reference is only needed when the
policy has already moved; the recipes score the starting policy itself before its first step.

KTO's reference point z0 is estimated on each micro-batch (`KTOLoss`), so under data
parallelism on each rank's share of it: the step equals one process's only with `use_kl=False`,
or up to the difference in z0 (as with gradient accumulation).

The reward model's head is part of the plan: FSDP2 wraps the `RewardModel` as the root above
the backbone's FSDP units (so the head's gradient is reduced with the rest), and under tensor
parallelism the head stays a replicated `nn.Linear` whose input (the final-norm hidden state)
is already replicated, so every tensor-parallel rank computes the same head gradient. Under
sequence parallelism the head reads the backbone's final output, which the Ulysses hooks gather
to the full sequence on every sp rank; its gradient is scaled so that the SUM over the sp ranks
counts it once (`_count_head_grads_once_over_sp`). pp and ep stay refused: a pipelined
backbone has no plain forward for the head to read, and an expert-parallel reward model is not
validated yet.

Example (needs a process group of 2 ranks; see tests/rl/test_plans_trainers.py):

    plan = ParallelPlan(dp_shard=2)
    runtime = parallelize_reward_model(plan, RewardModel.from_spec(spec, seed=0))
    opt = torch.optim.AdamW(runtime.model.parameters(), lr=1e-4)   # after the plan
    loader = ShardedPreferenceLoader(dataset, batch_size=8, rank=runtime.data_rank,
                                     world_size=runtime.data_size)
    Trainer(runtime.model, opt, data=loader, loss=BradleyTerryLoss(), runtime=runtime).fit(10)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from posttrain.core.distributed import flat_collective
from posttrain.data.preference_batches import KTOBatch, PreferenceBatch, PreferenceLoader
from posttrain.rewards.reward_model import RewardModel
from posttrain.train.optimizer_check import remember_parameters
from posttrain.train.parallel import ParallelPlan
from posttrain.train.plan_compat import register, runtime_of, warn_deprecated
from posttrain.train.plan_value import CheckedPlan, PlanFields
from posttrain.train.runtime import PlanRuntime, Runtime
from posttrain.train.sharding import parallelize, parallelized, reshard_root_after_frozen_forward

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torchtune.modules import TransformerDecoder

__all__ = [
    "ShardedPreferenceLoader",
    "PaddingPreferenceBatch",
    "PaddingKTOBatch",
    "trains_nothing",
    "parallelize_reward_model",
    "gathered_reward_model",
    "apply_plan_to_reward_model",
]


@dataclasses.dataclass(frozen=True)
class PaddingPreferenceBatch(PreferenceBatch):
    """One real pair standing in for an empty share: it runs forward and backward (so the
    collectives of FSDP2 and TP happen on every rank) and trains nothing (`trains_nothing`)."""

    trains_nothing: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True)
class PaddingKTOBatch(KTOBatch):
    """`PaddingPreferenceBatch` for KTO batches."""

    trains_nothing: ClassVar[bool] = True


def trains_nothing(batch: Any) -> bool:
    """True for the padding batch of a rank whose share of a global batch is empty: the
    preference losses count 0 units for it and scale its loss by 0."""
    return bool(getattr(batch, "trains_nothing", False))


def _as_padding(batch: PreferenceBatch | KTOBatch) -> PreferenceBatch | KTOBatch:
    cls = PaddingKTOBatch if isinstance(batch, KTOBatch) else PaddingPreferenceBatch
    return cls(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)})


class ShardedPreferenceLoader(PreferenceLoader):
    """`PreferenceLoader` over the data-parallel ranks: `batch_size` is the global batch; every
    rank walks the same seeded order and collates items r, r + W, r + 2W, ... of each global
    batch (strided, as `posttrain.data.loader.SFTLoader`), so the ranks' shares together are the
    one-process batch. The state is the global position (identical on every rank).

    The short last batch of an epoch may leave a rank without an item: it gets the batch's first
    pair as a `PaddingPreferenceBatch` (or `PaddingKTOBatch`), which the losses count as 0 pairs
    and multiply by 0, so that rank still runs the step's forward, backward and collectives.

    Args:
        dataset, batch_size, shuffle, seed: as `PreferenceLoader`.
        rank, world_size: this rank's place among the data-parallel ranks; under a plan
            `runtime.data_rank` and `runtime.data_size` (tensor-parallel ranks of one data rank
            get the same share). Default: the default process group's rank
            and size (0 and 1 without one).

    Raises:
        ValueError: for bad options, or a `batch_size` not divisible by `world_size`.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__(dataset, batch_size=batch_size, shuffle=shuffle, seed=seed)
        if rank is None or world_size is None:
            from posttrain.core.distributed import rank_and_world_size

            rank, world_size = rank_and_world_size()
        for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}={value!r}; must be an integer >= {low}")
        if rank >= world_size:
            raise ValueError(f"rank={rank} must be below world_size={world_size}")
        if batch_size % world_size:
            raise ValueError(
                f"ShardedPreferenceLoader: batch_size={batch_size} is not divisible "
                f"by world_size={world_size}; batch_size is the global batch of all "
                "data-parallel ranks together"
            )
        self.rank, self.world_size = rank, world_size

    def next_batch(self) -> PreferenceBatch | KTOBatch:
        """This rank's share of the next global batch (a padding batch when it is empty)."""
        indices = self._order[self.offset : self.offset + self.batch_size]
        self.offset += len(indices)
        if self.offset == len(self._order):
            self._start_epoch(self.epoch + 1)
        share = indices[self.rank :: self.world_size]
        if share:
            return self.dataset.collate(share)
        return _as_padding(self.dataset.collate(indices[:1]))


def parallelize_reward_model(
    plan: PlanFields | CheckedPlan, model: RewardModel, *, mesh: DeviceMesh | None = None
) -> PlanRuntime:
    """Split a `RewardModel` over this job's ranks by `plan`, head included, in place; returns
    its `PlanRuntime` (`runtime.model is model`), which the `Trainer` takes as `runtime=`.

    The backbone gets `posttrain.train.parallelize` (TP, Ulysses SP, activation checkpointing,
    FSDP2 per layer and its root); its output projection is the identity, so TP treats it as a tied
    model (embedding and output stay replicated). The head is broadcast from rank 0 and, with
    data parallelism, becomes part of FSDP2's root (`fully_shard(model)` above the backbone's
    units, gradients SUMmed like the rest, resharded after a forward no backward follows, as
    `parallelize` does its root); with TP alone it stays a replicated `nn.Linear`. Build the
    optimizer after this.

    Args:
        plan: a `posttrain.train.ParallelPlan` (checked here against the process group and
            the model), or the `CheckedPlan` a recipe's run start made (`RecipeRun.checked`:
            not checked again).
        model: a `RewardModel` built identically on every rank.
        mesh: the plan's DeviceMesh (default: built here).

    Raises:
        TypeError: if `model` is not a RewardModel.
        ValueError: if the model already has a plan, the plan does not fit it, or pp or ep > 1
            (named, with the allowed values).
    """
    if not isinstance(model, RewardModel):
        raise TypeError(
            f"parallelize_reward_model takes a RewardModel; got "
            f"{type(model).__name__} (use plan.parallelize for a plain decoder)"
        )
    checked, plan = plan, plan.plan if isinstance(plan, CheckedPlan) else plan
    done = parallelized(model)
    if done is not None:
        raise ValueError(
            f"this reward model already has a ParallelPlan applied ({done}); build a fresh one"
        )
    others = [f"{axis}={getattr(plan, axis)}" for axis in ("pp", "ep") if getattr(plan, axis) > 1]
    if others:
        raise ValueError(
            f"parallelize_reward_model: {', '.join(others)} is not supported "
            "for a reward model (its head is placed for dp_replicate, dp_shard, tp "
            "and sp); allowed pp and ep for a reward model: 1"
        )
    backbone = model.backbone
    remember_parameters(model, f"{plan} was applied (which replaces the parameters)")
    identity = backbone.output
    backbone.output = None  # no output module: TP leaves the embedding and output replicated
    try:
        runtime = parallelize(checked, backbone, spec=model.spec, mesh=mesh)
    finally:
        backbone.output = identity
    if dist.is_initialized():  # (a plan of one rank applies without a process group)
        flat_collective(list(model.head.parameters()), lambda flat: dist.broadcast(flat, src=0))
    if plan.sp > 1:
        _count_head_grads_once_over_sp(model.head, plan.sp)
    if runtime.fsdp:
        _fsdp_root(plan, model, backbone)
    return dataclasses.replace(runtime, model=model)


def apply_plan_to_reward_model(
    plan: ParallelPlan, model: RewardModel, *, mesh: DeviceMesh | None = None
) -> RewardModel:
    """Deprecated (one release): `runtime = parallelize_reward_model(plan, model)` and pass
    `runtime=runtime` to the `Trainer`. Splits `model` in place and returns it.

    Raises:
        As `parallelize_reward_model`.
    """
    warn_deprecated(
        "apply_plan_to_reward_model(plan, model)",
        instead="runtime = parallelize_reward_model(plan, model), then pass "
        "runtime=runtime to the Trainer",
    )
    register(parallelize_reward_model(plan, model, mesh=mesh))  # its runtime holds `model`
    return model


class _ScaleGrad(torch.autograd.Function):
    """Identity in the forward; the backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def _count_head_grads_once_over_sp(head: nn.Module, sp: int) -> None:
    """Under sp the head sits after the all-gather of the sequence-parallel backbone: every sp
    rank applies it to the same full hidden states and gets the whole head gradient, which
    FSDP2's SUM over the ranks (sp included) would count sp times (the backbone's parameters get
    one slice's gradient per sp rank, which add up right). Scale the gradient at the head's
    output by 1/sp and the one it passes back to its input by sp: the head's weight gradient
    is 1/sp of each rank's (summing to one), the backbone's is unchanged (exact for sp a
    power of two)."""
    head.register_forward_pre_hook(
        lambda module, args: (_ScaleGrad.apply(args[0], float(sp)), *args[1:])
    )
    head.register_forward_hook(lambda module, args, out: _ScaleGrad.apply(out, 1.0 / sp))


def _fsdp_root(plan: PlanFields, model: RewardModel, backbone: TransformerDecoder) -> None:
    """FSDP2 over `model` as the root above `backbone`'s units (its own parameter group: the
    head), on the mesh the plan sharded the backbone's root over (that of its final norm, which
    no tensor-parallel style touches), with the plan's mixed precision and offload, reducing
    by SUM like the backbone."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    param_dtype, reduce_dtype = plan.torch_dtypes()
    options: dict[str, Any] = dict(
        mesh=backbone.norm.scale.device_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    )
    if plan.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    root = fully_shard(model, **options)
    reshard_root_after_frozen_forward(model)  # the model, not the backbone, is the root now
    root.set_gradient_divide_factor(1.0)
    root.set_force_sum_reduction_for_comms(True)


def gathered_reward_model(model: RewardModel | Runtime) -> RewardModel:
    """A plain (unsharded) `RewardModel` with the full weights of a split one (a collective
    under a plan: every rank calls it and gets the copy), given its runtime; a plain reward
    model (or its `LocalRuntime`) is returned as it is. Use it to `save` a sharded reward model.

    Raises:
        ValueError: for a reward model split by a plan given without its runtime.
        TypeError: for the runtime of a model that is not a `RewardModel`.
    """
    runtime = runtime_of(model)
    reward_model = runtime.model
    if not isinstance(reward_model, RewardModel):
        raise TypeError(
            f"gathered_reward_model takes a RewardModel or its runtime; got the "
            f"runtime of a {type(reward_model).__name__}"
        )
    if runtime.plan is None:
        return reward_model
    state = runtime.full_state_dict()
    plain = RewardModel(_fresh_backbone(reward_model), reward_model.spec)
    plain.load_state_dict(state)
    return plain


def _fresh_backbone(model: RewardModel) -> nn.Module:
    from posttrain.models.specs import build_model

    weight = model.head.weight
    return build_model(model.spec, device=weight.device, dtype=weight.dtype, seed=0)
