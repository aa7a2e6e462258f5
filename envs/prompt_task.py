"""A single-turn task from any prompt records, scored by reward functions.

- `PromptEnv`: one episode: the record's prompt (a string, or a list of chat messages) as the
  conversation; the first assistant turn ends it with a placeholder reward that the group's
  scoring replaces.
- `PromptGroupBuilder(row, rewards)`: the G environments of one record; its `group_rewards`
  hook calls the reward functions once per group, in TRL's convention
  (`posttrain.rewards.functions`): `prompts`, `completions` (strings, or
  `[{"role": "assistant", "content": ...}]` for a conversational prompt), `completion_ids` and
  every other column of the record (the answer columns) as keyword lists. Failures are typed
  outcomes ("error" with the function's name), counted and excluded by the trainer. Each
  trajectory's `info["reward_terms"]` holds every function's own (unweighted) reward and
  `info["reward_term_failures"]` the functions that failed on it: the per-function metrics
  `reward/<name>` and `reward/<name>/failures` of `posttrain.rl.rollout.rollout_metrics`.
- `PromptTask(rows, rewards=...)`: an `EnvDataset` over a list of dicts or a prompts file
  (read by `posttrain.data.sources.load_prompt_records`): builders per batch index, cycling;
  the last `held_out_size` rows are held out. Registered as task "prompts".

Example:
    >>> def exact(completions, answer, **kwargs):
    ...     return [float(c.strip() == a) for c, a in zip(completions, answer)]
    >>> task = PromptTask([{"prompt": "1+2=", "answer": "3"}], rewards=[exact])
    >>> from posttrain.rl.environment import Trajectory, group_rewards
    >>> builder, = task.builders(0, 1)
    >>> builder.make_envs(2)[0].initial_messages()
    [{'role': 'user', 'content': '1+2='}]
    >>> trajs = [Trajectory(group_id=0, prompt_ids=[], completion_ids=[], logprobs=[], reward=0.0,
    ...                     outcome="ok", finish_reason="stop", text=t) for t in ("3", "4")]
    >>> group_rewards(builder, trajs), [t.outcome for t in trajs]
    ([1.0, 0.0], ['ok', 'wrong'])
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, cast

from posttrain.envs.reasoning_gym_env import cycle_builders, prompt_messages
from posttrain.rewards.functions import RewardFunctions
from posttrain.rewards.verifier import Outcome, VerifierResult
from posttrain.rl.environment import (
    EnvGroupBuilder,
    Environment,
    Messages,
    StepResult,
    Trajectory,
    register_task,
)
from posttrain.rl.rollout import REWARD_TERM_FAILURES, REWARD_TERMS

__all__ = ["PromptEnv", "PromptGroupBuilder", "PromptTask", "check_prompt_rows"]

_FAILED = (Outcome.ERROR.value, Outcome.TIMEOUT.value)
_NOT_COLUMNS = ("completion", "completion_ids")  # TRL leaves these out of the keyword columns


def _is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, list)


def check_prompt_rows(rows: Any, prompt_column: str = "prompt") -> list[dict]:
    """`rows` as a list of dicts whose `prompt_column` is a non-empty string or a non-empty list
    of `{"role", "content"}` messages.

    Raises:
        TypeError: if `rows` is not a list of dicts.
        ValueError: naming the row index, for an empty list or a missing / malformed prompt.
    """
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, Mapping) for r in rows):
        raise TypeError(f"prompt rows must be a list of dicts, got {type(rows).__name__}")
    if not rows:
        raise ValueError("prompt rows are empty; give at least one record")
    for i, row in enumerate(rows):
        prompt = row.get(prompt_column)
        ok = (isinstance(prompt, str) and prompt.strip()) or (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(m, Mapping) and {"role", "content"} <= set(m) for m in prompt)
        )
        if not ok:
            raise ValueError(
                f"prompt row {i}: column {prompt_column!r} must be a non-empty string or a list "
                f"of {{'role', 'content'}} messages, got {prompt!r:.80} (columns: {sorted(row)})"
            )
    return [dict(r) for r in rows]


class PromptEnv:
    """One single-turn episode on one record: `step` ends it with a placeholder reward of 0.0
    that `PromptGroupBuilder.group_rewards` replaces."""

    def __init__(
        self,
        row: Mapping[str, Any],
        prompt_column: str = "prompt",
        system_prompt: str | None = None,
    ) -> None:
        self.row, self.prompt_column, self.system_prompt = row, prompt_column, system_prompt
        self._done = False

    def initial_messages(self) -> Messages:
        prompt = self.row[self.prompt_column]
        if _is_conversation(prompt):
            system = [] if self.system_prompt is None else [self._system()]
            return system + [dict(m) for m in prompt]
        return prompt_messages(prompt, self.system_prompt)

    def _system(self) -> dict:
        return {"role": "system", "content": self.system_prompt}

    def step(self, assistant_text: str) -> StepResult:
        if self._done:
            raise RuntimeError(
                "this episode is over; environments are single-use (make new ones "
                "with the group builder)"
            )
        self._done = True
        return StepResult(done=True, reward=0.0, info={"scored": "by group"})


@dataclass(frozen=True)
class PromptGroupBuilder:
    """The environments of one prompt record, scored together by reward functions (see the
    module docstring). Pickles when the reward functions do.

    Args:
        row: the record: the prompt column plus any answer columns the functions read.
        rewards: a `RewardFunctions`, or what builds one (a list of callables / import paths).
        prompt_column: the column holding the prompt ("question" for reasoning-gym items).
        system_prompt: an optional system turn before the prompt.
    """

    row: dict
    rewards: RewardFunctions
    prompt_column: str = "prompt"
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rewards, RewardFunctions):
            object.__setattr__(self, "rewards", RewardFunctions(self.rewards))
        check_prompt_rows([self.row], self.prompt_column)

    @property
    def item(self) -> dict:
        """The record (named like the other builders' items)."""
        return self.row

    def make_envs(self, group_size: int) -> list[Environment]:
        if not (isinstance(group_size, int) and group_size >= 1):
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        return [
            PromptEnv(self.row, self.prompt_column, self.system_prompt) for _ in range(group_size)
        ]

    def group_rewards(self, trajectories: Sequence[Trajectory]) -> list[VerifierResult]:
        """The reward functions' typed results for the group's completions (one call of each
        function per group), in order; an episode that already failed keeps its outcome and
        is not scored. Each scored trajectory's `info` gets its per-function values (see the
        module docstring)."""
        results: list[VerifierResult | None] = [
            VerifierResult.failure(t.outcome, t.info.get("error", "episode failed"))
            if t.outcome in _FAILED
            else None
            for t in trajectories
        ]
        todo = [i for i, r in enumerate(results) if r is None]
        if todo:
            prompt = self.row[self.prompt_column]
            conversational = _is_conversation(prompt)
            completions = [
                [{"role": "assistant", "content": trajectories[i].text}]
                if conversational
                else trajectories[i].text
                for i in todo
            ]
            columns = {
                k: [v] * len(todo)
                for k, v in self.row.items()
                if k != self.prompt_column and k not in _NOT_COLUMNS
            }
            scored = self.rewards.score_terms(
                [prompt] * len(todo),
                completions,
                columns,
                completion_ids=[trajectories[i].completion_ids for i in todo],
            )
            for j, i in enumerate(todo):
                results[i] = scored.results[j]
                info = trajectories[i].info  # per-function metrics (`rollout_metrics`)
                info[REWARD_TERMS], info[REWARD_TERM_FAILURES] = scored.values[j], scored.failed[j]
        return cast("list[VerifierResult]", results)


@register_task("prompts")
@dataclass
class PromptTask:
    """Prompt records scored by reward functions, as an `EnvDataset`.

    Training rows are all but the last `held_out_size`; batch `b` of size `B` holds training rows
    `b*B .. b*B+B-1` (modulo their number). Pickles when the reward functions do.

    Args:
        rows: a list of dicts (see `check_prompt_rows`), or any source
            `posttrain.data.sources.load_prompt_records` reads (a .jsonl / .json / .parquet /
            .csv path, a DataFrame, a HF dataset) into them; the other columns reach the reward
            functions as keyword lists.
        rewards: reward functions (callables, `per_sample` wrappers, "module:function" paths) or
            a `RewardFunctions`.
        weights: one per function (None: all 1.0); only with a list of functions.
        prompt_column: the column holding the prompt.
        held_out_size: rows kept for evaluation (`held_out`), never trained on.
        system_prompt: an optional system turn before each prompt.

    Raises:
        ValueError / TypeError: for malformed rows (naming the row), bad reward functions or
            weights (`RewardFunctions`), `held_out_size` not in 0 .. len(rows) - 1.
        FileNotFoundError: for a file source that does not exist.
    """

    rows: list
    _: KW_ONLY
    rewards: Any
    weights: Sequence[float] | None = None
    prompt_column: str = "prompt"
    held_out_size: int = 0
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rows, (list, tuple)):  # a file, a DataFrame, a HF dataset
            from posttrain.data.sources import load_prompt_records

            self.rows = load_prompt_records(self.rows)
        self.rows = check_prompt_rows(self.rows, self.prompt_column)
        if isinstance(self.rewards, RewardFunctions):
            if self.weights is not None:
                raise ValueError("weights go into the RewardFunctions already given as rewards")
        else:
            self.rewards = RewardFunctions(self.rewards, self.weights)
        n = self.held_out_size
        if not (isinstance(n, int) and not isinstance(n, bool) and 0 <= n < len(self.rows)):
            raise ValueError(
                f"held_out_size must be an int in 0 .. {len(self.rows) - 1} (rows: "
                f"{len(self.rows)}), got {n!r}"
            )

    @property
    def train_items(self) -> list[dict]:
        return self.rows[: len(self.rows) - self.held_out_size]

    def __len__(self) -> int:
        return len(self.train_items)

    def make_builder(self, row: dict) -> EnvGroupBuilder:
        return PromptGroupBuilder(row, self.rewards, self.prompt_column, self.system_prompt)

    def builders(self, batch_index: int, batch_size: int) -> list[EnvGroupBuilder]:
        """The builders of training batch `batch_index` (see the class docstring)."""
        return cycle_builders(self.train_items, batch_index, batch_size, self.make_builder)

    def held_out(self, n: int | None = None) -> list[dict]:
        """The first `n` held-out rows (all when None), as copies.

        Raises:
            ValueError: if `n` exceeds `held_out_size`.

        A row whose prompt is text also holds it as "question" (unless the row has that column
        already), so the rows go to `evaluate_generations` as they are.
        """
        n = self.held_out_size if n is None else n
        if not (isinstance(n, int) and 0 <= n <= self.held_out_size):
            raise ValueError(
                f"held_out(n) needs 0 <= n <= held_out_size={self.held_out_size}, got {n!r}"
            )
        rows = copy.deepcopy(self.rows[len(self.rows) - self.held_out_size :][:n])
        for row in rows:
            if isinstance(row.get(self.prompt_column), str):
                row.setdefault("question", row[self.prompt_column])
        return rows

    def score_fn(self) -> Callable[[str, Mapping[str, Any]], float]:
        """`(completion, row) -> score` with these reward functions, for
        `posttrain.rewards.evaluation.evaluate_generations` on `held_out()` rows.

        The returned callable raises ValueError (naming the outcome and its reason) when the
        functions fail on a completion: a failure is not a score of 0.0. To count failures
        instead, score with `self.rewards.score`, whose results keep their typed outcome."""
        return _RowScore(cast(RewardFunctions, self.rewards), self.prompt_column)


@dataclass(frozen=True)
class _RowScore:
    rewards: RewardFunctions
    prompt_column: str

    def __call__(self, completion: str, row: Mapping[str, Any]) -> float:
        prompt = row[self.prompt_column]
        if _is_conversation(prompt):
            completion = [{"role": "assistant", "content": completion}]  # type: ignore[assignment]
        columns = {k: [v] for k, v in row.items() if k != self.prompt_column}
        result = self.rewards.score([prompt], [completion], columns)[0]
        if result.outcome not in (Outcome.OK, Outcome.WRONG):
            raise ValueError(
                f"reward functions failed on a held-out completion: outcome "
                f"{result.outcome.value!r} ({result.reason}); a failure is not a score"
            )
        return result.score
