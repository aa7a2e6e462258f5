"""Shared by the preference tests (tests/preference/test_preference_training.py,
tests/preference/test_preference_data.py): pair rows whose lengths all differ, and a preference
dataset of them with reference log-probs from a tiny model."""

from __future__ import annotations

from _train_helpers import tiny_model

from posttrain.data import PreferenceDataset
from posttrain.models import ByteTokenizer
from posttrain.preference import compute_reference_logps


def pair_rows(n: int) -> list[dict]:
    """Pairs whose prompts and responses all have different lengths."""
    return [
        {
            "prompt": f"{3 + 7 * i}+{11 + 5 * i}=" + "?" * (i % 3),
            "chosen": str(14 + 12 * i) + " ok" * (i % 2),
            "rejected": str(15 + 12 * i) + "!" * (i % 4),
        }
        for i in range(n)
    ]


def pair_dataset(n: int = 4, reference_seed: int = 1) -> PreferenceDataset:
    """`pair_rows(n)` (max_seq_len 64) with reference log-probs of `tiny_model(reference_seed)`."""
    ds = PreferenceDataset(pair_rows(n), ByteTokenizer(), max_seq_len=64)
    compute_reference_logps(tiny_model(reference_seed), ds, batch_size=3)
    return ds
