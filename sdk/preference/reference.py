"""Reference log-probabilities: summed response log-probs of a model (`response_logps`), and
those of a frozen reference over a whole preference dataset, computed once and cached on the
dataset (`compute_reference_logps`, keyed by `reference_fingerprint` of its parameters).

Notation: B = sequences in a forward, T = tokens per sequence, N = items of a dataset.
Log-probabilities are summed over the response tokens, in nats, fp32.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 2)
    >>> before = reference_fingerprint(model)
    >>> before == reference_fingerprint(model), len(before)
    (True, 64)
    >>> with torch.no_grad():
    ...     _ = model.weight.add_(1.0)
    >>> reference_fingerprint(model) == before
    False
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from posttrain.core.distributed import device_of
from posttrain.data.preference import KTODataset, PreferenceDataset
from posttrain.models.lora import adapters_disabled, has_adapters
from posttrain.policy.chunked_ce import check_chunk_tokens, token_logprobs_chunked

if TYPE_CHECKING:
    from posttrain.train.runtime import Runtime

__all__ = ["response_logps", "ReferenceLogps", "reference_fingerprint", "compute_reference_logps"]


def response_logps(
    model: nn.Module,
    input_ids_BT: Tensor,
    attention_mask_BT: Tensor,
    response_mask_BT: Tensor,
    *,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Summed log-probabilities of the response tokens and their counts, in one forward.

    Uses `posttrain.policy.sampling.token_logprobs` (temperature 1, the model's own
    distribution), which keeps the autograd graph; padding and prompt are excluded by position
    (`response_mask_BT`). With `chunk_tokens` the head and log-softmax run over that many
    response tokens at a time (`posttrain.policy.chunked_ce.token_logprobs_chunked`).

    Args:
        model: a torchtune decoder; the tensors are moved to its device.
        input_ids_BT: [B, T] int64; attention_mask_BT, response_mask_BT: [B, T] bool.
        chunk_tokens: None (full [B, T, V] logits) or an int >= 1.

    Returns:
        logps_B [B] fp32 (differentiable), lengths_B [B] int64 response tokens.
    """

    device = device_of(model)
    response_BT = response_mask_BT.to(device).bool()
    logprobs_BT = token_logprobs_chunked(
        model,
        input_ids_BT.to(device),
        attention_mask_BT.to(device),
        response_BT,
        chunk_tokens=chunk_tokens,
    )
    return logprobs_BT.sum(dim=-1), response_BT.sum(dim=-1)


@dataclass(frozen=True)
class ReferenceLogps:
    """Summed reference log-probs of every item of a dataset: `values[key]` is [N] fp32 for each
    key of the dataset's `REFERENCE_KEYS`; `fingerprint` identifies the reference parameters."""

    fingerprint: str
    values: dict[str, Tensor]


@torch.no_grad()
def reference_fingerprint(model: nn.Module, *, sample: int = 65536) -> str:
    """A hex digest of a model's parameters and buffers: for every tensor its name, shape, dtype,
    float64 sum and sum of squares, and the values of up to `sample` evenly spaced elements (all
    of them for smaller tensors). Any training update changes it; an edit of one element that
    keeps both sums and misses the sample would not (not a concern for a reference model).
    For a model split by a ParallelPlan it digests this rank's shards (and their placements);
    `compute_reference_logps` combines the digests of all ranks."""
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):  # split by a ParallelPlan: this rank's shard
            digest.update(f"{tensor.placements}".encode())
            tensor = tensor.to_local()
        values = tensor.detach().flatten().double()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        step = max(1, values.numel() // sample)
        digest.update(torch.stack([values.sum(), (values * values).sum()]).cpu().numpy().tobytes())
        digest.update(values[::step][:sample].cpu().numpy().tobytes())
    return digest.hexdigest()


def compute_reference_logps(
    reference: Any,
    dataset: PreferenceDataset | KTODataset,
    *,
    batch_size: int = 32,
    chunk_tokens: int | None = None,
) -> ReferenceLogps:
    """Summed response log-probs of every item under `reference`, computed once and cached on
    `dataset.reference`, keyed by `reference_fingerprint` of the reference's parameters: a
    second call with the same parameters returns the cache; other parameters recompute.

    Runs under `torch.no_grad()` in eval mode (the model's mode is restored), temperature 1,
    `batch_size` sequences per forward, right-padded (results do not depend on the batch beyond
    float rounding). A model with LoRA adapters is scored as its base, adapters disabled
    (`posttrain.models.lora.adapters_disabled`): the reference policy of a LoRA run is the
    frozen base, with no second copy in memory.

    A reference split by a `ParallelPlan` (given as the `PlanRuntime` of `plan.parallelize`;
    frozen, no optimizer) is a collective: every rank calls this with the same dataset. The
    forwards are the same batches as in one process; data-parallel rank r scores batches r,
    r + W, ... (W data ranks; a rank with one batch fewer repeats a forward it discards, as FSDP2
    needs every rank in every forward), and
    the values are summed over the data ranks (each item is scored by exactly one, so the sum
    is exact). Every rank then holds all values. The fingerprint combines every rank's shards.

    Args:
        reference: a `posttrain.policy.policy.Policy` or a torchtune decoder (`nn.Module`),
            or the `Runtime` of one (split by a ParallelPlan: its `PlanRuntime`).
        dataset: a `PreferenceDataset` or `KTODataset`.
        batch_size: sequences per forward (>= 1).
        chunk_tokens: None (each forward's full [batch_size, T, V] logits) or response tokens
            per chunk of the head and log-softmax (`response_logps`); equal up to rounding.

    Returns:
        The `ReferenceLogps` now on `dataset.reference`; loaders put its values into batches.

    Raises:
        ValueError: for batch_size < 1, or a `chunk_tokens` that is not None or an int >= 1.
        ValueError: for a reference split into pipeline stages (pp > 1), or a model split by a
            plan given without its runtime.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}; must be an integer >= 1")
    check_chunk_tokens(chunk_tokens, "chunk_tokens")
    from posttrain.train.plan_compat import runtime_of
    from posttrain.train.runtime import Runtime

    runtime = (
        reference
        if isinstance(reference, Runtime)
        else runtime_of(getattr(reference, "model", reference))
    )
    model = runtime.model
    if runtime.pipeline is not None:
        raise ValueError(
            f"compute_reference_logps: a reference split into pipeline stages "
            f"({runtime.plan}) has no plain forward to score with; allowed pp: 1"
        )
    fingerprint = reference_fingerprint(model)
    if runtime.mesh is not None:  # split over a mesh: every rank holds shards of it
        fingerprint = _all_ranks_fingerprint(fingerprint)
    if dataset.reference is not None and dataset.reference.fingerprint == fingerprint:
        return dataset.reference
    rank, ranks = runtime.data_rank, runtime.data_size
    starts = list(range(0, len(dataset), batch_size))
    mine = starts[rank::ranks]
    rounds = -(-len(starts) // ranks)  # forwards per rank: the same on every rank
    was_training = model.training
    model.eval()
    values = {}
    base = adapters_disabled(model) if has_adapters(model) else contextlib.nullcontext()
    try:
        with torch.no_grad(), base:  # a LoRA model's reference is its base
            for key in dataset.REFERENCE_KEYS:
                parts = {}
                for i in range(rounds):
                    start = mine[i] if i < len(mine) else starts[0]  # the spare forward
                    indices = range(start, min(start + batch_size, len(dataset)))
                    logps_B, _ = response_logps(
                        model, *dataset.padded(indices, key), chunk_tokens=chunk_tokens
                    )
                    if i < len(mine):
                        parts[start] = logps_B.float().cpu()
                values[key] = (
                    torch.cat([parts[s] for s in starts])
                    if ranks == 1
                    else _sum_over_data_ranks(parts, len(dataset), runtime)
                )
    finally:
        model.train(was_training)
    dataset.reference = ReferenceLogps(fingerprint, values)
    return dataset.reference


def _all_ranks_fingerprint(local: str) -> str:
    """sha256 over every rank's `reference_fingerprint` of its shards (a collective)."""
    import torch.distributed as dist

    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, local)
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def _sum_over_data_ranks(parts: dict[int, Tensor], n: int, runtime: Runtime) -> Tensor:
    """[n] fp32: this rank's batches (keyed by their first item) in place, zeros elsewhere,
    SUMmed over the runtime's data-parallel ranks."""
    full = torch.zeros(n, dtype=torch.float32)
    for start, logps_B in parts.items():
        full[start : start + logps_B.numel()] = logps_B
    # NCCL reduces on the GPU, gloo on the CPU
    return runtime.sum_over_data_ranks(full.to(runtime.collective_device)).cpu()
