"""The SFT loader (posttrain.data.loader.SFTLoader): a seeded epoch order that leaves the
global RNG alone, epochs that keep their last partial batch, batches independent of the global
RNG, a resume from its state dict that continues exactly as the uninterrupted loader across
epoch boundaries (padded and packed), refusals of a mismatched state and of bad options, and
the doctests of the data modules."""

from __future__ import annotations

import doctest
import json

import pytest
import torch
from _data_helpers import TOK, chat

from posttrain.data import Batch, SFTDataset, SFTLoader, epoch_order
from posttrain.data import loader as data_module
from posttrain.data import sft as data_sources


@pytest.fixture(scope="module")
def ten_rows():
    return SFTDataset(
        [chat("q" * (k + 1), "a" * (k % 3 + 1)) for k in range(10)], TOK, max_seq_len=32
    )


def _same(a: Batch, b: Batch) -> bool:
    masks = (a.attention_mask is None and b.attention_mask is None) or (
        a.attention_mask is not None
        and b.attention_mask is not None
        and torch.equal(a.attention_mask, b.attention_mask)
    )
    return (
        masks
        and a.num_samples == b.num_samples
        and torch.equal(a.input_ids, b.input_ids)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.position_ids, b.position_ids)
    )


def test_epoch_order_is_seeded_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    assert epoch_order(10, seed=1, epoch=0) == epoch_order(10, seed=1, epoch=0)
    assert epoch_order(10, seed=1, epoch=0) != epoch_order(10, seed=1, epoch=1)
    assert epoch_order(10, seed=1, epoch=0) != epoch_order(10, seed=2, epoch=0)
    assert sorted(epoch_order(10, seed=1, epoch=5)) == list(range(10))
    assert epoch_order(4, seed=1, epoch=0, shuffle=False) == [0, 1, 2, 3]
    assert torch.equal(torch.get_rng_state(), state)


def test_loader_epochs_keep_last_partial_batch(ten_rows):
    loader = SFTLoader(ten_rows, batch_size=3, seed=0)
    assert loader.batches_per_epoch == 4
    sizes, seen = [], []
    for _ in range(4):
        assert loader.epoch == 0
        batch = loader.next_batch()
        sizes.append(batch.num_samples)
        seen += [tuple(r[r != TOK.pad_id].tolist()) for r in batch.input_ids]
    assert sizes == [3, 3, 3, 1]
    assert sorted(seen) == sorted(tuple(s.input_ids.tolist()) for s in ten_rows)
    assert (loader.epoch, loader.offset) == (1, 0)  # moved on as soon as epoch 0 finished
    assert loader.state_dict()["order"] == epoch_order(10, seed=0, epoch=1)


def test_loader_is_deterministic_regardless_of_global_rng(ten_rows):
    torch.manual_seed(1)
    a = SFTLoader(ten_rows, batch_size=4, seed=7)
    first = [a.next_batch() for _ in range(5)]
    torch.manual_seed(2)
    b = SFTLoader(ten_rows, batch_size=4, seed=7)
    assert all(_same(x, b.next_batch()) for x in first)
    assert not _same(first[0], SFTLoader(ten_rows, batch_size=4, seed=8).next_batch())


@pytest.mark.parametrize("pack", [False, True])
def test_loader_resume_matches_uninterrupted_across_epoch_boundaries(ten_rows, pack):
    kwargs = dict(batch_size=3, seed=5, pack=pack, seq_len=40 if pack else None)
    reference_loader = SFTLoader(ten_rows, **kwargs)
    reference = [reference_loader.next_batch() for _ in range(14)]
    per_epoch = SFTLoader(ten_rows, **kwargs).batches_per_epoch
    stops = sorted({1, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch})
    assert per_epoch in stops
    for stop in stops:
        first = SFTLoader(ten_rows, **kwargs)
        for _ in range(stop):
            first.next_batch()
        state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
        resumed = SFTLoader(ten_rows, **kwargs)
        resumed.load_state_dict(state)
        for k in range(stop, 14):
            assert _same(resumed.next_batch(), reference[k]), (stop, k)


def test_resume_state_saved_exactly_at_epoch_end_starts_next_epoch_fresh(ten_rows):
    """A state whose offset is the whole epoch (written by another tool, or an older loader)
    continues with epoch+1's fresh order."""
    loader = SFTLoader(ten_rows, batch_size=5, seed=3)
    state = {
        "epoch": 0,
        "offset": 10,
        "seed": 3,
        "shuffle": True,
        "order": epoch_order(10, seed=3, epoch=0),
    }
    loader.load_state_dict(state)
    assert (loader.epoch, loader.offset) == (1, 0)
    assert loader.state_dict()["order"] == epoch_order(10, seed=3, epoch=1)


def test_load_state_dict_rejects_mismatches(ten_rows):
    loader = SFTLoader(ten_rows, batch_size=2, seed=0)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        loader.load_state_dict({**state, "seed": 1})
    with pytest.raises(ValueError, match="permutation"):
        loader.load_state_dict({**state, "order": state["order"][:-1]})
    with pytest.raises(ValueError, match="offset"):
        loader.load_state_dict({**state, "offset": 11})


def test_loader_option_errors(ten_rows):
    with pytest.raises(ValueError, match="batch_size"):
        SFTLoader(ten_rows, batch_size=0)
    with pytest.raises(ValueError, match="only used with pack=True"):
        SFTLoader(ten_rows, batch_size=2, seq_len=64)
    with pytest.raises(ValueError, match="more than seq_len=8"):
        SFTLoader(ten_rows, batch_size=2, pack=True, seq_len=8)
    with pytest.raises(ValueError, match="pad_id"):
        SFTLoader(list(ten_rows), batch_size=2)


def test_packed_loader_batch_shapes(ten_rows):
    loader = SFTLoader(ten_rows, batch_size=2, pack=True, seq_len=40, shuffle=False)
    batch = loader.next_batch()
    assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (2, 40)
    assert batch.attention_mask.shape == (2, 40, 40)
    assert batch.num_samples == loader.offset


def test_doctests():
    for module in (data_module, data_sources):
        assert doctest.testmod(module).failed == 0
