"""Single-turn coding environments: write a function, its unit tests decide the reward.

A code item is a mapping with `question` (what the policy is asked), `test` (the test code),
and optionally `prompt` (code placed before the completion: a signature and docstring),
`entry_point` (the function `check` is called on, HumanEval style; None when the tests assert
at top level, MBPP style) and `task_id`. HumanEval items come from
`posttrain.verifiers.humaneval.humaneval_problems()`; MBPP-style rows convert with `mbpp_item`.

- `CodeEnv`: one episode: the question as the user turn; the first assistant turn is run
  against the tests in the sandbox (`CodeTestsVerifier`) and ends the episode with reward 1.0
  (all tests pass) or 0.0 and a typed outcome.
- `CodeGroupBuilder(item)`: the G environments of one item; pickles.
- `CodeTask(items=..., held_out_fraction=...)`: an `EnvDataset` with a deterministic split:
  an item is held out when it is among the `round(held_out_fraction * N)` items with the
  smallest SHA-256 of `f"{split_seed}:{task_id}"`, so the split depends only on the task ids
  and the seed, in any process and whatever the item order.
- registered tasks: `get_task("humaneval", held_out_fraction=0.2)` (the 164 HumanEval problems)
  and `get_task("code", items=[...])` (any code items).

Example (the split needs no sandbox; a stand-in verifier keeps it so):
    >>> from posttrain.envs.code_env import CodeTask, mbpp_item
    >>> rows = [{"task_id": i, "text": f"Write add{i}(x), x + {i}.",
    ...          "test_list": [f"assert add{i}(1) == {1 + i}"]} for i in range(10)]
    >>> task = CodeTask(items=[mbpp_item(r) for r in rows], held_out_fraction=0.3,
    ...                 verifier=lambda completion, item: 0.0)
    >>> len(task.train_items), len(task.held_out())
    (7, 3)
    >>> task.builders(0, 1)[0].make_envs(1)[0].initial_messages()[0]["content"].splitlines()[0]
    'Write add0(x), x + 0.'
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.envs.reasoning_gym_env import ReasoningGymEnv, cycle_builders
from posttrain.rewards.verifier import Verifier, as_score_fn
from posttrain.rl.environment import EnvGroupBuilder, Environment, register_task
from posttrain.verifiers.code_exec import CODE_LIMITS, CodeTestsVerifier

__all__ = [
    "CODE_TIMEOUT_S",
    "CodeEnv",
    "CodeGroupBuilder",
    "CodeTask",
    "humaneval_task",
    "mbpp_item",
    "split_held_out",
]

CODE_TIMEOUT_S = CODE_LIMITS.wall_s + 5.0
"""The `run_verifier` budget of one check, in seconds: the sandbox's wall-clock limit plus 5 s
for starting it (the sandbox stops the program itself; this budget only bounds a stuck check)."""


def mbpp_item(row: Mapping[str, Any]) -> dict:
    """A code item from an MBPP-style row (Austin et al. 2021, arXiv:2108.07732): `text` (the
    task), `test_list` (assert statements), optional `test_setup_code` and `task_id`.

    The question is the text followed by the first test as an example of the call, as in the
    MBPP paper's prompt; the tests assert at top level (no entry point).

    Raises:
        ValueError: if `text` is not a str or `test_list` is not a non-empty list of str.
    """
    text, tests = row.get("text"), row.get("test_list")
    if not isinstance(text, str):
        raise ValueError(f"an MBPP row needs a 'text' string, got {text!r:.60}")
    if not (isinstance(tests, (list, tuple)) and tests and all(isinstance(t, str) for t in tests)):
        raise ValueError(
            f"an MBPP row needs 'test_list', a non-empty list of assert strings, got {tests!r:.60}"
        )
    question = f"{text}\nYour code should pass this test:\n{tests[0]}"
    return {
        "task_id": row.get("task_id"),
        "question": question,
        "prompt": "",
        "test": "\n".join([row.get("test_setup_code") or "", *tests]).strip() + "\n",
        "entry_point": None,
        "answer": row.get("code", ""),
    }


class CodeEnv(ReasoningGymEnv):
    """One single-turn coding episode on one item: the first `step` runs the tests and ends it
    (a `ReasoningGymEnv` with the code check's budget and the item's `task_id` in
    `StepResult.info`).

    Args:
        item: a code item (module docstring).
        verifier: checks the completion against the item (a `CodeTestsVerifier`).
        system_prompt: an optional system turn before the question.
        timeout_s: the `run_verifier` budget of the check (`CODE_TIMEOUT_S` by default).
            `collect_groups(verifier_timeout_s=...)` replaces it: give at least the sandbox's
            wall-clock limit plus a few seconds, or slow programs end as "timeout" (excluded
            from training) while the sandbox still runs them to its own limit.
    """

    def __init__(
        self,
        item: Mapping[str, Any],
        verifier: Verifier,
        *,
        system_prompt: str | None = None,
        timeout_s: float | None = CODE_TIMEOUT_S,
    ):
        super().__init__(
            item,
            verifier,
            system_prompt=system_prompt,
            timeout_s=timeout_s,
            info={"task_id": item.get("task_id")},
        )


@dataclass(frozen=True)
class CodeGroupBuilder:
    """The coding environments of one item (one GRPO group). Pickles.

    Args:
        item: the code item.
        verifier: the checker; a fresh `CodeTestsVerifier()` when None (made when the builder
            is, so a machine without a sandbox fails here, with the reason).
        system_prompt, timeout_s: passed to each `CodeEnv`.
    """

    item: dict
    verifier: Verifier | None = None
    system_prompt: str | None = None
    timeout_s: float | None = CODE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.verifier is None:
            object.__setattr__(self, "verifier", CodeTestsVerifier())

    def make_envs(self, group_size: int) -> list[Environment]:
        if not (isinstance(group_size, int) and group_size >= 1):
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        verifier = self.verifier
        assert verifier is not None  # __post_init__ made one
        return [
            CodeEnv(self.item, verifier, system_prompt=self.system_prompt, timeout_s=self.timeout_s)
            for _ in range(group_size)
        ]


def split_held_out(task_ids: Sequence[Any], held_out_fraction: float, seed: int = 0) -> set[Any]:
    """The task ids held out: the `round(held_out_fraction * N)` ids with the smallest
    SHA-256 of `f"{seed}:{task_id}"` (deterministic in any process, independent of order).

    Raises:
        ValueError: if the fraction is outside [0, 1) or the ids are not unique.
    """
    if not (isinstance(held_out_fraction, (int, float)) and 0 <= held_out_fraction < 1):
        raise ValueError(f"held_out_fraction must be in [0, 1), got {held_out_fraction!r}")
    if len(set(task_ids)) != len(task_ids):
        raise ValueError("task ids must be unique to split items by id")
    ranked = sorted(task_ids, key=lambda t: hashlib.sha256(f"{seed}:{t}".encode()).hexdigest())
    return set(ranked[: round(held_out_fraction * len(task_ids))])


@dataclass(kw_only=True)
class CodeTask:
    """Code items as an `EnvDataset`: training builders per batch and held-out items.

    Training items keep their order in `items`; batch `b` of size `B` holds training items
    `b*B .. b*B+B-1` (modulo their number: later epochs repeat the order). An item without
    `task_id` is identified by its position in `items`.

    Args:
        items: the code items (copied).
        held_out_fraction: share of items held out for evaluation, in [0, 1).
        split_seed: changes which items are held out (`split_held_out`).
        verifier: the checker shared by every builder; a `CodeTestsVerifier()` when None.
        system_prompt, timeout_s: passed to each `CodeEnv`.

    Raises:
        ValueError: for no items, an item without a `question` or `test` string, duplicate
            task ids, a fraction outside [0, 1) or one that leaves no training item.
        SandboxUnavailable: (default verifier only) when no sandbox can be made here.
    """

    items: Sequence[Mapping[str, Any]]
    held_out_fraction: float = 0.2
    split_seed: int = 0
    verifier: Verifier | None = None
    system_prompt: str | None = None
    timeout_s: float | None = CODE_TIMEOUT_S
    train_items: list[dict] = field(init=False, repr=False)
    held_out_items: list[dict] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.items) == 0:
            raise ValueError("CodeTask needs at least one item")
        items = [dict(item) for item in self.items]
        for i, item in enumerate(items):
            for key in ("question", "test"):
                if not isinstance(item.get(key), str):
                    raise ValueError(f"code item {i} has no '{key}' string")
            if item.get("task_id") is None:
                item["task_id"] = i
        self.items = items
        held = split_held_out(
            [item["task_id"] for item in items], self.held_out_fraction, self.split_seed
        )
        self.train_items = [item for item in items if item["task_id"] not in held]
        self.held_out_items = [item for item in items if item["task_id"] in held]
        if not self.train_items:
            raise ValueError(
                f"held_out_fraction={self.held_out_fraction} leaves no training "
                f"item out of {len(items)}"
            )
        if self.verifier is None:
            self.verifier = CodeTestsVerifier()

    def __len__(self) -> int:
        """Number of training items."""
        return len(self.train_items)

    def make_builder(self, item: dict) -> EnvGroupBuilder:
        """The group builder of one item."""
        return CodeGroupBuilder(
            item, verifier=self.verifier, system_prompt=self.system_prompt, timeout_s=self.timeout_s
        )

    def builders(self, batch_index: int, batch_size: int) -> list[EnvGroupBuilder]:
        """The builders of training batch `batch_index` (see the class docstring).

        Raises:
            ValueError: if `batch_index` < 0 or `batch_size` < 1.
        """
        return cycle_builders(self.train_items, batch_index, batch_size, self.make_builder)

    def held_out(self, n: int | None = None) -> list[dict]:
        """The first `n` held-out items (all when None), as copies.

        Raises:
            ValueError: if `n` is more than the held-out items.
        """
        n = len(self.held_out_items) if n is None else n
        if not (isinstance(n, int) and 0 <= n <= len(self.held_out_items)):
            raise ValueError(
                f"held_out(n) needs 0 <= n <= {len(self.held_out_items)} held-out items, got {n!r}"
            )
        return copy.deepcopy(self.held_out_items[:n])

    def score_fn(self) -> Callable[[str, Mapping[str, Any]], float]:
        """`(completion, item) -> score` with this task's verifier, for
        `posttrain.rewards.evaluation.evaluate_generations`."""
        assert self.verifier is not None  # __post_init__ made one
        return as_score_fn(self.verifier, timeout_s=self.timeout_s)


register_task("code")(CodeTask)


@register_task("humaneval")
def humaneval_task(*, held_out_fraction: float = 0.2, **options: Any) -> CodeTask:
    """The 164 HumanEval problems as a `CodeTask` (`humaneval_problems()`; verifier
    `humaneval_verifier()` unless `verifier=` is given). `options` are `CodeTask` keywords.

    Raises:
        ValueError: for `items=` in options (this task's items are HumanEval's).
    """
    from posttrain.verifiers.humaneval import humaneval_problems, humaneval_verifier

    if "items" in options:
        raise ValueError(
            "humaneval_task has HumanEval's items; use get_task('code', items=...) for others"
        )
    if options.get("verifier") is None:
        options["verifier"] = humaneval_verifier()
    return CodeTask(items=humaneval_problems(), held_out_fraction=held_out_fraction, **options)
