"""A recipe's `data:` section: a researcher's own rows instead of a reasoning-gym task, with a
held-out set and its metrics (validation loss; greedy exact match where rows have answers).

`data.train` is a path (.jsonl / .json / .parquet / .csv) or an object (a pandas DataFrame, a
`datasets.Dataset` or `DatasetDict` with `data.split`, a list of dicts): the sources and row
formats of `posttrain.data.sources`. The held-out rows are `data.eval` (the same kinds; a
`DatasetDict`'s `data.eval_split`), or else `data.eval_fraction` of the training rows drawn
with `data.seed` (and left out of training); at most `data.eval_rows` of them are scored, so
an evaluation stays cheap. With `data.train` set the recipe ignores its `task.*` keys.

Metrics of the held-out rows (`HeldOut.metrics`): `val_loss` (token-mean cross-entropy of the
trained tokens, nats) and, for rows with one user prompt and one answer (prompt/completion, or
a two-message chat), `val_exact_match` (share of greedy answers of at most `eval.max_new_tokens`
tokens equal to the answer, both stripped of surrounding white space). The SFT recipe records
them before and after training (results.json / results.md) and every `eval.every` steps
(metrics.jsonl as `eval/val_loss`, `eval/val_exact_match`; the dashboard shows them).

Example:
    >>> DataConfig(train="rows.xlsx")
    Traceback (most recent call last):
    ...
    ValueError: DataConfig.train='rows.xlsx'; must be a .jsonl/.json/.parquet/.csv path, \
a pandas DataFrame, a datasets.Dataset or DatasetDict, a list of dicts, or None (the task's data)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.data.loader import collate_padded
from posttrain.data.sft import CPTDataset, SFTDataset, normalize_sft_row
from posttrain.data.sources import FILE_SUFFIXES, load_records
from posttrain.workflows.config import fail, finite, ints, seeds

__all__ = ["DataConfig", "HeldOut", "own_data"]


def _is_dataset_dict(source: Any) -> bool:
    return type(source).__name__ in ("DatasetDict", "IterableDatasetDict")


def _check_source(value: Any, name: str) -> None:
    bad_path = isinstance(value, str) and not value.endswith(FILE_SUFFIXES)
    if bad_path or isinstance(value, (int, float, bool, bytes)):
        raise fail(
            name,
            value,
            f"a {'/'.join(FILE_SUFFIXES)} path, a pandas DataFrame, a datasets.Dataset or "
            "DatasetDict, a list of dicts, or None (the task's data)",
        )


@dataclass(kw_only=True)
class DataConfig:
    """Own data (see the module docstring); `train` None: the recipe's task."""

    train: Any = None
    eval: Any = None
    eval_fraction: float = 0.1
    split: str | None = None
    eval_split: str | None = None
    seed: int = 0
    eval_rows: int = 64

    def __post_init__(self) -> None:
        self.check("DataConfig")

    @property
    def given(self) -> bool:
        """Whether the recipe trains on these rows (`train` is set)."""
        return self.train is not None

    def check(self, at: str) -> None:
        _check_source(self.train, f"{at}.train")
        _check_source(self.eval, f"{at}.eval")
        if self.train is None and self.eval is not None:
            raise fail(f"{at}.eval", "...", "None without data.train (set data.train too)")
        finite(self, at, ("eval_fraction",), low=0.0, high=1.0)
        if self.eval_fraction == 1.0:
            raise fail(f"{at}.eval_fraction", 1.0, "below 1 (some rows must train)")
        seeds(self, at, ("seed",))
        ints(self, at, ("eval_rows",), minimum=1)
        for key, source, of in (("split", self.train, "train"), ("eval_split", self.eval, "eval")):
            name = getattr(self, key)
            if name is None:
                continue
            if not _is_dataset_dict(source):
                raise fail(
                    f"{at}.{key}",
                    name,
                    f"None: it names a split of a DatasetDict, and {at}.{of} is none",
                )
            if name not in source:
                raise fail(f"{at}.{key}", name, f"one of the DatasetDict's splits {sorted(source)}")

    def records(self, accepted: Sequence[str]) -> tuple[list[Any], list[Any], str]:
        """(training records, held-out records, row format) of `train` and `eval` (or
        `eval_fraction` of `train`, drawn with `seed`), the held-out ones at most `eval_rows`.

        Raises:
            FileNotFoundError, ValueError: as `posttrain.data.sources.load_records`, naming
                `data.train` / `data.eval`; ValueError if held-out rows are of another
                format than the training ones.
        """
        try:
            train, fmt = load_records(self.train, accepted=accepted, split=self.split)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"data.train={_shown(self.train)}: {e}") from None
        if self.eval is not None:
            try:
                held, held_fmt = load_records(self.eval, accepted=accepted, split=self.eval_split)
            except (ValueError, FileNotFoundError) as e:
                raise ValueError(f"data.eval={_shown(self.eval)}: {e}") from None
            if held_fmt != fmt and not {held_fmt, fmt} <= {"chat", "prompt_completion"}:
                raise ValueError(
                    f"data.eval holds {held_fmt} rows, data.train {fmt} rows; use one format"
                )
        elif self.eval_fraction > 0 and len(train) >= 2:
            n = min(len(train) - 1, max(1, round(self.eval_fraction * len(train))))
            order = list(range(len(train)))
            random.Random(self.seed).shuffle(order)
            chosen = set(order[:n])
            held = [r for i, r in enumerate(train) if i in chosen]
            train = [r for i, r in enumerate(train) if i not in chosen]
        else:
            held = []
        return train, held[: self.eval_rows], fmt


def _shown(source: Any) -> str:
    return repr(source) if isinstance(source, str) else f"<{type(source).__name__}>"


class HeldOut:
    """The held-out rows of own data and their metrics: `metrics(model, tokenizer)` ->
    {"val_loss": float, "val_exact_match": float (rows with an answer only)}.

    Args:
        records: held-out rows (dicts of one accepted format).
        mode: "sft" (chat / prompt_completion rows) or "cpt" (text rows; loss only).
        tokenizer, max_seq_len: as the training dataset's (rows cut alike).
        max_new_tokens: the longest greedy answer of the exact match.
        batch_size: rows per forward pass of the loss.

    Raises:
        posttrain.data.rows.BadRowError: for a malformed held-out row.
    """

    def __init__(
        self,
        records: list[Any],
        mode: str,
        tokenizer: Any,
        *,
        max_seq_len: int,
        max_new_tokens: int,
        batch_size: int,
    ) -> None:
        cls = SFTDataset if mode == "sft" else CPTDataset
        docs = records if mode == "sft" else [r.get("text") for r in records]
        self.dataset = cls(docs, tokenizer, max_seq_len=max_seq_len)
        self.tokenizer, self.max_new_tokens, self.batch_size = tokenizer, max_new_tokens, batch_size
        self.items = []
        if mode == "sft":
            for i, r in enumerate(records):
                messages = normalize_sft_row(r, i)
                if [m["role"] for m in messages] == ["user", "assistant"]:
                    self.items.append(
                        {"question": messages[0]["content"], "answer": messages[1]["content"]}
                    )

    def __len__(self) -> int:
        return len(self.dataset)

    def loss(self, model: torch.nn.Module) -> float:
        """Token-mean cross-entropy (nats) of the held-out rows' trained tokens."""
        from posttrain.train.losses import SFTCrossEntropy

        samples = [self.dataset[i] for i in range(len(self.dataset))]
        total = torch.tensor(sum(s.num_trained_tokens for s in samples))
        loss, value = SFTCrossEntropy(), 0.0
        with torch.no_grad():
            for start in range(0, len(samples), self.batch_size):
                batch = collate_padded(samples[start : start + self.batch_size], 0)
                value += float(loss(model, batch, total))
        return value

    def exact_match(self, policy: Any) -> float:
        """Share of the items whose greedy answer (`policy`: a Policy or rollout engine)
        equals the row's answer, stripped."""
        from posttrain.rewards.evaluation import evaluate_generations

        result = evaluate_generations(
            policy,
            self.items,
            max_new_tokens=self.max_new_tokens,
            score_fn=lambda text, item: float(text.strip() == str(item["answer"]).strip()),
        )
        return float(result.accuracy)

    def metrics(self, model: torch.nn.Module, spec: Any, sampler: Any = None) -> dict[str, float]:
        """{"val_loss", "val_exact_match" (where items have answers)} of `model` (built from
        `spec`); `sampler` (a rollout engine or Policy) answers instead of a Policy of it."""
        out = {"val_loss": self.loss(model)}
        if self.items:
            from posttrain.policy.policy import Policy

            out["val_exact_match"] = self.exact_match(
                sampler if sampler is not None else Policy(model, self.tokenizer, spec)
            )
        return out


def own_data(cfg: Any, tokenizer: Any) -> tuple[SFTDataset | CPTDataset, HeldOut | None, str]:
    """The training dataset, held-out rows (None when there are none) and row format of an
    SFT/CPT config whose `data.train` is set.

    Raises:
        ValueError: naming `data.train` / `data.eval` (see `DataConfig.records`), or a
            malformed row (`BadRowError`).
    """
    from posttrain.data.sources import CPT_FORMATS, SFT_FORMATS

    chat = cfg.mode == "sft"
    train, held, fmt = cfg.data.records(SFT_FORMATS if chat else CPT_FORMATS)
    rows = train if chat else [r.get("text") for r in train]
    cls = SFTDataset if chat else CPTDataset
    dataset = cls(rows, tokenizer, max_seq_len=cfg.max_seq_len)
    held_out = (
        HeldOut(
            held,
            cfg.mode,
            tokenizer,
            max_seq_len=cfg.max_seq_len,
            max_new_tokens=cfg.eval.max_new_tokens,
            batch_size=cfg.optim.batch_size,
        )
        if held
        else None
    )
    return dataset, held_out, fmt
