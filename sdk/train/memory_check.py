"""The memory check a trainer runs before any work under a `ParallelPlan`: `check_memory`
plans the model's spec and the loader's batch (`posttrain.train.memory_plan.check_plan_fits`)
against the smallest device of the ranks, so every rank refuses or none does."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from posttrain.train.memory_counts import MemoryBatch
from posttrain.train.memory_fit import device_memory_bytes
from posttrain.train.runtime import Runtime

__all__ = ["check_memory", "optimizer_states_of"]


def check_memory(
    runtime: Runtime,
    data: Any,
    *,
    phase: str = "sft",
    device_bytes: int | None = None,
    loss_chunk_tokens: int | None = None,
    optimizer: torch.optim.Optimizer | str | float = "adamw",
) -> None:
    """Refuse, before any work, a plan whose per-rank memory (`posttrain.train.memory_plan`)
    exceeds this rank's device (`device_bytes`; default: an accelerator's memory, or on CPU the
    machine's available RAM shared by the ranks on this host: LOCAL_WORLD_SIZE, Slurm's tasks
    per node, or else all of the plan's ranks; the smallest over the ranks, so that they
    agree). Needs a runtime with a plan and the spec given to `plan.parallelize`, and a loader
    with `batch_size` and known row lengths (`SFTLoader`); otherwise nothing is checked.
    `loss_chunk_tokens`: the loss's chunk (`SFTCrossEntropy.loss_chunk_tokens`), which sets
    what its logits hold. `optimizer`: the
    trainer's optimizer (its state per parameter: `optimizer_states_of`), or `plan_memory`'s
    name or number of states.

    Raises:
        ValueError: naming the dominant term and the plan axis that would lower it.
    """
    lengths = getattr(data, "_lengths", None)
    if (
        runtime.plan is None
        or runtime.spec is None
        or not hasattr(data, "batch_size")
        or not lengths
    ):
        return
    seq_len = data.seq_len if getattr(data, "pack", False) and data.seq_len else max(lengths)
    rows = -(-data.batch_size // max(1, getattr(data, "world_size", 1)))
    device = device_bytes
    if device is None:
        device = device_memory_bytes()
        if not torch.cuda.is_available():  # the ranks on this host share its RAM
            local = (
                os.environ.get("LOCAL_WORLD_SIZE")
                or os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
                or str(runtime.plan.world_size)
            )
            device //= max(1, int(local))
        device = _smallest_over_ranks(device)
    from posttrain.train.memory_plan import check_plan_fits  # the plan builds on this layer

    check_plan_fits(
        runtime.spec,
        runtime.plan,
        MemoryBatch(micro_batch_size=rows, seq_len=seq_len),
        phase=phase,
        device_bytes=device,
        loss_chunk_tokens=loss_chunk_tokens,
        optimizer=(
            optimizer_states_of(optimizer)
            if isinstance(optimizer, torch.optim.Optimizer)
            else optimizer
        ),
    )


def _smallest_over_ranks(device_bytes: int) -> int:
    """The smallest of the ranks' device sizes, so that every rank refuses or none does: each
    rank reads its free memory at its own moment, and a rank that refused alone left the others
    waiting in their first collective. One all-reduce over the default process group (every
    rank builds its trainer); without one, `device_bytes` itself."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return device_bytes
    on = "cuda" if dist.get_backend() == "nccl" else "cpu"
    smallest = torch.tensor([device_bytes], dtype=torch.int64, device=on)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return int(smallest.item())


def optimizer_states_of(optimizer: torch.optim.Optimizer) -> str | float:
    """The fp32 states per parameter `optimizer` keeps, as `plan_memory(optimizer=)` takes them:
    Adam/AdamW 2 (3 with amsgrad), SGD 0 without momentum in any group and 1 with, Lion-style
    or other classes "adamw" (2: the common case, erring on the large side).

    Example:
        >>> p = [torch.nn.Parameter(torch.zeros(2))]
        >>> optimizer_states_of(torch.optim.SGD(p, lr=0.1)), optimizer_states_of(
        ...     torch.optim.AdamW(p, amsgrad=True))
        (0, 3)
    """
    groups = optimizer.param_groups
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if any(g.get("momentum", 0) for g in groups) else 0
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if any(g.get("amsgrad", False) for g in groups) else 2
    return "adamw"
