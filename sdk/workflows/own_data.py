"""A recipe's `data:` section: a researcher's own rows instead of a reasoning-gym task, with a
held-out set and its metrics (validation loss; greedy exact match where rows have answers).

`data.train` is a path (.jsonl / .json / .parquet / .csv) or an object (a pandas DataFrame, a
`datasets.Dataset` or `DatasetDict` with `data.split`, a list of dicts): the sources and row
formats of `posttrain.data.sources`. The held-out rows are `data.eval` (the same kinds; a
`DatasetDict`'s `data.eval_split`), or else `data.eval_fraction` of the training rows drawn
with `data.seed` (and left out of training); at most `data.eval_rows` of them are scored, so
an evaluation stays cheap. With `data.train` set the recipe ignores its `task.*` keys.

Metrics of the held-out rows (`HeldOut.metrics`): `val_loss` (token-mean cross-entropy of the
trained tokens, nats) and `val_exact_match`: the share of rows whose greedy reply (at most
`eval.max_new_tokens` tokens) to the conversation up to the row's last user turn equals the
row's last assistant turn, both stripped of surrounding white space. Every prompt/completion
row and every chat whose last assistant turn follows a user turn is scored so, multi-turn
chats included (earlier turns and a system message are the context, as in training); chats
whose last assistant turn follows another role, and contexts that leave no room for
`eval.max_new_tokens` tokens within `max_seq_len`, are not. The SFT recipe records them before
and after training (results.json / results.md) and every `eval.every` steps (metrics.jsonl as
`eval/val_loss`, `eval/val_exact_match`; the dashboard shows them).

The preference and reward-model recipes read their own pairs through `DataConfig` too
(`posttrain.workflows.own_pairs`): the same sources and keys, held out by prompt.

Example:
    >>> DataConfig(train="rows.xlsx")
    Traceback (most recent call last):
    ...
    ValueError: DataConfig.train='rows.xlsx'; must be a .jsonl/.json/.parquet/.csv path, \
a pandas DataFrame, a datasets.Dataset or DatasetDict, a list of dicts, or None (the task's data)
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.data.loader import collate_padded
from posttrain.data.sft import CPTDataset, SFTDataset, normalize_sft_row
from posttrain.workflows.data_config import DataConfig

__all__ = ["DataConfig", "HeldOut", "own_data"]


class HeldOut:
    """The held-out rows of own data and their metrics: `metrics(model, spec)` ->
    {"val_loss": float, "val_exact_match": float (where some row is scored; module docstring)}.

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
        self.items: list[dict[str, Any]] = []
        if mode == "sft":
            for i, r in enumerate(records):
                messages = normalize_sft_row(r, i)
                if len(messages) < 2 or messages[-2]["role"] != "user":
                    continue  # the last assistant turn answers no user turn
                context = messages[:-1]
                room = len(tokenizer.render_prompt(context)) + max_new_tokens <= max_seq_len
                if room:
                    self.items.append({"context": context, "answer": messages[-1]["content"]})

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

    def exact_match(self, policy: Any, batch_size: int = 64) -> float:
        """Share of the items whose greedy reply (`policy`: a Policy or rollout engine) to the
        conversation before the row's last assistant turn equals that turn, both stripped.
        Prompts are rendered as `render_prompt(context)` (the chat template's generation
        prompt), `batch_size` at a time."""
        correct = 0
        for start in range(0, len(self.items), batch_size):
            chunk = self.items[start : start + batch_size]
            prompts = [policy.tokenizer.render_prompt(it["context"]) for it in chunk]
            for c in policy.generate(
                prompts, seed=start, max_new_tokens=self.max_new_tokens, temperature=0.0
            ):
                correct += c.text.strip() == str(chunk[c.prompt_index]["answer"]).strip()
        return correct / len(self.items)

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
