"""The collectives a `Runtime` runs over the data-parallel ranks, the gradient norm and
clipping of gradients split over a mesh, and the full weights of a split model.

Notation: W = ranks of the group, sizes[r] = rows of rank r.

Every function here is a collective over its `group` (the default process group for None):
every rank of it calls it, with tensors of the same keys, dtypes and trailing shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from posttrain.core.distributed import flat_collective

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "total_grad_norm",
    "clip_grads_with_norm_",
    "gather_rows",
    "reduce_metrics",
    "sum_grads_over_group",
    "gather_full_state_dict",
]


def total_grad_norm(
    grads: list[Tensor],
    *,
    tied_copy: Tensor | None = None,
    pp_group: ProcessGroup | None = None,
) -> Tensor:
    """Global L2 norm of gradients that may be DTensors on different meshes (FSDP2 shards,
    TP shards, replicated plain tensors): one `get_total_norm` per mesh, each made whole with
    `full_tensor()`, combined as sqrt(sum of squares). Under pipeline parallelism (`pp_group`:
    the stages of a `PlanRuntime`) the squares are summed over the stages, and the gradient of
    `tied_copy` (the last stage's copy of a tied embedding) is left out, so the tied weight
    counts once. Returns a plain 0-dim float32 tensor."""
    from torch.distributed.tensor import DTensor

    skip = tied_copy.grad if tied_copy is not None else None
    groups: dict[Any, list[Tensor]] = {}
    for g in grads:
        if g is skip:
            continue
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    squares = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.double() ** 2)
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt().to(torch.float32)


def clip_grads_with_norm_(grads: list[Tensor], max_norm: float, total_norm: Tensor) -> None:
    """Scale gradients (DTensors on any mesh, or plain) by min(1, max_norm / (total_norm +
    1e-6)), the coefficient of `torch.nn.utils.clip_grads_with_norm_`, in place on each rank's
    local shard (a scalar scale needs no communication)."""
    from torch.distributed.tensor import DTensor

    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    torch._foreach_mul_(local, coef.to(local[0].device))


def gather_rows(
    local: dict[str, Tensor], sizes: Sequence[int], group: ProcessGroup | None
) -> dict[str, Tensor]:
    """Concatenate every rank's row tensors ([sizes[r], ...] each, in rank order of `group`, the
    default group for None): each is padded to the largest share, all-gathered, and cut back."""
    out = {}
    most = max(sizes)
    for key in sorted(local):
        mine = local[key]
        padded = torch.zeros((most, *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
        rows = min(most, mine.shape[0])
        padded[:rows] = mine[:rows]
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=group)
        out[key] = torch.cat([piece[:size] for piece, size in zip(pieces, sizes)])
    return out


def reduce_metrics(totals: dict[str, Tensor], group: ProcessGroup | None) -> dict[str, Tensor]:
    """Metrics over the ranks of `group` (the default group for None): step shares and
    token-weighted means are SUMmed, `ratio_max` is the MAX (the keys are the same on every
    rank)."""
    keys = sorted(k for k in totals if k != "ratio_max")
    flat = torch.stack([totals[k].float().reshape(()) for k in keys])
    dist.all_reduce(flat, group=group)
    out = dict(zip(keys, flat.unbind()))
    if "ratio_max" in totals:
        top = totals["ratio_max"].float().reshape(1).clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        out["ratio_max"] = top[0]
    return out


def sum_grads_over_group(module: nn.Module, group: ProcessGroup | None) -> None:
    """SUM the gradients of a replicated (plain) module over the ranks of `group` (the default
    group for None), in place; a parameter without a gradient on this rank counts as zero."""
    grads = []
    for p in module.parameters():
        grad = p.grad
        if grad is None:
            grad = p.grad = torch.zeros_like(p)
        grads.append(grad)
    flat_collective(grads, lambda flat: dist.all_reduce(flat, group=group))


def gather_full_state_dict(model: nn.Module, pp_group: ProcessGroup | None) -> dict[str, Tensor]:
    """The unsharded `state_dict()` of a model split by a plan, on CPU, on every rank: gathered
    with `get_model_state_dict(full_state_dict=True)` (a collective over the model's mesh), and
    under pipeline parallelism merged over the stages of `pp_group` (each holds some names).

    Raises:
        TypeError: for a state entry that is not a tensor.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=False)
    )
    state: dict[str, Tensor] = {}
    for k, v in full.items():
        if not isinstance(v, Tensor):
            raise TypeError(
                f"full_state_dict: the model's state {k!r} is a {type(v).__name__}, not a tensor"
            )
        state[k] = v.detach().cpu()
    if pp_group is not None:  # each stage holds some of the names: merge them
        stages: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, state, group=pp_group)
        state = {k: v for stage in stages for k, v in stage.items()}
    return state
