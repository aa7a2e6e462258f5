"""Samples to batches (posttrain.data.loader): padding (`collate_padded`, `right_pad`) and
packing (`pack_samples`: block-causal masks, positions restarting per sample, no label across a
sample boundary) pinned by hand, `Batch` checking its shapes and dtypes, and packing being exact:
a tiny model sees each packed sample as if it were alone. Ids: tests/_data_helpers.py."""

from __future__ import annotations

import pytest
import torch
from _data_helpers import TOK, X, chat

from posttrain.data import (
    Batch,
    Sample,
    SFTDataset,
    SFTLoader,
    collate_padded,
    pack_samples,
    right_pad,
    stack_rows,
)

# ------------------------------------------------------------------------------------------
# Padding and packing, pinned by hand
# ------------------------------------------------------------------------------------------


def test_collate_padded_pinned():
    a = Sample.from_loss_mask([1, 2, 3], [False, True, True])
    b = Sample.from_loss_mask([4, 5], [False, True])
    batch = collate_padded([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert batch.labels.tolist() == [[2, 3, X], [5, X, X]]
    assert batch.position_ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert batch.attention_mask is None and batch.num_samples == 2
    assert batch.num_trained_tokens == 3
    with pytest.raises(ValueError, match="at least one"):
        collate_padded([], 0)


def test_right_pad_shapes_dtypes_and_values():
    ids_BT, mask_BT = right_pad([[5, 6, 7], torch.tensor([8])], pad_id=1)
    assert ids_BT.dtype == torch.int64 and mask_BT.dtype == torch.bool
    assert ids_BT.tolist() == [[5, 6, 7], [8, 1, 1]]
    assert mask_BT.tolist() == [[True] * 3, [True, False, False]]
    logps_BT, _ = right_pad([[-0.5], []], 0.0, dtype=torch.float32)
    assert logps_BT.dtype == torch.float32 and logps_BT.tolist() == [[-0.5], [0.0]]
    with pytest.raises(ValueError, match="at least one"):
        right_pad([], 0)


def test_pack_pinned_block_causal_mask_positions_and_labels():
    a = Sample.from_loss_mask([1, 2], [False, True])
    b = Sample.from_loss_mask([3, 4, 5], [False, True, True])
    (row,) = pack_samples([a, b], seq_len=6, pad_id=0)
    assert row.input_ids.tolist() == [[1, 2, 3, 4, 5, 0]]
    # Sample a's last token (2) must not learn to predict b's first token (3).
    assert row.labels.tolist() == [[2, X, 4, 5, X, X]]
    assert row.position_ids.tolist() == [[0, 1, 0, 1, 2, 0]]
    T, F = True, False
    assert row.attention_mask[0].tolist() == [
        [T, F, F, F, F, F],
        [T, T, F, F, F, F],
        [F, F, T, F, F, F],
        [F, F, T, T, F, F],
        [F, F, T, T, T, F],
        [F, F, F, F, F, T],  # padding tail: its own block, so no row is fully masked
    ]
    assert row.num_samples == 2 and row.attention_mask.dtype == torch.bool


def test_pack_samples_starts_new_rows_and_rejects_too_long():
    samples = [Sample.from_loss_mask(list(range(n)), [True] * n) for n in (3, 3, 2, 4)]
    rows = pack_samples(samples, seq_len=6, pad_id=0)
    assert [r.num_samples for r in rows] == [2, 2]
    batch = stack_rows(rows)
    assert batch.input_ids.shape == batch.labels.shape == (2, 6)
    assert batch.attention_mask.shape == (2, 6, 6) and batch.num_samples == 4
    with pytest.raises(ValueError, match="does not fit"):
        pack_samples(samples, seq_len=3, pad_id=0)


def test_batch_validates_shapes_and_dtypes():
    ids = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="labels"):
        Batch(ids, torch.zeros(2, 3, dtype=torch.int32), ids, None, 2)
    with pytest.raises(ValueError, match="attention_mask"):
        Batch(ids, ids, ids, torch.ones(2, 3, 3), 2)


# ------------------------------------------------------------------------------------------
# Packing is exact: the model sees each packed sample as if alone
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    from posttrain.models import build_model, get_preset

    return build_model(get_preset("tiny-1m"), seed=0).eval()


ROWS = [chat("hello there", "general kenobi"), chat("2+2?", "4"), chat("abc", "def ghi")]


def _forward(model, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        return model(batch.input_ids, mask=batch.attention_mask, input_pos=batch.position_ids)


def test_packed_logits_equal_each_sample_alone(tiny_model):
    """A packed row [s0 | s1 | s2 | pad] against each sample alone.

    Alone in a row of the same length (same matmul shapes) the logits agree to <= 1e-5 (in
    practice bitwise). Alone unpadded, with the default causal mask (mask=None), they agree up
    to fp32 rounding of different matmul shapes: logits here reach |x| ~ 140, where 1 ulp is
    1.5e-5, so the comparison is relative (rtol 1e-5) with atol 1e-5.
    """
    ds = SFTDataset(ROWS, TOK, max_seq_len=64)
    T = 80
    (row,) = pack_samples(list(ds), T, TOK.pad_id)
    assert row.num_samples == 3 and sum(len(s) for s in ds) < T
    logits = _forward(tiny_model, row)[0]
    start = 0
    for s in ds:
        L = len(s)
        same_shape = _forward(tiny_model, pack_samples([s], T, TOK.pad_id)[0])[0, :L]
        assert (logits[start : start + L] - same_shape).abs().max().item() <= 1e-5
        with torch.no_grad():
            alone = tiny_model(s.input_ids[None])[0]
        torch.testing.assert_close(logits[start : start + L], alone, rtol=1e-5, atol=1e-5)
        start += L


def test_packed_sample_does_not_see_its_neighbour(tiny_model):
    """Changing every token of sample 0 leaves sample 1's logits bitwise unchanged."""
    ds = SFTDataset(ROWS[:2], TOK, max_seq_len=64)
    (row,) = pack_samples(list(ds), 48, TOK.pad_id)
    a, b = len(ds[0]), len(ds[0]) + len(ds[1])
    other = row.input_ids.clone()
    other[0, :a] = 65
    changed = Batch(other, row.labels, row.position_ids, row.attention_mask, row.num_samples)
    assert torch.equal(_forward(tiny_model, row)[0, a:b], _forward(tiny_model, changed)[0, a:b])


def test_no_label_crosses_a_sample_boundary():
    ds = SFTDataset([chat("q" * k, "a" * (k % 5 + 1)) for k in range(20)], TOK, max_seq_len=40)
    loader = SFTLoader(ds, batch_size=3, pack=True, seq_len=64, seed=1)
    for _ in range(loader.batches_per_epoch):
        batch = loader.next_batch()
        for b, t in (batch.labels != X).nonzero().tolist():
            assert t + 1 < batch.labels.shape[1]
            assert batch.labels[b, t] == batch.input_ids[b, t + 1]
            assert batch.position_ids[b, t + 1] == batch.position_ids[b, t] + 1
            assert batch.attention_mask[b, t + 1, t]  # t and t+1 belong to the same sample
