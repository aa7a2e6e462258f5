"""Rows to batches: row validation, chat rendering, SFT/CPT and preference datasets, padding,
packing and collation, and the resumable data-parallel loader.
"""

from __future__ import annotations

from posttrain.data.rows import (
    BAD_ROW_REASONS,
    BadRowError,
    DataStats,
    text_char_limit,
)
from posttrain.data.collate import right_pad
from posttrain.data.loader import (
    IGNORE_INDEX,
    Batch,
    Sample,
    SFTDataset,
    CPTDataset,
    EpochOrderLoader,
    SFTLoader,
    collate_padded,
    pack_samples,
    stack_rows,
    labels_from_loss_mask,
    epoch_order,
    load_sft_rows,
    load_text_documents,
    normalize_sft_row,
    normalize_document,
    reasoning_gym_sft_rows,
)
from posttrain.data.preference_rows import (
    load_preference_rows,
    pairs_to_kto_rows,
)
from posttrain.data.preference import (
    PreferenceDataset,
    KTODataset,
    PreferenceBatch,
    KTOBatch,
    PreferenceLoader,
    render_response,
)
from posttrain.data.sft import ON_BAD_ROW, OVERLONG

__all__ = [
    "IGNORE_INDEX",
    "BAD_ROW_REASONS",
    "BadRowError",
    "DataStats",
    "text_char_limit",
    "right_pad",
    "Batch",
    "Sample",
    "SFTDataset",
    "CPTDataset",
    "EpochOrderLoader",
    "SFTLoader",
    "collate_padded",
    "pack_samples",
    "stack_rows",
    "labels_from_loss_mask",
    "epoch_order",
    "load_sft_rows",
    "load_text_documents",
    "normalize_sft_row",
    "normalize_document",
    "reasoning_gym_sft_rows",
    "load_preference_rows",
    "PreferenceDataset",
    "KTODataset",
    "PreferenceBatch",
    "KTOBatch",
    "PreferenceLoader",
    "pairs_to_kto_rows",
    "render_response",
    "ON_BAD_ROW",
    "OVERLONG",
]
