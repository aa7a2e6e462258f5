"""Gold checks: is a reasoning-gym item's upstream answer right by its task's own rules?

A procedurally generated item `{question, answer, metadata}` carries its generator's answer (the
"gold"). Generators have bugs, so the gold is checked before an item is trained or evaluated on
(`posttrain.envs.ReasoningGymTask` does it when it generates its items):

1. scorer: the task's own `dataset.score_answer(answer=item["answer"], entry=item)` must give
   full credit (1.0). Catches golds that the task itself would mark wrong, e.g. base_conversion
   of the value 0, whose question and gold are both empty.
2. metadata: for the tasks in `GOLD_CHECKS`, the answer recomputed from the item's metadata (with
   the standard library or sympy, never the generator's code) must equal the gold:

       chain_sum, decimal_chain_sum, basic_arithmetic, products   the expression, evaluated
                                                                  exactly (true division)
       countdown            the gold uses exactly the numbers and evaluates exactly to target
       simple_equations     the gold solves the equation, and gold + 1 does not
       gcd, lcm, prime_factorization, count_bits, base_conversion, leg_counting,
       spell_backward, letter_counting, number_sorting            recomputed directly
       syllogism            whether the conclusion follows, decided over every model of
                            the premises (`reasoning_gym_gold_logic`)

   and, where the question should quote the metadata (the expression, the numbers, the word),
   it must.

Items that fail are dropped and counted in a `GoldReport`, never trained or evaluated on. A task
without a metadata check gets the scorer check only, which compares the gold with itself for most
tasks: its report says so (`recomputed` False; "scorer only" in its text), and
docs/reference/gold_checks.md lists the tasks that are recomputed. Measured on 2,000 items of each
task (seed 0, default options; chain_sum also with the 2-term 1-2-digit preset the recipes use):
basic_arithmetic 19 fail (its generator floor-divides: "-1 / -( -( -( -2 - 9 ) ) + -3 + -13 )" is
-1/27, the gold says -1), simple_equations 2 ("0 = 0": every value solves it), base_conversion 2
(the value 0: empty number, empty gold), syllogism 258 (its generator accepts an undistributed
middle term: "All ants are dolphins, some dolphins are not spiders" does not give "some ants are not
spiders", the gold says Yes); 0 of chain_sum (both), countdown, decimal_chain_sum, products, gcd,
lcm, prime_factorization, count_bits, leg_counting, spell_backward, letter_counting, number_sorting,
and of 16 tasks with the scorer check only (propositional_logic and graph_color have no gold:
`no_gold`). Cost on a 2-core machine, per 1000 items: chain_sum 8-13 ms, basic_arithmetic 15, the
others 1-55, countdown 340 (its scorer parses with sympy; generating the items takes 10 s).

Example:
    >>> from posttrain.verifiers.reasoning_gym import scoring_dataset
    >>> dataset = scoring_dataset("chain_sum", {})
    >>> items = [dataset[0], {**dataset[0], "answer": "-1"}]
    >>> report = GoldReport("chain_sum")
    >>> len(list(check_gold("chain_sum", dataset, items, report))), report.dropped
    (1, {'metadata': 1})
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from fractions import Fraction
from typing import Any

from posttrain.core.registry import Registry
from posttrain.verifiers.reasoning_gym_gold_logic import syllogism_check

__all__ = [
    "GOLD_CHECKS",
    "GoldReport",
    "check_gold",
    "exact_value",
    "gold_problem",
    "register_gold_check",
]

GoldCheck = Callable[..., str | None]
"""`check(item) -> None` when the item's gold agrees with its metadata, else a sentence saying
how it does not (called with the keyword `item=`)."""

GOLD_CHECKS: Registry[GoldCheck] = Registry("gold check")
"""The metadata checks by reasoning-gym task name (the tasks listed in the module docstring)."""

_MAX_EXAMPLES = 3


def register_gold_check(name: str) -> Callable[[GoldCheck], GoldCheck]:
    """Decorator registering the metadata check of reasoning-gym task `name`: a function
    `check(item) -> str | None` (None: consistent) that recomputes the answer from
    `item["metadata"]`. It may raise on malformed metadata: `gold_problem` reports that too.

    Example:
        >>> @register_gold_check("doc_palindrome")
        ... def palindrome(item):
        ...     word = item["metadata"]["word"]
        ...     return None if item["answer"] == word[::-1] else f"{word!r} reversed is not that"
        >>> GOLD_CHECKS.build("doc_palindrome", item={"answer": "ab", "metadata": {"word": "ba"}})

    Raises:
        ValueError: if `name` already has another check (see `posttrain.core.registry`).
    """
    return GOLD_CHECKS.register(name)


def gold_problem(name: str, dataset: Any, item: Mapping[str, Any]) -> str | None:
    """Why `item`'s gold answer cannot be trusted, or None when it can.

    Two checks, in order: the task's scorer must give its own gold full credit
    (`dataset.score_answer(answer=item["answer"], entry=item) == 1.0`), and, for the tasks in
    `GOLD_CHECKS`, the answer recomputed from the item's metadata must equal the gold. An item
    without a gold answer (`answer` None: the task scores against its metadata alone, e.g.
    propositional_logic) gets only the metadata check. A scorer or check that raises on the item
    makes it untrustworthy too (the reason names the exception).

    Args:
        name: the reasoning-gym task name (selects the metadata check).
        dataset: the reasoning-gym dataset that generated `item` (its `score_answer` is used).
        item: `{question, answer, metadata}`.

    Returns:
        None, or the reason as "scorer: ..." or "metadata: ..." (the check that failed first).

    Example:
        >>> from posttrain.verifiers.reasoning_gym import scoring_dataset
        >>> item = {"question": "State the final answer to the following arithmetic problem: "
        ...         "4 - 1 =", "answer": "3", "metadata": {"expression": "4 - 1"}}
        >>> dataset = scoring_dataset("chain_sum", {})
        >>> gold_problem("chain_sum", dataset, item) is None
        True
        >>> gold_problem("chain_sum", dataset, {**item, "answer": "4"})
        "metadata: '4 - 1' is 3, the gold says '4'"
    """
    entry = item if isinstance(item, dict) else dict(item)
    if entry.get("answer") is not None:
        try:
            score = dataset.score_answer(answer=entry["answer"], entry=entry)
        except Exception as exc:  # noqa: BLE001 - any scorer failure distrusts the item
            return f"scorer: raised {type(exc).__name__}: {exc}"
        if score != 1.0:  # also catches NaN and non-numbers
            return f"scorer: gives its own gold {score!r}, not 1.0"
    if name in GOLD_CHECKS.names():
        try:
            problem = GOLD_CHECKS.build(name, item=entry)
        except Exception as exc:  # noqa: BLE001 - malformed metadata distrusts the item
            return f"metadata: the check raised {type(exc).__name__}: {exc}"
        if problem is not None:
            return f"metadata: {problem}"
    return None


@dataclasses.dataclass
class GoldReport:
    """What checking the gold answers of one set of items found (filled by `check_gold`).

    Attributes:
        task: the reasoning-gym task name.
        checked: items checked (int).
        dropped: items whose gold failed, by the check that failed first: {"scorer": n,
            "metadata": m} (only the keys that occurred).
        no_gold: items kept without a gold answer (`answer` None; metadata check only).
        recomputed: whether the task has a metadata check that recomputes the answer (False:
            the scorer check only; None until `check_gold` has run).
        examples: the first three failures, as "item i (source index s): reason".
        seconds: wall-clock time spent checking, in seconds.
    """

    task: str
    checked: int = 0
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    no_gold: int = 0
    recomputed: bool | None = None
    examples: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def num_dropped(self) -> int:
        """Items dropped, over both checks."""
        return sum(self.dropped.values())

    @property
    def ms_per_1000(self) -> float:
        """Checking cost in milliseconds per 1000 items (0.0 before any item)."""
        return 1e6 * self.seconds / self.checked if self.checked else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain values for a log or results.json: checked, dropped (total), dropped_by,
        no_gold, recomputed, ms_per_1000, examples."""
        return {
            "checked": self.checked,
            "dropped": self.num_dropped,
            "dropped_by": dict(self.dropped),
            "no_gold": self.no_gold,
            "recomputed": self.recomputed,
            "ms_per_1000": round(self.ms_per_1000, 3),
            "examples": list(self.examples),
        }

    def __str__(self) -> str:
        parts = [f"{k} {v}" for k, v in sorted(self.dropped.items())]
        if self.recomputed is False:
            parts.append("scorer only: no recomputed answer")
        return f"{self.num_dropped} of {self.checked} dropped" + (
            f" ({', '.join(parts)})" if parts else ""
        )


def check_gold(
    name: str, dataset: Any, items: Iterable[Mapping[str, Any]], report: GoldReport | None = None
) -> Iterator[dict]:
    """Yields, in order, the items of `items` whose gold `gold_problem` accepts (as dicts),
    counting every item checked, the others by reason, and the time spent into `report` (a new
    one when None). Lazy: a caller that stops early has checked only what it read.

    Args:
        name: the reasoning-gym task name; dataset: the dataset that generated the items.
        items: task items; report: where the counts go.

    Example (the second item's gold contradicts its expression):
        >>> from posttrain.verifiers.reasoning_gym import scoring_dataset
        >>> dataset = scoring_dataset("chain_sum", {})
        >>> report = GoldReport("chain_sum")
        >>> kept = check_gold("chain_sum", dataset, [{**dataset[0], "answer": "-1"}, dataset[1]],
        ...                   report)
        >>> next(kept) == dataset[1], report.checked, str(report)
        (True, 2, '1 of 2 dropped (metadata 1)')
    """
    report = GoldReport(name) if report is None else report
    report.recomputed = name in GOLD_CHECKS.names()
    for index, item in enumerate(items):
        start = time.perf_counter()
        problem = gold_problem(name, dataset, item)
        report.seconds += time.perf_counter() - start
        report.checked += 1
        if problem is None:
            report.no_gold += item.get("answer") is None
            yield item if isinstance(item, dict) else dict(item)
            continue
        kind = problem.split(":", 1)[0]
        report.dropped[kind] = report.dropped.get(kind, 0) + 1
        if len(report.examples) < _MAX_EXAMPLES:
            source = (item.get("metadata") or {}).get("source_index", "?")
            report.examples.append(f"item {index} (source index {source}): {problem}"[:300])


# The checks. Each recomputes the answer from the metadata with the standard library (or sympy,
# which reasoning-gym depends on), never with the generator's own code.

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def exact_value(expression: str, names: Mapping[str, Fraction] | None = None) -> Fraction:
    """The exact rational value of an arithmetic expression, executing nothing.

    Allowed: integer and decimal literals (read from their text, so 0.1 is 1/10), binary
    + - * / (true division), unary + -, parentheses and the variables in `names`.

    Raises:
        ValueError: for anything else, or a division by zero; the message says what.

    Example:
        >>> exact_value("-7 / 2 + 0.25"), exact_value("3*h - 1", {"h": Fraction(2)})
        (Fraction(-13, 4), Fraction(5, 1))
    """
    names, expression = names or {}, expression.strip()

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.Constant) and type(node.value) is float:
            return Fraction(ast.get_source_segment(expression, node) or repr(node.value))
        if isinstance(node, ast.Name) and node.id in names:
            return Fraction(names[node.id])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError(f"division by zero in {expression!r}")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"{ast.dump(node)[:40]} is not allowed in an arithmetic expression")

    try:
        return value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {expression!r:.80}") from None


def _number(text: Any) -> Fraction:
    try:
        return Fraction(str(text).strip())
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"the gold {text!r:.60} is not a number") from None


def _expression_check(item: Mapping[str, Any]) -> str | None:
    expression = item["metadata"]["expression"]
    if expression not in item["question"]:
        return f"the question does not contain the expression {expression!r}"
    value = exact_value(expression)
    if value != _number(item["answer"]):
        return f"{expression!r:.80} is {value}, the gold says {item['answer']!r}"
    return None


for _name in ("chain_sum", "decimal_chain_sum", "basic_arithmetic", "products"):
    register_gold_check(_name)(_expression_check)


@register_gold_check("countdown")
def _countdown_check(item: Mapping[str, Any]) -> str | None:
    numbers, target = item["metadata"]["numbers"], item["metadata"]["target"]
    if f"{target}" not in item["question"] or ", ".join(map(str, numbers)) not in item["question"]:
        return f"the question does not state target {target} and numbers {numbers}"
    used = sorted(int(n) for n in re.findall(r"\d+", item["answer"]))
    if used != sorted(numbers):
        return f"the gold {item['answer']!r} uses {used}, not the numbers {sorted(numbers)}"
    value = exact_value(item["answer"])
    return None if value == target else f"the gold {item['answer']!r} is {value}, not {target}"


@register_gold_check("simple_equations")
def _simple_equations_check(item: Mapping[str, Any]) -> str | None:
    metadata = item["metadata"]
    equation, variable, value = metadata["equation"], metadata["variable"], _number(item["answer"])
    if equation not in item["question"]:
        return f"the question does not contain the equation {equation!r}"
    left, right = equation.split("=")

    def residual(x: Fraction) -> Fraction:
        return exact_value(left, {variable: x}) - exact_value(right, {variable: x})

    if residual(value) != 0:
        return f"{variable} = {item['answer']} does not solve {equation!r}"
    if residual(value + 1) == 0:  # the left side is linear in the variable (one term holds it)
        return f"every {variable} solves {equation!r}: the gold {item['answer']!r} is arbitrary"
    return None


@register_gold_check("gcd")
def _gcd_check(item: Mapping[str, Any]) -> str | None:
    value = math.gcd(*item["metadata"]["numbers"])
    return None if value == _number(item["answer"]) else f"gcd is {value}, not {item['answer']!r}"


@register_gold_check("lcm")
def _lcm_check(item: Mapping[str, Any]) -> str | None:
    value = math.lcm(*item["metadata"]["numbers"])
    return None if value == _number(item["answer"]) else f"lcm is {value}, not {item['answer']!r}"


@register_gold_check("prime_factorization")
def _prime_factorization_check(item: Mapping[str, Any]) -> str | None:
    from sympy import factorint

    number = item["metadata"]["number"]
    factors = sorted(int(f) for f in item["answer"].split("×"))
    expected = sorted(p for p, k in factorint(number).items() for _ in range(k))
    return None if factors == expected else f"{number} = {expected}, the gold says {factors}"


@register_gold_check("count_bits")
def _count_bits_check(item: Mapping[str, Any]) -> str | None:
    number = item["metadata"]["number"]
    value = bin(number).count("1")
    if f"{number}" not in item["question"]:
        return f"the question does not state {number}"
    return None if value == _number(item["answer"]) else f"{number} has {value} one bits"


@register_gold_check("spell_backward")
def _spell_backward_check(item: Mapping[str, Any]) -> str | None:
    word = item["metadata"]["word"]
    if not item["question"].rstrip().endswith(word):
        return f"the question does not end with the word {word!r}"
    return None if item["answer"] == word[::-1] else f"{word!r} backward is {word[::-1]!r}"


@register_gold_check("letter_counting")
def _letter_counting_check(item: Mapping[str, Any]) -> str | None:
    metadata = item["metadata"]
    letter, span = metadata["target_letter"], metadata["span"]
    if f'"{" ".join(span)}"' not in item["question"] or f'"{letter}"' not in item["question"]:
        return "the question does not state the letter and text of the metadata"
    value = sum(word.lower().count(letter.lower()) for word in span)
    return None if value == _number(item["answer"]) else f"{letter!r} occurs {value} times"


@register_gold_check("number_sorting")
def _number_sorting_check(item: Mapping[str, Any]) -> str | None:
    metadata = item["metadata"]
    if ", ".join(metadata["original_numbers"]) not in item["question"]:
        return "the question does not list the numbers of the metadata"
    numbers = [Fraction(n) for n in metadata["original_numbers"]]
    expected = sorted(numbers, reverse=metadata["direction"] == "descending")
    gold = [Fraction(n) for n in ast.literal_eval(item["answer"])]
    if gold != expected:
        return f"in {metadata['direction']} order: {[str(float(n)) for n in expected]}"
    return None


@register_gold_check("base_conversion")
def _base_conversion_check(item: Mapping[str, Any]) -> str | None:
    metadata = item["metadata"]
    value, source = metadata["decimal_value"], metadata["source_repr"]
    if f" number {source} to " not in item["question"]:
        return f"the question does not state the base-{metadata['source_base']} number {source!r}"
    if int(source, metadata["source_base"]) != value:
        return f"{source!r} in base {metadata['source_base']} is not {value}"
    if int(item["answer"], metadata["target_base"]) != value:
        return f"the gold {item['answer']!r} in base {metadata['target_base']} is not {value}"
    return None


@register_gold_check("leg_counting")
def _leg_counting_check(item: Mapping[str, Any]) -> str | None:
    from reasoning_gym.arithmetic.leg_counting import ANIMALS  # the task's legs table (data)

    value = sum(count * ANIMALS[animal] for animal, count in item["metadata"]["animals"].items())
    return None if value == _number(item["answer"]) else f"the animals have {value} legs"


register_gold_check("syllogism")(syllogism_check)
