"""Single-turn episodes judged a whole group at a time: one judge call per GRPO group.

`JudgedGroupBuilder(item, judge)` makes the G environments of one item. Each episode ends at
its first assistant turn without a reward of its own; the builder's `group_rewards` hook then
asks `judge.judge` about all G completions in ONE call (one HTTP request to a judge server
with `posttrain.rewards.judge_client.JudgeClient`, one batched forward with an in-process
`RewardModelJudge` / `LLMJudge`) and returns the G typed results, which the rollout records as
the trajectories' rewards and outcomes (`posttrain.rl.environment.group_rewards`). A judge
failure (server down, deadline passed, unparsable verdict) is `error` / `timeout` on every
member, so `RLTrainer` excludes the group and counts it (`groups_excluded_error`).

An episode that already failed before judging (its outcome is `error` or `timeout`) keeps its
outcome and is not sent to the judge.

Example (an in-process reward-model judge; a task whose builders judge by group):
    >>> import functools
    >>> from posttrain.envs import chain_sum_task
    >>> from posttrain.models import ByteTokenizer
    >>> from posttrain.policy import Policy
    >>> from posttrain.rewards import RewardModel, RewardModelJudge
    >>> from posttrain.rl import collect_groups
    >>> judge = RewardModelJudge(RewardModel.from_spec("tiny-1m", seed=0), ByteTokenizer())
    >>> task = chain_sum_task(size=8, held_out_size=2,
    ...                       builder=functools.partial(JudgedGroupBuilder, judge=judge))
    >>> [group] = collect_groups(Policy.from_spec("tiny-1m", seed=0), task.builders(0, 1),
    ...                          group_size=3, max_new_tokens=4, seed=0)
    >>> len(group), set(group.outcomes) <= {"ok", "wrong"}
    (3, True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from posttrain.envs.reasoning_gym_env import prompt_messages
from posttrain.rewards.judge_protocol import Judge
from posttrain.rewards.verifier import Outcome, VerifierResult
from posttrain.rl.environment import Messages, StepResult, Trajectory

__all__ = ["JudgedEnv", "JudgedGroupBuilder"]

_FAILED = (Outcome.ERROR.value, Outcome.TIMEOUT.value)


class JudgedEnv:
    """One single-turn episode whose reward comes from its group's judge call: `step` ends the
    episode with a placeholder reward of 0.0 that `JudgedGroupBuilder.group_rewards` replaces."""

    def __init__(self, item: Mapping[str, Any], system_prompt: str | None = None) -> None:
        self.item, self.system_prompt = item, system_prompt
        self._done = False

    def initial_messages(self) -> Messages:
        return prompt_messages(self.item["question"], self.system_prompt)

    def step(self, assistant_text: str) -> StepResult:
        if self._done:
            raise RuntimeError(
                "this episode is over; environments are single-use (make new ones "
                "with the group builder)"
            )
        self._done = True
        return StepResult(done=True, reward=0.0, info={"judged": "by group"})


@dataclass(frozen=True)
class JudgedGroupBuilder:
    """The environments of one item, judged together (see the module docstring). Pickles when
    the judge does (a `JudgeClient` always does).

    Args:
        item: the task item (question, answer, metadata); the judge sees it for every member.
        judge: a `posttrain.rewards.judges.Judge` (a `JudgeClient`, `RewardModelJudge`, ...).
        system_prompt: an optional system turn before the question.

    Raises:
        TypeError: if `judge` has no `judge(completions, items)` method.
    """

    item: dict
    judge: Judge
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if not callable(getattr(self.judge, "judge", None)):
            raise TypeError(
                f"judge must have a judge(completions, items) method; got "
                f"{type(self.judge).__name__}"
            )

    def make_envs(self, group_size: int) -> list[JudgedEnv]:
        if not (isinstance(group_size, int) and group_size >= 1):
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        return [JudgedEnv(self.item, self.system_prompt) for _ in range(group_size)]

    def group_rewards(self, trajectories: Sequence[Trajectory]) -> list[VerifierResult]:
        """The judge's results for the group's completions (one `judge` call), in order; an
        episode that already failed keeps its outcome and is not judged.

        Raises:
            ValueError: if the judge returns another number of results than it was asked for
                (the rollout then marks the whole group `error`).
        """
        results: list[VerifierResult | None] = [
            VerifierResult.failure(t.outcome, t.info.get("error", "episode failed"))
            if t.outcome in _FAILED
            else None
            for t in trajectories
        ]
        todo = [i for i, r in enumerate(results) if r is None]
        if todo:
            judged = list(
                self.judge.judge([trajectories[i].text for i in todo], [self.item] * len(todo))
            )
            if len(judged) != len(todo):
                raise ValueError(
                    f"{type(self.judge).__name__}.judge returned {len(judged)} "
                    f"results for {len(todo)} completions"
                )
            for i, result in zip(todo, judged):
                results[i] = result
        assert all(r is not None for r in results)  # the failed ones, then the judged ones
        return cast("list[VerifierResult]", results)
