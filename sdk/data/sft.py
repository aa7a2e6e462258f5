"""From rows to tokenized samples: readers, row validation, `SFTDataset` and `CPTDataset`.

Notation: L = tokens of one sample. `posttrain.data.loader` re-exports everything public here and
turns samples into batches.

Readers (`load_sft_rows`, `load_text_documents`, `reasoning_gym_sft_rows`) return rows *as
found*; `normalize_sft_row` / `normalize_document` validate one row, raising
`posttrain.data.rows.BadRowError` with the row index and a reason, so that the datasets can raise
or, with `on_bad_row="skip"`, count (`DataStats`).

Accepted SFT row shapes:
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    {"prompt": "...", "completion": "..."}   -> user + assistant messages

SFT end of sequence: the rendered chat's last trained token is kept as is when it is one of the
tokenizer's `stop_ids` (ByteTokenizer `<|end|>`, ChatML `<|im_end|>`, Llama 3 `<|eot_id|>`);
otherwise EOS is appended and trained, so the model always learns to stop. Truncation happens
after this, so a truncated answer does not learn to stop where it was cut. Which tokens are
trained is decided by position (the tokenizer's loss mask), never by token id, so EOS is
trained even when `pad_id == eos_id`. Each message is validated whole but cut to
`posttrain.data.rows.text_char_limit` characters before it is tokenised, a bound that cannot
change the kept tokens, so a 50M-character completion costs what a short over-long one does.
CPT documents are tokenised whole: every token lands in a chunk, so there is nothing to cut.

Example:
    >>> from posttrain.data.sft import SFTDataset, load_sft_rows, normalize_sft_row
    >>> from posttrain.models import ByteTokenizer
    >>> rows = load_sft_rows([{"prompt": "2+2?", "completion": "4"}])
    >>> normalize_sft_row(rows[0], 0)
    [{'role': 'user', 'content': '2+2?'}, {'role': 'assistant', 'content': '4'}]
    >>> sample = SFTDataset(rows, ByteTokenizer(), max_seq_len=32)[0]
    >>> sample.labels.tolist()    # '4' and <|end|> are trained, already shifted
    [-100, -100, -100, -100, -100, -100, -100, 52, 262, -100]
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from posttrain.data.rows import (
    BadRowError,
    DataStats,
    cap_messages,
    is_frame,
    is_missing,
    read_json_rows,
    read_rows,
    read_text_file,
    text_char_limit,
)
from posttrain.models.chat import ROLES
from posttrain.models.tokenizer import Tokenizer

IGNORE_INDEX = -100
"""Label of positions that are not trained (`torch.nn.functional.cross_entropy` default)."""

ON_BAD_ROW = ("raise", "skip")
OVERLONG = ("truncate", "drop")

SAMPLE_COUNTS = ("truncated", "dropped", "split_documents", "trained_tokens")
"""The optional `DataStats` counts that SFT and CPT datasets keep."""


def load_sft_rows(source: Sequence[Mapping] | Any | str | os.PathLike) -> list[Any]:
    """Read SFT rows from a list of dicts, a pandas DataFrame, or a `.jsonl` / `.json` path.

    Rows are returned as found (DataFrame cells that pandas filled with NaN are dropped);
    `normalize_sft_row` validates them.

    Raises:
        FileNotFoundError: for a path that does not exist.
        ValueError: for a JSONL line that is not JSON (naming file and line), a file that is not
            UTF-8 (naming file, line and byte offset), or a source of another type.
    """
    return read_rows(source, "SFT")


def _as_list(value: Any) -> Any:
    # Parquet/Arrow-backed frames hold message lists as numpy arrays.
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, str) else value


def normalize_sft_row(row: Any, index: int) -> list[dict]:
    """Validate one SFT row and return its messages as `[{"role", "content"}, ...]`.

    Args:
        row: {"messages": [...]} or {"prompt": str, "completion": str}.
        index: the row's position in its source, used in error messages.

    Returns:
        New message dicts holding only "role" and "content"; the last one is the assistant's.

    Raises:
        BadRowError (a ValueError): naming `index` and one of `BAD_ROW_REASONS`.
    """
    if not isinstance(row, Mapping):
        raise BadRowError(
            index,
            None,
            "not_a_dict",
            f"is a {type(row).__name__}, expected a dict with 'messages' or 'prompt'/'completion'",
        )
    if "messages" in row:
        messages = _as_list(row["messages"])
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise BadRowError(
                index,
                None,
                "no_messages",
                f"'messages' is a {type(messages).__name__}, expected a list",
            )
    elif "prompt" in row or "completion" in row:
        for key in ("prompt", "completion"):
            if key not in row:
                raise BadRowError(
                    index,
                    None,
                    "no_messages",
                    f"has no {key!r} (a prompt/completion row needs both)",
                )
            if not isinstance(row[key], str):
                raise BadRowError(
                    index,
                    None,
                    "non_string_content",
                    f"{key!r} is a {type(row[key]).__name__}, expected str",
                )
        messages = [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["completion"]},
        ]
    else:
        raise BadRowError(
            index,
            None,
            "no_messages",
            f"has keys {sorted(map(str, row))}; expected 'messages' or 'prompt' and 'completion'",
        )
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise BadRowError(
                index,
                None,
                "bad_message",
                f"message {j} must be a dict with 'role' and 'content', got {m!r:.80}",
            )
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise BadRowError(
                index,
                None,
                "unknown_role",
                f"message {j} has role {role!r}; allowed roles: {', '.join(ROLES)}",
            )
        if not isinstance(content, str):
            raise BadRowError(
                index,
                None,
                "non_string_content",
                f"message {j} content is a {type(content).__name__}, expected str",
            )
        if role == "assistant" and not content.strip():
            raise BadRowError(
                index, None, "empty_assistant", f"message {j} is an empty assistant turn"
            )
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRowError(
            index, None, "no_assistant", "has no assistant turn, so nothing to train on"
        )
    if out[-1]["role"] != "assistant":
        raise BadRowError(
            index,
            None,
            "last_not_assistant",
            f"ends with a {out[-1]['role']!r} turn; an SFT row must end with the assistant turn",
        )
    return out


def load_text_documents(
    source: Sequence[Any] | Any | str | os.PathLike, *, field: str = "text"
) -> list[Any]:
    """Read CPT documents: a list of str, a DataFrame column, a `.jsonl`/`.json` file of
    {field: str} rows, or a `.txt` file (the whole file is one document).

    Values are returned as found (a row without `field` gives None); `normalize_document`
    validates them.

    Raises:
        FileNotFoundError: for a path that does not exist.
        ValueError: for a DataFrame without the column, bad JSONL, a file that is not UTF-8
            (naming file, line and byte offset), or another source type.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"CPT data file {path} does not exist")
        if path.suffix == ".txt":
            return [read_text_file(path)]
        return [r.get(field) if isinstance(r, Mapping) else r for r in read_json_rows(path)]
    if is_frame(source):
        if field not in source.columns:
            raise ValueError(
                f"DataFrame has no column {field!r} (columns: "
                f"{', '.join(map(str, source.columns))}); pass field=..."
            )
        return [None if is_missing(v) else v for v in source[field].tolist()]
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        return [r.get(field) if isinstance(r, Mapping) else r for r in source]
    raise ValueError(
        f"cannot read documents from a {type(source).__name__}; pass a list of str, "
        f"a DataFrame with a {field!r} column, or a .txt/.jsonl path"
    )


def normalize_document(doc: Any, index: int) -> str:
    """Validate one CPT document. Raises BadRowError (a ValueError) naming `index`."""
    if not isinstance(doc, str):
        raise BadRowError(
            index, None, "non_string_content", f"document is a {type(doc).__name__}, expected str"
        )
    if not doc.strip():
        raise BadRowError(index, None, "empty_text", "document is empty")
    return doc


def reasoning_gym_sft_rows(
    name: str,
    *,
    size: int,
    seed: int,
    item_filter: Callable[[Any, Any], Iterable[Mapping]] | None = None,
    **task_config: Any,
) -> list[dict]:
    """SFT rows from a reasoning-gym task: the question, exactly as the task words it, is the
    user turn; the task's reference answer is the assistant turn.

    Args:
        name: a reasoning-gym dataset name, e.g. "chain_sum".
        size, seed: passed to `reasoning_gym.create_dataset`.
        item_filter: `(dataset, items) -> kept items`, e.g. a check of each item's gold answer
            (`posttrain.verifiers.reasoning_gym_gold.check_gold`); None keeps every item.
        task_config: the task's own options (e.g. `min_terms=2, max_terms=2`).

    Returns:
        One row {"messages": [user, assistant]} per kept item (`size` without a filter).

    Raises:
        ValueError: from reasoning-gym for an unknown name or bad option.

    Example:
        >>> rows = reasoning_gym_sft_rows("chain_sum", size=2, seed=0)  # doctest: +SKIP
        >>> rows[0]["messages"][1]["role"]                                # doctest: +SKIP
        'assistant'
    """
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **task_config)
    items = dataset if item_filter is None else item_filter(dataset, dataset)
    return [
        {
            "messages": [
                {"role": "user", "content": item["question"]},
                {"role": "assistant", "content": item["answer"]},
            ]
        }
        for item in items
    ]


# --------------------------------------------------------------------------------------------
# Tokenized samples
# --------------------------------------------------------------------------------------------


def labels_from_loss_mask(input_ids: Sequence[int], loss_mask: Sequence[bool]) -> list[int]:
    """Shifted labels: `labels[t] = input_ids[t+1]` if `loss_mask[t+1]` else IGNORE_INDEX; the
    last position has no next token and is IGNORE_INDEX. `loss_mask[0]` is never used.

    Raises:
        ValueError: if the two lengths differ.
    """
    if len(input_ids) != len(loss_mask):
        raise ValueError(f"{len(input_ids)} input_ids but {len(loss_mask)} loss_mask entries")
    if not input_ids:
        return []
    nxt = zip(input_ids[1:], loss_mask[1:])
    return [int(i) if m else IGNORE_INDEX for i, m in nxt] + [IGNORE_INDEX]


@dataclass(frozen=True)
class Sample:
    """One tokenized sample. `input_ids`, `labels`: [L] int64, labels already shifted."""

    input_ids: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def from_loss_mask(cls, input_ids: Sequence[int], loss_mask: Sequence[bool]) -> Sample:
        labels = labels_from_loss_mask(input_ids, loss_mask)
        return cls(
            torch.tensor(list(input_ids), dtype=torch.int64),
            torch.tensor(labels, dtype=torch.int64),
        )

    def __len__(self) -> int:
        return self.input_ids.numel()

    @property
    def num_trained_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}; allowed: {', '.join(map(repr, allowed))}")


def _check_max_seq_len(max_seq_len: Any) -> None:
    if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 2:
        raise ValueError(f"max_seq_len={max_seq_len!r}; must be an integer >= 2")


class _TokenizedDataset(Sequence):
    """Samples held in memory, with the tokenizer's pad id and the stats of how they were made."""

    samples: list[Sample]
    row_indices: list[int]
    stats: DataStats
    max_seq_len: int
    pad_id: int

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]

    def _bad_row(self, error: BadRowError, on_bad_row: str) -> None:
        if on_bad_row == "raise":
            raise error
        self.stats.skip(error)

    def _keep(self, sample: Sample, index: int) -> None:
        self.samples.append(sample)
        self.row_indices.append(index)
        self.stats.samples += 1
        self.stats.tokens += len(sample)
        self.stats.add("trained_tokens", sample.num_trained_tokens)

    def _check_not_empty(self, what: str) -> None:
        if not self.samples:
            raise ValueError(
                f"{type(self).__name__}: no usable {what} ({self.stats.rows} read, "
                f"skipped {self.stats.skipped_by_reason}, {self.stats.dropped} "
                f"dropped as over-long); the dataset is empty"
            )


class SFTDataset(_TokenizedDataset):
    """Chat rows tokenized with `tokenizer.render_chat`; assistant content and the end of each
    assistant turn are trained (see the module docstring for the EOS rule).

    Args:
        rows: a list of row dicts, a pandas DataFrame, or a .jsonl/.json path
            (`load_sft_rows`); rows are {"messages": [...]} or {"prompt", "completion"}.
        tokenizer: a `posttrain.models.tokenizer.Tokenizer`.
        max_seq_len: most tokens per sample.
        on_bad_row: "raise" (first bad row raises) or "skip" (counted in
            `stats.skipped_by_reason`).
        overlong: rows longer than `max_seq_len`: "truncate" (keep the first `max_seq_len`
            tokens; counted in `stats.truncated`, or in `stats.dropped` if no trained token is
            left) or "drop" (counted in `stats.dropped`).

    Items are `Sample`s; `row_indices[i]` is the source row of sample i. Rows are tokenized
    eagerly, in memory.

    Raises:
        BadRowError (a ValueError): with on_bad_row="raise", naming the row index and problem.
        ValueError: for bad options, or if no row is usable.
    """

    def __init__(
        self,
        rows: Any,
        tokenizer: Tokenizer,
        *,
        max_seq_len: int,
        on_bad_row: Literal["raise", "skip"] = "raise",
        overlong: Literal["truncate", "drop"] = "truncate",
    ) -> None:
        _check_choice("on_bad_row", on_bad_row, ON_BAD_ROW)
        _check_choice("overlong", overlong, OVERLONG)
        _check_max_seq_len(max_seq_len)
        self.max_seq_len, self.pad_id = max_seq_len, tokenizer.pad_id
        self.samples, self.row_indices = [], []
        self.stats = DataStats.counting(*SAMPLE_COUNTS)
        stops, limit = tokenizer.stop_ids, text_char_limit(tokenizer, max_seq_len)
        for i, row in enumerate(load_sft_rows(rows)):
            self.stats.rows += 1
            try:
                # Validated whole, tokenised cut: a longer text could only add tokens past
                # max_seq_len (`text_char_limit`).
                messages = cap_messages(normalize_sft_row(row, i), limit)
                try:
                    chat = tokenizer.render_chat(messages)
                except ValueError as e:
                    raise BadRowError(i, None, "render_error", str(e)) from e
                trained = [t for t, m in enumerate(chat.loss_mask) if m]
                if not trained:
                    raise BadRowError(
                        i, None, "render_error", "the chat template marked no token as trained"
                    )
            except BadRowError as e:
                self._bad_row(e, on_bad_row)
                continue
            ids, mask = list(chat.input_ids), list(chat.loss_mask)
            if ids[trained[-1]] not in stops:
                ids.append(tokenizer.eos_id)
                mask.append(True)
            if len(ids) > max_seq_len:
                if overlong == "drop":
                    self.stats.add("dropped", 1)
                    continue
                ids, mask = ids[:max_seq_len], mask[:max_seq_len]
                if not any(mask[1:]):
                    self.stats.add("dropped", 1)
                    continue
                self.stats.add("truncated", 1)
            self._keep(Sample.from_loss_mask(ids, mask), i)
        self._check_not_empty("rows")


class CPTDataset(_TokenizedDataset):
    """Plain-text documents for continued pretraining: BOS (if the tokenizer has one) + text +
    EOS, every next token trained.

    A document longer than `max_seq_len` is split into chunks of `max_seq_len` tokens that
    overlap by one token, so every token after the first is predicted exactly once (counted in
    `stats.split_documents`; `stats.samples` counts chunks). Pack with `SFTLoader(pack=True)`.

    Args:
        documents: list of str, DataFrame with a `field` column, .txt or .jsonl path
            (`load_text_documents`).
        tokenizer: a `posttrain.models.tokenizer.Tokenizer`.
        max_seq_len: most tokens per chunk (>= 2).
        on_bad_row: "raise" or "skip" for non-string or empty documents.
        field: the column / JSON key that holds the text.

    Raises:
        BadRowError (a ValueError): with on_bad_row="raise", naming the document index.
        ValueError: for bad options, or if no document is usable.
    """

    def __init__(
        self,
        documents: Any,
        tokenizer: Tokenizer,
        *,
        max_seq_len: int,
        on_bad_row: Literal["raise", "skip"] = "raise",
        field: str = "text",
    ) -> None:
        _check_choice("on_bad_row", on_bad_row, ON_BAD_ROW)
        _check_max_seq_len(max_seq_len)
        self.max_seq_len, self.pad_id = max_seq_len, tokenizer.pad_id
        self.samples, self.row_indices = [], []
        self.stats = DataStats.counting(*SAMPLE_COUNTS)
        stride = max_seq_len - 1
        for i, doc in enumerate(load_text_documents(documents, field=field)):
            self.stats.rows += 1
            try:
                text = normalize_document(doc, i)
            except BadRowError as e:
                self._bad_row(e, on_bad_row)
                continue
            ids = tokenizer.encode(text, add_bos=True, add_eos=True)
            starts = range(0, max(len(ids) - 1, 1), stride)
            self.stats.add("split_documents", int(len(starts) > 1))
            for s in starts:
                chunk = ids[s : s + max_seq_len]
                self._keep(Sample.from_loss_mask(chunk, [True] * len(chunk)), i)
        self._check_not_empty("documents")
