"""The memory check before any work: `check_plan_fits` refuses a plan whose per-rank memory
(`posttrain.train.memory_plan.plan_memory`) exceeds the device, naming the dominant term and
the plan axis that would lower it; `check_memory` is the one a trainer runs under a
`ParallelPlan`, for the model's spec and the loader's batch, against this rank's device."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from posttrain.train.memory_counts import MemoryBatch
from posttrain.train.runtime import Runtime

if TYPE_CHECKING:
    import pandas as pd

    from posttrain.models.specs import ModelSpec
    from posttrain.train.plan_value import PlanFields

__all__ = ["check_memory", "check_plan_fits", "device_memory_bytes", "optimizer_states_of"]

_GIB = 2**30


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


_FIXES = {
    "parameters": "raise dp_shard (parameters fall 1/dp_shard), or tp (block weights fall 1/tp)",
    "gradients": "raise dp_shard (gradients fall 1/dp_shard)",
    "optimizer state": "raise dp_shard (optimizer state falls 1/dp_shard)",
    "optimizer step temporaries": "raise dp_shard (the local tensors fall 1/dp_shard)",
    "activations": "turn on activation_checkpointing (a block then keeps only its input), raise "
    "sp or tp, or lower micro_batch_size",
    "activations (head)": "raise sp, or lower micro_batch_size x seq_len",
    "activations (rebuilt block)": "raise tp or sp (the rebuilt block falls 1/tp, 1/sp)",
    "logits": "set the loss's loss_chunk_tokens (e.g. 1024: a chunk's logits at a time), lower "
    "micro_batch_size x seq_len (logits stay whole under tp and sp), or raise pp with several "
    "micro-batches (the last stage holds one micro-batch's logits)",
    "backward working set": "raise tp or sp",
    "FSDP buffers": "raise tp (gathered blocks fall 1/tp)",
    "FSDP gathered root": "raise tp with untied embeddings (the output falls 1/tp; a tied "
    "embedding stays whole), or set reshard_after_forward",
    "tied embedding gradients": "no plan axis lowers it: the tied embedding's gradients are "
    "whole on every rank (untie the embeddings, or lower the vocabulary)",
    "rollout copy": "no plan axis lowers it: RLTrainer samples from a full copy of the policy "
    "under a plan (use rollout_engine='vllm', or a smaller policy)",
    "model build": "no plan axis lowers it: every rank builds the whole model before sharding "
    "(build it on the meta device and load sharded weights)",
    "reference model": "raise dp_shard (the reference falls 1/dp_shard), or precompute the "
    "reference log-probs",
    "KV cache": "raise tp (KV heads fall 1/tp) or pp, or lower num_sequences x max_total_len",
    "prefill": "lower num_sequences x prompt_len",
    "runtime": "lower runtime_bytes",
}


def device_memory_bytes() -> int:
    """Total memory of the current CUDA device if CUDA is available, else the machine's
    MemAvailable from /proc/meminfo."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo; pass device_bytes=")


def check_plan_fits(
    spec: ModelSpec,
    plan: PlanFields | None,
    batch: MemoryBatch | dict[str, Any],
    *,
    phase: str = "sft",
    device_bytes: int | None = None,
    **options: Any,
) -> pd.DataFrame:
    """Refuse a plan whose per-rank peak (`plan_memory`) exceeds the device, before any work.

    Args:
        spec, plan, batch, phase: as `plan_memory`; `options` are its other keywords.
        device_bytes: memory of one rank's device (default `device_memory_bytes()`: the GPU's
            total if CUDA is available, else the machine's available RAM).

    Returns:
        The `plan_memory` DataFrame when the plan fits.

    Raises:
        ValueError: naming the peak, the device size, the dominant term and the plan axis that
            would lower it; or the errors of `plan_memory`.
    """
    from posttrain.train.memory_plan import plan_memory
    from posttrain.train.parallel import ParallelPlan

    df = plan_memory(spec, plan, batch, phase=phase, **options)
    device = device_memory_bytes() if device_bytes is None else device_bytes
    if isinstance(device, bool) or not isinstance(device, int) or device < 1:
        raise ValueError(f"device_bytes={device_bytes!r}; must be a positive integer or None")
    peak, dominant = df.attrs["peak_bytes"], df.attrs["dominant"]
    if peak > device:
        term_bytes = int(df.set_index("term").loc[dominant, "bytes"])
        plan = ParallelPlan() if plan is None else plan
        raise ValueError(
            f"{plan} needs about {peak / _GIB:.1f} GiB per rank for phase "
            f"{phase!r} but the device has {device / _GIB:.1f} GiB: {dominant} "
            f"{term_bytes / _GIB:.1f} GiB of {peak / _GIB:.1f} GiB per rank: "
            f"{_FIXES.get(dominant, 'lower micro_batch_size')}"
        )
    return df
