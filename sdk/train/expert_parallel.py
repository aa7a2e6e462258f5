"""Expert parallelism for `posttrain.models.MoEFeedForward`: the experts of each MoE layer split
over the `ep` ranks, tokens sent to the rank that holds their expert and back (the GShard /
Switch dispatch, Lepikhin et al. 2021; Fedus et al. 2022).

The ep ranks see different data (they are data-parallel for everything but the experts). Per
MoE layer, on each rank:

    route the local tokens (router replicated): N tokens -> N*K assignments, grouped by expert
    counts [ep, E/ep] -> all_to_all -> how many rows each source sends to each local expert
    rows -> all_to_all_single (uneven splits) -> rows for the local experts, by source
    regroup by local expert -> MoEFeedForward._run_experts on the local weights -> ungroup
    outputs -> all_to_all_single back -> weight by the router, add into the tokens

The all-to-alls are torch.distributed.nn.functional's autograd-aware ones, so the backward sends
each gradient back along the same route: an expert's weight gradient collects the rows of every
ep rank. Expert weights are DTensors sharded on dim 0 over mesh["ep"] (checkpoints reshard and
`full_state_dict` gathers them like any other parameter). They are replicated over the other
data-parallel and sp ranks (FSDP2 ignores them: its mesh spans ep); `sync_expert_grads` SUMs
their gradients over those ranks after the backward.

The load-balancing loss stays per rank (each rank's own tokens, as in one process per
micro-batch): it is not invariant to how a batch is split over ranks.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from posttrain.models.moe import MoEFeedForward

__all__ = ["apply_expert_parallel", "expert_parameters", "sync_expert_grads"]

_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def _moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    from posttrain.models.moe import moe_layers

    return moe_layers(model)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The stacked expert weights of every MoE layer (gate_proj, up_proj, down_proj)."""
    return [getattr(m, name) for m in _moe_layers(model) for name in _EXPERT_WEIGHTS]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split the experts of every MoE layer of `model` over mesh["ep"], in place.

    Raises:
        ValueError: for a model without MoE layers, or num_experts not divisible by ep.
    """
    from torch.distributed.tensor import DTensor, Shard

    layers = _moe_layers(model)
    ep_mesh = mesh["ep"]
    ep = ep_mesh.size()
    if not layers:
        raise ValueError(f"ParallelPlan.ep={ep} needs a model with MoE layers; this one has none")
    for moe in layers:
        if moe.num_experts % ep:
            raise ValueError(f"ParallelPlan.ep={ep} must divide num_experts={moe.num_experts}")
        local = moe.num_experts // ep
        start = ep_mesh.get_local_rank() * local
        for name in _EXPERT_WEIGHTS:
            full = getattr(moe, name)  # the same on every rank (parallelize broadcast it)
            piece = full.detach()[start : start + local].clone()
            sharded = DTensor.from_local(piece, ep_mesh, [Shard(0)], run_check=False)
            setattr(moe, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        # MoEFeedForward documents experts_forward as the hook an ep plan replaces per instance
        moe.experts_forward = functools.partial(  # type: ignore[method-assign]  # that hook
            _dispatch, moe, ep_mesh.get_group(), ep, range(start, start + local)
        )


def _dispatch(
    moe: MoEFeedForward,
    group: dist.ProcessGroup,
    ep: int,
    local: range,
    rows_AD: Tensor,
    counts_E: Tensor,
) -> Tensor:
    """`MoEFeedForward.experts_forward` under ep: send rows (grouped by global expert) to the
    ranks holding their experts (`local`: this rank's experts, of `ep` ranks in `group`), run
    them there, and bring the outputs back in the same order."""
    send_counts = counts_E.view(ep, len(local))  # [dest, local expert]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # [source, local expert]
    send_splits = send_counts.sum(dim=1).tolist()
    recv_splits = recv_counts.sum(dim=1).tolist()
    received = _exchange(rows_AD, send_splits, recv_splits, group)
    # Received rows come by source, each source's rows by local expert: regroup by expert.
    expert_of_row = torch.repeat_interleave(
        torch.arange(len(local)).repeat(ep), recv_counts.reshape(-1).cpu()
    )
    by_expert = torch.argsort(expert_of_row, stable=True)
    weights = {name: getattr(moe, name).to_local() for name in _EXPERT_WEIGHTS}
    out = moe._run_experts(
        received[by_expert], recv_counts.sum(dim=0).tolist(), range(len(local)), weights
    )
    out = torch.empty_like(out).index_copy_(0, by_expert, out)  # back to source order
    return _exchange(out, recv_splits, send_splits, group)


def _exchange(
    rows: Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup
) -> Tensor:
    """Autograd-aware all_to_all_single of `rows` [sum(send_splits), D] with uneven splits."""
    from torch.distributed.nn.functional import all_to_all_single

    out = rows.new_empty(sum(recv_splits), rows.shape[1])
    return all_to_all_single(out, rows, recv_splits, send_splits, group=group)


def sync_expert_grads(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """SUM the expert weights' gradients over `group` (the ranks holding the same experts: the
    other data-parallel and sp ranks); no-op without a group."""
    if group is None:
        return
    from torch.distributed.tensor import DTensor

    from posttrain.core.distributed import flat_collective

    grads = [
        g.to_local() if isinstance(g, DTensor) else g
        for p in expert_parameters(model)
        if (g := p.grad) is not None
    ]
    flat_collective(grads, lambda flat: dist.all_reduce(flat, group=group))
