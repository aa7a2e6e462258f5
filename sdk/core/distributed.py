"""torch.distributed helpers shared by the trainers, the data loaders and the recipes; each is a
no-op (or the single-process answer) when no process group is initialised, so the same code runs
in a notebook, under `torchrun` and in a multi-task job of `posttrain.launch.submit`.

Example (no process group here):
    >>> rank_and_world_size()
    (0, 1)
    >>> barrier()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["rank_and_world_size", "barrier", "flat_collective", "device_of"]

_BUCKET_BYTES = 64 * 2**20
"""Largest flat buffer of one gradient all-reduce (or parameter broadcast)."""


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world_size) of the initialised default `torch.distributed` process group, or
    (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    """`torch.distributed.barrier()` with an initialised process group; otherwise nothing."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def flat_collective(
    tensors: Sequence[torch.Tensor], collective: Callable[[torch.Tensor], object]
) -> None:
    """Run an in-place `collective` (all_reduce, broadcast) over `tensors` through flat buffers
    of at most `_BUCKET_BYTES` (one dtype and device each; a larger tensor goes alone), and copy
    the results back. Every rank must pass tensors of the same shapes, dtypes and order."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if (
            not buckets
            or size + nbytes > _BUCKET_BYTES
            or (t.dtype, t.device) != (buckets[-1][0].dtype, buckets[-1][0].device)
        ):
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    for bucket in buckets:
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        collective(flat)
        for t, piece in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.detach().copy_(piece.view_as(t))


def device_of(model: torch.nn.Module) -> torch.device:
    """The device of `model`'s first parameter (where collectives and new tensors go); CPU for
    a model without parameters."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
