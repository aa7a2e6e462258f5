"""What the memory plan counts from: the batch it is asked about (`MemoryBatch`), a model's
parameters per block and in the root (`model_counts`), the bytes one block saves per token for
the backward (`activation_bytes_per_token`), and the bytes of a dtype and of an optimizer's
state per parameter. The formulas are those of `posttrain.train.memory_plan`'s module docstring
(notation there), which adds these up, term by term, into one rank's peak.

Example:
    >>> from posttrain.models import get_preset
    >>> all_parameters(model_counts(get_preset("tiny-1m")), get_preset("tiny-1m"))
    1020032
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.models.specs import ModelSpec
    from posttrain.train.plan_value import PlanFields

__all__ = [
    "MemoryBatch",
    "OPTIMIZER_STATES",
    "DTYPE_BYTES",
    "ModelCounts",
    "model_counts",
    "activation_bytes_per_token",
    "all_parameters",
    "optimizer_states",
    "dtype_bytes",
]

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "lion": 1}
"""fp32 tensors the optimizer keeps per parameter tensor (AdamW: exp_avg and exp_avg_sq)."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes of one element of each dtype a model's parameters or activations may be held in."""


@dataclass(kw_only=True, frozen=True)
class MemoryBatch:
    """The shapes `plan_memory` needs.

    Args:
        micro_batch_size: rows per micro-batch on ONE data-parallel rank (the loader's global
            batch / plan.data_parallel_size; a DPO pair is two rows).
        seq_len: tokens per row (the padded length).
        num_sequences: sequences one rank generates at once (grpo, ppo, rollout); default
            micro_batch_size.
        max_total_len: prompt + completion tokens the KV cache holds; default seq_len.
        prompt_len: tokens of the prefill; default max_total_len.

    Raises:
        ValueError: naming the field, for a value that is not a positive integer.
    """

    micro_batch_size: int
    seq_len: int
    num_sequences: int | None = None
    max_total_len: int | None = None
    prompt_len: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MemoryBatch.{f.name}={value!r}; must be a positive integer")

    @classmethod
    def of(cls, batch: MemoryBatch | dict[str, Any]) -> MemoryBatch:
        """`batch` itself, or a MemoryBatch from a dict with its field names."""
        if isinstance(batch, cls):
            return batch
        if not isinstance(batch, dict):
            raise ValueError(
                f"batch={batch!r}; must be a MemoryBatch or a dict with keys "
                f"{', '.join(f.name for f in fields(cls))}"
            )
        if unknown := sorted(set(batch) - {f.name for f in fields(cls)}):
            raise ValueError(
                f"batch has unknown key(s) {', '.join(unknown)}; allowed: "
                f"{', '.join(f.name for f in fields(cls))}"
            )
        return cls(**batch)


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts of one block and of the root (embedding, final norm, output)."""

    block_tp: int  # q/k/v/o (+ biases) and dense w1/w2/w3: split by tp
    block_replicated: int  # RMSNorm scales, MoE router and shared expert
    block_experts: int  # routed experts: split by ep
    root_tp: int  # embedding + output when untied (split by tp); tied: 0
    root_replicated: int  # final norm, and the tied embedding
    largest_block: int  # elements of a block's largest tp-split tensor (before tp)
    largest_expert: int  # elements of one stacked expert weight [E, M, D] (before ep)
    largest_root: int  # elements of the embedding


def model_counts(spec: ModelSpec) -> ModelCounts:
    """The parameter counts of `spec`'s blocks and root (module docstring of
    `posttrain.train.memory_plan`: "Counts")."""
    D, H, K, d, F, V = (
        spec.embed_dim,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.intermediate_dim,
        spec.vocab_size,
    )
    bias = (H + 2 * K) * d if spec.traits.qkv_bias else 0  # qwen2's q/k/v biases
    attn = 2 * D * H * d + 2 * D * K * d + bias
    qk_norm = 2 * d if spec.traits.qk_norm else 0  # qwen3's per-head q/k norm scales
    replicated, experts, mlp = 2 * D + qk_norm, 0, 3 * D * F
    if spec.is_moe:
        E, M, S = spec.num_experts, spec.moe_intermediate_dim, spec.shared_expert_dim
        mlp, experts = 0, 3 * E * M * D
        replicated += E * D + (3 * D * S + D if S else 0)
    tied = spec.tie_word_embeddings
    return ModelCounts(
        block_tp=attn + mlp,
        block_replicated=replicated,
        block_experts=experts,
        root_tp=0 if tied else 2 * V * D,
        root_replicated=D + (V * D if tied else 0),
        largest_block=max(D * H * d, 0 if spec.is_moe else D * F),
        largest_expert=experts // 3,
        largest_root=V * D,
    )


def activation_bytes_per_token(spec: ModelSpec, plan: PlanFields, a: int) -> float:
    """Saved bytes of one block per token (module docstring), on one rank of plan.tp."""
    D, H, K, F, tp = (
        spec.embed_dim,
        spec.num_heads,
        spec.num_kv_heads,
        spec.intermediate_dim,
        plan.tp,
    )
    d = spec.head_dim  # H x d = D unless the spec sets attention_head_dim (qwen3)
    rope = 8 * d if spec.traits.interleaved_rope else 4 * a * d
    replicated = 16 * D + 8 + 2 * a * D + rope
    split = 4 * a * H * d + 4 * H
    if spec.traits.qk_norm:  # per-head RMSNorms of q and k, saved as the block norms, per head
        split += 8 * (H + K) * d + 4 * (H + K)
    if spec.is_moe:
        k, M, S, E = (
            spec.experts_per_token,
            spec.moe_intermediate_dim,
            spec.shared_expert_dim,
            spec.num_experts,
        )
        mlp = k * (3 * a * D + 4 * a * M + 24) + 4 * E + ((4 * S + D + 2) * a if S else 0)
        return replicated + split / tp + mlp
    return replicated + (split + 4 * a * F) / tp


def optimizer_states(optimizer: str | float) -> float:
    """fp32 states per parameter of `optimizer`: a name in `OPTIMIZER_STATES`, or the number.

    Raises:
        ValueError: for an unknown name, or a number that is not finite and >= 0.
    """
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZER_STATES:
            raise ValueError(
                f"optimizer={optimizer!r}; allowed: {', '.join(OPTIMIZER_STATES)} "
                "or a number of fp32 states per parameter"
            )
        return OPTIMIZER_STATES[optimizer]
    if (
        isinstance(optimizer, bool)
        or not isinstance(optimizer, (int, float))
        or not 0 <= optimizer < math.inf
    ):
        raise ValueError(
            f"optimizer={optimizer!r}; must be a name ({', '.join(OPTIMIZER_STATES)})"
            " or a number >= 0 of fp32 states per parameter"
        )
    return float(optimizer)


def dtype_bytes(name: str, value: str | None) -> int:
    """Bytes of one element of dtype `value` (a key of `DTYPE_BYTES`).

    Raises:
        ValueError: naming the argument `name`, for another dtype.
    """
    if value not in DTYPE_BYTES:
        raise ValueError(f"{name}={value!r}; allowed: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[value]


def all_parameters(counts: ModelCounts, spec: ModelSpec) -> int:
    """All parameters of the model (every block, the root), from the counts above."""
    block = counts.block_tp + counts.block_replicated + counts.block_experts
    return spec.num_layers * block + counts.root_tp + counts.root_replicated


def loss_bytes(
    vocab: int, embed_dim: int, tokens: int, a: int, p: int, chunk_tokens: int | None
) -> float:
    """Bytes the cross-entropy (or the token log-probs) allocates at its peak, forward and
    backward, the head weight's gradient included; measured with
    `posttrain.train.memory_measure.TensorPeak` (tests/train/test_chunked_ce.py).

    Unchunked (`chunk_tokens` None): the forward holds the fp32 logits (the decoder's
    `.float()`; a bf16 model's own logits are a freed temporary), their copy with untrained
    positions zeroed (`keep_selected`'s `torch.where`) and the saved log-softmax, 12 x N x V;
    backward holds the log-softmax, its gradient and the logits' gradient, then the logits'
    gradient beside the head's (p x V x D) and the hidden states' (a x D x N, twice).
    Chunked (`posttrain.policy.chunked_ce`, C = chunk_tokens < N): the same 12 x C x V for one
    chunk beside the running head gradient, or three head gradients at once (the running one,
    the chunk's and their sum), plus the gathered hidden states of the scored positions and
    their gradient, 2 x a x D x N. One chunk (C >= N): as unchunked, + a x D x N.

    Args:
        vocab, embed_dim: V and D. tokens: N, positions scored. a, p: bytes of an activation and
            of a parameter. chunk_tokens: the chunk size, or None.
    """
    head_grad = p * vocab * embed_dim
    if chunk_tokens is None or chunk_tokens >= tokens:
        whole = max(
            12.0 * tokens * vocab, 4.0 * tokens * vocab + head_grad + 2 * a * embed_dim * tokens
        )
        return whole + (0 if chunk_tokens is None else a * embed_dim * tokens)
    c = chunk_tokens
    return max(12.0 * c * vocab + head_grad, 3.0 * head_grad) + 2 * a * embed_dim * tokens
