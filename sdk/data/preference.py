"""Preference data: tokenised pair and KTO datasets. The batches they collate into and the
resumable loader that streams them are in `posttrain.data.preference_batches` (importable from
here too); rows and their validation are in `posttrain.data.preference_rows`; reference
log-probabilities (`posttrain.preference.reference`) and pairs made by rejection sampling
(`posttrain.preference.pairs`) live in the higher `posttrain.preference` layer.

Notation: B = pairs (or KTO rows) in a batch, T = tokens per sequence, L = tokens of one sequence.

Rows:
    pairs: {"prompt": str | [messages], "chosen": str | [assistant message],
            "rejected": str | [assistant message]}
    KTO:   {"prompt": ..., "completion": str | [assistant message], "label": bool}
from a list of dicts, a pandas DataFrame or a .jsonl/.json path. A bad row (a JSONL line that is
not JSON, missing field, non-string, empty response, chosen == rejected up to surrounding
whitespace, longer than `max_seq_len`, ...) raises `posttrain.data.rows.BadRowError` (a
ValueError naming the row index, the field and a reason), or with `on_bad_row="skip"` is skipped
and counted by reason in `dataset.stats` (a `posttrain.data.rows.DataStats`). Each prompt and
response is validated whole but cut to `posttrain.data.rows.text_char_limit` characters before it
is tokenised (a text past that is over-long either way).

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

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from posttrain.data.collate import right_pad
from posttrain.data.preference_batches import KTOBatch, PreferenceBatch, PreferenceLoader
from posttrain.data.preference_rows import _check_row, _prompt, _response
from posttrain.data.rows import BadRowError, DataStats, cap_messages, read_rows, text_char_limit
from posttrain.models.tokenizer import Tokenizer

__all__ = [
    "PreferenceDataset",
    "KTODataset",
    "PreferenceBatch",
    "KTOBatch",
    "PreferenceLoader",
    "render_response",
]

PAIR_COUNTS = ("response_tokens", "kl_truncated")
"""The optional `DataStats` counts that preference and KTO datasets keep."""


# --------------------------------------------------------------------------------------------
# Rows -> token ids
# --------------------------------------------------------------------------------------------


def render_response(
    tokenizer: Tokenizer, prompt: str | list[dict], response: str, *, chat: bool = True
) -> tuple[list[int], list[bool]]:
    """Token ids of prompt + response as every preference model here reads them, and the
    response mask ([T] bools, True at response tokens): with `chat`, the prompt (a user message
    string, or a message list) and an assistant turn through the tokenizer's chat template;
    without it, BOS + prompt + response. EOS is appended when the last response token is not a
    stop token. Raises BadRowError (a ValueError) when the template cannot render it.

    Example:
        >>> from posttrain.models import ByteTokenizer
        >>> ids, mask = render_response(ByteTokenizer(), "1+1", "2")
        >>> ids, [t for t, m in zip(ids, mask) if m]   # <bos><user>1+1<end><assistant>2<end>
        ([257, 260, 49, 43, 49, 262, 261, 50, 262], [50, 262])
    """
    if chat and isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return _render(tokenizer, prompt, response, chat, index=0, key="response")


def _render(
    tokenizer: Tokenizer, prompt: str | list[dict], response: str, chat: bool, index: int, key: str
) -> tuple[list[int], list[bool]]:
    """Token ids of prompt + response and the response mask (see the module docstring)."""
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        try:
            prefix = list(tokenizer.render_prompt(messages))
            full = tokenizer.render_chat(messages + [{"role": "assistant", "content": response}])
        except ValueError as e:
            raise BadRowError(index, key, "render_error", str(e)) from e
        ids = list(full.input_ids)
        if ids[: len(prefix)] != prefix:
            raise BadRowError(
                index,
                key,
                "render_error",
                "the chat template renders the prompt differently when a response follows it",
            )
        mask = [bool(m) and t >= len(prefix) for t, m in enumerate(full.loss_mask)]
    else:
        assert isinstance(prompt, str)  # rows give a str prompt when chat=False
        prefix = tokenizer.encode(prompt, add_bos=True)
        body = tokenizer.encode(response)
        ids, mask = prefix + body, [False] * len(prefix) + [True] * len(body)
    response_at = [t for t, m in enumerate(mask) if m]
    if not response_at or ids[response_at[-1]] not in tokenizer.stop_ids:
        ids.append(tokenizer.eos_id)
        mask.append(True)
    if mask[0]:
        raise BadRowError(
            index,
            key,
            "render_error",
            "the first token cannot be a response token (no context to predict it from)",
        )
    return ids, mask


def _as_tensors(ids: list[int], mask: list[bool]) -> tuple[Tensor, Tensor]:
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool)


def _pad(sequences: Sequence[tuple[Tensor, Tensor]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded (input_ids [B, T] int64, attention_mask [B, T] bool, response_mask [B, T]
    bool) of (ids, response mask) pairs."""
    input_ids, attention = right_pad([ids for ids, _ in sequences], pad_id)
    response, _ = right_pad([mask for _, mask in sequences], False, dtype=torch.bool)
    return input_ids, attention, response


class _RowDataset(Sequence):
    """Shared parts: bad-row handling, padding, the reference log-prob cache."""

    REFERENCE_KEYS: tuple[str, ...] = ()
    reference: Any  # a posttrain.preference.reference.ReferenceLogps, or None

    def _init(self, tokenizer: Tokenizer, max_seq_len: int, chat: bool, on_bad_row: str) -> None:
        if on_bad_row not in ("raise", "skip"):
            raise ValueError(f"on_bad_row={on_bad_row!r}; allowed: 'raise', 'skip'")
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 2:
            raise ValueError(f"max_seq_len={max_seq_len!r}; must be an integer >= 2")
        self.tokenizer, self.max_seq_len, self.chat = tokenizer, max_seq_len, bool(chat)
        self.on_bad_row, self.pad_id = on_bad_row, tokenizer.pad_id
        self.stats, self.reference = DataStats.counting(*PAIR_COUNTS), None
        self.row_indices: list[int] = []
        self._char_limit = text_char_limit(tokenizer, max_seq_len)

    def _bad_row(self, error: BadRowError) -> None:
        if self.on_bad_row == "raise":
            raise error
        self.stats.skip(error)

    def _render_fitting(
        self, prompt: str | list[dict], response: str, index: int, key: str
    ) -> tuple[list[int], list[bool]]:
        """`_render` of the validated prompt and response, each text cut to `text_char_limit`
        first (a longer text is over-long either way); BadRowError "overlong" past max_seq_len."""
        limit = self._char_limit
        texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
        cut = any(len(t) > limit for t in texts + [response])
        prompt = prompt[:limit] if isinstance(prompt, str) else cap_messages(prompt, limit)
        ids, mask = _render(self.tokenizer, prompt, response[:limit], self.chat, index, key)
        if len(ids) > self.max_seq_len:
            raise BadRowError(
                index,
                key,
                "overlong",
                f"prompt + {key} has "
                f"{'over ' if cut else ''}{len(ids)} tokens, more than "
                f"max_seq_len={self.max_seq_len}",
            )
        return ids, mask

    def _check_not_empty(self) -> None:
        if len(self) == 0:
            raise ValueError(
                f"{type(self).__name__}: no usable row ({self.stats.rows} read, "
                f"skipped {self.stats.skipped_by_reason})"
            )

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
        row_indices: source row of each item. stats: `DataStats`. reference: the cached
            `ReferenceLogps` (keys "chosen", "rejected"), set by
            `posttrain.preference.reference.compute_reference_logps`.

    Raises:
        BadRowError (a ValueError): with on_bad_row="raise", naming row, field, reason.
        ValueError: for bad options, or if no row is usable.
    """

    REFERENCE_KEYS = ("chosen", "rejected")

    def __init__(
        self,
        rows: Any,
        tokenizer: Tokenizer,
        *,
        max_seq_len: int,
        chat: bool = True,
        on_bad_row: Literal["raise", "skip"] = "raise",
    ) -> None:
        self._init(tokenizer, max_seq_len, chat, on_bad_row)
        self.items: list[dict[str, Tensor]] = []
        for i, row in enumerate(read_rows(rows, "preference", keep_bad_lines=True)):
            self.stats.rows += 1
            try:
                _check_row(row, i, "prompt, chosen, rejected")
                prompt = _prompt(row, i, self.chat)
                chosen, rejected = _response(row, i, "chosen"), _response(row, i, "rejected")
                if chosen.strip() == rejected.strip():
                    raise BadRowError(
                        i,
                        "rejected",
                        "same_response",
                        "rejected is the same text as chosen (surrounding whitespace ignored)",
                    )
                item = {}
                for key, text in (("chosen", chosen), ("rejected", rejected)):
                    ids, mask = self._render_fitting(prompt, text, i, key)
                    item[f"{key}_ids"], item[f"{key}_mask"] = _as_tensors(ids, mask)
            except BadRowError as e:
                self._bad_row(e)
                continue
            self.items.append(item)
            self.row_indices.append(i)
            self.stats.samples += 1
            for key in self.REFERENCE_KEYS:
                self.stats.tokens += len(item[f"{key}_ids"])
                self.stats.add("response_tokens", int(item[f"{key}_mask"].sum()))
        self._check_not_empty()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def sequence(self, i: int, key: str) -> tuple[Tensor, Tensor]:
        return self.items[i][f"{key}_ids"], self.items[i][f"{key}_mask"]

    def collate(self, indices: Sequence[int]) -> PreferenceBatch:
        """A `PreferenceBatch` of items `indices`; chosen and rejected padded to one T."""
        n = len(indices)
        ids, attention, response = _pad(
            [self.sequence(i, "chosen") for i in indices]
            + [self.sequence(i, "rejected") for i in indices],
            self.pad_id,
        )
        return PreferenceBatch(
            ids[:n],
            attention[:n],
            response[:n],
            ids[n:],
            attention[n:],
            response[n:],
            self._reference("chosen", indices),
            self._reference("rejected", indices),
        )


class KTODataset(_RowDataset):
    """Unpaired (prompt, completion, label) rows for KTO, tokenised, each with a mismatched
    sequence for the KL reference point: prompt i with the completion of kept row i - 1
    (cyclically), as TRL's rotation by one. Needs at least two usable rows.

    Args, attributes and raises: as `PreferenceDataset`; `reference` has keys "completion" and
    "kl". A mismatched sequence longer than `max_seq_len` is cut to it (`stats.kl_truncated`).
    """

    REFERENCE_KEYS = ("completion", "kl")

    def __init__(
        self,
        rows: Any,
        tokenizer: Tokenizer,
        *,
        max_seq_len: int,
        chat: bool = True,
        on_bad_row: Literal["raise", "skip"] = "raise",
    ) -> None:
        self._init(tokenizer, max_seq_len, chat, on_bad_row)
        kept: list[tuple[Any, str, bool, int, list[int], list[bool]]] = []
        for i, row in enumerate(read_rows(rows, "preference", keep_bad_lines=True)):
            self.stats.rows += 1
            try:
                _check_row(row, i, "prompt, completion, label")
                prompt = _prompt(row, i, self.chat)
                completion = _response(row, i, "completion")
                if "label" not in row:
                    raise BadRowError(i, "label", "missing_field", "has no 'label'")
                if not isinstance(row["label"], (bool, np.bool_)):
                    raise BadRowError(
                        i,
                        "label",
                        "bad_label",
                        f"is {row['label']!r}; expected True (desirable) or False (undesirable)",
                    )
                ids, mask = self._render_fitting(prompt, completion, i, "completion")
            except BadRowError as e:
                self._bad_row(e)
                continue
            kept.append((prompt, completion, bool(row["label"]), i, ids, mask))
            self.row_indices.append(i)
            self.stats.samples += 1
            self.stats.tokens += len(ids)
            self.stats.add("response_tokens", sum(mask))
        if len(kept) < 2:
            raise ValueError(
                f"KTODataset: {len(kept)} usable row(s) ({self.stats.rows} read, "
                f"skipped {self.stats.skipped_by_reason}); the KL estimate needs at "
                "least 2"
            )
        self.items: list[dict[str, Any]] = []
        for j, (prompt, _, desirable, i, ids, mask) in enumerate(kept):
            kl_ids, kl_mask = _render(tokenizer, prompt, kept[j - 1][1], self.chat, i, "kl")
            if len(kl_ids) > max_seq_len:
                kl_ids, kl_mask = kl_ids[:max_seq_len], kl_mask[:max_seq_len]
                self.stats.add("kl_truncated", 1)
            self.items.append(
                {
                    "completion": _as_tensors(ids, mask),
                    "kl": _as_tensors(kl_ids, kl_mask),
                    "desirable": desirable,
                }
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def sequence(self, i: int, key: str) -> tuple[Tensor, Tensor]:
        return self.items[i][key]

    def collate(self, indices: Sequence[int]) -> KTOBatch:
        """A `KTOBatch` of items `indices`."""
        ids, attention, response = self.padded(indices, "completion")
        kl_ids, kl_attention, kl_response = self.padded(indices, "kl")
        desirable = torch.tensor([self.items[i]["desirable"] for i in indices], dtype=torch.bool)
        return KTOBatch(
            ids,
            attention,
            response,
            desirable,
            kl_ids,
            kl_attention,
            kl_response,
            self._reference("completion", indices),
            self._reference("kl", indices),
        )
