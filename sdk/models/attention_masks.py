"""Attention masks of packed sequences from per-position segment ids: a dense bool mask `[N, S, S]`
for SDPA, or a block-sparse FlexAttention `BlockMask` that never materialises the S x S matrix.

Two layouts use them. Packed rows (`posttrain.data.loader.pack_samples`): documents back to
back, each position sees the earlier positions of its own document (the padding tail is a
document of its own). Shared-prefix groups (`posttrain.policy.shared_prefix`): a prompt, then
its G responses; a response sees the prompt and its own earlier tokens. One rule covers both:
query q sees key k iff `k <= q` and (`segment[k] == segment[q]` or `segment[k] == PREFIX`);
a `PAD` query sees itself only (no empty softmax row).

Which mask (`use_block_mask`): torchtune 0.6.1's attention sends a `BlockMask` to its compiled
`flex_attention` only on CUDA with compute capability >= 7.5 (`_SUPPORTS_FLEX_ATTENTION`);
elsewhere it hands any mask to SDPA, which takes dense masks only. Every packed path asks the
same question: shared-prefix scoring (`segment_attention_mask`), and the packed rows of SFT/CPT,
distillation and the pipeline stages (`device_mask` of the loader's dense mask; the pipeline
builds each micro-batch's mask from its documents). On CPU the dense mask stays,
at every length: with torch 2.13, FlexAttention has no backward on CPU ("FlexAttention does not
support backward on CPU"), eager or compiled, and its forward is slower than SDPA with the dense
mask (benchmarks/attention_masks.py; docs/benchmarks_real_models.md). So a CPU forward is
bitwise what it was. Memory of the dense mask: N x S x S bytes, plus SDPA's float copy of it.

Shape legend: N = packed sequences, S = tokens per packed sequence.

Example:
    >>> import torch
    >>> segment_NS = torch.tensor([[PREFIX, PREFIX, 0, 0, 1, PAD]])
    >>> dense_segment_mask(segment_NS)[0].int().tolist()
    [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], \
[1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]]
    >>> block = block_segment_mask(segment_NS)
    >>> tuple(block.shape)
    (1, 1, 6, 6)
    >>> attended_pairs(segment_NS)  # the True entries of the dense mask: 1+2+3+4+3+1
    14
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

__all__ = [
    "PAD",
    "PREFIX",
    "FLEX_CAPABILITY",
    "AttentionMask",
    "attended_pairs",
    "block_segment_mask",
    "dense_segment_mask",
    "device_mask",
    "documents_from_mask",
    "pad_block_mask",
    "segment_attention_mask",
    "use_block_mask",
]

PREFIX = -1
"""Segment id of positions every later position of the sequence sees (a shared prompt)."""
PAD = -2
"""Segment id of padding: a padding query sees itself only."""

AttentionMask = Tensor | BlockMask
"""What a torchtune decoder takes as `mask=`: dense bool `[N, S, S]` or a `BlockMask`."""


def _check_segments(segment_NS: Tensor) -> None:
    if segment_NS.ndim != 2 or segment_NS.dtype != torch.int64:
        raise ValueError(
            f"segment_NS must be int64 [N, S]; got {segment_NS.dtype} {tuple(segment_NS.shape)}"
        )
    if bool((segment_NS < PAD).any()):
        raise ValueError(
            f"segment_NS holds {int(segment_NS.min())}; allowed: PREFIX={PREFIX}, PAD={PAD} "
            "or a segment id >= 0"
        )


def dense_segment_mask(segment_NS: Tensor) -> Tensor:
    """bool `[N, S, S]`, True where query s may attend to key s' (the module's rule).

    Raises:
        ValueError: if `segment_NS` is not int64 `[N, S]` or holds an id below PAD.
    """
    _check_segments(segment_NS)
    S = segment_NS.shape[1]
    q, k = segment_NS[:, :, None], segment_NS[:, None, :]
    causal = torch.ones(S, S, dtype=torch.bool, device=segment_NS.device).tril()
    mask = causal & ((k == PREFIX) | (k == q))
    eye = torch.eye(S, dtype=torch.bool, device=segment_NS.device)
    return torch.where(q == PAD, eye, mask)


def block_segment_mask(segment_NS: Tensor) -> BlockMask:
    """The same mask as `dense_segment_mask`, as a FlexAttention `BlockMask` on `segment_NS`'s
    device (blocks of 128 x 128 positions; fully masked blocks are skipped by the kernel).

    Raises:
        ValueError: if `segment_NS` is not int64 `[N, S]` or holds an id below PAD.
    """
    _check_segments(segment_NS)
    N, S = segment_NS.shape
    segment = segment_NS

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q, k = segment[b, q_idx], segment[b, kv_idx]
        seen = (kv_idx <= q_idx) & ((k == PREFIX) | (k == q))
        return torch.where(q == PAD, q_idx == kv_idx, seen)

    return create_block_mask(mask_mod, N, None, S, S, device=str(segment_NS.device))


def attended_pairs(segment_NS: Tensor) -> int:
    """The number of (query, key) pairs the mask allows, summed over sequences, in O(N x S):
    the attention work of a kernel that skips masked pairs (a dense mask costs N x S x S).

    Raises:
        ValueError: if `segment_NS` is not int64 `[N, S]` or holds an id below PAD.
    """
    _check_segments(segment_NS)
    total = 0
    for row in segment_NS.tolist():
        seen: dict[int, int] = {}  # earlier positions of each segment
        for s in row:
            if s == PAD:
                total += 1
                continue
            seen[s] = seen.get(s, 0) + 1
            total += seen[s] + (seen.get(PREFIX, 0) if s != PREFIX else 0)
    return total


FLEX_CAPABILITY = (7, 5)
"""The least CUDA compute capability torchtune 0.6.1 runs FlexAttention on."""


def use_block_mask(
    device: torch.device | str, *, capability: tuple[int, int] | None = None
) -> bool:
    """True where torchtune's attention runs a `BlockMask` through FlexAttention: CUDA with
    compute capability >= 7.5 (`FLEX_CAPABILITY`). False on CPU (see the module docstring).

    Args:
        device: the model's device.
        capability: the CUDA device's (major, minor); None: what torchtune found at import
            (`_SUPPORTS_FLEX_ATTENTION`, the current CUDA device's), which is what its
            attention acts on.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if capability is not None:
        return tuple(capability) >= FLEX_CAPABILITY
    from torchtune.utils._import_guard import _SUPPORTS_FLEX_ATTENTION

    return bool(_SUPPORTS_FLEX_ATTENTION)


def segment_attention_mask(segment_NS: Tensor, *, block: bool | None = None) -> AttentionMask:
    """The mask of `segment_NS` for a torchtune decoder's `mask=`: a `BlockMask` when `block`
    (None: `use_block_mask` of `segment_NS`'s device), else dense bool `[N, S, S]`.

    Raises:
        ValueError: if `segment_NS` is not int64 `[N, S]` or holds an id below PAD.
    """
    if block is None:
        block = use_block_mask(segment_NS.device)
    return block_segment_mask(segment_NS) if block else dense_segment_mask(segment_NS)


def documents_from_mask(mask_BTT: Tensor) -> Tensor:
    """The document ids int64 `[B, T]` of a block-causal mask (`posttrain.data.loader`'s packed
    rows): a document starts where a position does not see the one before it.

    Raises:
        ValueError: if `mask_BTT` is not bool `[B, T, T]`, or not the block-causal mask of the
            documents it starts (the check compares the dense masks: O(B x T x T) on the mask's
            device).
    """
    if mask_BTT.ndim != 3 or mask_BTT.dtype != torch.bool or mask_BTT.shape[1] != mask_BTT.shape[2]:
        raise ValueError(
            f"mask_BTT must be bool [B, T, T]; got {mask_BTT.dtype} {tuple(mask_BTT.shape)}"
        )
    B, T = mask_BTT.shape[:2]
    starts_BT = torch.ones(B, T, dtype=torch.long, device=mask_BTT.device)
    starts_BT[:, 1:] = (~mask_BTT.diagonal(offset=-1, dim1=1, dim2=2)).long()
    documents_BT = starts_BT.cumsum(-1) - 1
    if not torch.equal(dense_segment_mask(documents_BT), mask_BTT):
        raise ValueError(
            "mask_BTT is not block-causal: each position must see exactly the earlier positions "
            "of its own document (posttrain.data.loader.pack_samples)"
        )
    return documents_BT


def device_mask(mask_BTT: Tensor | None, device: torch.device | str) -> AttentionMask | None:
    """A packed batch's block-causal mask (`posttrain.data.loader.Batch.attention_mask`) for a
    model on `device`: the same dense mask moved there, or, where `use_block_mask(device)`, the
    `BlockMask` of its documents (`documents_from_mask`, read on the mask's device), which never
    holds the T x T matrix on the model's device. None (plain causal rows) stays None.

    Raises:
        ValueError: as `documents_from_mask`, when a `BlockMask` is built.
    """
    if mask_BTT is None or not use_block_mask(device):
        return None if mask_BTT is None else mask_BTT.to(device)
    return block_segment_mask(documents_from_mask(mask_BTT).to(device))


def pad_block_mask(block: BlockMask, pad: int) -> BlockMask:
    """`block` (a `[N, 1, S, S]` mask with a `mask_mod`) grown to S + `pad` positions: the first
    S keep their mask and see no padding, a padding position sees itself only (sequence
    parallelism pads a row to a multiple of its degree).

    Raises:
        ValueError: if `pad` is not an int >= 0.
    """
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise ValueError(f"pad={pad!r}; must be an int >= 0")
    if pad == 0:
        return block
    S, inner = block.seq_lengths[0], block.mask_mod

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        real = (q_idx < S) & (kv_idx < S)
        seen = inner(b, h, q_idx.clamp(max=S - 1), kv_idx.clamp(max=S - 1)) & real
        return seen | ((q_idx >= S) & (q_idx == kv_idx))

    device = str(block.kv_num_blocks.device)
    return create_block_mask(mask_mod, block.shape[0], None, S + pad, S + pad, device=device)
