"""Shared-prefix packing: the rows of a batch that start with the same prompt (a GRPO group's G
samples) are scored in one sequence per prompt, the prompt's tokens once.

A group of G rows, each a prompt of P tokens followed by its own response of L_j tokens, becomes
one packed sequence `prompt, response_1, ..., response_G` of `P + sum_j L_j` tokens, with an
attention mask in which response j sees the prompt and its own earlier tokens only, and position
ids that restart at P for every response (`posttrain.models.attention_masks`: a block-sparse
FlexAttention mask on CUDA, dense `[N, S, S]` on CPU). Each response token then sees exactly
what it saw in its own row, so the logits equal the unpacked forward's up to float rounding,
and the gradient of the shared prompt positions is the sum over the G rows, as in the unpacked
batch. The prompt is computed once instead of G times: for 72-token prompts, 16 new tokens and
G = 8 the forward runs 200 instead of 704 tokens per group.

Shape legend: B = rows, T = tokens per row, N = packed sequences (distinct prompts), S = tokens
per packed sequence, V = vocabulary, D = hidden size.

Example:
    >>> import torch
    >>> ids = torch.tensor([[5, 6, 7, 0], [5, 6, 8, 9]])
    >>> valid = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()
    >>> response = torch.tensor([[0, 0, 1, 0], [0, 0, 1, 1]]).bool()
    >>> pack = SharedPrefixPack.build(ids, valid, response, embed_dim=64)
    >>> pack.input_ids_NS.tolist(), pack.input_pos_NS.tolist()
    ([[5, 6, 7, 8, 9]], [[0, 1, 2, 2, 3]])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.models.attention_masks import (
    PAD,
    PREFIX,
    AttentionMask,
    attended_pairs,
    dense_segment_mask,
    segment_attention_mask,
    use_block_mask,
)

__all__ = ["SharedPrefixPack"]


@dataclass(frozen=True)
class SharedPrefixPack:
    """Rows of a right-padded batch packed by shared prefix (see the module docstring).

    Attributes:
        input_ids_NS: int64 `[N, S]`, right-padded with 0 (padding attends to itself only).
        mask: what the model's `mask=` takes: a FlexAttention `BlockMask` or the dense bool
            `mask_NSS` (`posttrain.models.attention_masks.segment_attention_mask`).
        input_pos_NS: int64 `[N, S]`, the RoPE position of every packed token in its own row.
        sequence_B: int64 `[B]`, the packed sequence that holds row b.
        index_BT: int64 `[B, T]`, where row b's position t lies in its packed sequence (0 on
            padding: read it only through a mask).
        segment_NS: int64 `[N, S]`, PREFIX on the prompt, j on row j's part, PAD on padding.
    """

    input_ids_NS: Tensor
    mask: AttentionMask
    input_pos_NS: Tensor
    sequence_B: Tensor
    index_BT: Tensor
    segment_NS: Tensor

    @property
    def mask_NSS(self) -> Tensor:
        """bool `[N, S, S]`, True where query position s may attend to key position s'."""
        return self.mask if isinstance(self.mask, Tensor) else dense_segment_mask(self.segment_NS)

    @classmethod
    def build(
        cls,
        input_ids_BT: Tensor,
        valid_BT: Tensor,
        response_BT: Tensor,
        *,
        embed_dim: int = 1024,
        max_seq_len: int | None = None,
        block_mask: bool | None = None,
    ) -> SharedPrefixPack | None:
        """Pack right-padded rows by the prefix before each row's first response token; None
        when packing does not pay: no prefix is shared, or the packed forward would cost more
        than 0.9x the rows' by a flop count of 6 x `embed_dim` per token (the projections,
        relative to one attention score) plus the attention scores (T^2 / 2 per causal row;
        S^2 per packed sequence with a dense mask, as with long responses after a short prompt;
        with a block mask only the attended pairs, never more than the rows'); or when a packed
        sequence would be longer than `max_seq_len`, the model's position limit (a prompt's G
        responses together can exceed it where each row fits).

        Args:
            input_ids_BT: int64 `[B, T]`.
            valid_BT: bool `[B, T]`, a run of real tokens then padding in every row.
            response_BT: bool `[B, T]`, a subset of `valid_BT`; a row without a response token
                is all prefix.
            block_mask: pass a FlexAttention `BlockMask` (True) or a dense mask (False); None:
                a `BlockMask` where torchtune's attention runs one (CUDA,
                `posttrain.models.attention_masks.use_block_mask`).
        """
        B, T = input_ids_BT.shape
        lengths = valid_BT.sum(-1).tolist()
        has_response = response_BT.any(-1)
        firsts = torch.where(has_response, response_BT.int().argmax(-1), valid_BT.sum(-1)).tolist()
        ids = input_ids_BT.tolist()
        groups: dict[tuple[int, ...], list[int]] = {}
        for b in range(B):
            groups.setdefault(tuple(ids[b][: firsts[b]]), []).append(b)
        if len(groups) == B:
            return None
        N = len(groups)
        S = max(
            len(prefix) + sum(lengths[b] - firsts[b] for b in rows)
            for prefix, rows in groups.items()
        )
        if max_seq_len is not None and max_seq_len < S:
            return None
        if block_mask is None:
            block_mask = use_block_mask(input_ids_BT.device)
        if not block_mask and N * S * (6 * embed_dim + S) >= 0.9 * B * T * (6 * embed_dim + T / 2):
            return None
        packed_ids, segment, position = (torch.zeros(N, S, dtype=torch.long) for _ in range(3))
        segment.fill_(PAD)
        sequence_B = torch.empty(B, dtype=torch.long)
        index_BT = torch.zeros(B, T, dtype=torch.long)
        for n, (prefix, rows) in enumerate(groups.items()):
            P = len(prefix)
            packed_ids[n, :P] = torch.tensor(prefix, dtype=torch.long)
            segment[n, :P] = PREFIX
            position[n, :P] = torch.arange(P)
            offset = P
            for j, b in enumerate(rows):
                L = lengths[b] - P
                packed_ids[n, offset : offset + L] = input_ids_BT[b, P : P + L]
                segment[n, offset : offset + L] = j
                position[n, offset : offset + L] = torch.arange(P, P + L)
                sequence_B[b] = n
                index_BT[b, :P] = torch.arange(P)
                index_BT[b, P : P + L] = torch.arange(offset, offset + L)
                offset += L
        if block_mask:
            pairs = attended_pairs(segment)
            if N * S * 6 * embed_dim + pairs >= 0.9 * B * T * (6 * embed_dim + T / 2):
                return None
        device = input_ids_BT.device
        segment = segment.to(device)
        return cls(
            packed_ids.to(device),
            segment_attention_mask(segment, block=block_mask),
            position.to(device),
            sequence_B.to(device),
            index_BT.to(device),
            segment,
        )

    def unpack(self, x_NSx: Tensor) -> Tensor:
        """A per-position output of the packed forward (`[N, S, ...]`: logits, hidden states) in
        row layout `[B, T, ...]`; differentiable (the shared prefix's gradient is the sum over
        its rows). Padding positions hold an arbitrary real position's value.

        `index_select`, not advanced indexing: its backward (`index_add_`) sums a shared
        position's gradients in a fixed order on CPU, where advanced indexing's (`index_put_`
        with accumulate) adds them with atomics across threads, so a rerun would not be bitwise
        equal."""
        (N, S), (B, T) = x_NSx.shape[:2], self.index_BT.shape
        flat_index = (self.sequence_B[:, None] * S + self.index_BT).reshape(-1)
        rows = x_NSx.reshape(N * S, *x_NSx.shape[2:]).index_select(0, flat_index)
        return rows.reshape(B, T, *x_NSx.shape[2:])

    def forward(self, model: torch.nn.Module) -> Tensor | list[Tensor]:
        """`model`'s output on the packed sequences (a torchtune `TransformerDecoder`: the
        mask and position ids are passed as `mask=` and `input_pos=`)."""
        return model(self.input_ids_NS, mask=self.mask, input_pos=self.input_pos_NS)
