"""Pipeline parallelism for a torchtune decoder with torch.distributed.pipelining (GPipe, Huang et
al. 2019; 1F1B, Narayanan et al. 2021, PipeDream-Flush).

`split_into_stage` keeps, on each of the `pp` ranks of a pipeline group, a contiguous slice of the
layers (stage 0 also the token embedding, the last stage the final norm and output projection)
under their original names, so checkpoints keep one key per parameter across stages and reshard
to any other plan. With tied embeddings the last stage holds a copy of the embedding matrix for
its output projection; `sync_tied_grads` SUMs the two copies' gradients after the backward, so
they stay equal, and the gradient norm counts the matrix once.

`PipelineRunner.step(batch, num_units)` runs one of the trainer's micro-batches through the
schedule, split into `plan.microbatches` pipeline micro-batches (rows padded with untrained rows
to a multiple of it). The schedule's loss per pipeline micro-batch is the summed token
cross-entropy divided by the step's global token count, and the schedule is built with
`scale_grads=False` (by default it divides gradients by the number of micro-batches, which would
turn the token-normalised step loss into a mean of means). Each (rows, length) shape gets its
own stage and schedule, built on first use (torch's stages infer shapes once). Packed rows' masks
travel as the dense mask, or on CUDA as document ids from which each stage builds the FlexAttention
`BlockMask` of its pipeline micro-batch (`_stage_mask`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from posttrain.models.attention_masks import (
    AttentionMask,
    block_segment_mask,
    documents_from_mask,
    use_block_mask,
)
from posttrain.train.losses import (
    SFTCrossEntropy,
    TrainingLoss,
    normalize_by_step,
    token_cross_entropy_sum,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    from torchtune.modules import TransformerDecoder

    from posttrain.data.loader import Batch
    from posttrain.train.plan_value import PlanFields

__all__ = ["split_into_stage", "PipelineRunner", "stage_layers", "is_stage"]


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The layer indices of `stage` when `num_layers` are split into `pp` contiguous stages (the
    first `num_layers % pp` stages get one more)."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def split_into_stage(model: TransformerDecoder, mesh: DeviceMesh) -> dict[str, Any]:
    """Keep only this rank's pipeline stage of `model` (in place); returns facts the runner and
    the gradient sync need: {"stage", "pp", "group", "tied", "first", "last", "dim", "vocab",
    "dtype"}."""
    from torchtune.modules import TiedLinear

    pp_mesh = mesh["pp"]
    stage, pp = pp_mesh.get_local_rank(), pp_mesh.size()
    first, last = stage == 0, stage == pp - 1
    layers = list(model.layers)
    facts = {
        "dim": layers[0].attn.embed_dim,
        "vocab": model.tok_embeddings.num_embeddings,
        "dtype": next(model.parameters()).dtype,
    }
    keep = stage_layers(len(layers), pp, stage)
    model.layers = nn.ModuleDict({str(i): layers[i] for i in keep})
    tied = isinstance(model.output, TiedLinear)
    if not first and not (last and tied):
        del model.tok_embeddings
    if not last:
        del model.norm
        if isinstance(model.output, nn.Module):
            del model.output
        else:
            model.output = None
    model.forward = _StageForward(model, first, last)
    return {
        "stage": stage,
        "pp": pp,
        "group": pp_mesh.get_group(),
        "tied": tied,
        "first": first,
        "last": last,
        **facts,
    }


def is_stage(model: nn.Module) -> bool:
    """Whether `split_into_stage` made `model` a pipeline stage."""
    return isinstance(model.__dict__.get("forward"), _StageForward)


class _StageForward:
    """The forward of one stage: tokens or activations in, activations or logits out."""

    def __init__(self, model: TransformerDecoder, first: bool, last: bool) -> None:
        self.model, self.first, self.last = model, first, last

    def __call__(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        input_pos: Tensor | None = None,
        documents: Tensor | None = None,
    ) -> Tensor:
        """`documents` (int64 [rows, T], in place of `mask`): the micro-batch's document ids,
        whose FlexAttention `BlockMask` the stage builds (`_stage_mask`)."""
        attention: AttentionMask | None = mask
        if documents is not None:
            attention = block_segment_mask(documents)
        h = self.model.tok_embeddings(x) if self.first else x
        for layer in self.model.layers.values():
            h = layer(h, mask=attention, input_pos=input_pos)
        return self.model.unembed(h) if self.last else h


def tied_group(mesh: DeviceMesh) -> ProcessGroup:
    """The 2-rank group of the first and last pipeline stage with the same other coordinates
    (collective: every rank creates every group)."""
    names = mesh.mesh_dim_names
    if names is None or "pp" not in names:
        raise ValueError(
            f"tied_group needs a mesh with a 'pp' dimension; its dimensions are {names}"
        )
    ranks = mesh.mesh.movedim(names.index("pp"), -1)
    pairs = ranks[..., [0, -1]].reshape(-1, 2).tolist()
    mine, _ = dist.new_subgroups_by_enumeration(pairs)
    return mine


def sync_tied_grads(model: nn.Module, group: ProcessGroup) -> None:
    """SUM the embedding-matrix gradient of the first and the last stage (tied embeddings)."""
    from torch.distributed.tensor import DTensor

    embeddings = getattr(model, "tok_embeddings", None)
    if embeddings is None or embeddings.weight.grad is None:
        return
    grad = embeddings.weight.grad
    dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)


class PipelineRunner:
    """Runs the trainer's micro-batches through this rank's pipeline stage.

    Args:
        model: the stage module (after `split_into_stage`, FSDP2 and TP).
        info: what `split_into_stage` returned.
        plan: the ParallelPlan (pp_schedule, microbatches).
    """

    def __init__(self, model: nn.Module, info: dict[str, Any], plan: PlanFields) -> None:
        self.model, self.info, self.plan = model, info, plan
        self._schedules: dict[tuple[int, ...], PipelineScheduleSingle] = {}
        self._num_units: Tensor | None = None
        self._ignore_index = -100

    def _loss(self, logits_BTV: Tensor, labels_BT: Tensor) -> Tensor:
        # the schedule calls this only inside `step`, which sets the step's token count first
        assert self._num_units is not None, "PipelineRunner._loss runs only inside step()"
        loss_sum, _ = token_cross_entropy_sum(
            logits_BTV, labels_BT, ignore_index=self._ignore_index
        )
        return normalize_by_step(loss_sum, self._num_units.to(loss_sum.device))

    def _schedule(self, shape: tuple[int, ...], device: torch.device) -> PipelineScheduleSingle:
        """The schedule for trainer micro-batches of `shape` (rows, length), built on first use
        with static shapes: torch's runtime shape inference would run a forward (and FSDP2's
        all-gathers) on some data-parallel ranks and not on others, whose batches have other
        shapes, and leave their collectives unmatched."""
        if shape not in self._schedules:
            from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

            rows, length = shape[0] // self.plan.microbatches, shape[1]
            dim, vocab = self.info["dim"], self.info["vocab"]
            dtype = self.plan.torch_dtypes()[0] or self.info["dtype"]
            meta = torch.device("meta")

            def activations() -> Tensor:  # gradients flow back
                return torch.empty(rows, length, dim, dtype=dtype, device=meta, requires_grad=True)

            inputs = (
                torch.empty(rows, length, dtype=torch.long, device=meta)
                if self.info["first"]
                else activations()
            )
            outputs = (
                torch.empty(rows, length, vocab, dtype=torch.float32, device=meta)
                if self.info["last"]
                else activations()
            )
            stage = _static_shape_stage()(
                self.model,
                self.info["stage"],
                self.info["pp"],
                device,
                input_args=inputs,
                output_args=outputs,
                group=self.info["group"],
            )
            kind = ScheduleGPipe if self.plan.pp_schedule == "gpipe" else Schedule1F1B
            self._schedules[shape] = kind(
                stage, n_microbatches=self.plan.microbatches, loss_fn=self._loss, scale_grads=False
            )
        return self._schedules[shape]

    def step(self, loss: TrainingLoss, batch: Batch, num_units: Tensor) -> Tensor:
        """Forward and backward of one trainer micro-batch through the pipeline; returns its loss
        share (the same on every stage: summed from the last stage over the pipeline group).

        Raises:
            ValueError: for a loss other than SFT cross-entropy with unchunked logits (the
                pipeline computes the loss on the last stage from logits and labels only).
        """
        if not isinstance(loss, SFTCrossEntropy) or loss.loss_chunk_tokens is not None:
            raise ValueError(
                f"pipeline parallelism (pp={self.plan.pp}) trains the SFT "
                f"cross-entropy with loss_chunk_tokens=None only; got {loss!r}"
            )
        self._ignore_index, self._num_units = loss.ignore_index, num_units
        device = next(self.model.parameters()).device
        n = self.plan.microbatches
        tokens, labels = batch.input_ids.to(device), batch.labels.to(device)
        # the stage forward's keyword tensors (Any: schedule.step has keywords of its own)
        kwargs: dict[str, Any] = {"input_pos": batch.position_ids.to(device)}
        kwargs.update(_stage_mask(batch.attention_mask, device))
        rows = -tokens.shape[0] % n  # untrained padding rows: every micro-batch gets rows
        if rows:
            tokens = torch.cat([tokens, tokens[-1:].expand(rows, -1)])
            labels = torch.cat(
                [labels, labels.new_full((rows, labels.shape[1]), self._ignore_index)]
            )
            kwargs = {
                k: torch.cat([v, v[-1:].expand(rows, *v.shape[1:])]) for k, v in kwargs.items()
            }
        schedule = self._schedule(tuple(tokens.shape), device)
        losses: list[Tensor] = []
        if self.info["first"]:
            schedule.step(
                tokens, target=labels if self.info["last"] else None, losses=losses, **kwargs
            )
        elif self.info["last"]:
            schedule.step(target=labels, losses=losses, **kwargs)
        else:
            schedule.step(**kwargs)
        share = (
            torch.stack([part.detach() for part in losses]).sum()
            if losses
            else torch.zeros((), device=device)
        )
        dist.all_reduce(share, group=self.info["group"])
        return share


def _stage_mask(mask_BTT: Tensor | None, device: torch.device) -> dict[str, Tensor]:
    """The stage forward's mask keyword for a packed batch's block-causal mask: {"mask": the
    dense mask on `device`} or, where `use_block_mask(device)` (CUDA: FlexAttention), {"documents":
    int64 [B, T]} (`documents_from_mask`), from which each stage builds its micro-batch's
    `BlockMask`: the schedule splits keyword tensors along rows, and a `BlockMask` is not one.
    Plain causal rows (None): {}.

    Raises:
        ValueError: as `documents_from_mask`, for a mask that is not block-causal.
    """
    if mask_BTT is None:
        return {}
    if use_block_mask(device):
        return {"documents": documents_from_mask(mask_BTT).to(device)}
    return {"mask": mask_BTT.to(device)}


@functools.cache
def _static_shape_stage() -> type[PipelineStage]:
    """torch's `PipelineStage` without the cleanup that ends a new schedule's first step.

    That cleanup also clears the gradients of FSDP2 modules (stale ones of a shape-inference
    pass). With static shapes there is no such pass, and clearing would drop the gradients of
    the step's earlier micro-batches: keep them. (Built on first use: importing
    torch.distributed.pipelining takes about a second.)"""
    from torch.distributed.pipelining import PipelineStage

    class StaticShapeStage(PipelineStage):
        def _post_metadata_inference_cleanup(self) -> None:
            """Nothing to clean up: no shape-inference pass ran."""

    return StaticShapeStage
