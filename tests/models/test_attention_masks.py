"""Attention masks from segment ids (`posttrain.models.attention_masks`): the dense mask equals
torchtune's block-causal mask for packed documents and the hand-written rule for shared-prefix
groups; the block-sparse FlexAttention mask gives the dense mask's attention (FlexAttention's
eager forward on CPU, which has no backward there); a torchtune model fed the block mask gives
the logits of the dense mask and of the unpacked rows (shared-prefix groups:
tests/policy/test_shared_prefix.py)."""

import pytest
import torch
import torch.nn.functional as F
from _flex_helpers import flex, route_block_masks
from torch.nn.attention.flex_attention import BlockMask
from torchtune.modules.attention_utils import create_block_causal_mask

from posttrain.data.loader import Sample, pack_samples
from posttrain.models.attention_masks import (
    PAD,
    PREFIX,
    attended_pairs,
    block_segment_mask,
    dense_segment_mask,
    device_mask,
    documents_from_mask,
    segment_attention_mask,
    use_block_mask,
)
from posttrain.policy import Policy

pytestmark = pytest.mark.usefixtures("one_thread")


def _documents(lengths: list[int]) -> torch.Tensor:
    """int64 [1, sum(lengths)]: document i's id on its positions."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


def _group(prompt: int, answers: list[int], pad: int = 0) -> torch.Tensor:
    """int64 [1, S]: a shared prompt, the answers' segments 0..G-1, then padding."""
    parts = [torch.full((prompt,), PREFIX)] + [torch.full((n,), j) for j, n in enumerate(answers)]
    return torch.cat(parts + [torch.full((pad,), PAD)])[None]


def _reference_mask(segment: list[int]) -> torch.Tensor:
    """The rule of the module docstring, one (query, key) pair at a time."""
    S = len(segment)
    mask = torch.zeros(S, S, dtype=torch.bool)
    for q in range(S):
        for k in range(q + 1):
            if segment[q] == PAD:
                mask[q, k] = k == q
            else:
                mask[q, k] = segment[k] in (segment[q], PREFIX)
    return mask


def test_the_documents_mask_is_torchtunes_block_causal_mask():
    for lengths in ([3, 2, 1], [1, 7, 2, 5], [9]):
        want = create_block_causal_mask([torch.tensor(lengths)])
        assert torch.equal(dense_segment_mask(_documents(lengths)), want)


def test_the_shared_prefix_mask_by_hand():
    segment_NS = torch.cat([_group(2, [3, 1, 2], pad=2), _group(4, [2, 3], pad=1)])
    mask = dense_segment_mask(segment_NS)
    for n in range(2):
        assert torch.equal(mask[n], _reference_mask(segment_NS[n].tolist()))
    # the first answer's last token sees the prompt and its own tokens, not the padding
    assert mask[0, 4].tolist() == [True, True, True, True, True, False, False, False, False, False]
    assert attended_pairs(segment_NS) == int(mask.sum())


def test_bad_segments_are_refused_by_name():
    with pytest.raises(ValueError, match="segment_NS must be int64"):
        dense_segment_mask(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="segment_NS holds -3"):
        block_segment_mask(torch.tensor([[0, -3]]))


def test_cpu_keeps_the_dense_mask():
    assert not use_block_mask("cpu")
    mask = segment_attention_mask(_documents([2, 2]))
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
    assert isinstance(segment_attention_mask(_documents([2, 2]), block=True), BlockMask)


def test_a_packed_batchs_documents_are_read_back_from_its_mask():
    samples = [Sample(torch.arange(3, 3 + n), torch.full((n,), -100)) for n in (5, 1, 7, 3)]
    rows = pack_samples(samples, seq_len=10, pad_id=0)  # 5 + 1 + 4 padding, 7 + 3
    masks = torch.cat([r.attention_mask for r in rows])
    want = [[0, 0, 0, 0, 0, 1, 2, 2, 2, 2], [0] * 7 + [1] * 3]
    assert documents_from_mask(masks).tolist() == want
    assert device_mask(masks, "cpu") is masks  # CPU: the dense mask, as it was
    leaky = masks.clone()
    leaky[0, 6, 0] = True  # a query of the second document sees the first one
    with pytest.raises(ValueError, match="mask_BTT is not block-causal"):
        documents_from_mask(leaky)
    with pytest.raises(ValueError, match="mask_BTT must be bool"):
        documents_from_mask(masks.long())


@pytest.mark.parametrize(
    "segment_NS",
    [
        _documents([37, 130, 100, 33]),  # uneven documents across 128-blocks
        torch.cat([_group(20, [150, 90, 40], pad=0), _group(5, [200, 80], pad=15)]),
    ],
    ids=["documents", "long-answers"],
)
@torch.no_grad()
def test_the_block_mask_gives_the_dense_masks_attention(segment_NS):
    N, S = segment_NS.shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(N, 2, S, 64, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_segment_mask(segment_NS)[:, None]
    )
    got = flex(q, k, v, block_segment_mask(segment_NS))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def flex_model():
    """tiny-1m whose attention runs a `BlockMask` through eager FlexAttention."""
    return route_block_masks(Policy.from_spec("tiny-1m", seed=0).model.eval())


@torch.no_grad()
def test_packed_rows_with_the_block_mask_give_the_unpacked_logits(flex_model):
    g = torch.Generator().manual_seed(1)
    lengths = [37, 110, 9, 64]
    samples = [
        Sample(ids, torch.full((n,), -100))
        for n in lengths
        for ids in [torch.randint(3, 250, (n,), generator=g)]
    ]
    (row,) = pack_samples(samples, seq_len=240, pad_id=0)
    documents = _documents([*lengths, 240 - sum(lengths)])
    dense = flex_model(row.input_ids, mask=row.attention_mask, input_pos=row.position_ids)
    block = flex_model(
        row.input_ids, mask=block_segment_mask(documents), input_pos=row.position_ids
    )
    torch.testing.assert_close(block, dense, rtol=1e-5, atol=1e-5)
    start = 0
    for sample in samples:
        alone = flex_model(sample.input_ids[None])[0]
        torch.testing.assert_close(
            block[0, start : start + len(sample)], alone, rtol=1e-5, atol=1e-5
        )
        start += len(sample)
