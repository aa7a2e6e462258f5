"""Gold checks of reasoning-gym's categorical-logic task (syllogism), decided from the premises.

A syllogism item asks whether a conclusion "logically follows" from two statements of the forms

    All X are Y     No X are Y     Some X are Y     Some X are not Y

and its gold is "Yes" or "No". The generator decides with a list of traditional rules and misses
one (the middle term must be distributed at least once), so it says "Yes" to the undistributed
middle in its first figure: "All ants are dolphins. Some dolphins are not spiders. Therefore some
ants are not spiders" (seed 0, item 11: ants can all be spiders). About 13% of the items
(258 of 2,000 at seed 0, default options) reward that wrong "Yes".

Here validity is decided by models instead of rules: a conclusion follows when it is true in
every model of the premises. A model says, for each of the 2^k - 1 non-empty combinations of
the k terms (the regions of a Venn diagram), whether something lies in it; every term names
something (the Aristotelian reading the task states, under which "All X are Y" gives "Some Y
are X"). Three terms: 2^7 = 128 models, each tried once per form of item (cached).

Example:
    >>> barbara = [parse_statement("All men are mortals"), parse_statement("All kings are men")]
    >>> follows(barbara, parse_statement("All kings are mortals"))
    True
    >>> follows([parse_statement("All ants are dolphins"),
    ...          parse_statement("Some dolphins are not spiders")],
    ...         parse_statement("Some ants are not spiders"))
    False
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_TERMS", "follows", "parse_statement", "syllogism_check"]

MAX_TERMS = 4
"""Most distinct terms `follows` decides over (4 terms: 2^15 models)."""

_STATEMENT = re.compile(r"(All|No|Some) (\S+) are (not )?(\S+)")

Statement = tuple[str, str, str]
"""(form, subject, predicate): form "A" (All), "E" (No), "I" (Some), "O" (Some ... are not)."""


def parse_statement(text: str) -> Statement:
    """The (form, subject, predicate) of a categorical statement, e.g. "Some cats are not
    birds" -> ("O", "cats", "birds"); terms are single words (as the task writes them).

    Raises:
        ValueError: if `text` is not "All|No|Some X are [not] Y", or "not" follows All/No.
    """
    match = _STATEMENT.fullmatch(text.strip().rstrip("?."))
    if match is None or (match[3] and match[1] != "Some"):
        raise ValueError(f"not a categorical statement (All|No|Some X are [not] Y): {text!r:.80}")
    form = {"All": "A", "No": "E", "Some": "I"}[match[1]] if not match[3] else "O"
    return form, match[2], match[4]


def follows(premises: Sequence[Statement], conclusion: Statement) -> bool:
    """Whether `conclusion` is true in every model of `premises` in which every term names
    something (see the module docstring).

    Raises:
        ValueError: for a form other than A/E/I/O, or more than `MAX_TERMS` distinct terms.
    """
    names: dict[str, int] = {}
    canonical = tuple(
        (form, names.setdefault(s, len(names)), names.setdefault(p, len(names)))
        for form, s, p in (*premises, conclusion)
    )
    if len(names) > MAX_TERMS:
        raise ValueError(f"{len(names)} terms: at most {MAX_TERMS} are decided")
    if any(form not in ("A", "E", "I", "O") for form, _, _ in canonical):
        raise ValueError(f"statement forms must be A, E, I or O: {canonical}")
    return _follows(canonical[:-1], canonical[-1], len(names))


def _holds(statement: tuple[str, int, int], model: tuple[frozenset[int], ...]) -> bool:
    form, s, p = statement
    if form == "A":
        return not any(s in region and p not in region for region in model)
    if form == "E":
        return not any(s in region and p in region for region in model)
    if form == "I":
        return any(s in region and p in region for region in model)
    return any(s in region and p not in region for region in model)


@functools.lru_cache(maxsize=4096)
def _follows(
    premises: tuple[tuple[str, int, int], ...], conclusion: tuple[str, int, int], num_terms: int
) -> bool:
    regions = [
        frozenset(c)
        for k in range(1, num_terms + 1)
        for c in itertools.combinations(range(num_terms), k)
    ]
    for occupied in itertools.product((False, True), repeat=len(regions)):
        model = tuple(region for region, full in zip(regions, occupied) if full)
        if not all(any(term in region for region in model) for term in range(num_terms)):
            continue  # a term that names nothing
        if all(_holds(premise, model) for premise in premises) and not _holds(conclusion, model):
            return False
    return True


def syllogism_check(item: Mapping[str, Any]) -> str | None:
    """Gold check of a reasoning-gym syllogism item: None when its "Yes"/"No" says whether
    `metadata["conclusion"]` follows from `metadata["premise1"]` and `["premise2"]`, which the
    question must state; else a sentence saying how the gold is wrong.

    Raises:
        KeyError / ValueError: malformed metadata (`gold_problem` reports it as a reason).
    """
    metadata = item["metadata"]
    texts = [metadata["premise1"], metadata["premise2"], metadata["conclusion"]]
    if any(text not in item["question"] for text in texts):
        return "the question does not state the premises and conclusion of the metadata"
    if item["answer"] not in ("Yes", "No"):
        return f"the gold {item['answer']!r:.40} is neither 'Yes' nor 'No'"
    *premises, conclusion = (parse_statement(text) for text in texts)
    valid = follows(premises, conclusion)
    if valid == (item["answer"] == "Yes"):
        return None
    if valid:
        return f"{texts[2]!r} follows from {texts[0]!r} and {texts[1]!r}; the gold says 'No'"
    return (
        f"{texts[2]!r} does not follow from {texts[0]!r} and {texts[1]!r} (a model of both "
        "premises falsifies it); the gold says 'Yes'"
    )
