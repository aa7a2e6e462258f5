"""Preference and KTO batches, and the resumable loader that streams them: what a dataset of
`posttrain.data.preference` hands to a trainer. The datasets tokenise rows and pad the items of
one batch (their `collate`); this module holds the padded batch they return (`PreferenceBatch`,
`KTOBatch`) and the order in which batches are drawn, epoch after epoch, resumable from a state
dict (`PreferenceLoader`).

Notation: B = pairs (or KTO rows) in a batch, T = tokens per sequence.

Example:
    >>> from posttrain.data.preference import PreferenceDataset
    >>> from posttrain.data.preference_batches import PreferenceLoader
    >>> from posttrain.models import ByteTokenizer
    >>> rows = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"},
    ...         {"prompt": "1+1=", "chosen": "2", "rejected": "11"}]
    >>> loader = PreferenceLoader(PreferenceDataset(rows, ByteTokenizer(), max_seq_len=32),
    ...                           batch_size=2, shuffle=False)
    >>> batch = loader.next_batch()
    >>> batch.num_pairs, tuple(batch.concatenated()[0].shape)
    (2, (4, 11))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from posttrain.data.loader import EpochOrderLoader

__all__ = ["PreferenceBatch", "KTOBatch", "PairSource", "PreferenceLoader"]


@dataclass(frozen=True)
class PreferenceBatch:
    """B preference pairs; chosen and rejected right-padded to one length T.

    Attributes:
        chosen_input_ids, rejected_input_ids: [B, T] int64 (padding = the tokenizer's pad_id).
        chosen_attention_mask, rejected_attention_mask: [B, T] bool, True on real tokens.
        chosen_response_mask, rejected_response_mask: [B, T] bool, True exactly on the response
            tokens (never on prompt or padding).
        ref_chosen_logps, ref_rejected_logps: [B] fp32 summed reference log-probs, or None
            before `posttrain.preference.reference.compute_reference_logps`.
    """

    chosen_input_ids: Tensor
    chosen_attention_mask: Tensor
    chosen_response_mask: Tensor
    rejected_input_ids: Tensor
    rejected_attention_mask: Tensor
    rejected_response_mask: Tensor
    ref_chosen_logps: Tensor | None = None
    ref_rejected_logps: Tensor | None = None

    @property
    def num_pairs(self) -> int:
        return self.chosen_input_ids.shape[0]

    def concatenated(self) -> tuple[Tensor, Tensor, Tensor]:
        """(input_ids, attention_mask, response_mask), each [2B, T]: chosen rows, then rejected."""
        return (
            torch.cat([self.chosen_input_ids, self.rejected_input_ids]),
            torch.cat([self.chosen_attention_mask, self.rejected_attention_mask]),
            torch.cat([self.chosen_response_mask, self.rejected_response_mask]),
        )

    def to(self, device: torch.device | str) -> PreferenceBatch:
        return dataclasses.replace(self, **_moved(self, device))


@dataclass(frozen=True)
class KTOBatch:
    """B unpaired KTO rows.

    Attributes:
        input_ids, attention_mask, response_mask: [B, T] (as in `PreferenceBatch`).
        desirable: [B] bool.
        kl_input_ids, kl_attention_mask, kl_response_mask: [B, T'] the mismatched sequences.
        ref_logps, ref_kl_logps: [B] fp32 reference log-probs, or None before
            `posttrain.preference.reference.compute_reference_logps`.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    desirable: Tensor
    kl_input_ids: Tensor
    kl_attention_mask: Tensor
    kl_response_mask: Tensor
    ref_logps: Tensor | None = None
    ref_kl_logps: Tensor | None = None

    def to(self, device: torch.device | str) -> KTOBatch:
        return dataclasses.replace(self, **_moved(self, device))


def _moved(batch: Any, device: torch.device | str) -> dict[str, Any]:
    return {
        f.name: getattr(batch, f.name).to(device)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), Tensor)
    }


class PairSource(Protocol):
    """What `PreferenceLoader` draws batches from: `posttrain.data.preference.PreferenceDataset`
    and `KTODataset` (or any sized source whose `collate(indices)` pads items `indices` into one
    `PreferenceBatch` or `KTOBatch`)."""

    def __len__(self) -> int: ...

    def collate(self, indices: Sequence[int]) -> PreferenceBatch | KTOBatch: ...


class PreferenceLoader(EpochOrderLoader):
    """An endless stream of batches over a `PreferenceDataset` or `KTODataset`, epoch after
    epoch, in a seeded order (`posttrain.data.loader.epoch_order`, the global RNG untouched), that
    resumes exactly from `state_dict()` (the same rules as `posttrain.data.loader.SFTLoader`:
    batches never span two epochs; the state counts items, so batch_size may change across a
    resume).

    Reference log-probs are read from the dataset's cache when a batch is made, so call
    `posttrain.preference.reference.compute_reference_logps` before the first batch.

    Single process only for now: `rank`/`world_size` are 0/1, so the `Trainer` refuses this
    loader under data parallelism rather than training every rank on the same batches.

    Raises:
        ValueError: for a batch_size below 1 or an empty dataset.
    """

    dataset: PairSource

    def __init__(
        self,
        dataset: PairSource,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}; must be a positive integer")
        if len(dataset) == 0:
            raise ValueError("PreferenceLoader: the dataset is empty")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.rank, self.world_size = 0, 1
        self._start_epoch(0)

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(len(self.dataset) / self.batch_size)

    def next_batch(self) -> PreferenceBatch | KTOBatch:
        indices = self._order[self.offset : self.offset + self.batch_size]
        batch = self.dataset.collate(indices)
        self.offset += len(indices)
        if self.offset == len(self._order):
            self._start_epoch(self.epoch + 1)
        return batch

    def __iter__(self) -> Iterator[PreferenceBatch | KTOBatch]:
        while True:
            yield self.next_batch()
