"""Preference data: pair and KTO rows, tokenised datasets, batches, a resumable loader,
precomputed reference log-probabilities, and pairs made by rejection sampling.

Notation: B = pairs (or KTO rows) in a batch, T = tokens per sequence, L = tokens of one sequence.

Rows:
    pairs: {"prompt": str | [messages], "chosen": str | [assistant message],
            "rejected": str | [assistant message]}
    KTO:   {"prompt": ..., "completion": str | [assistant message], "label": bool}
from a list of dicts, a pandas DataFrame or a .jsonl/.json path. A bad row (a JSONL line that is
not JSON, missing field, non-string, empty response, chosen == rejected up to surrounding
whitespace, longer than `max_seq_len`, ...) raises `PreferenceRowError` (a
ValueError naming the row index, the field and a reason), or with `on_bad_row="skip"` is skipped
and counted by reason in `dataset.stats`.

Each response is rendered after its prompt with the tokenizer's chat template (`chat=True`, as
`SFTDataset` renders chats) or as plain text after BOS (`chat=False`); `response_mask` marks
exactly the response tokens, by position (the end-of-turn token included; EOS is appended and
marked when the template does not end the turn with a stop token). Padding never counts.

Example:
    >>> from posttrain.data.preference import PreferenceDataset, PreferenceLoader
    >>> from posttrain.models import ByteTokenizer
    >>> rows = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"},
    ...         {"prompt": "1+1=", "chosen": "2", "rejected": "11"}]
    >>> ds = PreferenceDataset(rows, ByteTokenizer(), max_seq_len=32)
    >>> batch = PreferenceLoader(ds, batch_size=2, shuffle=False).next_batch()
    >>> tuple(batch.chosen_input_ids.shape), batch.chosen_response_mask.sum(-1).tolist()
    ((2, 11), [2, 2])
    >>> batch.rejected_response_mask.sum(-1).tolist(), batch.ref_chosen_logps is None
    ([2, 3], True)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from posttrain.data.loader import epoch_order
from posttrain.data.sft import load_sft_rows
from posttrain.models.tokenizer import ROLES, Tokenizer
from posttrain.rewards.verifier import DEFAULT_TIMEOUT_S, Outcome, count_outcomes, score_batch

__all__ = ["PREFERENCE_BAD_ROW_REASONS", "PreferenceRowError", "PreferenceStats",
           "load_preference_rows", "PreferenceDataset", "KTODataset", "PreferenceBatch",
           "KTOBatch", "PreferenceLoader", "ReferenceLogps", "reference_fingerprint",
           "compute_reference_logps", "pairs_to_kto_rows", "PairStats", "make_preference_pairs",
           "render_response"]

PREFERENCE_BAD_ROW_REASONS = (
    "bad_json",        # a line of a .jsonl file that is not JSON (the reason names the line)
    "not_a_dict",      # the row is not a mapping
    "missing_field",   # no prompt / chosen / rejected (KTO: completion / label)
    "non_string",      # a field that is neither a string nor the accepted message form
    "empty",           # an empty (whitespace-only) prompt
    "empty_response",  # an empty (whitespace-only) chosen, rejected or completion
    "same_response",   # chosen == rejected, surrounding whitespace ignored
    "bad_label",       # KTO label that is not a bool
    "render_error",    # the tokenizer's chat template rejected the conversation
    "overlong",        # prompt + response longer than max_seq_len
)
"""Reasons a row is rejected; the keys of `PreferenceStats.skipped_by_reason`."""


class PreferenceRowError(ValueError):
    """A malformed preference or KTO row. Attributes: `index` (0-based row position), `field`
    (the offending field or None), `reason` (one of `PREFERENCE_BAD_ROW_REASONS`)."""

    def __init__(self, index: int, field: str | None, reason: str, detail: str) -> None:
        assert reason in PREFERENCE_BAD_ROW_REASONS, reason
        where = f"row {index}" + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {detail} [{reason}]")
        self.index, self.field, self.reason = index, field, reason


@dataclass
class PreferenceStats:
    """What a dataset read and kept. `rows` read, `samples` kept (pairs or KTO rows),
    `skipped_by_reason` (with on_bad_row="skip"), `tokens` over all kept sequences,
    `response_tokens`, `kl_truncated` (KTO mismatched sequences cut to max_seq_len)."""

    rows: int = 0
    samples: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    response_tokens: int = 0
    kl_truncated: int = 0

    @property
    def skipped(self) -> int:
        return sum(self.skipped_by_reason.values())

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "skipped": self.skipped}


def load_preference_rows(source: Any) -> list[Any]:
    """Rows as found, from a list of dicts, a pandas DataFrame or a .jsonl/.json path.

    Raises:
        FileNotFoundError: for a path that does not exist.
        ValueError: for a JSONL line that is not JSON (naming file and line), or another kind
            of source.
    """
    rows = _read_rows(source)
    for row in rows:
        if isinstance(row, _BadLine):
            raise ValueError(row.detail)
    return rows


@dataclass(frozen=True)
class _BadLine:
    """A .jsonl line that is not JSON, kept in its row position so a dataset can skip it."""

    detail: str


def _read_rows(source: Any) -> list[Any]:
    """`load_preference_rows`, but a broken JSONL line comes back as a `_BadLine`."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"preference data file {source} does not exist")
        if path.suffix == ".json":
            return load_sft_rows(path)
        rows: list[Any] = []
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                rows.append(_BadLine(f"{path}:{line_no}: not valid JSON ({e.msg}); each line of "
                                     "a JSONL file must be one JSON object"))
        return rows
    if type(source).__name__ == "DataFrame" or (
            isinstance(source, Sequence) and not isinstance(source, (str, bytes))):
        return load_sft_rows(source)
    raise ValueError(f"cannot read preference rows from a {type(source).__name__}; pass a list "
                     "of dicts, a pandas DataFrame, or a .jsonl/.json path")


def _check_row(row: Any, index: int, fields: str) -> None:
    """PreferenceRowError for a broken JSONL line or a row that is not a mapping."""
    if isinstance(row, _BadLine):
        raise PreferenceRowError(index, None, "bad_json", row.detail)
    if not isinstance(row, Mapping):
        raise PreferenceRowError(index, None, "not_a_dict", f"is a {type(row).__name__}, "
                                 f"expected a dict with {fields}")


# --------------------------------------------------------------------------------------------
# Rows -> token ids
# --------------------------------------------------------------------------------------------


def _prompt(row: Mapping, index: int, chat: bool) -> str | list[dict]:
    if "prompt" not in row:
        raise PreferenceRowError(index, "prompt", "missing_field", "has no 'prompt'")
    prompt = row["prompt"]
    if hasattr(prompt, "tolist") and not isinstance(prompt, str):
        prompt = prompt.tolist()   # Arrow-backed frames hold message lists as arrays
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PreferenceRowError(index, "prompt", "empty", "the prompt is empty")
        return [{"role": "user", "content": prompt}] if chat else prompt
    if chat and isinstance(prompt, Sequence) and prompt and all(
            isinstance(m, Mapping) and isinstance(m.get("content"), str) for m in prompt):
        for j, m in enumerate(prompt):
            if m.get("role") not in ROLES:
                raise PreferenceRowError(index, "prompt", "render_error", f"message {j} has role "
                                         f"{m.get('role')!r}; allowed: {', '.join(ROLES)}")
        if prompt[-1].get("role") == "assistant":
            raise PreferenceRowError(index, "prompt", "render_error", "a message prompt must not "
                                     "end with an assistant turn")
        return [{"role": m.get("role"), "content": m["content"]} for m in prompt]
    allowed = "a str or a list of {'role', 'content'} messages" if chat else "a str (chat=False)"
    raise PreferenceRowError(index, "prompt", "non_string",
                             f"is a {type(prompt).__name__}; expected {allowed}")


def _response(row: Mapping, index: int, key: str) -> str:
    if key not in row:
        raise PreferenceRowError(index, key, "missing_field", f"has no {key!r}")
    value = row[key]
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    if (isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 1
            and isinstance(value[0], Mapping) and value[0].get("role") == "assistant"):
        value = value[0].get("content")   # TRL's conversational form: [assistant message]
    if not isinstance(value, str):
        raise PreferenceRowError(index, key, "non_string", f"is a {type(value).__name__}; "
                                 "expected a str or [{'role': 'assistant', 'content': str}]")
    if not value.strip():
        raise PreferenceRowError(index, key, "empty_response", f"the {key} is empty")
    return value


def render_response(tokenizer: Tokenizer, prompt: str | list[dict], response: str, *,
                    chat: bool = True) -> tuple[list[int], list[bool]]:
    """Token ids of prompt + response as every preference model here reads them, and the
    response mask ([T] bools, True at response tokens): with `chat`, the prompt (a user message
    string, or a message list) and an assistant turn through the tokenizer's chat template;
    without it, BOS + prompt + response. EOS is appended when the last response token is not a
    stop token. Raises PreferenceRowError (a ValueError) when the template cannot render it.

    Example:
        >>> from posttrain.models import ByteTokenizer
        >>> ids, mask = render_response(ByteTokenizer(), "1+1", "2")
        >>> ids, [t for t, m in zip(ids, mask) if m]   # <bos><user>1+1<end><assistant>2<end>
        ([257, 260, 49, 43, 49, 262, 261, 50, 262], [50, 262])
    """
    if chat and isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return _render(tokenizer, prompt, response, chat, index=0, key="response")


def _render(tokenizer: Tokenizer, prompt: str | list[dict], response: str, chat: bool,
            index: int, key: str) -> tuple[list[int], list[bool]]:
    """Token ids of prompt + response and the response mask (see the module docstring)."""
    if chat:
        try:
            prefix = list(tokenizer.render_prompt(prompt))
            full = tokenizer.render_chat(prompt + [{"role": "assistant", "content": response}])
        except ValueError as e:
            raise PreferenceRowError(index, key, "render_error", str(e)) from e
        ids = list(full.input_ids)
        if ids[:len(prefix)] != prefix:
            raise PreferenceRowError(index, key, "render_error", "the chat template renders the "
                                     "prompt differently when a response follows it")
        mask = [bool(m) and t >= len(prefix) for t, m in enumerate(full.loss_mask)]
    else:
        prefix = tokenizer.encode(prompt, add_bos=True)
        body = tokenizer.encode(response)
        ids, mask = prefix + body, [False] * len(prefix) + [True] * len(body)
    response_at = [t for t, m in enumerate(mask) if m]
    if not response_at or ids[response_at[-1]] not in tokenizer.stop_ids:
        ids.append(tokenizer.eos_id)
        mask.append(True)
    if mask[0]:
        raise PreferenceRowError(index, key, "render_error", "the first token cannot be a "
                                 "response token (no context to predict it from)")
    return ids, mask


def _as_tensors(ids: list[int], mask: list[bool]) -> tuple[Tensor, Tensor]:
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool)


class _RowDataset(Sequence):
    """Shared parts: bad-row handling, padding, the reference log-prob cache."""

    REFERENCE_KEYS: tuple[str, ...] = ()
    reference: ReferenceLogps | None

    def _init(self, tokenizer: Tokenizer, max_seq_len: int, chat: bool, on_bad_row: str) -> None:
        if on_bad_row not in ("raise", "skip"):
            raise ValueError(f"on_bad_row={on_bad_row!r}; allowed: 'raise', 'skip'")
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 2:
            raise ValueError(f"max_seq_len={max_seq_len!r}; must be an integer >= 2")
        self.tokenizer, self.max_seq_len, self.chat = tokenizer, max_seq_len, bool(chat)
        self.on_bad_row, self.pad_id = on_bad_row, tokenizer.pad_id
        self.stats, self.row_indices, self.reference = PreferenceStats(), [], None

    def _bad_row(self, error: PreferenceRowError) -> None:
        if self.on_bad_row == "raise":
            raise error
        by_reason = self.stats.skipped_by_reason
        by_reason[error.reason] = by_reason.get(error.reason, 0) + 1

    def _fits(self, ids: list[int], index: int, key: str) -> None:
        if len(ids) > self.max_seq_len:
            raise PreferenceRowError(index, key, "overlong", f"prompt + {key} has {len(ids)} "
                                     f"tokens, more than max_seq_len={self.max_seq_len}")

    def _check_not_empty(self) -> None:
        if len(self) == 0:
            raise ValueError(f"{type(self).__name__}: no usable row ({self.stats.rows} read, "
                             f"skipped {self.stats.skipped_by_reason})")

    def sequence(self, i: int, key: str) -> tuple[Tensor, Tensor]:
        """(input_ids [L] int64, response_mask [L] bool) of item `i`, sequence `key` (one of
        `REFERENCE_KEYS`)."""
        raise NotImplementedError

    def padded(self, indices: Sequence[int], key: str) -> tuple[Tensor, Tensor, Tensor]:
        """Right-padded (input_ids, attention_mask, response_mask), each [len(indices), T]."""
        return _pad([self.sequence(i, key) for i in indices], self.pad_id)

    def _reference(self, key: str, indices: Sequence[int]) -> Tensor | None:
        return None if self.reference is None else self.reference.values[key][list(indices)]


class PreferenceDataset(_RowDataset):
    """(prompt, chosen, rejected) rows, tokenised; items are dicts of 1-D tensors.

    Args:
        rows: list of dicts, DataFrame or .jsonl/.json path (module docstring for the shapes).
        tokenizer: a `posttrain.models.tokenizer.Tokenizer`.
        max_seq_len: most tokens of prompt + response; longer rows are bad rows ("overlong").
        chat: render with the chat template (True) or as plain text after BOS (False).
        on_bad_row: "raise" or "skip" (counted in `stats.skipped_by_reason`).

    Attributes:
        row_indices: source row of each item. stats: `PreferenceStats`. reference: the cached
            `ReferenceLogps` (keys "chosen", "rejected"), set by `compute_reference_logps`.

    Raises:
        PreferenceRowError (a ValueError): with on_bad_row="raise", naming row, field, reason.
        ValueError: for bad options, or if no row is usable.
    """

    REFERENCE_KEYS = ("chosen", "rejected")

    def __init__(self, rows: Any, tokenizer: Tokenizer, *, max_seq_len: int, chat: bool = True,
                 on_bad_row: Literal["raise", "skip"] = "raise") -> None:
        self._init(tokenizer, max_seq_len, chat, on_bad_row)
        self.items: list[dict[str, Tensor]] = []
        for i, row in enumerate(_read_rows(rows)):
            self.stats.rows += 1
            try:
                _check_row(row, i, "prompt, chosen, rejected")
                prompt = _prompt(row, i, self.chat)
                chosen, rejected = _response(row, i, "chosen"), _response(row, i, "rejected")
                if chosen.strip() == rejected.strip():
                    raise PreferenceRowError(i, "rejected", "same_response", "rejected is the "
                                             "same text as chosen (surrounding whitespace "
                                             "ignored)")
                item = {}
                for key, text in (("chosen", chosen), ("rejected", rejected)):
                    ids, mask = _render(tokenizer, prompt, text, self.chat, i, key)
                    self._fits(ids, i, key)
                    item[f"{key}_ids"], item[f"{key}_mask"] = _as_tensors(ids, mask)
            except PreferenceRowError as e:
                self._bad_row(e)
                continue
            self.items.append(item)
            self.row_indices.append(i)
            self.stats.samples += 1
            for key in self.REFERENCE_KEYS:
                self.stats.tokens += len(item[f"{key}_ids"])
                self.stats.response_tokens += int(item[f"{key}_mask"].sum())
        self._check_not_empty()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):  # type: ignore[override]
        return self.items[i]

    def sequence(self, i: int, key: str) -> tuple[Tensor, Tensor]:
        return self.items[i][f"{key}_ids"], self.items[i][f"{key}_mask"]

    def collate(self, indices: Sequence[int]) -> PreferenceBatch:
        """A `PreferenceBatch` of items `indices`; chosen and rejected padded to one T."""
        n = len(indices)
        ids, attention, response = _pad([self.sequence(i, "chosen") for i in indices]
                                        + [self.sequence(i, "rejected") for i in indices],
                                        self.pad_id)
        return PreferenceBatch(ids[:n], attention[:n], response[:n], ids[n:], attention[n:],
                               response[n:], self._reference("chosen", indices),
                               self._reference("rejected", indices))


class KTODataset(_RowDataset):
    """Unpaired (prompt, completion, label) rows for KTO, tokenised, each with a mismatched
    sequence for the KL reference point: prompt i with the completion of kept row i - 1
    (cyclically), as TRL's rotation by one. Needs at least two usable rows.

    Args, attributes and raises: as `PreferenceDataset`; `reference` has keys "completion" and
    "kl". A mismatched sequence longer than `max_seq_len` is cut to it (`stats.kl_truncated`).
    """

    REFERENCE_KEYS = ("completion", "kl")

    def __init__(self, rows: Any, tokenizer: Tokenizer, *, max_seq_len: int, chat: bool = True,
                 on_bad_row: Literal["raise", "skip"] = "raise") -> None:
        self._init(tokenizer, max_seq_len, chat, on_bad_row)
        kept: list[tuple[Any, str, bool, int, list[int], list[bool]]] = []
        for i, row in enumerate(_read_rows(rows)):
            self.stats.rows += 1
            try:
                _check_row(row, i, "prompt, completion, label")
                prompt = _prompt(row, i, self.chat)
                completion = _response(row, i, "completion")
                if "label" not in row:
                    raise PreferenceRowError(i, "label", "missing_field", "has no 'label'")
                if not isinstance(row["label"], (bool, np.bool_)):
                    raise PreferenceRowError(i, "label", "bad_label", f"is {row['label']!r}; "
                                             "expected True (desirable) or False (undesirable)")
                ids, mask = _render(tokenizer, prompt, completion, self.chat, i, "completion")
                self._fits(ids, i, "completion")
            except PreferenceRowError as e:
                self._bad_row(e)
                continue
            kept.append((prompt, completion, bool(row["label"]), i, ids, mask))
            self.row_indices.append(i)
            self.stats.samples += 1
            self.stats.tokens += len(ids)
            self.stats.response_tokens += sum(mask)
        if len(kept) < 2:
            raise ValueError(f"KTODataset: {len(kept)} usable row(s) ({self.stats.rows} read, "
                             f"skipped {self.stats.skipped_by_reason}); the KL estimate needs at "
                             "least 2")
        self.items = []
        for j, (prompt, _, desirable, i, ids, mask) in enumerate(kept):
            kl_ids, kl_mask = _render(tokenizer, prompt, kept[j - 1][1], self.chat, i, "kl")
            if len(kl_ids) > max_seq_len:
                kl_ids, kl_mask = kl_ids[:max_seq_len], kl_mask[:max_seq_len]
                self.stats.kl_truncated += 1
            self.items.append({"completion": _as_tensors(ids, mask),
                               "kl": _as_tensors(kl_ids, kl_mask), "desirable": desirable})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):  # type: ignore[override]
        return self.items[i]

    def sequence(self, i: int, key: str) -> tuple[Tensor, Tensor]:
        return self.items[i][key]

    def collate(self, indices: Sequence[int]) -> KTOBatch:
        """A `KTOBatch` of items `indices`."""
        ids, attention, response = self.padded(indices, "completion")
        kl_ids, kl_attention, kl_response = self.padded(indices, "kl")
        desirable = torch.tensor([self.items[i]["desirable"] for i in indices], dtype=torch.bool)
        return KTOBatch(ids, attention, response, desirable, kl_ids, kl_attention, kl_response,
                        self._reference("completion", indices), self._reference("kl", indices))


def _pad(sequences: Sequence[tuple[Tensor, Tensor]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    B, T = len(sequences), max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((B, T), pad_id, dtype=torch.int64)
    attention = torch.zeros(B, T, dtype=torch.bool)
    response = torch.zeros(B, T, dtype=torch.bool)
    for b, (ids, mask) in enumerate(sequences):
        input_ids[b, :len(ids)], attention[b, :len(ids)], response[b, :len(ids)] = ids, True, mask
    return input_ids, attention, response


def pairs_to_kto_rows(rows: Any) -> list[dict]:
    """Each pair becomes two KTO rows: (prompt, chosen, label True), (prompt, rejected, False).

    Args:
        rows: pairs as `PreferenceDataset` reads them: a list of dicts, a DataFrame or a
            .jsonl/.json path. Fields are copied as they are; `KTODataset` validates them.

    Raises:
        PreferenceRowError (a ValueError): for a row that is not a mapping or lacks prompt,
            chosen or rejected, naming the row.
        ValueError, FileNotFoundError: as `load_preference_rows`.
    """
    out = []
    for i, row in enumerate(load_preference_rows(rows)):
        _check_row(row, i, "prompt, chosen, rejected")
        for key in ("prompt", "chosen", "rejected"):
            if key not in row:
                raise PreferenceRowError(i, key, "missing_field", f"has no {key!r}")
        out.append({"prompt": row["prompt"], "completion": row["chosen"], "label": True})
        out.append({"prompt": row["prompt"], "completion": row["rejected"], "label": False})
    return out


# --------------------------------------------------------------------------------------------
# Batches and the loader
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreferenceBatch:
    """B preference pairs; chosen and rejected right-padded to one length T.

    Attributes:
        chosen_input_ids, rejected_input_ids: [B, T] int64 (padding = the tokenizer's pad_id).
        chosen_attention_mask, rejected_attention_mask: [B, T] bool, True on real tokens.
        chosen_response_mask, rejected_response_mask: [B, T] bool, True exactly on the response
            tokens (never on prompt or padding).
        ref_chosen_logps, ref_rejected_logps: [B] fp32 summed reference log-probs, or None
            before `compute_reference_logps`.
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
        return (torch.cat([self.chosen_input_ids, self.rejected_input_ids]),
                torch.cat([self.chosen_attention_mask, self.rejected_attention_mask]),
                torch.cat([self.chosen_response_mask, self.rejected_response_mask]))

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
            `compute_reference_logps`.
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
    return {f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), Tensor)}


class PreferenceLoader:
    """An endless stream of batches over a `PreferenceDataset` or `KTODataset`, epoch after
    epoch, in a seeded order (`posttrain.data.loader.epoch_order`, the global RNG untouched), that
    resumes exactly from `state_dict()` (the same rules as `posttrain.data.loader.SFTLoader`: batches
    never span two epochs; the state counts items, so batch_size may change across a resume).

    Reference log-probs are read from the dataset's cache when a batch is made, so call
    `compute_reference_logps` before the first batch.

    Single process only for now: `rank`/`world_size` are 0/1, so the `Trainer` refuses this
    loader under data parallelism rather than training every rank on the same batches.

    Raises:
        ValueError: for a batch_size below 1 or an empty dataset.
    """

    def __init__(self, dataset: PreferenceDataset | KTODataset, *, batch_size: int,
                 shuffle: bool = True, seed: int = 0) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}; must be a positive integer")
        if len(dataset) == 0:
            raise ValueError("PreferenceLoader: the dataset is empty")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.rank, self.world_size = 0, 1
        self._start_epoch(0)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.offset = epoch, 0
        self._order = epoch_order(len(self.dataset), seed=self.seed, epoch=epoch,
                                  shuffle=self.shuffle)

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(len(self.dataset) / self.batch_size)

    def next_batch(self) -> PreferenceBatch | KTOBatch:
        indices = self._order[self.offset: self.offset + self.batch_size]
        batch = self.dataset.collate(indices)
        self.offset += len(indices)
        if self.offset == len(self._order):
            self._start_epoch(self.epoch + 1)
        return batch

    def __iter__(self) -> Iterator[PreferenceBatch | KTOBatch]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """{"epoch", "offset", "seed", "shuffle", "order"}: JSON-safe."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "shuffle": self.shuffle, "order": list(self._order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`. Raises ValueError for another seed, shuffle setting or
        dataset size."""
        for key in ("seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"loader state has {key}={state[key]!r} but this loader has "
                                 f"{key}={getattr(self, key)!r}; the order would not match")
        order = [int(i) for i in state["order"]]
        offset = int(state["offset"])
        if sorted(order) != list(range(len(self.dataset))) or not 0 <= offset <= len(order):
            raise ValueError(f"loader state (order of {len(order)}, offset {state['offset']}) "
                             f"does not fit this dataset of {len(self.dataset)} items")
        self.epoch, self.offset, self._order = int(state["epoch"]), int(state["offset"]), order
        if self.offset == len(order):
            self._start_epoch(self.epoch + 1)


# --------------------------------------------------------------------------------------------
# Reference log-probabilities, computed once
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReferenceLogps:
    """Summed reference log-probs of every item of a dataset: `values[key]` is [N] fp32 for each
    key of the dataset's `REFERENCE_KEYS`; `fingerprint` identifies the reference parameters."""

    fingerprint: str
    values: dict[str, Tensor]


@torch.no_grad()
def reference_fingerprint(model: nn.Module, *, sample: int = 65536) -> str:
    """A hex digest of a model's parameters and buffers: for every tensor its name, shape, dtype,
    float64 sum and sum of squares, and the values of up to `sample` evenly spaced elements (all
    of them for smaller tensors). Any training update changes it; an edit of one element that
    keeps both sums and misses the sample would not (not a concern for a reference model)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        values = tensor.detach().flatten().double()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        step = max(1, values.numel() // sample)
        digest.update(torch.stack([values.sum(), (values * values).sum()]).cpu().numpy().tobytes())
        digest.update(values[::step][:sample].cpu().numpy().tobytes())
    return digest.hexdigest()


def compute_reference_logps(reference: Any, dataset: PreferenceDataset | KTODataset, *,
                            batch_size: int = 32) -> ReferenceLogps:
    """Summed response log-probs of every item under `reference`, computed once and cached on
    `dataset.reference`, keyed by `reference_fingerprint` of the reference's parameters: a
    second call with the same parameters returns the cache; other parameters recompute.

    Runs under `torch.no_grad()` in eval mode (the model's mode is restored), temperature 1,
    `batch_size` sequences per forward, right-padded (results do not depend on the batch beyond
    float rounding).

    Args:
        reference: a `posttrain.policy.policy.Policy` or a torchtune decoder (`nn.Module`).
        dataset: a `PreferenceDataset` or `KTODataset`.
        batch_size: sequences per forward (>= 1).

    Returns:
        The `ReferenceLogps` now on `dataset.reference`; loaders put its values into batches.

    Raises:
        ValueError: for batch_size < 1.
    """
    from posttrain.preference.losses import response_logps

    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}; must be an integer >= 1")
    model = getattr(reference, "model", reference)
    fingerprint = reference_fingerprint(model)
    if dataset.reference is not None and dataset.reference.fingerprint == fingerprint:
        return dataset.reference
    was_training = model.training
    model.eval()
    values = {}
    try:
        with torch.no_grad():
            for key in dataset.REFERENCE_KEYS:
                parts = []
                for start in range(0, len(dataset), batch_size):
                    indices = range(start, min(start + batch_size, len(dataset)))
                    logps_B, _ = response_logps(model, *dataset.padded(indices, key))
                    parts.append(logps_B.float().cpu())
                values[key] = torch.cat(parts)
    finally:
        model.train(was_training)
    dataset.reference = ReferenceLogps(fingerprint, values)
    return dataset.reference


# --------------------------------------------------------------------------------------------
# Pairs by rejection sampling
# --------------------------------------------------------------------------------------------


@dataclass
class PairStats:
    """Counts of `make_preference_pairs`: prompts, samples (completions drawn), pairs kept,
    skipped_all_equal (every usable candidate ranked the same), skipped_too_few (fewer than two
    usable candidates), excluded (candidates left out, by outcome: timeout / error, and
    format_error with format_error="exclude"), outcomes (of every candidate scored),
    reference_chosen (pairs whose chosen is the reference answer)."""

    prompts: int = 0
    samples: int = 0
    pairs: int = 0
    skipped_all_equal: int = 0
    skipped_too_few: int = 0
    excluded: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    reference_chosen: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_preference_pairs(policy: Any, items: Sequence[Mapping[str, Any]], *,
                          rank: Callable[[str, Mapping[str, Any]], Any], n: int = 8,
                          max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0,
                          seed: int = 0, prompts_per_batch: int = 64, chat: bool = True,
                          timeout_s: float | None = DEFAULT_TIMEOUT_S,
                          format_error: Literal["lowest", "exclude"] = "lowest",
                          reference_answer: Callable[[Mapping[str, Any]], str] | None = None,
                          ) -> tuple[list[dict], PairStats]:
    """Preference pairs by rejection sampling: `n` completions per item's question, ranked, and
    the best against the worst when they rank differently (best-vs-worst of n, as in RSO / the
    Llama 2 rejection-sampling recipe).

    Ranking: every candidate goes through `posttrain.rewards.verifier.score_batch(rank, ...)`, so `rank`
    is a verifier (typed `VerifierResult`s) or any `(completion, item) -> float` (a judge).
    Outcomes ok / wrong rank by score. timeout / error are excluded and counted, never scored 0.
    format_error (no answer found: the policy's fault) ranks below every scored candidate
    (`format_error="lowest"`) or is excluded ("exclude"). Ties go to the earliest sample.

    Args:
        policy: a `posttrain.policy.policy.Policy`.
        items: mappings with a "question" (the user turn) and whatever `rank` reads.
        rank: verifier or scoring callable.
        n: completions per prompt (>= 2). max_new_tokens, temperature, top_p: sampling.
        seed: `Policy.generate` seeds, `seed + first item index` per chunk (deterministic).
        prompts_per_batch: prompts per `generate` call (memory: prompts_per_batch * n rows).
        chat: prompt with the one-turn chat template (True) or the raw question after BOS.
        timeout_s: the ranker's per-call budget. format_error: see above.
        reference_answer: `item -> str`; if given, that text joins the candidates (after the
            samples, ranked by `rank` like them), so a prompt whose samples all fail still gives
            a pair. Off-policy: off by default.

    Returns:
        rows {"prompt", "chosen", "rejected", "chosen_score", "rejected_score",
        "chosen_outcome", "rejected_outcome"} (prompt = the question; feed to
        `PreferenceDataset`), and the `PairStats`.

    Raises:
        ValueError: for n < 2, an item without a str "question", or a bad format_error.
    """
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"n={n!r}; rejection sampling needs at least 2 completions per prompt")
    if format_error not in ("lowest", "exclude"):
        raise ValueError(f"format_error={format_error!r}; allowed: 'lowest', 'exclude'")
    for i, item in enumerate(items):
        if not isinstance(item.get("question"), str):
            raise ValueError(f"items[{i}] has no str 'question'")
    stats = PairStats(prompts=len(items))
    stats.outcomes = {o.value: 0 for o in Outcome}
    rows: list[dict] = []
    tok = policy.tokenizer
    for start in range(0, len(items), prompts_per_batch):
        chunk = items[start:start + prompts_per_batch]
        prompts = [tok.render_prompt([{"role": "user", "content": it["question"]}]) if chat
                   else it["question"] for it in chunk]
        completions = policy.generate(prompts, n=n, max_new_tokens=max_new_tokens,
                                      temperature=temperature, top_p=top_p, seed=seed + start)
        stats.samples += len(completions)
        texts = [[c.text for c in completions[j * n:(j + 1) * n]] for j in range(len(chunk))]
        if reference_answer is not None:
            texts = [t + [reference_answer(it)] for t, it in zip(texts, chunk)]
        flat = [(t, it) for ts, it in zip(texts, chunk) for t in ts]
        results = score_batch(rank, [t for t, _ in flat], [it for _, it in flat],
                              timeout_s=timeout_s)
        for outcome, count in count_outcomes(results).items():
            stats.outcomes[outcome] += count
        at = 0
        for ts, item in zip(texts, chunk):
            candidates = []
            for k, (text, result) in enumerate(zip(ts, results[at:at + len(ts)])):
                if result.outcome in (Outcome.TIMEOUT, Outcome.ERROR) or (
                        result.outcome is Outcome.FORMAT_ERROR and format_error == "exclude"):
                    stats.excluded[result.outcome.value] = stats.excluded.get(
                        result.outcome.value, 0) + 1
                    continue
                key = (0, 0.0) if result.outcome is Outcome.FORMAT_ERROR else (1, result.score)
                candidates.append((key, k, text, result))
            at += len(ts)
            if len(candidates) < 2:
                stats.skipped_too_few += 1
                continue
            best = max(candidates, key=lambda c: (c[0], -c[1]))
            worst = min(candidates, key=lambda c: (c[0], c[1]))
            if best[0] == worst[0] or best[2] == worst[2]:
                stats.skipped_all_equal += 1
                continue
            stats.pairs += 1
            stats.reference_chosen += reference_answer is not None and best[1] == n
            rows.append({"prompt": item["question"], "chosen": best[2], "rejected": worst[2],
                         "chosen_score": best[3].score, "rejected_score": worst[3].score,
                         "chosen_outcome": best[3].outcome.value,
                         "rejected_outcome": worst[3].outcome.value})
    return rows, stats
