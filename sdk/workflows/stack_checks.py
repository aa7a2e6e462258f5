"""Config checks that need the training stack, and how a command line defers them.

A recipe's `Config` validates itself when it is built (`config_paths.validate`). Most checks
read plain values (an int >= 1, one of some names); a few import torch, reasoning-gym or verl,
seconds of CPU each: a model preset's limits (`posttrain.models.specs`), a reasoning-gym task's
options (its config class), an RL algorithm preset, the adapters' and quantisation
converters' configs, a parallel plan against its model. `posttrain run` builds the config twice:
first inside `defer_stack_checks()`, where those checks are skipped, so a typo or a bad value
answers in a fraction of a second; then as usual, every check included, before the run starts.
A config that passes the first build and fails the second is refused with the message it always
had; a valid config is built and run exactly as without the first build.

A task name needs no stack: it is checked against `REASONING_GYM_TASKS`, reasoning-gym's
registry as installed (a test checks that the two are equal), or against the registry itself
where reasoning-gym is loaded already (a task registered by the caller then counts).

Example:
    >>> with defer_stack_checks():
    ...     stack_checks_deferred()
    True
    >>> stack_checks_deferred()
    False
    >>> with defer_stack_checks():
    ...     check_task_name("no_such_task")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown reasoning-gym task 'no_such_task'; valid names: ab, acre, ...
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator

__all__ = [
    "REASONING_GYM_TASKS",
    "defer_stack_checks",
    "stack_checks_deferred",
    "task_names",
    "check_task_name",
]

_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "posttrain_stack_checks_deferred", default=False
)


@contextlib.contextmanager
def defer_stack_checks() -> Iterator[None]:
    """Within the block, config checks that import torch, reasoning-gym or verl are skipped
    (`stack_checks_deferred()` is True): a config built here is checked in everything else.
    Build it again outside the block before using it."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def stack_checks_deferred() -> bool:
    """Whether the caller is inside `defer_stack_checks()`: a check that needs the training
    stack returns without checking then."""
    return _DEFERRED.get()


REASONING_GYM_TASKS: tuple[str, ...] = (
    "ab", "acre", "advanced_geometry", "aiw", "arc_1d", "arc_agi", "base_conversion",
    "basic_arithmetic", "bf", "binary_alternation", "binary_matrix", "bitwise_arithmetic",
    "boxnet", "caesar_cipher", "calendar_arithmetic", "chain_sum", "circuit_logic", "codeio",
    "coin_flip", "color_cube_rotation", "complex_arithmetic", "composite", "count_bits",
    "count_primes", "countdown", "course_schedule", "cryptarithm", "decimal_arithmetic",
    "decimal_chain_sum", "dice", "emoji_mystery", "family_relationships", "figlet_font",
    "fraction_simplification", "futoshiki", "game_of_life", "game_of_life_halting", "gcd",
    "graph_color", "group_anagrams", "gsm_symbolic", "intermediate_integration",
    "isomorphic_strings", "jugs", "kakurasu", "knight_swap", "knights_knaves", "largest_island",
    "lcm", "leg_counting", "letter_counting", "letter_jumble", "list_functions",
    "mahjong_puzzle", "manipulate_matrix", "maze", "mini_sudoku", "modulo_grid", "n_queens",
    "needle_haystack", "number_filtering", "number_format", "number_sequence", "number_sorting",
    "palindrome_generation", "palindrome_partitioning", "path_star", "polynomial_equations",
    "polynomial_multiplication", "pool_matrix", "power_function", "prime_factorization",
    "products", "propositional_logic", "puzzle24", "quantum_lock", "ransom_note", "rearc",
    "rectangle_count", "rotate_matrix", "rotten_oranges", "rubiks_cube", "rush_hour",
    "self_reference", "sentence_reordering", "shortest_path", "simple_equations",
    "simple_geometry", "simple_integration", "sokoban", "spell_backward", "spiral_matrix",
    "string_insertion", "string_manipulation", "string_splitting", "string_synthesis", "sudoku",
    "survo", "syllogism", "time_intervals", "tower_of_hanoi", "tsumego", "word_ladder",
    "word_sequence_reversal", "word_sorting", "zebra_puzzles",
)  # fmt: skip
"""The task names of the installed reasoning-gym's registry (`reasoning_gym.factory.DATASETS`),
sorted; tests/project/test_import_cost.py checks that they are equal."""


def task_names() -> list[str]:
    """The reasoning-gym task names, sorted: the registry's where reasoning-gym is loaded or the
    stack checks run (importing it), `REASONING_GYM_TASKS` inside `defer_stack_checks()`."""
    if "reasoning_gym.factory" not in sys.modules and stack_checks_deferred():
        return list(REASONING_GYM_TASKS)
    from posttrain.verifiers.reasoning_gym import reasoning_gym_names

    return reasoning_gym_names()


def check_task_name(name: str) -> None:
    """Raises ValueError, listing the valid names (`task_names`), when `name` is not a
    reasoning-gym task (the message of `posttrain.verifiers.reasoning_gym.check_task_name`)."""
    names = task_names()
    if name not in names:
        raise ValueError(f"unknown reasoning-gym task {name!r}; valid names: {', '.join(names)}")
