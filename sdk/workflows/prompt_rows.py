"""Own prompt rows of an RL run (`posttrain.workflows.rl_data`): their reading from the `data:`
section (`prompt_data`, `PromptData`), the check that they fit the model (`check_prompts_fit`,
before a run writes anything), the warm start's demonstrations (`chat_rows`), and the held-out
rows answered greedily and scored by the run's reward functions: `PromptHeldOut` (one table row
per record), `summary` (mean reward, failures, each function's mean, exact match),
`paired_diffs` (after minus before, paired over the rows) and `PromptHeldOutCurve` (the same
every N RL steps).

Example:
    >>> data = PromptData([{"prompt": "1+2=", "answer": 3}, {"prompt": "hi"}], [])
    >>> data.demonstrations()
    [{'messages': [{'role': 'user', 'content': '1+2='}, {'role': 'assistant', 'content': '3'}]}]
    >>> table = pd.DataFrame({"reward": [1.0, float("nan"), 0.0], "exact": [1.0, 0.0, float("nan")],
    ...                       "reward/acc": [1.0, None, 0.0]})
    >>> summary(table)  # doctest: +NORMALIZE_WHITESPACE
    {'num_rows': 3, 'reward_mean': 0.5, 'reward_failures': 1, 'reward/acc': 0.5,
     'exact_match': 0.5, 'exact_match_rows': 2}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from posttrain.core.stage_files import write_stage_file
from posttrain.data.sources import load_prompt_records
from posttrain.envs.prompt_task import PromptEnv, PromptTask
from posttrain.rewards.evaluation import paired_bootstrap_diff
from posttrain.rewards.functions import RewardFunctions
from posttrain.workflows.config import ROOT, fail
from posttrain.workflows.data_config import DataConfig
from posttrain.workflows.reports import plot_curves, read_table, write_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from posttrain.rl.trainer import RLTrainer

__all__ = [
    "PromptData",
    "PromptHeldOut",
    "PromptHeldOutCurve",
    "answer_of",
    "chat_rows",
    "check_prompts_fit",
    "paired_diffs",
    "prompt_data",
    "summary",
    "write_demonstrations",
]


def answer_of(row: dict) -> str | None:
    """The record's "answer" as a string (None when it has none)."""
    answer = row.get("answer")
    return None if answer is None else str(answer)


_PROMPT_FORMATS = ("prompt", "prompt_completion")


@dataclass
class PromptData:
    """Training and held-out prompt records of an RL run with own data (`prompt_data`)."""

    train: list[dict]
    held: list[dict]

    def demonstrations(self, limit: int | None = None) -> list[dict]:
        """Chat rows (prompt as the RL task renders it, then the answer as the assistant turn)
        of the first `limit` (None: all) training rows that have an "answer"."""
        return chat_rows(self.train)[:limit]

    def task(self, rewards: RewardFunctions) -> PromptTask:
        """The RL task: every training row, scored by `rewards`."""
        return PromptTask(self.train, rewards=rewards)


def chat_rows(rows: list[dict]) -> list[dict]:
    """The rows with an "answer" as chat rows: the prompt's messages, then the answer."""
    return [
        {
            "messages": [
                *PromptEnv(r).initial_messages(),
                {"role": "assistant", "content": answer_of(r)},
            ]
        }
        for r in rows
        if answer_of(r) is not None
    ]


def prompt_data(data: DataConfig) -> PromptData:
    """The records of an RL config's `data` section (see the module docstring).

    Raises:
        ValueError: naming `data.train` / `data.eval` for a source that does not read, rows of
            another format than prompt (+ answer) or prompt/completion, or a malformed prompt.
    """
    train, held, _ = data.records(_PROMPT_FORMATS)
    out = []
    for key, records in (("data.train", train), ("data.eval", held)):
        try:
            out.append(load_prompt_records(records) if records else [])
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
    return PromptData(*out)


def check_prompts_fit(cfg: Any, tokenizer: Any, at: str = ROOT) -> None:
    """`cfg.data`'s rows read (`prompt_data`) and every prompt, rendered as the RL task renders
    it, leaves room in `cfg.model` for `sampling.max_new_tokens` (training rows) and
    `eval.max_new_tokens` (held-out rows).

    Raises:
        ValueError: naming `data.train` / `data.eval` (rows), or the `max_new_tokens` field
            with the longest prompt's length and the model's limit.
    """
    data, limit = prompt_data(cfg.data), cfg.model.max_seq_len()
    for name, new_tokens, rows, what in (
        ("sampling", cfg.sampling.max_new_tokens, data.train, "training prompt"),
        ("eval", cfg.eval.max_new_tokens, data.held, "held-out prompt"),
    ):
        longest = max(
            (len(tokenizer.render_prompt(PromptEnv(r).initial_messages())) for r in rows),
            default=0,
        )
        if limit is not None and longest + new_tokens > limit:
            raise fail(
                f"{at}.{name}.max_new_tokens",
                new_tokens,
                f"at most {limit - longest}: the longest {what} has {longest} tokens and "
                f"the model holds {limit}",
            )


def write_demonstrations(rows: list[dict], path: Path) -> str:
    """`rows` as JSON Lines at `path` (a stage file); returns the path for `data.train`."""
    write_stage_file(path, "".join(json.dumps(r) + "\n" for r in rows), rows=len(rows))
    return str(path)


class PromptHeldOut:
    """Held-out prompt records answered greedily and scored by reward functions.

    Args:
        rows: prompt records (`prompt_data`'s `held`), at least one.
        rewards: the run's reward functions.
        max_new_tokens: the longest answer.
        batch_size: prompts per `generate` call.

    Raises:
        ValueError: for no rows.
    """

    def __init__(
        self,
        rows: list[dict],
        rewards: RewardFunctions,
        *,
        max_new_tokens: int,
        batch_size: int = 64,
    ) -> None:
        if not rows:
            raise ValueError("PromptHeldOut needs at least one held-out row")
        self.rows, self.rewards = rows, rewards
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size

    def evaluate(self, sampler: Any) -> pd.DataFrame:
        """One row per held-out record: prompt, answer, completion, reward (the weighted sum;
        NaN where the functions failed), outcome, reason, exact (True/False; NaN without an
        answer), finish_reason and each function's own value `reward/<name>`.

        `sampler`: a `Policy` or rollout engine (`generate(prompt_ids, seed=..., ...)` and a
        `tokenizer`); answers are greedy (temperature 0), prompts rendered as in training."""
        texts: list[Any] = []
        for start in range(0, len(self.rows), self.batch_size):
            chunk = self.rows[start : start + self.batch_size]
            prompts = [
                sampler.tokenizer.render_prompt(PromptEnv(r).initial_messages()) for r in chunk
            ]
            texts += sampler.generate(
                prompts, seed=start, max_new_tokens=self.max_new_tokens, temperature=0.0
            )
        table = []
        for row, completion in zip(self.rows, texts):
            prompt = row["prompt"]
            answer = answer_of(row)
            given = completion.text
            if isinstance(prompt, list):  # conversational: TRL's completion form
                given = [{"role": "assistant", "content": completion.text}]
            columns = {k: [v] for k, v in row.items() if k not in ("prompt", "completion")}
            terms = self.rewards.score_terms(
                [prompt], [given], columns, completion_ids=[completion.token_ids]
            )
            result = terms.results[0]
            table.append(
                {
                    "prompt": prompt if isinstance(prompt, str) else json.dumps(prompt),
                    "answer": answer,
                    "completion": completion.text,
                    "reward": result.score if result.scored else math.nan,
                    "outcome": result.outcome.value,
                    "reason": result.reason,
                    "exact": math.nan
                    if answer is None
                    else float(completion.text.strip() == answer.strip()),
                    "finish_reason": completion.finish_reason,
                    **{f"reward/{k}": v for k, v in terms.values[0].items()},
                }
            )
        return pd.DataFrame(table)


def summary(table: pd.DataFrame) -> dict[str, Any]:
    """The held-out metrics of a `PromptHeldOut.evaluate` table: num_rows, reward_mean (None
    when no row was scored), reward_failures, each function's mean `reward/<name>` (None when
    it scored no row), and, where rows have answers, exact_match and exact_match_rows."""
    scored = table["reward"].dropna()
    out: dict[str, Any] = {
        "num_rows": len(table),
        "reward_mean": float(scored.mean()) if len(scored) else None,
        "reward_failures": int(len(table) - len(scored)),
    }
    for column in table.columns:
        if column.startswith("reward/"):
            values = pd.to_numeric(table[column], errors="coerce").dropna()
            out[column] = float(values.mean()) if len(values) else None
    answered = pd.to_numeric(table["exact"], errors="coerce").dropna()
    if len(answered):
        out["exact_match"] = float(answered.mean())
        out["exact_match_rows"] = int(len(answered))
    return out


def paired_diffs(after: pd.DataFrame, before: pd.DataFrame, *, seed: int) -> dict[str, Any]:
    """After minus before, paired over the held-out rows (`paired_bootstrap_diff`): of the
    reward over rows scored in both tables, and of exact match over rows with an answer; a
    metric no row has in both is left out."""
    out = {}
    for key, column in (("reward_mean", "reward"), ("exact_match", "exact")):
        a = pd.to_numeric(after[column], errors="coerce").to_numpy(float)
        b = pd.to_numeric(before[column], errors="coerce").to_numpy(float)
        both = ~(np.isnan(a) | np.isnan(b))
        if both.any():
            out[key] = paired_bootstrap_diff(a[both], b[both], seed=seed)
    return out


class PromptHeldOutCurve:
    """A trainer callback: `PromptHeldOut` metrics of `policy` every `every` RL steps (and at
    the last), one CSV row per point (step, reward_mean, reward_failures, exact_match where
    rows have answers) in `path`, written as it comes. Greedy answers draw no random numbers,
    so the run trains exactly as without it. Call `start(step, first)` once the trainer exists:
    it writes step 0 (`first`, the starting policy's summary) and drops the rows of steps a
    resumed run takes again."""

    def __init__(
        self, policy: Any, held: PromptHeldOut, *, every: int, path: Path, engines: Any
    ) -> None:
        self.policy, self.held, self.every, self.path = policy, held, every, Path(path)
        self.engines = engines

    def start(self, step: int, first: dict[str, Any]) -> None:
        old = read_table(self.path)
        kept = [] if old is None else [r for r in old.to_dict("records") if 0 < r["step"] <= step]
        self._write([_point(0, first), *kept])

    def __call__(self, trainer: RLTrainer, row: dict[str, Any]) -> None:
        if trainer.step_count % self.every and trainer.step_count != trainer.target_steps:
            return
        table = self.held.evaluate(self.engines.sampler(self.policy))
        self._write([*self.rows(), _point(trainer.step_count, summary(table))])

    def _write(self, points: list[dict[str, Any]]) -> None:
        write_table(pd.DataFrame(points), self.path)

    def rows(self) -> list[dict[str, Any]]:
        """The points so far (none before the first)."""
        table = read_table(self.path)
        return [] if table is None else table.to_dict("records")

    def plot(self, path: Path, *, xlabel: str) -> Figure:
        """The held-out mean reward (and exact match) against step, saved to `path` as PNG."""
        curve = read_table(self.path, required=True)
        return plot_curves(
            curve,
            path,
            [("reward_mean", "held-out mean reward"), ("exact_match", "held-out exact match")],
            xlabel=xlabel,
        )


def _point(step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    keys = ("reward_mean", "reward_failures", "exact_match")
    return {"step": step, **{k: metrics[k] for k in keys if k in metrics}}
