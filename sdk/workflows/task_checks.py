"""The checks of a recipe config's task and lengths that need no data (`check_seq_len`,
`check_gym_task`), apart from `posttrain.workflows.task_data` (the data, which imports torch
and reasoning-gym) so that a config module imports them without the training stack; both are
importable from `task_data` too.

Example:
    >>> from types import SimpleNamespace
    >>> from posttrain.workflows.config import ModelConfig
    >>> check_seq_len(SimpleNamespace(model=ModelConfig(), max_seq_len=1), "Config")
    Traceback (most recent call last):
    ...
    ValueError: Config.max_seq_len=1; must be an integer >= 2
"""

from __future__ import annotations

from typing import Any

from posttrain.workflows.field_checks import fail, ints
from posttrain.workflows.stack_checks import stack_checks_deferred

__all__ = ["check_seq_len", "check_gym_task"]


def check_seq_len(cfg: Any, at: str) -> None:
    """The lengths of `cfg` fit `cfg.model` (its preset's or folder's limit L): `max_seq_len`,
    where the config has one, is an int in [2, L] (a row needs a prompt token and a trained
    one), and `max_new_tokens` of the `eval` and `sampling` sections, where present, is below L
    (a prompt takes a token at least). Whether the task's own prompts leave that room needs
    the data: `check_task_fits`, before a run writes anything. Inside `defer_stack_checks()`
    the model's limit is not looked up (a preset is a ModelSpec: torch)."""
    limit = None if stack_checks_deferred() else cfg.model.max_seq_len()
    if hasattr(cfg, "max_seq_len"):
        ints(cfg, at, ("max_seq_len",), minimum=2)
        if limit is not None and cfg.max_seq_len > limit:
            raise fail(
                f"{at}.max_seq_len",
                cfg.max_seq_len,
                f"at most {limit}, the longest sequence {at}.model holds",
            )
    for section in ("eval", "sampling"):
        new_tokens = getattr(getattr(cfg, section, None), "max_new_tokens", None)
        if limit is not None and new_tokens is not None and new_tokens >= limit:
            raise fail(
                f"{at}.{section}.max_new_tokens",
                new_tokens,
                f"below {limit}, the "
                f"longest sequence {at}.model holds (the prompt takes a token at least)",
            )


def check_gym_task(cfg: Any, at: str, *, min_eval_size: int = 1) -> None:
    """The recipe's task is a reasoning-gym task (not a data file) with at least
    `min_eval_size` held-out items, and `sft.demonstrations` (where the config has it) is at
    most `task.train_size`.

    Raises ValueError naming the dotted field under `at` and what is allowed."""
    if cfg.task.is_file:
        raise fail(f"{at}.task.name", cfg.task.name, "a reasoning-gym task (not a data file)")
    ints(cfg.task, f"{at}.task", ("eval_size",), minimum=min_eval_size)
    demonstrations = getattr(getattr(cfg, "sft", None), "demonstrations", None)
    if demonstrations is not None and demonstrations > cfg.task.train_size:
        raise fail(
            f"{at}.sft.demonstrations",
            demonstrations,
            f"at most task.train_size={cfg.task.train_size} (the warm start's items are "
            "the task's first ones), or None for all",
        )
