"""Single-turn environments for any reasoning-gym task, generated offline.

reasoning-gym (https://github.com/open-thought/reasoning-gym) generates items
`{question, answer, metadata}` procedurally from a name, a config and a seed; item `i` of seed
`s` depends only on `s + i`. Each task scores answers itself (`ReasoningGymVerifier`).

- `ReasoningGymEnv`: one episode: the question as the user turn; the first assistant turn is
  verified and ends the episode with the verifier's score as reward.
- `ReasoningGymGroupBuilder(item, task)`: the G environments of one item; pickles.
- `ReasoningGymTask(name, size=, seed=, config=)`: an `EnvDataset`: builders per batch index
  (deterministic; wraps around after the last item) and held-out items whose questions never
  occur in training. Small tasks repeat questions (2-term, 1-2-digit chain_sum has only ~8k
  distinct ones), so training items whose question is held out are dropped. Items whose
  upstream gold answer fails its check (`posttrain.verifiers.reasoning_gym_gold`: the task's
  scorer and, for chain_sum, basic_arithmetic, countdown and others, its metadata) are dropped
  first and counted (`task.gold_train`, `task.gold_held_out`, `repr(task)`, `task.stats()`):
  e.g. ~1% of basic_arithmetic items, whose generator floor-divides.
- `chain_sum_task(**overrides)`: the 2-term, 1-2-digit chain_sum preset.

Example:
    >>> from posttrain.envs.reasoning_gym_env import chain_sum_task
    >>> task = chain_sum_task(size=100, held_out_size=10)
    >>> builders = task.builders(batch_index=0, batch_size=2)
    >>> envs = builders[0].make_envs(group_size=4)
    >>> question = envs[0].initial_messages()[-1]["content"]
    >>> question.startswith("State the final answer")
    True
    >>> result = envs[0].step(builders[0].item["answer"])
    >>> result.done, result.reward, result.verifier_result.outcome.value
    (True, 1.0, 'ok')
    >>> held = {item["question"] for item in task.held_out(10)}
    >>> held.isdisjoint(item["question"] for item in task.train_items)
    True
    >>> task.num_bad_gold, task.gold_train.checked   # every item checked, none dropped
    (0, 100)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.rewards.verifier import DEFAULT_TIMEOUT_S, Verifier, as_score_fn, run_verifier
from posttrain.rl.environment import (
    EnvGroupBuilder,
    Environment,
    Messages,
    StepResult,
    register_task,
)
from posttrain.verifiers.reasoning_gym import ReasoningGymVerifier, check_task_name
from posttrain.verifiers.reasoning_gym_gold import GoldReport, check_gold

MAX_HELD_OUT_SIZE = 50_000
"""Largest `held_out_size`: the held-out scan reads up to 4 times as many candidates (~75 us
each for chain_sum, gold check included: at most ~15 s)."""


def prompt_messages(question: str, system_prompt: str | None = None) -> Messages:
    """`[system?, user]` messages asking `question`."""
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    return messages + [{"role": "user", "content": question}]


def cycle_builders(
    items: Sequence[dict], batch_index: int, batch_size: int, make_builder: Callable[[dict], Any]
) -> list:
    """The builders of training batch `batch_index`: items `batch_index * batch_size + j`
    (j < batch_size), cycling through `items`, each made by `make_builder` (the same for the same
    arguments, in any process).

    Raises:
        ValueError: if `batch_index` < 0 or `batch_size` < 1.
    """
    if not (isinstance(batch_index, int) and batch_index >= 0):
        raise ValueError(f"batch_index must be an int >= 0, got {batch_index!r}")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    start = batch_index * batch_size
    return [make_builder(items[(start + j) % len(items)]) for j in range(batch_size)]


class ReasoningGymEnv:
    """One single-turn episode on one item: the first `step` verifies and ends it.

    Args:
        item: a task item with `question` and `answer` (and `metadata`).
        verifier: scores the completion against the item (usually a `ReasoningGymVerifier`).
        system_prompt: an optional system turn before the question.
        timeout_s: the verifier's time budget (`run_verifier`).
        info: extras for the final `StepResult.info` (e.g. the item's id).
    """

    def __init__(
        self,
        item: Mapping[str, Any],
        verifier: Verifier,
        *,
        system_prompt: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        info: Mapping[str, Any] | None = None,
    ):
        self.item = item
        self.verifier = verifier
        self.system_prompt = system_prompt
        self.timeout_s = timeout_s
        self.info = dict(info or {})
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
        result = run_verifier(self.verifier, assistant_text, self.item, timeout_s=self.timeout_s)
        return StepResult(
            done=True, reward=result.score, verifier_result=result, info=dict(self.info)
        )


@dataclass(frozen=True)
class ReasoningGymGroupBuilder:
    """The environments of one reasoning-gym item (one GRPO group). Pickles.

    Args:
        item: the task item (question/answer/metadata).
        task: the reasoning-gym task name, used to build the default verifier.
        verifier: overrides the default `ReasoningGymVerifier(task)` (to pass task options or
            another extraction, or a different verifier altogether).
        system_prompt, timeout_s: passed to each `ReasoningGymEnv`.
    """

    item: dict
    task: str
    verifier: Verifier | None = None
    system_prompt: str | None = None
    timeout_s: float | None = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.verifier is None:
            object.__setattr__(self, "verifier", ReasoningGymVerifier(self.task))

    def make_envs(self, group_size: int) -> list[Environment]:
        if not (isinstance(group_size, int) and group_size >= 1):
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        verifier = self.verifier
        assert verifier is not None  # __post_init__ made one
        return [
            ReasoningGymEnv(
                self.item, verifier, system_prompt=self.system_prompt, timeout_s=self.timeout_s
            )
            for _ in range(group_size)
        ]


@dataclass(kw_only=True)
class ReasoningGymTask:
    """Any reasoning-gym task as an `EnvDataset`.

    Training items are items 0..size-1 of `create_dataset(name, size=size, seed=seed, **config)`
    minus those whose question is held out; batch `b` of size `B` holds training items
    `b*B .. b*B+B-1` (modulo the number of training items: later epochs repeat the same order).
    Held-out items are the first `held_out_size` distinct questions of the same task generated
    with `held_out_seed`. Items are generated on first use and are not pickled (the remote side
    regenerates the same ones).

    Gold check: when the items are generated (once per task object and process, never per
    step), every item's upstream answer is checked by
    `posttrain.verifiers.reasoning_gym_gold.gold_problem`: the task's own scorer must give it full
    credit and, for the tasks with a metadata check (`GOLD_CHECKS`: chain_sum, basic_arithmetic,
    countdown, ...), the answer recomputed from the metadata must equal it. Items that fail are
    dropped before anything else, from training and held-out items alike, and counted in
    `gold_train` / `gold_held_out` (and `repr(task)`, `task.stats()`). A task without a
    metadata check is checked by its scorer only, which its reports say ("scorer only";
    docs/reference/gold_checks.md lists the recomputed tasks). The held-out set is the first
    `held_out_size` distinct questions among the items that pass.

    Args:
        name: the reasoning-gym task name.
        size, seed: the training items.
        config: the task's options (e.g. `{"min_terms": 2}`); not `size` / `seed`.
        held_out_size, held_out_seed: the evaluation items; `held_out_seed` defaults to
            `seed + 1_000_000_000`, far from the training seeds `seed .. seed+size-1`.
        system_prompt: an optional system turn before each question (default builder only).
        extract: how the verifier finds the answer (see `ReasoningGymVerifier`); the verifier of
            the default builder and of `score_fn`.
        timeout_s: the verifier's time budget (positive seconds or None): the default builder's
            and `score_fn`'s.
        builder: `item -> EnvGroupBuilder`; None makes `ReasoningGymGroupBuilder`s. Must pickle
            when the task has to (e.g. `functools.partial(CalculatorGroupBuilder, max_turns=3)`).
            A custom builder makes its own prompts and sets its own time budget: give it those
            options (`system_prompt` with a custom builder is refused rather than ignored).

    Attributes (besides the arguments):
        verifier: the task's `ReasoningGymVerifier`.
        num_dropped: training items dropped because their question is held out (known once the
            items are generated).
        gold_train, gold_held_out: `GoldReport`s of the gold check of the training items and of
            the held-out candidates read (filled when the items are generated).
        num_bad_gold: items dropped by the gold check, training and held-out together.

    Held-out scan: at most `4 * held_out_size + 64` candidates are read, and the scan stops
    early once `found + 1000` candidates in a row brought no new question (the task has
    run out of distinct questions); `held_out_size` is at most `MAX_HELD_OUT_SIZE`.

    Raises:
        ValueError: for an unknown task name or option, bad sizes (`held_out_size` above
            `MAX_HELD_OUT_SIZE`), `size`/`seed` in `config`, a bad `timeout_s`, `system_prompt`
            with a custom builder; on first use, when the task has fewer than `held_out_size`
            distinct questions with a trusted gold answer, or no training item is left.
        TypeError: `builder` is not callable, `system_prompt` not a str or None.
    """

    name: str
    size: int
    seed: int = 0
    config: dict = field(default_factory=dict)
    held_out_size: int = 200
    held_out_seed: int | None = None
    system_prompt: str | None = None
    extract: Any = "whole"
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    builder: Callable[[dict], EnvGroupBuilder] | None = None

    def __post_init__(self) -> None:
        check_task_name(self.name)
        if not (isinstance(self.size, int) and self.size >= 1):
            raise ValueError(f"size must be an int >= 1, got {self.size!r}")
        if not (
            isinstance(self.held_out_size, int)
            and not isinstance(self.held_out_size, bool)
            and 0 <= self.held_out_size <= MAX_HELD_OUT_SIZE
        ):
            raise ValueError(
                f"held_out_size must be an int in 0 .. {MAX_HELD_OUT_SIZE}, got "
                f"{self.held_out_size!r}"
            )
        self._check_options()
        if {"size", "seed"} & set(self.config):
            raise ValueError("pass size and seed as ReasoningGymTask arguments, not in config")
        self.config = dict(self.config)
        if self.held_out_seed is None:
            self.held_out_seed = self.seed + 1_000_000_000
        self.verifier = ReasoningGymVerifier(self.name, extract=self.extract, **self.config)
        self._train: list[dict] | None = None
        self._held_out: list[dict] | None = None
        self.num_dropped = 0
        self.gold_train, self.gold_held_out = GoldReport(self.name), GoldReport(self.name)

    def _check_options(self) -> None:
        timeout = self.timeout_s
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout < float("inf")
        ):
            raise ValueError(
                f"timeout_s must be a positive number of seconds or None, got {timeout!r}"
            )
        if not (self.system_prompt is None or isinstance(self.system_prompt, str)):
            raise TypeError(
                f"system_prompt must be a str or None, got {type(self.system_prompt).__name__}"
            )
        if self.builder is not None:
            if not callable(self.builder):
                raise TypeError(
                    f"builder must be callable (item -> EnvGroupBuilder) or None, "
                    f"got {type(self.builder).__name__}"
                )
            if self.system_prompt is not None:
                raise ValueError(
                    "system_prompt is used only by the default builder; a custom "
                    "builder makes its own prompts: pass it to the builder"
                )

    # Items are regenerated rather than pickled.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_train"] = state["_held_out"] = None
        state["gold_train"], state["gold_held_out"] = GoldReport(self.name), GoldReport(self.name)
        return state

    def _dataset(self, size: int, seed: int):
        import reasoning_gym

        return reasoning_gym.create_dataset(self.name, size=size, seed=seed, **self.config)

    def _held_out_items(self) -> list[dict]:
        if self._held_out is None:
            want = self.held_out_size
            assert self.held_out_seed is not None  # __post_init__ derives it from seed
            dataset = self._dataset(4 * want + 64, self.held_out_seed)
            report = self.gold_held_out = GoldReport(self.name)
            items: list[dict] = []
            seen: set[Any] = set()
            stale = 0
            candidates = (dataset[index] for index in range(len(dataset)))
            for item in check_gold(self.name, dataset, candidates, report) if want else ():
                if item["question"] in seen:
                    stale += 1
                    if stale >= len(items) + 1000:  # out of distinct questions
                        break
                    continue
                stale = 0
                seen.add(item["question"])
                items.append(item)
                if len(items) == want:
                    break
            if len(items) < want:
                raise ValueError(
                    f"{self.name} gave only {len(items)} distinct questions with a "
                    f"trusted gold answer in {report.checked} of {len(dataset)} candidates "
                    f"read (gold check: {report}); lower held_out_size ({want})"
                )
            self._held_out = items
        return self._held_out

    @property
    def train_items(self) -> list[dict]:
        """The training items, in order (generated on first use)."""
        if self._train is None:
            held = {item["question"] for item in self._held_out_items()}
            dataset = self._dataset(self.size, self.seed)
            report = self.gold_train = GoldReport(self.name)
            items = list(
                check_gold(self.name, dataset, (dataset[i] for i in range(self.size)), report)
            )
            train = [item for item in items if item["question"] not in held]
            self.num_dropped = len(items) - len(train)
            if not train:
                example = f" (e.g. {report.examples[0]})" if report.examples else ""
                raise ValueError(
                    f"no training item of {self.name} is left: {self.num_dropped} "
                    f"held out, gold check {report}{example}; raise size or lower "
                    "held_out_size"
                )
            self._train = train
        return self._train

    @property
    def num_bad_gold(self) -> int:
        """Items dropped by the gold check so far, training and held-out together."""
        return self.gold_train.num_dropped + self.gold_held_out.num_dropped

    def stats(self) -> dict[str, Any]:
        """What building the items kept and dropped, for a run's log (generates the items):
        `train_items`, `held_out_items`, `dropped_held_out_questions` (training items whose
        question is held out) and the gold checks `gold_train` / `gold_held_out`
        (`GoldReport.as_dict()`: checked, dropped, ms_per_1000, ...)."""
        train = self.train_items
        return {
            "task": self.name,
            "train_items": len(train),
            "held_out_items": len(self._held_out_items()),
            "dropped_held_out_questions": self.num_dropped,
            "gold_train": self.gold_train.as_dict(),
            "gold_held_out": self.gold_held_out.as_dict(),
        }

    def __repr__(self) -> str:
        config = "".join(f", {k}={v!r}" for k, v in self.config.items())
        head = (
            f"ReasoningGymTask({self.name!r}, size={self.size}, seed={self.seed}{config}, "
            f"held_out_size={self.held_out_size})"
        )
        if self._train is None and self._held_out is None:
            return f"{head}: items not generated yet"
        parts = []
        if self._train is not None:
            parts.append(
                f"{len(self._train)} training items ({self.num_dropped} dropped as "
                f"held-out questions, gold check {self.gold_train})"
            )
        if self._held_out is not None:
            parts.append(f"{len(self._held_out)} held out (gold check {self.gold_held_out})")
        return f"{head}: " + "; ".join(parts)

    def __len__(self) -> int:
        """Number of training items (after dropping held-out questions)."""
        return len(self.train_items)

    def make_builder(self, item: dict) -> EnvGroupBuilder:
        """The group builder of one item: `builder(item)`, or a `ReasoningGymGroupBuilder` with
        the task's verifier, `system_prompt` and `timeout_s`."""
        if self.builder is not None:
            return self.builder(item)
        return ReasoningGymGroupBuilder(
            item,
            self.name,
            verifier=self.verifier,
            system_prompt=self.system_prompt,
            timeout_s=self.timeout_s,
        )

    def builders(self, batch_index: int, batch_size: int) -> list[EnvGroupBuilder]:
        """The builders of training batch `batch_index` (see the class docstring).

        Raises:
            ValueError: if `batch_index` < 0 or `batch_size` < 1.
        """
        return cycle_builders(self.train_items, batch_index, batch_size, self.make_builder)

    def held_out(self, n: int | None = None) -> list[dict]:
        """The first `n` held-out items (all `held_out_size` when None), as copies.

        Raises:
            ValueError: if `n` exceeds `held_out_size`.
        """
        n = self.held_out_size if n is None else n
        if not (isinstance(n, int) and 0 <= n <= self.held_out_size):
            raise ValueError(
                f"held_out(n) needs 0 <= n <= held_out_size={self.held_out_size}, got {n!r}"
            )
        return copy.deepcopy(self._held_out_items()[:n])

    def score_fn(self) -> Callable[[str, Mapping[str, Any]], float]:
        """`(completion, item) -> score` with this task's verifier, for
        `posttrain.rewards.evaluation.evaluate_generations`."""
        return as_score_fn(self.verifier, timeout_s=self.timeout_s)


register_task("reasoning_gym")(ReasoningGymTask)


CHAIN_SUM_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
"""2-term sums/differences of 1-2-digit numbers (~8k distinct questions)."""

_TASK_ARGS = frozenset(
    name for name in ReasoningGymTask.__dataclass_fields__ if name not in ("name", "config")
)


@register_task("chain_sum")
def chain_sum_task(**overrides: Any) -> ReasoningGymTask:
    """The chain_sum preset: `CHAIN_SUM_CONFIG`, size 10,000, seed 0, 200 held-out items.

    `overrides` are `ReasoningGymTask` arguments (`size=`, `seed=`, `builder=`, ...) or chain_sum
    options (`max_digits=3`, or `config={...}`), which update the preset.

    Example:
        >>> chain_sum_task(size=50, max_terms=3).config["max_terms"]
        3
    """
    config = dict(CHAIN_SUM_CONFIG)
    config.update(overrides.pop("config", {}))
    arguments: dict[str, Any] = {"size": 10_000, "seed": 0, "held_out_size": 200}
    for key, value in overrides.items():
        if key in _TASK_ARGS:
            arguments[key] = value
        else:
            config[key] = value
    return ReasoningGymTask(name="chain_sum", config=config, **arguments)
