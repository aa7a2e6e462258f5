"""The attention term of the MFU convention (posttrain.core.timing): `attention_span` (the sum,
over counted tokens, of their sequence's length), `attention_dims` (L, d_attn read off a model)
and `step_flops` (6 N D + 12 L d_attn S), each against counts made by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from posttrain.core.timing import attention_dims, attention_flops, attention_span, step_flops


def test_attention_span_of_packed_and_unpacked_rows_by_hand():
    """Row 0 packs documents of 3, 4 and 1 tokens (then no padding); row 1 is one document of 5
    then a padding tail of 3. Counted: all but each document's last token and the padding.
    By hand: row 0: 3 x 2 + 4 x 3 + 1 x 0 = 18; row 1: 5 x 4 = 20; total 38."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 2]])
    counted = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]).bool()
    assert int(attention_span(pos, counted)) == 38
    # unpacked right-padded rows (ids 0..T-1): every counted token gets the row length T = 8
    plain = torch.arange(8).expand(2, 8)
    assert int(attention_span(plain, counted)) == 8 * int(counted.sum())
    # a row whose ids do not start at 0 still starts a sequence at column 0
    assert int(attention_span(torch.tensor([[5, 6, 0]]), torch.ones(1, 3).bool())) == 2 * 2 + 1
    with pytest.raises(ValueError, match=r"must both be \[B, T\]"):
        attention_span(pos, counted[0])


def test_attention_dims_of_a_preset_a_plain_mlp_and_mixed_widths():
    """tiny-1m: 4 layers of 4 heads x 32 = 128; no q_proj: (0, 0); two widths: refused."""
    from posttrain.models import build_model, get_preset

    assert attention_dims(build_model(get_preset("tiny-1m"), seed=0)) == (4, 128)
    assert attention_dims(nn.Sequential(nn.Linear(4, 4))) == (0, 0)

    class Attn(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.q_proj = nn.Linear(8, width)

    assert attention_dims(nn.Sequential(Attn(16), Attn(16))) == (2, 16)
    with pytest.raises(ValueError, match=r"widths \[16, 24\]"):
        attention_dims(nn.Sequential(Attn(16), Attn(24)))


def test_step_flops_is_6nd_plus_the_attention_term():
    """One length T for all: the attention term is attention_flops (PaLM appendix B). Mixed
    lengths 4 and 6 (S = 16 + 36 = 52), N = 1,000, L = 2, d_attn = 4: train 60,000 + 12 x 2 x
    4 x 52 = 64,992; forward 20,000 + 4 x 2 x 4 x 52 = 21,664."""
    uniform = step_flops(1_000, 10, span=8 * 10, num_layers=2, attn_dim=4, kind="train")
    assert uniform == 6 * 1_000 * 10 + attention_flops(2, 8, 4, 10, kind="train")
    assert step_flops(1_000, 10, span=52, num_layers=2, attn_dim=4, kind="train") == 64_992
    assert step_flops(1_000, 10, span=52, num_layers=2, attn_dim=4, kind="forward") == 21_664
    assert step_flops(1_000, 10, span=52, num_layers=0, attn_dim=0, kind="train") == 60_000
    with pytest.raises(ValueError, match="kind='eval'"):
        step_flops(1, 1, span=1, num_layers=1, attn_dim=1, kind="eval")
