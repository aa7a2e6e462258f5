"""SFT and continued-pretraining (CPT) batches: the `Batch` contract, right-padded or packed
collation, and `SFTLoader`, an endless, seeded loader that resumes exactly.

Notation: B = rows in a batch, T = tokens per row, V = vocabulary.

Rows -> `SFTDataset` / `CPTDataset` (in `posttrain.data.sft`, re-exported here: token ids
+ shifted labels per sample, validated and counted in `.stats`) -> `SFTLoader.next_batch()` ->
`Batch` -> the model:

    logits_BTV = model(batch.input_ids, mask=batch.attention_mask, input_pos=batch.position_ids)
    loss = F.cross_entropy(logits_BTV.flatten(0, 1), batch.labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum") / num_trained_tokens

Labels are shifted once, in the dataset: `labels[b, t]` is the token the model must predict at
position t, so the loss needs no further shift. Trained positions come from the tokenizer's loss
mask, never from token ids, so EOS is trained even when `pad_id == eos_id`.

Packed rows carry a [B, T, T] block-causal mask (`posttrain.models.attention_masks`).
torchtune's attention calls SDPA with `is_causal=False` whenever a mask is given, so the mask
itself is causal; the padding tail of a row is its own causal block (a fully masked query row
would give NaN). Memory: B*T*T bytes.

Example:
    >>> from posttrain.data.loader import SFTDataset, SFTLoader
    >>> from posttrain.models import ByteTokenizer
    >>> rows = [{"prompt": "2+2?", "completion": "4"}, {"prompt": "1+1?", "completion": "2"}]
    >>> ds = SFTDataset(rows, ByteTokenizer(), max_seq_len=64)
    >>> batch = SFTLoader(ds, batch_size=2, seed=0).next_batch()
    >>> tuple(batch.input_ids.shape), batch.num_samples, batch.num_trained_tokens
    ((2, 10), 2, 4)
    >>> packed = SFTLoader(ds, batch_size=1, pack=True, seq_len=32).next_batch()
    >>> tuple(packed.attention_mask.shape), packed.position_ids[0, 9:11].tolist()
    ((1, 32, 32), [9, 0])
    >>> shard = SFTLoader(ds, batch_size=2, seed=0, rank=1, world_size=2).next_batch()
    >>> shard.num_samples, shard.num_trained_tokens  # rank 1's half of the global batch
    (1, 2)
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.data.collate import right_pad
from posttrain.data.sft import (  # re-exported: `from posttrain.data import ...` is the API
    IGNORE_INDEX,
    CPTDataset,
    Sample,
    SFTDataset,
    labels_from_loss_mask,
    load_sft_rows,
    load_text_documents,
    normalize_document,
    normalize_sft_row,
    reasoning_gym_sft_rows,
)
from posttrain.models.attention_masks import dense_segment_mask

__all__ = [
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
]


@dataclass(frozen=True)
class Batch:
    """One training batch; the contract between the data pipeline and the trainer.

    Attributes:
        input_ids: [B, T] int64; padding holds the tokenizer's `pad_id` (may equal `eos_id`).
        labels: [B, T] int64; `labels[b, t]` is the token to predict at position t (already
            shifted), or IGNORE_INDEX where nothing is trained (prompt, padding, the last token
            of every sample).
        position_ids: [B, T] int64; restart at 0 for every packed sample.
        attention_mask: [B, T, T] bool, True = query t may attend to key s; block-causal for
            packed rows (padding tail = its own causal block, so no row is fully masked). None
            means plain causal attention (right-padded, unpacked batches).
        num_samples: real samples in the batch.

    Raises:
        ValueError: if shapes or dtypes disagree with the above.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    num_samples: int

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"Batch.input_ids must be [B, T], got {tuple(self.input_ids.shape)}")
        for name in ("input_ids", "labels", "position_ids"):
            t = getattr(self, name)
            if t.shape != self.input_ids.shape or t.dtype != torch.int64:
                raise ValueError(
                    f"Batch.{name} is {t.dtype} {tuple(t.shape)}; expected int64 "
                    f"{tuple(self.input_ids.shape)}"
                )
        if self.attention_mask is not None:
            B, T = self.input_ids.shape
            m = self.attention_mask
            if m.shape != (B, T, T) or m.dtype != torch.bool:
                raise ValueError(
                    f"Batch.attention_mask is {m.dtype} {tuple(m.shape)}; expected bool {(B, T, T)}"
                )

    @property
    def num_trained_tokens(self) -> int:
        """Number of positions with a label: `(labels != IGNORE_INDEX).sum()`."""
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str) -> Batch:
        """A copy with every tensor on `device`."""
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


# --------------------------------------------------------------------------------------------
# Collation and packing
# --------------------------------------------------------------------------------------------


def collate_padded(samples: Sequence[Sample], pad_id: int) -> Batch:
    """Right-pad samples to the longest one: input_ids [B, T] (pad_id after each sample),
    labels IGNORE_INDEX on padding, position_ids 0..T-1, attention_mask None (causal: real
    tokens precede the padding, so they never attend to it).

    Raises:
        ValueError: if `samples` is empty.
    """
    if not samples:
        raise ValueError("collate_padded needs at least one sample")
    input_ids, _ = right_pad([s.input_ids for s in samples], pad_id)
    labels, _ = right_pad([s.labels for s in samples], IGNORE_INDEX)
    B, T = input_ids.shape
    position_ids = torch.arange(T, dtype=torch.int64).expand(B, T).clone()
    return Batch(input_ids, labels, position_ids, None, B)


def _pack_row(samples: Sequence[Sample], seq_len: int, pad_id: int) -> Batch:
    """One packed row [1, seq_len]: samples back to back, then a padding tail."""
    used = sum(len(s) for s in samples)
    assert used <= seq_len, (used, seq_len)
    pieces = [s.input_ids for s in samples] + [torch.full((seq_len - used,), pad_id)]
    input_ids = torch.cat(pieces).to(torch.int64)
    # A sample's last label is IGNORE_INDEX already: no label points into the next sample.
    labels = torch.cat(
        [s.labels for s in samples] + [torch.full((seq_len - used,), IGNORE_INDEX)]
    ).to(torch.int64)
    lengths = [len(s) for s in samples] + ([seq_len - used] if used < seq_len else [])
    position_ids = torch.cat([torch.arange(n) for n in lengths]).to(torch.int64)
    doc_1T = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    mask_1TT = dense_segment_mask(doc_1T)  # block-causal: each document sees its own past
    return Batch(input_ids[None], labels[None], position_ids[None], mask_1TT, len(samples))


def _greedy_rows(lengths: Iterable[int], seq_len: int, max_rows: int | None = None) -> list[int]:
    """Number of samples in each packed row, filling rows in order (next-fit); stops once
    `max_rows` rows are full."""
    counts: list[int] = []
    used = seq_len + 1
    for n in lengths:
        if n > seq_len:
            raise ValueError(f"a sample of {n} tokens does not fit in seq_len={seq_len}")
        if used + n > seq_len:
            if max_rows is not None and len(counts) == max_rows:
                break
            counts.append(0)
            used = 0
        counts[-1] += 1
        used += n
    return counts


def pack_samples(samples: Sequence[Sample], seq_len: int, pad_id: int) -> list[Batch]:
    """Pack samples, in order, into rows of `seq_len` tokens (a new row starts when the next
    sample does not fit). Each returned Batch is one row: [1, seq_len], with a block-causal
    attention_mask [1, seq_len, seq_len] and position ids restarting per sample. Join rows with
    `stack_rows`.

    Raises:
        ValueError: if a sample is longer than `seq_len`.
    """
    rows, start = [], 0
    for count in _greedy_rows([len(s) for s in samples], seq_len):
        rows.append(_pack_row(samples[start : start + count], seq_len, pad_id))
        start += count
    return rows


def stack_rows(rows: Sequence[Batch]) -> Batch:
    """Concatenate batches of equal T along B. Raises ValueError if T differs or some rows have
    an attention_mask and others do not."""
    if not rows:
        raise ValueError("stack_rows needs at least one row")
    if len({r.input_ids.shape[1] for r in rows}) > 1:
        raise ValueError("stack_rows: rows have different lengths T")
    masks = [r.attention_mask for r in rows]
    if any(m is None for m in masks) and not all(m is None for m in masks):
        raise ValueError("stack_rows: cannot mix rows with and without attention_mask")
    return Batch(
        torch.cat([r.input_ids for r in rows]),
        torch.cat([r.labels for r in rows]),
        torch.cat([r.position_ids for r in rows]),
        None if masks[0] is None else torch.cat([m for m in masks if m is not None]),
        sum(r.num_samples for r in rows),
    )


# --------------------------------------------------------------------------------------------
# Loader with exact resume
# --------------------------------------------------------------------------------------------


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Sample order of one epoch: `torch.randperm` with a generator seeded from (seed, epoch)
    (never the global RNG), or 0..n-1 without shuffling."""
    if not shuffle:
        return list(range(num_samples))
    # The salt is a fixed string (it once was this module's name): changing it reorders every
    # seeded run's data.
    digest = hashlib.sha256(f"posttrain.data:{seed}:{epoch}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(num_samples, generator=gen).tolist()


class EpochOrderLoader:
    """The resumable part of every loader: a seeded order per epoch (`epoch_order`, the global
    RNG untouched) and a position in it, saved by `state_dict()` and restored exactly by
    `load_state_dict()`. A subclass sets `dataset`, `seed`, `shuffle` and calls
    `_start_epoch(0)`; it advances `offset` as it yields batches."""

    dataset: Sized  # only its length is read here
    seed: int
    shuffle: bool

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.offset = epoch, 0
        self._order = epoch_order(
            len(self.dataset), seed=self.seed, epoch=epoch, shuffle=self.shuffle
        )

    def state_dict(self) -> dict[str, Any]:
        """{"epoch", "offset", "seed", "shuffle", "order"}: plain ints/bools/lists (JSON-safe)."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "order": list(self._order),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`. Raises ValueError if it was made with another seed, shuffle
        setting or dataset size, or is inconsistent."""
        for key in ("seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"loader state has {key}={state[key]!r} but this loader has "
                    f"{key}={getattr(self, key)!r}; the order would not match"
                )
        order = [int(i) for i in state["order"]]
        if sorted(order) != list(range(len(self.dataset))):
            raise ValueError(
                f"loader state's order covers {len(order)} samples, not a "
                f"permutation of this dataset's {len(self.dataset)}"
            )
        if not 0 <= state["offset"] <= len(order):
            raise ValueError(f"loader state offset={state['offset']} outside 0..{len(order)}")
        self.epoch, self.offset, self._order = int(state["epoch"]), int(state["offset"]), order
        if self.offset == len(order):
            self._start_epoch(self.epoch + 1)


class SFTLoader(EpochOrderLoader):
    """An endless stream of batches over a dataset of `Sample`s (SFT or CPT), epoch after
    epoch, that resumes exactly from `state_dict()`.

    Args:
        dataset: a sequence of `Sample` (`SFTDataset`, `CPTDataset`, or a list).
        batch_size: samples per batch (pack=False) or packed rows per batch (pack=True).
        shuffle: each epoch's order is `epoch_order(len(dataset), seed=seed, epoch=epoch)`.
        seed: order seed; the global RNG is neither read nor changed.
        pack: pack several samples per row of `seq_len` tokens (block-causal attention mask).
        seq_len: packed row length; defaults to `dataset.max_seq_len`. Only with pack=True.
        pad_id: padding id; defaults to `dataset.pad_id`.
        rank, world_size: this process's share of each batch under data parallelism. Default:
            the initialised `torch.distributed` default process group's, else 0 and 1.

    Data parallelism: `batch_size` is the global batch (all ranks together). Every rank walks
    the same global order (same seed) and forms the same global batch of rows (a row is a sample,
    or with pack=True a packed row: the global rows are packed first, from lengths only, then
    split, so packing does not depend on the number of ranks); rank r collates rows r, r + W,
    r + 2W, ... of it (W = world_size, strided like `torch.utils.data.DistributedSampler`). The
    rows of all ranks together are exactly the rows one process gets with world_size=1, so the
    sums of loss and gradient over ranks are the single-process ones. `batch_size` must be
    divisible by `world_size`; the short last batch of an epoch is split as evenly as the
    striding gives (rank r gets ceil((n - r) / W) of its n rows), and a rank whose share is empty
    gets one padding row that trains no token (num_samples 0), so it still runs the step's
    forward, backward and collectives. The state (below) is the global position, identical on
    every rank, so a checkpoint written by rank 0 resumes every rank.

    Batches never span two epochs: the last batch of an epoch is kept even when it is smaller
    (fewer samples, or fewer packed rows). `epoch` is the epoch the next batch comes from (=
    epochs completed) and `offset` the samples of it already consumed; as soon as a batch
    finishes an epoch, the loader moves to the next epoch (offset 0, fresh order).

    Resume: `load_state_dict(state_dict())` continues with the very same batches. The state
    counts samples, so batch_size and pack may change across a resume; seed, shuffle and the
    dataset size may not.

    Raises:
        ValueError: for bad options, a `batch_size` not divisible by `world_size`, or
            (pack=True) a sample longer than `seq_len`.
    """

    dataset: Sequence[Sample]

    def __init__(
        self,
        dataset: Sequence[Sample],
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        pack: bool = False,
        seq_len: int | None = None,
        pad_id: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}; must be a positive integer")
        rank, world_size = _rank_and_world_size(rank, world_size)
        if batch_size % world_size:
            raise ValueError(
                f"SFTLoader: batch_size={batch_size} is not divisible by "
                f"world_size={world_size}; batch_size is the global batch of all "
                "ranks together, and each rank takes batch_size / world_size of "
                "its rows"
            )
        if len(dataset) == 0:
            raise ValueError("SFTLoader: the dataset is empty")
        if pad_id is None:
            pad_id = getattr(dataset, "pad_id", None)
            if pad_id is None:
                raise ValueError("SFTLoader: pass pad_id= (the dataset has no pad_id)")
        if pack:
            seq_len = seq_len if seq_len is not None else getattr(dataset, "max_seq_len", None)
            if not isinstance(seq_len, int) or seq_len < 1:
                raise ValueError(f"seq_len={seq_len!r}; pack=True needs a positive seq_len")
            for i, s in enumerate(dataset):
                if len(s) > seq_len:
                    raise ValueError(
                        f"sample {i} has {len(s)} tokens, more than seq_len="
                        f"{seq_len}; raise seq_len or lower max_seq_len"
                    )
        elif seq_len is not None:
            raise ValueError(
                "seq_len is only used with pack=True (padded batches are as long "
                "as their longest sample)"
            )
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.pack, self.seq_len, self.pad_id = pack, seq_len, pad_id
        self.rank, self.world_size = rank, world_size
        self._lengths = [len(s) for s in dataset]
        self._start_epoch(0)

    @property
    def _row_len(self) -> int:
        """Tokens per packed row (`seq_len`, checked in __init__ when pack=True)."""
        assert self.seq_len is not None, "only packed loaders have rows of seq_len"
        return self.seq_len

    @property
    def batches_per_epoch(self) -> int:
        """Batches in a full epoch. Packed: of the current epoch (packing depends on the order)."""
        if not self.pack:
            return math.ceil(len(self.dataset) / self.batch_size)
        rows = _greedy_rows([self._lengths[i] for i in self._order], self._row_len)
        return math.ceil(len(rows) / self.batch_size)

    def next_batch(self) -> Batch:
        """This rank's share of the next global batch (see the class docstring for its size at
        the end of an epoch and under data parallelism)."""
        order, start = self._order, self.offset
        if not self.pack:
            rows = [[i] for i in order[start : start + self.batch_size]]
        else:
            lengths = (self._lengths[order[j]] for j in range(start, len(order)))
            counts = _greedy_rows(lengths, self._row_len, max_rows=self.batch_size)
            bounds = list(itertools.accumulate(counts, initial=start))
            rows = [order[a:b] for a, b in zip(bounds, bounds[1:])]
        self.offset += sum(len(row) for row in rows)
        if self.offset == len(self._order):
            self._start_epoch(self.epoch + 1)
        return self._collate(rows[self.rank :: self.world_size])

    def _collate(self, rows: list[list[int]]) -> Batch:
        """One Batch of the given rows (each a list of dataset indices); a padding row that
        trains nothing when `rows` is empty."""
        if not self.pack:
            if not rows:
                ids = torch.full((1, 1), self.pad_id, dtype=torch.int64)
                return Batch(
                    ids, torch.full_like(ids, IGNORE_INDEX), torch.zeros_like(ids), None, 0
                )
            return collate_padded([self.dataset[i] for row in rows for i in row], self.pad_id)
        return stack_rows(
            [
                _pack_row([self.dataset[i] for i in row], self._row_len, self.pad_id)
                for row in rows or [[]]
            ]
        )

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()


def _rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Fill `rank` / `world_size` left as None from the initialised default torch.distributed
    process group (else 0 and 1), and check them."""
    if rank is None or world_size is None:
        from posttrain.core.distributed import rank_and_world_size

        group_rank, group_size = rank_and_world_size()
        rank = group_rank if rank is None else rank
        world_size = group_size if world_size is None else world_size
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}; must be a positive integer")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank!r}; must be an integer in 0..world_size-1 (world_size={world_size})"
        )
    return rank, world_size
