"""The syllogism gold check: validity decided by models agrees with the textbook table of valid
forms, and the upstream items that reward an undistributed middle term are dropped.

The expected verdicts come from the traditional table (the 15 unconditionally valid moods and
the 9 valid when every term names something, by figure), written out by hand below, and from
the conversion rules for the task's single-premise items; never from the check itself.
"""

import itertools
import re

import pytest
import reasoning_gym

from posttrain.envs import ReasoningGymTask
from posttrain.verifiers.reasoning_gym_gold import gold_problem
from posttrain.verifiers.reasoning_gym_gold_logic import follows, parse_statement

# Figure 1: M-P, S-M; 2: P-M, S-M; 3: M-P, M-S; 4: P-M, M-S. Moods: major, minor, conclusion.
VALID_FORMS = {
    1: {"AAA", "EAE", "AII", "EIO", "AAI", "EAO"},  # Barbara Celarent Darii Ferio; Barbari Celaront
    2: {
        "EAE",
        "AEE",
        "EIO",
        "AOO",
        "EAO",
        "AEO",
    },  # Cesare Camestres Festino Baroco; Cesaro Camestros
    3: {
        "IAI",
        "AII",
        "OAO",
        "EIO",
        "AAI",
        "EAO",
    },  # Disamis Datisi Bocardo Ferison; Darapti Felapton
    4: {
        "AEE",
        "IAI",
        "EIO",
        "AEO",
        "AAI",
        "EAO",
    },  # Camenes Dimaris Fresison; Camenos Bramantip Fesapo
}
PREMISE_ORDER = {1: ("MP", "SM"), 2: ("PM", "SM"), 3: ("MP", "MS"), 4: ("PM", "MS")}
# Conversion of one statement: what follows about its terms swapped (every term names something).
CONVERSIONS = {"A": {"I"}, "E": {"E", "O"}, "I": {"I"}, "O": set()}
WORDS = {"A": ("All", ""), "E": ("No", ""), "I": ("Some", ""), "O": ("Some", "not ")}
_TEXT = re.compile(r"(All|No|Some) (\S+) are (not )?(\S+)")


NAMES = {"S": "cats", "M": "dogs", "P": "birds"}


def _statement(form, terms):
    return form, NAMES[terms[0]], NAMES[terms[1]]


def test_all_256_moods_and_figures_agree_with_the_textbook_table():
    valid = []
    for figure, (major, minor) in PREMISE_ORDER.items():
        for mood in map("".join, itertools.product("AEIO", repeat=3)):
            premises = [_statement(mood[0], major), _statement(mood[1], minor)]
            verdict = follows(premises, _statement(mood[2], "SP"))
            assert verdict == (mood in VALID_FORMS[figure]), (figure, mood)
            valid.append(verdict)
    assert sum(valid) == 24


def test_conversions_agree_with_the_textbook_rules():
    for premise, conclusion in itertools.product("AEIO", repeat=2):
        verdict = follows([(premise, "cats", "dogs")], (conclusion, "dogs", "cats"))
        assert verdict == (conclusion in CONVERSIONS[premise]), (premise, conclusion)


def _parse(text):
    quantifier, subject, negated, predicate = _TEXT.fullmatch(text).groups()
    form = "O" if negated else {"All": "A", "No": "E", "Some": "I"}[quantifier]
    return form, subject, predicate


def _textbook_verdict(item) -> bool:
    """Whether the item's conclusion follows, by the tables above."""
    metadata = item["metadata"]
    first, second = _parse(metadata["premise1"]), _parse(metadata["premise2"])
    conclusion = _parse(metadata["conclusion"])
    if metadata["type"] == "inversion":
        premise = (first, second)[metadata["selected_premise"] - 1]
        assert conclusion[1:] == (premise[2], premise[1])  # its terms, swapped
        return conclusion[0] in CONVERSIONS[premise[0]]
    subject, predicate = conclusion[1:]
    major, minor = (first, second) if predicate in first[1:] else (second, first)
    middle = (set(major[1:]) & set(minor[1:])).pop()
    shape = ("MP" if major[1] == middle else "PM", "SM" if minor[2] == middle else "MS")
    figure = {order: f for f, order in PREMISE_ORDER.items()}[shape]
    assert minor[1:] in ((subject, middle), (middle, subject))
    return major[0] + minor[0] + conclusion[0] in VALID_FORMS[figure]


def test_upstream_items_that_reward_an_undistributed_middle_are_caught():
    """Seed 0, items 11 and 32 (checked by hand): the middle term (dolphins, writers) is never
    distributed, so nothing links ants to spiders or parents to doctors; the gold says Yes."""
    dataset = reasoning_gym.create_dataset("syllogism", size=33, seed=0)
    item = dataset[11]
    assert (
        item["metadata"]["premise1"],
        item["metadata"]["premise2"],
        item["metadata"]["conclusion"],
        item["answer"],
    ) == (
        "All ants are dolphins",
        "Some dolphins are not spiders",
        "Some ants are not spiders",
        "Yes",
    )
    assert gold_problem("syllogism", dataset, item) == (
        "metadata: 'Some ants are not spiders' does not follow from 'All ants are dolphins' and "
        "'Some dolphins are not spiders' (a model of both premises falsifies it); the gold says "
        "'Yes'"
    )
    item = dataset[32]
    assert (
        item["metadata"]["premise1"],
        item["metadata"]["premise2"],
        item["metadata"]["conclusion"],
        item["answer"],
    ) == ("All parents are writers", "Some writers are doctors", "Some parents are doctors", "Yes")
    assert gold_problem("syllogism", dataset, item).startswith("metadata: 'Some parents are")


def test_a_syllogism_task_drops_exactly_the_items_the_textbook_rejects():
    items = list(reasoning_gym.create_dataset("syllogism", size=400, seed=0))
    wrong = [
        it["metadata"]["source_index"]
        for it in items
        if _textbook_verdict(it) != (it["answer"] == "Yes")
    ]
    assert {it["metadata"]["type"] for it in items} == {"syllogism", "inversion"}
    assert 11 in wrong and 32 in wrong and len(wrong) >= 20  # ~13% of the items
    assert all(items[i]["answer"] == "Yes" for i in wrong)
    task = ReasoningGymTask(name="syllogism", size=400, seed=0, held_out_size=0)
    kept = task.train_items
    assert task.gold_train.dropped == {"metadata": len(wrong)}
    assert task.gold_train.recomputed is True
    assert [it["metadata"]["source_index"] for it in kept] == [
        i for i in range(400) if i not in wrong
    ]


@pytest.mark.parametrize(
    "text",
    ["All cats are not dogs", "Most cats are dogs", "cats are dogs", "Some big cats are dogs", ""],
)
def test_a_statement_that_is_not_categorical_is_refused(text):
    with pytest.raises(ValueError, match="not a categorical statement"):
        parse_statement(text)


def test_malformed_items_are_reasons_not_crashes():
    dataset = reasoning_gym.create_dataset("syllogism", size=1, seed=0)
    item = dataset[0]
    assert gold_problem("syllogism", dataset, {**item, "metadata": {}}) == (
        "metadata: the check raised KeyError: 'premise1'"
    )
    other = {**item, "metadata": {**item["metadata"], "premise1": "All owls are bats"}}
    assert gold_problem("syllogism", dataset, other) == (
        "metadata: the question does not state the premises and conclusion of the metadata"
    )
    with pytest.raises(ValueError, match="at most 4"):
        follows([("A", "a", "b"), ("A", "c", "d")], ("A", "e", "a"))
