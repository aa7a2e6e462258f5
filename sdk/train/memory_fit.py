"""Whether a planned per-rank peak fits the device: `refuse_over_device` turns a `plan_memory`
table into a refusal naming the peak, the device size, the dominant term and the plan axis that
would lower it (`posttrain.train.memory_plan.check_plan_fits` is the entry point);
`device_memory_bytes` reads the device's size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import pandas as pd

    from posttrain.train.plan_value import PlanFields

__all__ = ["device_memory_bytes", "refuse_over_device"]

_GIB = 2**30

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


def refuse_over_device(
    df: pd.DataFrame, plan: PlanFields | None, phase: str, device_bytes: int | None
) -> pd.DataFrame:
    """`df` (a `plan_memory` table) when its peak fits `device_bytes` (default
    `device_memory_bytes()`).

    Raises:
        ValueError: naming the peak, the device size, the dominant term and the plan axis that
            would lower it; or for a `device_bytes` that is not a positive int.
    """
    from posttrain.train.parallel import ParallelPlan

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
