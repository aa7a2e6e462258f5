"""Rows to batches: row validation, chat rendering, SFT/CPT and preference datasets, padding,
packing and collation, the resumable data-parallel loader. Grouped by purpose, one module each;
the package exports the names of rows, datasets and loaders (`__all__`):

    rows         rows (BadRowError, DataStats, the reasons a row is left out), sft
                 (ON_BAD_ROW, OVERLONG)
    SFT / CPT    loader (SFTDataset, CPTDataset, reading and normalising rows, SFTLoader,
                 packing and collation), collate (right_pad)
    preference   preference_rows (reading pairs, KTO rows), preference (PreferenceDataset,
                 KTODataset), preference_batches (their batches, PreferenceLoader)
    synthetic    synthetic, synthetic_stages: generate -> score -> filter
                 (`posttrain.data.synthetic`: SyntheticPipeline, its stages)

The synthetic-data names the package exported before it was grouped (`FORMER_NAMES`) still
import from it.
"""

from __future__ import annotations

from posttrain.core.lazy import lazy_exports
from posttrain.data.collate import right_pad
from posttrain.data.loader import (
    IGNORE_INDEX,
    Batch,
    CPTDataset,
    EpochOrderLoader,
    Sample,
    SFTDataset,
    SFTLoader,
    collate_padded,
    epoch_order,
    labels_from_loss_mask,
    load_sft_rows,
    load_text_documents,
    normalize_document,
    normalize_sft_row,
    pack_samples,
    reasoning_gym_sft_rows,
    stack_rows,
)
from posttrain.data.preference import (
    KTODataset,
    PreferenceDataset,
    render_response,
)
from posttrain.data.preference_batches import (
    KTOBatch,
    PreferenceBatch,
    PreferenceLoader,
)
from posttrain.data.preference_rows import (
    load_preference_rows,
    pairs_to_kto_rows,
)
from posttrain.data.rows import (
    BAD_ROW_REASONS,
    BadRowError,
    DataStats,
    text_char_limit,
)
from posttrain.data.sft import ON_BAD_ROW, OVERLONG

__all__ = [
    # rows
    "BAD_ROW_REASONS",
    "BadRowError",
    "DataStats",
    "text_char_limit",
    "ON_BAD_ROW",
    "OVERLONG",
    # SFT / CPT
    "IGNORE_INDEX",
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
    "right_pad",
    # preference
    "load_preference_rows",
    "pairs_to_kto_rows",
    "PreferenceDataset",
    "KTODataset",
    "PreferenceBatch",
    "KTOBatch",
    "PreferenceLoader",
    "render_response",
]

FORMER_NAMES: dict[str, str] = dict.fromkeys(
    (
        "generate_candidates",
        "SyntheticPipeline",
        "SyntheticResult",
        "Stage",
        "Score",
        "ExactDedup",
        "NearDedup",
        "Length",
        "MinScore",
        "Decontaminate",
        "build_stage",
    ),
    "synthetic",
)
"""Names `posttrain.data` exported before it was grouped by purpose -> the module that holds each
(`posttrain.data.<module>`); `from posttrain.data import NAME` still works."""

__getattr__, _ = lazy_exports(__name__, {}, former=FORMER_NAMES)
