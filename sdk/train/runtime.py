"""The runtime a trainer holds: what is specific to how its model is split over the ranks.

Notation: W = data-parallel ranks (ranks that see different data), r = this rank's index among
them.

A trainer never asks whether there is a plan. It holds a `Runtime` and calls it for everything
that depends on the split:

    data_rank, data_size              r and W (the data loader's shard)
    sum_over_data_ranks(x)            SUM of a tensor over the W data ranks (token counts, losses)
    set_gradient_sync(last)           FSDP2: reduce gradients only in the step's last backward
    forward_backward(loss, b, units)  one micro-batch's forward and backward (a pipeline stage
                                      runs it through the schedule)
    sync_gradients(params)            after the last backward: the gradient SUMs no wrapper did
    sum_module_grads(module)          SUM a replicated module's gradients (RL's value head)
    grad_norm(params), clip_grads_    the global L2 norm (pipeline stages, tied copies, DTensors
                                      on several meshes) and clipping to it
    full_state_dict()                 the unsharded weights on every rank (export, evaluation)
    gather_rows, gather_objects,      collectives over the data ranks (RL's groups and frozen
    reduce_metrics                    forwards)
    save_checkpoint, load_checkpoint  a full checkpoint on rank 0, or DCP shards from every rank

Two kinds:

* `LocalRuntime(model)`: no plan. One process does everything locally (every collective a no-op,
  plain torch for the norm and clipping). With an initialised default process group of W > 1
  ranks and `replicas=True` (the `Trainer`'s plain data parallelism), the ranks are data-parallel
  replicas: sums and gradients are all-reduced over the default group, weights broadcast from
  rank 0 at the start. With `replicas=False` (`RLTrainer` without a plan) every rank repeats the
  same work on the same data and nothing is communicated.
* `PlanRuntime`: what `ParallelPlan.parallelize(model, spec=spec)` returns
  (`posttrain.train.sharding`): the model split in place, its mesh, the data-parallel group,
  the gradient syncs FSDP2 does not do (expert weights over their replicas, the two copies of a
  tied embedding on the first and last pipeline stage), the pipeline runner of this stage.
  Checkpoints are DCP shards that reload under another plan or none.

Like torchtitan's `ParallelDims`, the runtime is held by the trainer and passed where it is
needed; nothing about the plan is stored on the model.

Example (one process: the local runtime, what a trainer builds when it is given none):
    >>> from posttrain.models import build_model, get_preset
    >>> runtime = LocalRuntime(build_model(get_preset("tiny-1m"), seed=0))
    >>> runtime.data_rank, runtime.data_size, runtime.plan, runtime.sharded
    (0, 1, None, False)
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from posttrain.core.distributed import device_of, flat_collective, rank_and_world_size
from posttrain.train.collectives import (
    clip_grads_with_norm_,
    gather_full_state_dict,
    gather_rows,
    reduce_metrics,
    sum_grads_over_group,
    total_grad_norm,
)
from posttrain.train.optimizer_check import reshard
from posttrain.train.sharded_checkpoint import (
    load_full_state,
    load_sharded_state,
    save_on_rank_zero,
    save_sharded_checkpoint,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from posttrain.models.specs import ModelSpec
    from posttrain.train.losses import TrainingLoss
    from posttrain.train.pipeline import PipelineRunner
    from posttrain.train.plan_value import PlanFields

__all__ = ["Runtime", "LocalRuntime", "PlanRuntime"]


def _grads(params: Sequence[nn.Parameter]) -> list[Tensor]:
    """The gradients of `params` (the trainer passes parameters that have one)."""
    return [g for p in params if (g := p.grad) is not None]


class Runtime(abc.ABC):
    """What a trainer asks of how its model is split (see the module docstring).

    Attributes:
        model: the trained model (split in place under a plan).
        plan: the applied `ParallelPlan` (read as its `PlanFields`), or None (`LocalRuntime`).
        mesh: the plan's DeviceMesh, or None.
        spec: the model's `ModelSpec` when known (the memory check uses it), or None.
        pipeline: this rank's `PipelineRunner` (pp > 1), or None.
        data_rank: this rank's index among the data-parallel ranks (0..data_size - 1).
        data_size: the number of ranks that see different data.
    """

    # annotations only (PlanRuntime is a dataclass of these, LocalRuntime sets them)
    model: nn.Module
    plan: PlanFields | None
    mesh: DeviceMesh | None
    spec: ModelSpec | None
    pipeline: PipelineRunner | None
    data_rank: int

    @property
    @abc.abstractmethod
    def data_size(self) -> int:
        """The number of ranks that see different data."""

    # ------------------------------------------------------------------ data ranks
    @property
    def collective_device(self) -> torch.device:
        """Where tensors go for a collective over the data ranks: the mesh's device type under
        a plan (NCCL reduces on the GPU, gloo on the CPU), else the model's device."""
        if self.mesh is not None:
            return torch.device(self.mesh.device_type)
        return device_of(self.model)

    @property
    def sharded(self) -> bool:
        """Whether checkpoints are DCP shards written by every rank (under a plan)."""
        return False

    @abc.abstractmethod
    def sum_over_data_ranks(self, value: Tensor) -> Tensor:
        """SUM of `value` over the data-parallel ranks: a copy, or `value` itself when there is
        one data rank (a collective otherwise: every data rank calls it)."""

    @abc.abstractmethod
    def gather_objects(self, obj: Any) -> list[Any]:
        """Every data rank's picklable `obj`, in data-rank order ([obj] with one data rank)."""

    @abc.abstractmethod
    def gather_rows(self, local: dict[str, Tensor], sizes: Sequence[int]) -> dict[str, Tensor]:
        """Concatenate every data rank's row tensors ([sizes[r], ...] each, in data-rank order);
        `local` itself with one data rank."""

    @abc.abstractmethod
    def reduce_metrics(self, totals: dict[str, Tensor]) -> dict[str, Tensor]:
        """Step metrics over the data ranks: SUM, `ratio_max` MAX (`totals` itself with one)."""

    # ------------------------------------------------------------------ gradients
    def share_initial_weights(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Make every data rank start from the same weights (rank 0's); a no-op by default."""

    def set_gradient_sync(self, enabled: bool) -> None:  # noqa: B027 - optional hook, a no-op by default
        """FSDP2: reduce gradients in the coming backward (the step's last micro-batch) or keep
        accumulating them unsharded; a no-op without FSDP2."""

    def forward_backward(self, loss: TrainingLoss, batch: Any, num_units: Tensor) -> Tensor:
        """Forward and backward of one micro-batch; returns its loss share (`loss(model, batch,
        num_units)`, detached by the caller)."""
        share = loss(self.model, batch, num_units)
        share.backward()
        return share

    @abc.abstractmethod
    def sync_gradients(self, params: Sequence[nn.Parameter]) -> None:
        """After the step's last backward: make the gradients of `params` the SUM over the data
        ranks where no wrapper (FSDP2, TP) did it."""

    @abc.abstractmethod
    def sum_module_grads(self, module: nn.Module) -> None:
        """SUM the gradients of a plain module replicated on every data rank, in place (a
        parameter without a gradient counts as zero); a no-op with one data rank."""

    @abc.abstractmethod
    def grad_norm(self, params: Sequence[nn.Parameter]) -> Tensor:
        """The global L2 norm of the gradients of `params` (a 0-dim float32 tensor)."""

    @abc.abstractmethod
    def clip_grads_(
        self, params: Sequence[nn.Parameter], max_norm: float, total_norm: Tensor
    ) -> None:
        """Scale the gradients of `params` by min(1, max_norm / (total_norm + 1e-6)) in place."""

    # ------------------------------------------------------------------ weights and checkpoints
    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, Tensor]:
        """The unsharded `state_dict()` of the model, on CPU, on every rank (a collective under
        a plan: every rank calls it)."""

    def save_checkpoint(
        self,
        run_dir: Path,
        step: int,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: dict[str, Any],
        meta: dict[str, Any],
        keep_last: int | None,
        rank: int,
        model_state: Callable[[], dict[str, Any]],
    ) -> Path:
        """Save checkpoint `step` of `module` (everything the trainer trains) and `optimizer`
        into `run_dir/checkpoints/` (every rank calls it); returns its folder on every rank.

        `train_state` holds `optimizer.state_dict()` under "optimizer"; `model_state()` gives
        the weights of a full (unsharded) checkpoint. Without a plan (`sharded` False) rank 0
        writes the full checkpoint; under a plan every rank writes DCP shards of `module` and
        `optimizer` and the plan goes into the meta. Either way every rank waits at a barrier.
        """
        if not self.sharded:
            return save_on_rank_zero(
                run_dir,
                step,
                rank=rank,
                model_state=model_state,
                train_state=train_state,
                meta=meta,
                keep_last=keep_last,
            )
        assert self.plan is not None, "a runtime that writes shards holds a plan"
        train_state = {k: v for k, v in train_state.items() if k != "optimizer"}  # in the shards
        reshard(module)  # after a forward with grad and no backward
        return save_sharded_checkpoint(
            run_dir,
            step,
            model=module,
            optimizer=optimizer,
            train_state=train_state,
            meta={**meta, "plan": self.plan.to_dict()},
            keep_last=keep_last,
            rank=rank,
        )

    def load_checkpoint(
        self,
        ckpt: dict[str, Any],
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        load_model_state: Callable[[dict[str, Any]], None],
    ) -> None:
        """Load the weights and optimizer state of a loaded checkpoint (`load_checkpoint`'s
        dict: sharded or full, saved under any plan or none) into `module` and `optimizer`.

        Shards (saved under this plan, another one or none) reshard, and without a plan are
        gathered into the plain module; a full checkpoint of a run without a plan is split on
        load under a plan (`load_full_state`)."""
        if ckpt["sharded"] is not None:
            load_sharded_state(ckpt["sharded"], model=module, optimizer=optimizer)
        elif self.sharded:
            load_full_state(
                ckpt["model_state"],
                ckpt["train_state"]["optimizer"],
                model=module,
                optimizer=optimizer,
            )
        else:
            load_model_state(ckpt["model_state"])
            optimizer.load_state_dict(ckpt["train_state"]["optimizer"])

    def describe(self) -> str:
        """The plan in words for messages ("" without one)."""
        return "" if self.plan is None else f" of {self.plan}"


class LocalRuntime(Runtime):
    """The runtime of a model without a plan (see the module docstring).

    Args:
        model: the trained model.
        replicas: with an initialised default process group of several ranks: True, the ranks
            are data-parallel replicas (the `Trainer`); False, they repeat the same work and
            nothing is communicated (`RLTrainer` without a plan).
    """

    plan = mesh = spec = pipeline = None

    def __init__(self, model: nn.Module, *, replicas: bool = True) -> None:
        rank, world = rank_and_world_size()
        self.model = model
        self.data_rank, self._size = (rank, world) if replicas else (0, 1)

    @property
    def data_size(self) -> int:
        return self._size

    def sum_over_data_ranks(self, value: Tensor) -> Tensor:
        if self._size == 1:
            return value
        value = value.detach().to(device_of(self.model), copy=True)
        dist.all_reduce(value)
        return value

    def gather_objects(self, obj: Any) -> list[Any]:
        if self._size == 1:
            return [obj]
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, obj)
        return out

    def gather_rows(self, local: dict[str, Tensor], sizes: Sequence[int]) -> dict[str, Tensor]:
        return local if self._size == 1 else gather_rows(local, sizes, None)

    def reduce_metrics(self, totals: dict[str, Tensor]) -> dict[str, Tensor]:
        return totals if self._size == 1 else reduce_metrics(totals, None)

    def share_initial_weights(self) -> None:
        """Broadcast the parameters from rank 0 when the ranks are replicas (as DDP does;
        buffers are not: a KV cache may exist on one rank only)."""
        if self._size > 1:
            flat_collective(list(self.model.parameters()), lambda flat: dist.broadcast(flat, src=0))

    def sync_gradients(self, params: Sequence[nn.Parameter]) -> None:
        if self._size > 1:
            flat_collective(_grads(params), dist.all_reduce)

    def sum_module_grads(self, module: nn.Module) -> None:
        if self._size > 1:
            sum_grads_over_group(module, None)

    def grad_norm(self, params: Sequence[nn.Parameter]) -> Tensor:
        return torch.nn.utils.get_total_norm(_grads(params), norm_type=2.0)

    def clip_grads_(
        self, params: Sequence[nn.Parameter], max_norm: float, total_norm: Tensor
    ) -> None:
        torch.nn.utils.clip_grads_with_norm_(list(params), max_norm, total_norm)

    def full_state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def __repr__(self) -> str:
        return f"LocalRuntime(data_rank={self.data_rank}, data_size={self._size})"


@dataclasses.dataclass(frozen=True, eq=False)
class PlanRuntime(Runtime):
    """A model split by a `ParallelPlan` (`plan.parallelize(model, spec=spec)`), and what the
    trainer needs of the split (see the module docstring).

    Attributes:
        model: the split model (the same object that was given to `parallelize`).
        plan: the ParallelPlan applied.
        mesh: its DeviceMesh (dimensions `MESH_DIMS`), or None for a plan of one rank applied
            without a process group.
        data_rank: this rank's index among the data-parallel ranks (0..data_size - 1).
        data_group: the process group of the ranks that see different data and share this
            rank's tp/sp/pp coordinates (sums of token counts and losses go over it), or None
            with one data rank.
        fsdp: whether FSDP2 was applied.
        grad_syncs: called after the step's last backward, in order, to reduce the gradients no
            wrapper reduced (expert weights over the ranks that hold the same experts; the two
            copies of a tied embedding matrix on the first and last pipeline stage).
        pipeline: the `PipelineRunner` of this rank's stage (pp > 1), or None.
        pp_group: the pipeline group (the gradient norm sums over its stages), or None.
        tied_copy: the last stage's copy of a tied embedding matrix (left out of the norm).
        spec: the model's ModelSpec when `parallelize` was given one (the memory check uses it).
    """

    model: nn.Module
    plan: PlanFields
    mesh: DeviceMesh | None
    data_rank: int
    data_group: ProcessGroup | None
    fsdp: bool
    grad_syncs: tuple[Callable[[], None], ...] = ()
    pipeline: PipelineRunner | None = None
    pp_group: ProcessGroup | None = None
    tied_copy: nn.Parameter | None = None
    spec: ModelSpec | None = None

    @property
    def data_size(self) -> int:
        return self.plan.data_parallel_size

    @property
    def sharded(self) -> bool:
        return True

    def sum_over_data_ranks(self, value: Tensor) -> Tensor:
        if self.data_group is None:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, group=self.data_group)
        return value

    def gather_objects(self, obj: Any) -> list[Any]:
        if self.data_group is None:
            return [obj]
        gathered: list[Any] = [None] * dist.get_world_size(self.data_group)
        dist.all_gather_object(gathered, (self.data_rank, obj), group=self.data_group)
        return [o for _, o in sorted(gathered, key=lambda item: item[0])]

    def gather_rows(self, local: dict[str, Tensor], sizes: Sequence[int]) -> dict[str, Tensor]:
        return local if self.data_group is None else gather_rows(local, sizes, self.data_group)

    def reduce_metrics(self, totals: dict[str, Tensor]) -> dict[str, Tensor]:
        return totals if self.data_group is None else reduce_metrics(totals, self.data_group)

    def set_gradient_sync(self, enabled: bool) -> None:
        if self.fsdp:
            from torch.distributed.fsdp import FSDPModule

            assert isinstance(self.model, FSDPModule), "fsdp: parallelize applied fully_shard"
            self.model.set_requires_gradient_sync(enabled)

    def forward_backward(self, loss: TrainingLoss, batch: Any, num_units: Tensor) -> Tensor:
        """Under pp > 1 through this stage's schedule (`PipelineRunner.step`)."""
        if self.pipeline is not None:
            return self.pipeline.step(loss, batch, num_units)
        return super().forward_backward(loss, batch, num_units)

    def sync_gradients(self, params: Sequence[nn.Parameter]) -> None:
        """FSDP2 and TP reduced the gradients in the backward; the plan's own syncs run here."""
        for sync in self.grad_syncs:
            sync()

    def sum_module_grads(self, module: nn.Module) -> None:
        if self.data_group is not None:
            sum_grads_over_group(module, self.data_group)

    def grad_norm(self, params: Sequence[nn.Parameter]) -> Tensor:
        return total_grad_norm(_grads(params), tied_copy=self.tied_copy, pp_group=self.pp_group)

    def clip_grads_(
        self, params: Sequence[nn.Parameter], max_norm: float, total_norm: Tensor
    ) -> None:
        clip_grads_with_norm_(_grads(params), max_norm, total_norm)

    def full_state_dict(self) -> dict[str, Tensor]:
        """`gather_full_state_dict`: under pp the stages' names are merged."""
        return gather_full_state_dict(self.model, self.pp_group)

    def __repr__(self) -> str:
        return f"PlanRuntime({self.plan}, data_rank={self.data_rank}, data_size={self.data_size})"
