"""Environments for RL: single-use episodes, picklable group builders, task datasets, and the
trajectory records the buffer and the RL losses consume.

The shape follows tinker-cookbook (`tinker_cookbook/rl/types.py`):

- an `Environment` is ONE episode: `initial_messages()` gives the conversation to prompt with,
  then `step(assistant_text)` is called once per assistant turn until a `StepResult` says
  `done`. Single-turn environments are done after the first step, with the verified reward.
  Multi-turn environments answer with `observation` messages (tool results) to append.
- an `EnvGroupBuilder` makes the G environments of one prompt (a GRPO group). It pickles,
  because the same object travels to a Slurm job. Its optional `group_rewards(trajectories)`
  hook turns per-episode rewards into group-level ones (pairwise judges, ranking rewards).
- an `EnvDataset` (a task) gives the builders of training batch `i`, deterministically, and
  held-out items for evaluation.

Everything here is a `typing.Protocol`: a class in a notebook cell satisfies it without
importing anything. Concrete environments live in `posttrain.envs`; tasks are chosen by name
through the registry here (`get_task("chain_sum", size=1000)`).

Example (a scripted "policy" plays a single-turn episode):
    >>> from posttrain.rl.environment import run_text_episode
    >>> from posttrain.envs import ReasoningGymGroupBuilder
    >>> item = {"question": "4 - 1 =", "answer": "3", "metadata": {}}
    >>> env, = ReasoningGymGroupBuilder(item, "chain_sum").make_envs(1)
    >>> env.initial_messages()
    [{'role': 'user', 'content': '4 - 1 ='}]
    >>> episode = run_text_episode(env, lambda messages: "3")
    >>> episode.reward, episode.outcome, episode.num_turns
    (1.0, 'ok', 1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from posttrain.core.registry import Registry
from posttrain.rewards.verifier import Outcome, VerifierResult, check_reward

Messages = list[dict]
"""A conversation: `[{"role": "user", "content": "..."}, ...]` (the roles of
posttrain.models.tokenizer)."""


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one assistant turn.

    Attributes:
        done: the episode is over; `step` must not be called again.
        reward: the episode's reward when done (required then); None, or a shaped reward, on
            intermediate turns; a reward passes `check_reward` (finite, within float32).
        observation: messages to append after the assistant turn before generating the next one
            (tool results); None when done.
        verifier_result: the typed verification of the final answer, when there was one.
        info: anything worth logging (per-episode metrics, the extracted answer, ...).

    Raises:
        ValueError: if done without a reward, a reward that breaks `check_reward` (NaN, inf,
            beyond float32 such as 1e39), or not done without an observation list. Inside a
            rollout that makes the episode's outcome "error" (counted), not a crash.
    """

    done: bool
    reward: float | None = None
    observation: Messages | None = None
    verifier_result: VerifierResult | None = None
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.reward is not None:
            object.__setattr__(self, "reward", check_reward(self.reward, name="StepResult reward"))
        if self.done and self.reward is None:
            raise ValueError("a StepResult with done=True needs the episode's reward")
        if not self.done and not isinstance(self.observation, list):
            raise ValueError(
                "a StepResult with done=False needs `observation`, the list of "
                "messages to append before the next turn (may be empty)"
            )

    @property
    def outcome(self) -> str:
        """The verifier outcome ("ok", "wrong", ...); "ok" when done without a verifier."""
        if self.verifier_result is None:
            return Outcome.OK.value
        return self.verifier_result.outcome.value


@runtime_checkable
class Environment(Protocol):
    """One episode, used once. See the module docstring."""

    def initial_messages(self) -> Messages:
        """The conversation to prompt the policy with (ends with a user or tool turn)."""
        ...

    def step(self, assistant_text: str) -> StepResult:
        """Take the policy's next assistant turn; raises RuntimeError once the episode is done."""
        ...


@runtime_checkable
class EnvGroupBuilder(Protocol):
    """Makes the environments of ONE prompt. Must pickle (pickle and cloudpickle).

    Optional hook, looked up with `getattr` by `group_rewards`:
        `group_rewards(trajectories: list[Trajectory]) -> list[float]`, the final rewards of the
        group, given its trajectories with their per-episode rewards filled in.
    """

    def make_envs(self, group_size: int) -> list[Environment]:
        """`group_size` fresh environments for the same prompt (the G samples of a group)."""
        ...


@runtime_checkable
class EnvDataset(Protocol):
    """A task: training prompts as group builders, and held-out items for evaluation."""

    def builders(self, batch_index: int, batch_size: int) -> list[EnvGroupBuilder]:
        """The `batch_size` builders of training batch `batch_index`: the same for the same
        arguments, in any process (resume and Slurm depend on it)."""
        ...

    def held_out(self, n: int) -> list[dict]:
        """`n` evaluation items (question/answer/metadata), never used in training."""
        ...


def group_rewards(builder: EnvGroupBuilder, trajectories: Sequence[Trajectory]) -> list[float]:
    """The group's final rewards: the builder's `group_rewards` hook when it has one, otherwise
    each trajectory's own reward.

    The hook may return `VerifierResult`s instead of floats (a judge scoring the whole group in
    one call, `posttrain.envs.JudgedGroupBuilder`): each trajectory then takes its result's
    outcome (and reason, as `info["verifier_reason"]`), and the result's score is the reward.

    Raises:
        ValueError: if the hook returns the wrong number of rewards or one that breaks
            `check_reward` (NaN, inf, beyond float32); the rollout then marks the group's
            trajectories outcome "error".
    """
    hook = getattr(builder, "group_rewards", None)
    if hook is None:
        return [t.reward for t in trajectories]
    rewards = list(hook(list(trajectories)))
    for t, r in zip(trajectories, rewards):
        if isinstance(r, VerifierResult):
            t.outcome = r.outcome.value
            if r.reason:
                t.info["verifier_reason"] = r.reason
    name = f"{type(builder).__name__}.group_rewards"
    rewards = [
        check_reward(r.score if isinstance(r, VerifierResult) else r, name=f"{name} reward {i}")
        for i, r in enumerate(rewards)
    ]
    if len(rewards) != len(trajectories):
        raise ValueError(
            f"{type(builder).__name__}.group_rewards returned {len(rewards)} rewards "
            f"for {len(trajectories)} trajectories"
        )
    return rewards


# --------------------------------------------------------------------------------------------
# Trajectories: what a rollout produces, what the buffer stores
# --------------------------------------------------------------------------------------------

FINISH_REASONS = ("stop", "length", "max_turns", "error")
"""Why generation ended: a stop token, the token limit, the environment's turn limit, a failure."""


@dataclass(kw_only=True)
class Trajectory:
    """One sampled episode for one prompt, in tokens and text.

    Notation: P = prompt tokens, C = completion tokens.

    Attributes:
        group_id: which group (prompt) this belongs to; equal within a `Group`.
        prompt_ids: [P] token ids of the rendered prompt (`Tokenizer.render_prompt`).
        completion_ids: [C] token ids after the prompt: the sampled tokens, and for multi-turn
            episodes the observation tokens in between (see `completion_mask`).
        logprobs: [C] log-probabilities of `completion_ids` under the sampling distribution
            (0.0 at observation positions).
        reward: the final reward (after `group_rewards`); passes `check_reward`.
        outcome: the verifier outcome, an `Outcome` value ("ok", "wrong", "format_error",
            "timeout", "error").
        finish_reason: one of `FINISH_REASONS`.
        text: the completion as text (all assistant turns for multi-turn episodes).
        policy_version: the policy step that sampled it (staleness bound in the buffer).
        info: per-episode extras for logging.
        completion_mask: [C] True where the policy sampled the token (trained), False at
            observation tokens; None means every completion token was sampled (single-turn).

    Raises:
        ValueError: for mismatched lengths, a reward that breaks `check_reward`, an unknown
            outcome or finish reason.
    """

    group_id: int | str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    reward: float
    outcome: str
    finish_reason: str
    text: str
    policy_version: int = 0
    info: dict = field(default_factory=dict)
    completion_mask: list[bool] | None = None

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"Trajectory has {len(self.completion_ids)} completion ids but "
                f"{len(self.logprobs)} logprobs; they must match one to one"
            )
        mask = self.completion_mask
        if mask is not None and len(mask) != len(self.completion_ids):
            raise ValueError(
                f"Trajectory completion_mask has {len(mask)} entries "
                f"for {len(self.completion_ids)} completion ids"
            )
        self.reward = check_reward(self.reward, name="Trajectory reward")
        try:
            self.outcome = Outcome(self.outcome).value
        except ValueError:
            raise ValueError(
                f"Trajectory outcome {self.outcome!r} is not one of {[o.value for o in Outcome]}"
            ) from None
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Trajectory finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}"
            )

    @property
    def num_completion_tokens(self) -> int:
        return len(self.completion_ids)


@dataclass
class Group:
    """The trajectories of one prompt (a GRPO group).

    Raises:
        ValueError: if empty or if the trajectories disagree on `group_id`.
    """

    trajectories: list[Trajectory]

    def __post_init__(self) -> None:
        if not self.trajectories:
            raise ValueError("a Group needs at least one trajectory")
        ids = {t.group_id for t in self.trajectories}
        if len(ids) != 1:
            raise ValueError(
                f"a Group's trajectories must share one group_id, got {sorted(ids, key=repr)}"
            )

    @property
    def group_id(self) -> int | str:
        return self.trajectories[0].group_id

    @property
    def rewards(self) -> list[float]:
        """[G] rewards, in trajectory order."""
        return [t.reward for t in self.trajectories]

    @property
    def outcomes(self) -> list[str]:
        return [t.outcome for t in self.trajectories]

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self):
        return iter(self.trajectories)


def screen_rewards(groups: Sequence[Group]) -> Sequence[Group]:
    """Give every trajectory of `groups` whose reward breaks `check_reward` (set after it was
    built, e.g. by code that edits rollouts) outcome "error", reward 0.0 and the reason in
    `info["error"]`, so the trainer counts and excludes it (1e39 would be inf in the float32
    batch and end `fit()`). Returns `groups` (changed in place)."""
    for group in groups:
        for t in group:
            try:
                check_reward(t.reward, name="Trajectory reward")
            except ValueError as exc:
                t.outcome, t.reward, t.info["error"] = Outcome.ERROR.value, 0.0, str(exc)
    return groups


# --------------------------------------------------------------------------------------------
# Playing an episode at the text level (notebooks, scripted tests, evaluation)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextEpisode:
    """A finished episode at the text level: the full conversation and its final step."""

    messages: Messages
    final: StepResult
    num_turns: int

    @property
    def reward(self) -> float:
        reward = self.final.reward
        assert reward is not None, "StepResult refuses done=True without a reward"
        return reward

    @property
    def outcome(self) -> str:
        return self.final.outcome


def run_text_episode(
    env: Environment, respond: Callable[[Messages], str], *, max_turns: int = 64
) -> TextEpisode:
    """Play `env` to the end with `respond(messages) -> assistant text` (a policy, or a scripted
    function in tests).

    Raises:
        RuntimeError: if the environment is not done after `max_turns` turns (a safety net for
            environments without a turn limit of their own).
    """
    messages = list(env.initial_messages())
    for turn in range(1, max_turns + 1):
        text = respond(list(messages))
        messages.append({"role": "assistant", "content": text})
        result = env.step(text)
        if result.done:
            return TextEpisode(messages, result, turn)
        messages.extend(result.observation or [])
    raise RuntimeError(f"{type(env).__name__} was not done after {max_turns} turns")


# --------------------------------------------------------------------------------------------
# Registry of tasks
# --------------------------------------------------------------------------------------------

TaskFactory = Callable[..., EnvDataset]
"""Builds a task (`EnvDataset`) from keyword options."""


TASKS: Registry[TaskFactory] = Registry(
    "task", builtins_hint="the built-in tasks register on `import posttrain.envs`"
)

register_task = TASKS.register
"""Decorator registering a task factory under a name (see `posttrain.core.registry.Registry`)."""


def get_task(name: str, /, **options: Any) -> EnvDataset:
    """Build the task registered under `name` with `options`.

    The built-in tasks (reasoning_gym, chain_sum, calculator) register when `posttrain.envs` is
    imported; `posttrain.envs.get_task` is this function with them loaded.

    Raises:
        ValueError: if `name` is unknown; the message lists the registered names.
    """
    return TASKS.build(name, **options)


def registered_tasks() -> tuple[str, ...]:
    """Names `get_task` accepts (the built-ins once `posttrain.envs` is imported)."""
    return TASKS.names()
