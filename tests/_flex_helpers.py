"""A torchtune model whose attention runs a FlexAttention `BlockMask` on CPU, forward only.

torchtune 0.6.1's attention sends a `BlockMask` to FlexAttention only on CUDA; on CPU it hands
every mask to SDPA, which takes dense masks only, and FlexAttention has no backward on CPU
(torch 2.13). These helpers route a `BlockMask` through eager FlexAttention, as the CUDA path
does, so the block-mask path can be compared with the dense one here, under `torch.no_grad()`.
"""

import warnings
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> Any:
    """Eager FlexAttention, without its warning that it runs unfused."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, block_mask=block_mask)


def route_block_masks(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, whose attention modules run a `BlockMask` through `flex` (dense masks: SDPA)."""
    for module in model.modules():
        if hasattr(module, "_attention_call"):
            sdpa = module._attention_call

            def call(q, k, v, mask, dropout_p, is_causal, sdpa=sdpa):
                if isinstance(mask, BlockMask):
                    return flex(q, k, v, mask)
                return sdpa(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)

            module._attention_call = call
    return model
