"""The gold checks one by one, on real reasoning-gym items: each accepts the real golds and
catches a corrupted one, upstream items whose question does not determine the gold are caught,
a failing scorer or metadata is a reason and not a crash, `exact_value` executes nothing; and
every registered check, and every task the project uses, is checked or named in
docs/reference/gold_checks.md."""

import ast
import doctest
import glob
import os
import re
from decimal import Decimal
from fractions import Fraction

import pytest
import reasoning_gym
from reasoning_gym.factory import DATASETS

from posttrain.verifiers import reasoning_gym_gold as gold
from posttrain.verifiers.reasoning_gym_gold import (
    GOLD_CHECKS,
    exact_value,
    gold_problem,
    register_gold_check,
)

# the corrupted chain_sum that test_gold_checks.py registers (with its check) when it runs too
BAD = "chain_sum_bad_gold_for_tests"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------------------------
# The checks one by one, on real items
# --------------------------------------------------------------------------------------------


def _plus_one(answer: str) -> str:
    return str(Fraction(answer) + 1)


# task -> (options, corruption of the gold, the check that catches it)
CORRUPTIONS = {
    "chain_sum": ({}, _plus_one, "metadata"),
    "decimal_chain_sum": ({}, lambda a: str(Decimal(a) + 1), "metadata"),
    "basic_arithmetic": ({}, _plus_one, "metadata"),
    "products": ({}, _plus_one, "metadata"),
    "simple_equations": ({}, _plus_one, "metadata"),
    "gcd": ({}, _plus_one, "metadata"),
    "lcm": ({}, _plus_one, "metadata"),
    "count_bits": ({}, _plus_one, "metadata"),
    "leg_counting": ({}, _plus_one, "metadata"),
    "letter_counting": ({}, _plus_one, "metadata"),
    "prime_factorization": ({}, lambda a: f"2 × {a}", "metadata"),
    "spell_backward": ({}, lambda a: a[::-1] + "x", "metadata"),
    "number_sorting": ({}, lambda a: str(ast.literal_eval(a)[1:]), "metadata"),  # still sorted
    "base_conversion": ({}, lambda a: a + "1", "metadata"),
    "countdown": ({"min_numbers": 3, "max_numbers": 3}, lambda a: a + " + 1", "scorer"),
    # seed 107: both answers and both item types, none of the items with a wrong gold
    "syllogism": ({"seed": 107}, lambda a: {"Yes": "No", "No": "Yes"}[a], "metadata"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_each_check_accepts_real_golds_and_catches_a_corrupted_one(name):
    options, corrupt, caught_by = CORRUPTIONS[name]
    dataset = reasoning_gym.create_dataset(name, **{"size": 5, "seed": 100, **options})
    for item in dataset:
        assert gold_problem(name, dataset, item) is None, item
        problem = gold_problem(name, dataset, {**item, "answer": corrupt(item["answer"])})
        assert problem is not None and problem.startswith(caught_by + ":"), problem


def test_every_registered_check_is_exercised_and_documented():
    builtin = {n for n in GOLD_CHECKS.names() if n != BAD and not n.startswith("doc_")}
    assert builtin == set(CORRUPTIONS)
    for name in builtin:
        assert name in gold.__doc__


def test_upstream_items_whose_question_does_not_determine_the_gold_are_caught():
    """Found by the checks on 2,000 items each, checked by hand: simple_equations item 13 of seed
    0 asks to solve '0 = 0' (any value does; the gold says 83); base_conversion item 1514 of
    seed 0 converts the value 0, whose question names no number and whose gold is empty."""
    equations = reasoning_gym.create_dataset("simple_equations", size=14, seed=0)
    item = equations[13]
    assert item["metadata"]["equation"] == "0 = 0" and item["answer"] == "83"
    assert gold_problem("simple_equations", equations, item) == (
        "metadata: every i solves '0 = 0': the gold '83' is arbitrary"
    )
    bases = reasoning_gym.create_dataset("base_conversion", size=1515, seed=0)
    item = bases[1514]
    assert item["answer"] == "" and item["metadata"]["decimal_value"] == 0
    assert gold_problem("base_conversion", bases, item) == (
        "scorer: gives its own gold 0.0, not 1.0"
    )


def test_countdown_metadata_that_contradicts_the_gold_is_caught_by_the_scorer():
    dataset = reasoning_gym.create_dataset(
        "countdown", size=1, seed=0, min_numbers=3, max_numbers=3
    )
    item = dataset[0]
    metadata = item["metadata"]
    moved = {**item, "metadata": {**metadata, "target": metadata["target"] + 1}}
    assert gold_problem("countdown", dataset, moved).startswith("scorer: gives its own gold 0.05")
    numbers = {**item, "metadata": {**metadata, "numbers": metadata["numbers"][:-1] + [1000]}}
    assert gold_problem("countdown", dataset, numbers).startswith("scorer:")


def test_failures_of_the_scorer_or_the_metadata_are_reasons_not_crashes():
    dataset = reasoning_gym.create_dataset("chain_sum", size=1, seed=0)
    item = dataset[0]
    no_metadata = {"question": item["question"], "answer": item["answer"], "metadata": {}}
    assert gold_problem("chain_sum", dataset, no_metadata) == (
        "metadata: the check raised KeyError: 'expression'"
    )
    countdown = reasoning_gym.create_dataset(
        "countdown", size=1, seed=0, min_numbers=3, max_numbers=3
    )
    assert gold_problem("countdown", countdown, {**countdown[0], "answer": "1 +"}).startswith(
        "scorer: gives its own gold 0.01"
    )

    class Raises:
        def score_answer(self, answer, entry):
            raise RuntimeError("broken scorer")

    assert gold_problem("chain_sum", Raises(), item) == (
        "scorer: raised RuntimeError: broken scorer"
    )


def test_exact_value_is_exact_and_executes_nothing():
    assert exact_value("1 / 3 + 1 / 6") == Fraction(1, 2)
    assert exact_value("-( 0.1 + 0.2 ) * 10") == -3
    assert exact_value("-7 / 2") == Fraction(-7, 2)  # not -4: true division
    for bad in (
        "__import__('os').system('true')",
        "2 ** 10",
        "x + 1",
        "1 / (2 - 2)",
        "3 +",
        "True + 1",
        "(" * 500 + "1" + ")" * 500,
    ):
        with pytest.raises(ValueError):
            exact_value(bad)


def test_registering_a_second_check_for_a_task_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        register_gold_check("chain_sum")(lambda item: None)


def test_doctests():
    result = doctest.testmod(gold, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


REGISTRY_COPIES = {"sdk/workflows/stack_checks.py"}
"""Files that name every task because they hold a copy of reasoning-gym's registry (the task
names a config check knows before reasoning-gym loads), not because they use the tasks."""


def _used_task_names() -> dict[str, set[str]]:
    """Reasoning-gym task names (whole words) in the presets, recipes, notebooks, docs, README,
    the environments and the workflows' defaults, with the files that name them."""
    folders = {
        "recipes/presets": ".yaml",
        "recipes": ".py",
        "notebooks": ".ipynb",
        "docs": ".md",
        "envs": ".py",
        "sdk/workflows": ".py",
    }
    files = [os.path.join(ROOT, "README.md")] + [
        path
        for folder, ext in folders.items()
        for path in sorted(glob.glob(os.path.join(ROOT, folder, "**", f"*{ext}"), recursive=True))
    ]
    used: dict[str, set[str]] = {}
    for path in files:
        if os.path.relpath(path, ROOT) in REGISTRY_COPIES:
            continue
        with open(path, encoding="utf-8") as f:
            words = set(re.findall(r"[A-Za-z0-9_]+", f.read()))
        for name in words & set(DATASETS):
            used.setdefault(name, set()).add(os.path.relpath(path, ROOT))
    return used


def _gold_checks_doc() -> str:
    with open(os.path.join(ROOT, "docs", "reference", "gold_checks.md"), encoding="utf-8") as f:
        return f.read()


def _documented_unchecked() -> set[str]:
    line = next(
        line for line in _gold_checks_doc().splitlines() if line.startswith("Named as unchecked:")
    )
    return set(re.findall(r"`([a-z0-9_]+)`", line))


def test_every_task_the_project_uses_is_recomputed_or_named_as_unchecked():
    used = _used_task_names()
    assert {"chain_sum", "spell_backward", "basic_arithmetic", "countdown"} <= set(used)
    unchecked = _documented_unchecked()
    assert unchecked and unchecked <= set(DATASETS)
    assert not unchecked & set(GOLD_CHECKS.names())
    missing = {
        name: sorted(paths)
        for name, paths in used.items()
        if name not in GOLD_CHECKS.names() and name not in unchecked
    }
    assert not missing, (
        f"reasoning-gym tasks used without a gold recomputation: {missing}; "
        "register one (register_gold_check) or name the task under 'Named as "
        "unchecked:' in docs/reference/gold_checks.md"
    )
    builtin = {n for n in GOLD_CHECKS.names() if n != BAD and not n.startswith("doc_")}
    undocumented = [n for n in builtin if not re.search(rf"\b{n}\b", _gold_checks_doc())]
    assert not undocumented, f"add {undocumented} to the table of docs/reference/gold_checks.md"
