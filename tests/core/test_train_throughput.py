"""tokens_per_s and mfu in the Trainer's metrics rows (SFT and DPO), checked by hand.

tokens_per_s = non-padding tokens the loss trains on in the step / step_time_s (tokens per
second); mfu = 6 N x those tokens / (step_time_s x peak FLOP/s), N = non-embedding parameters
(`posttrain.core.timing`, the convention of RL's `mfu` column).
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


def _check_row(row, tokens, n_params):
    assert row["tokens_per_s"] * row["step_time_s"] == pytest.approx(tokens)
    assert row["mfu"] == pytest.approx(6 * n_params * tokens / (row["step_time_s"] * PEAK))
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
        hand = sum(int((s.labels != -100).sum()) for s in samples[2 * k : 2 * k + 2])
        assert hand == sum(s.num_trained_tokens for s in samples[2 * k : 2 * k + 2])
        assert row["trained_tokens"] == hand
        _check_row(row, hand, n_params)


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
    ds = PreferenceDataset(_pair_rows(3), ByteTokenizer(), max_seq_len=64)
    compute_reference_logps(tiny_model(1), ds, batch_size=3)
    # the hand count: response tokens of each unpadded chosen and rejected sequence
    hand = sum(
        int(ds.sequence(i, key)[1].sum()) for i in range(3) for key in ("chosen", "rejected")
    )
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
    _check_row(row, hand, non_embedding_params(model))


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
