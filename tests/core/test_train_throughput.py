"""tokens_per_s and mfu in the Trainer's metrics rows (SFT and DPO), checked by hand.

tokens_per_s = non-padding tokens the loss trains on in the step / step_time_s (tokens per
second); mfu = (6 N x those tokens + 12 L d_attn S) / (step_time_s x peak FLOP/s), N =
non-embedding parameters, S = the sum over those tokens of their sequence's length
(`posttrain.core.timing.step_flops`,
docs/benchmarks/README.md "Conventions", as RL's `mfu` column). The test model (TINY) has L = 2
attention layers of d_attn = 4 heads x 16 = 64.
"""

from __future__ import annotations

import pytest
import torch
from _train_helpers import sft_dataset, sft_loader, tiny_model

from posttrain.core import read_metrics
from posttrain.core.timing import non_embedding_params, set_peak_flops
from posttrain.data import PreferenceDataset, PreferenceLoader
from posttrain.models import ByteTokenizer
from posttrain.preference import compute_reference_logps
from posttrain.train import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PEAK = 1e15  # FLOP/s: fixed, so that the hand formula does not depend on a measurement, and
# far above what a CPU does, so that mfu stays the plain ratio (below 1: it is capped there)


@pytest.fixture
def fixed_peak():
    set_peak_flops(PEAK)
    yield
    set_peak_flops(None)


L, D_ATTN = 2, 64  # TINY: 2 layers, 4 heads of 64 / 4 = 16


def _check_row(row, tokens, n_params, span=0):
    assert row["tokens_per_s"] * row["step_time_s"] == pytest.approx(tokens)
    flops = 6 * n_params * tokens + 12 * L * D_ATTN * span
    assert row["mfu"] == pytest.approx(flops / (row["step_time_s"] * PEAK), rel=1e-12)
    assert row["mfu"] > 0


def test_sft_rows_count_the_loss_tokens_and_mfu(tmp_path, fixed_peak):
    samples = list(sft_dataset(4))
    model = tiny_model(0)
    n_params = non_embedding_params(model)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data=sft_loader(4, batch_size=2, shuffle=False),
        run_dir=tmp_path,
        progress=False,
    )
    trainer.fit(2)
    rows = read_metrics(tmp_path).to_dict("records")  # metrics.jsonl
    assert len(rows) == 2
    for k, row in enumerate(rows):
        pair = samples[2 * k : 2 * k + 2]
        hand = sum(int((s.labels != -100).sum()) for s in pair)
        assert hand == sum(s.num_trained_tokens for s in pair)
        assert row["trained_tokens"] == hand
        # unpacked: every trained token attends within the padded row, T = the longer sample
        _check_row(row, hand, n_params, span=max(len(s) for s in pair) * hand)


def test_packed_sft_row_counts_attention_at_each_documents_length(tmp_path, fixed_peak):
    """Packed rows of 48 tokens: the attention term takes each document's own length (not
    the row's), so S = sum over documents of length x trained tokens, from the samples alone
    (the packing redone by hand: next-fit in order)."""
    samples = list(sft_dataset(6))
    model = tiny_model(0)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data=sft_loader(6, batch_size=2, shuffle=False, pack=True, seq_len=48),
        run_dir=tmp_path,
        progress=False,
    )
    trainer.fit(1)
    (row,) = read_metrics(tmp_path).to_dict("records")
    rows, used = [[]], 0  # next-fit of the samples in order into rows of 48
    for s in samples:
        if used + len(s) > 48:
            rows.append([])
            used = 0
        rows[-1].append(s)
        used += len(s)
    step = [s for r in rows[:2] for s in r]  # the first batch: 2 packed rows
    assert len(step) > 2  # several documents per row: packing is exercised
    tokens = sum(s.num_trained_tokens for s in step)
    span = sum(len(s) * s.num_trained_tokens for s in step)
    assert span < 48 * tokens  # below the row-length count
    _check_row(row, tokens, non_embedding_params(model), span=span)


def _pair_rows(n):
    return [
        {
            "prompt": f"{3 + 7 * i}+{11 + 5 * i}=" + "?" * (i % 3),
            "chosen": str(14 + 12 * i) + " ok" * (i % 2),
            "rejected": str(15 + 12 * i) + "!" * (i % 4),
        }
        for i in range(n)
    ]


def test_dpo_row_counts_the_response_tokens_of_both_sides_and_mfu(tmp_path, fixed_peak):
    """DPO: each response token attends over its own (unpadded) sequence: S = sum over the
    chosen and rejected sequences of length x response tokens."""
    ds = PreferenceDataset(_pair_rows(3), ByteTokenizer(), max_seq_len=64)
    compute_reference_logps(tiny_model(1), ds, batch_size=3)
    # the hand count: response tokens of each unpadded chosen and rejected sequence
    seqs = [ds.sequence(i, key) for i in range(3) for key in ("chosen", "rejected")]
    hand = sum(int(response.sum()) for _, response in seqs)
    span = sum(len(ids) * int(response.sum()) for ids, response in seqs)
    model = tiny_model(0)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data=PreferenceLoader(ds, batch_size=3, shuffle=False),
        loss="dpo",
        run_dir=tmp_path,
        progress=False,
    )
    trainer.fit(1)
    (row,) = read_metrics(tmp_path).to_dict("records")
    assert row["trained_tokens"] == 3  # the normaliser: pairs
    _check_row(row, hand, non_embedding_params(model), span=span)


def test_a_peak_below_the_steps_rate_gives_mfu_one_not_more(tmp_path):
    """A peak of 1 FLOP/s (as low as a peak timed while the process waited for a core can get)
    against a real step of millions of model FLOPs: the row's mfu is 1.0, never above."""
    set_peak_flops(1.0)
    try:
        model = tiny_model(0)
        trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            data=sft_loader(2, batch_size=2, shuffle=False),
            run_dir=tmp_path,
            progress=False,
        )
        trainer.fit(1)
    finally:
        set_peak_flops(None)
    (row,) = read_metrics(tmp_path).to_dict("records")
    assert 6 * non_embedding_params(model) * row["tokens_per_s"] > 1.0  # far above the peak
    assert row["mfu"] == 1.0
