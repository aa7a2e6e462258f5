"""Pairwise judges: which of two completions is better, with typed outcomes.

A pairwise judge (`PairwiseJudge`) compares `completions_a[i]` with `completions_b[i]` as answers
to `items[i]` and returns one `PairwiseResult` per pair: `LLMPairwiseJudge` asks "A or B?" in
both orders (position bias shows up as the typed outcome `inconsistent`),
`RewardModelPairwiseJudge` compares reward-model scores (P(A better) = sigmoid(r_A - r_B),
Bradley & Terry 1952). Pointwise judges, and the helpers both kinds share, are in
`posttrain.rewards.judges`.

    =============  ==================================================================
    outcome        for a pairwise judge
    =============  ==================================================================
    a / b          A (or B) is better, in both orders when both are judged
    tie            equal rewards within `tie_tol` (reward-model judges)
    inconsistent   the two orders disagree: position bias (LLM judges)
    error          the judge failed: a verdict holds no parsable "A" or "B", the parser
                   raised, too long, no question, the judge prompt fails
    =============  ==================================================================

As for pointwise judges, a verdict the judge did not give is the judge's failure (`error`), not
a judgement about either completion.

Thread safety: as `posttrain.rewards.judges.LLMJudge`, `LLMPairwiseJudge` holds a lock around
`Policy.generate`, so concurrent calls wait for each other.

Example (a reward model ranks two answers; P(A better) = sigmoid(r_A - r_B)):
    >>> from posttrain.rewards.reward_model import RewardModel
    >>> from posttrain.models import ByteTokenizer
    >>> judge = RewardModelPairwiseJudge(RewardModel.from_spec("tiny-1m", seed=0), ByteTokenizer())
    >>> [r] = judge.compare(["12"], ["13"], [{"question": "5 + 7 ="}])
    >>> r.outcome.value in ("a", "b", "tie"), 0.0 <= r.prob_a <= 1.0
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from posttrain.rewards.judge_parsing import parse_choice
from posttrain.rewards.judge_protocol import _check_lengths, _text_problem
from posttrain.rewards.judges import (
    RewardModelJudge,
    _check_real,
    _check_template,
    _Generator,
    _quote,
    _sigmoid,
)

__all__ = [
    "parse_choice",
    "DEFAULT_PAIRWISE_TEMPLATE",
    "DEFAULT_PAIRWISE_RUBRIC",
    "PairwiseOutcome",
    "PairwiseResult",
    "PairwiseJudge",
    "LLMPairwiseJudge",
    "RewardModelPairwiseJudge",
    "count_pairwise",
]

# --------------------------------------------------------------------------------------------
# Pairwise judges
# --------------------------------------------------------------------------------------------


class PairwiseOutcome(str, Enum):
    """What a pairwise comparison gave. Compares equal to its string value."""

    A = "a"  # A is better (in both orders, when both are judged)
    B = "b"  # B is better
    TIE = "tie"  # equal scores (reward-model judges)
    INCONSISTENT = "inconsistent"  # the two orders disagree: position bias
    ERROR = "error"  # the judge failed (no verdict, too long, no question, ...)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PairwiseResult:
    """One pairwise comparison.

    Attributes:
        outcome: a `PairwiseOutcome`.
        prob_a: P(A is better) in [0, 1]: 1.0 / 0.0 for an LLM verdict, sigmoid(r_A - r_B) for a
            reward model, 0.5 for a tie; None when there is no decision (inconsistent, error).
        reason: why, in words.
        raw: the judge's texts (A-first order, then B-first order) for LLM judges.
    """

    outcome: PairwiseOutcome
    prob_a: float | None
    reason: str = ""
    raw: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcome", PairwiseOutcome(self.outcome))
        decided = self.outcome in (PairwiseOutcome.A, PairwiseOutcome.B, PairwiseOutcome.TIE)
        if decided != (self.prob_a is not None):
            raise ValueError(
                f"PairwiseResult {self.outcome.value!r} needs prob_a "
                f"{'in [0, 1]' if decided else 'None'}, got {self.prob_a!r}"
            )
        if self.prob_a is not None and not 0.0 <= self.prob_a <= 1.0:
            raise ValueError(f"PairwiseResult prob_a={self.prob_a!r}; must be in [0, 1]")

    @property
    def winner(self) -> str | None:
        """ "A", "B", or None (tie or no decision)."""
        return {PairwiseOutcome.A: "A", PairwiseOutcome.B: "B"}.get(self.outcome)


@runtime_checkable
class PairwiseJudge(Protocol):
    """Compares `completions_a[i]` with `completions_b[i]` as answers to `items[i]`."""

    def compare(
        self,
        completions_a: Sequence[str],
        completions_b: Sequence[str],
        items: Sequence[Mapping[str, Any]],
    ) -> list[PairwiseResult]: ...


def count_pairwise(results: Sequence[PairwiseResult]) -> dict[str, int]:
    """How many results have each `PairwiseOutcome` (every value is a key, zeros included)."""
    counts = {o.value: 0 for o in PairwiseOutcome}
    for r in results:
        counts[PairwiseOutcome(r.outcome).value] += 1
    return counts


DEFAULT_PAIRWISE_TEMPLATE = (
    "{rubric}\n\nQuestion:\n{question}\n\n[Answer A]\n{completion_a}\n\n[Answer B]\n"
    "{completion_b}\n\nWhich answer is better, A or B? Reply 'Answer: A' or 'Answer: B'."
)
"""Placeholders: rubric, question, completion_a, completion_b, reference."""

DEFAULT_PAIRWISE_RUBRIC = "Judge which answer answers the question correctly and clearly."


class LLMPairwiseJudge:
    """LLM pairwise judge: "Which answer is better, A or B?", in both orders.

    LLM judges favour a position (Zheng et al. 2023, section 3.3, "position bias"; Wang et al.
    2023, "Large Language Models are not Fair Evaluators"). With `both_orders` (default) each
    pair is judged as (A, B) and as (B, A): the verdict counts only when both orders name the
    same completion; otherwise the outcome is `inconsistent`. Any unparsable verdict makes the
    pair `error`. One batched `generate` call covers all 2N prompts.

    Args:
        policy: the judge model (a `Policy`, or a rollout engine holding its weights, as in
            `LLMJudge`).
        rubric: the `{rubric}` placeholder.
        template: format string over rubric, question, completion_a, completion_b, reference;
            it must use {question}, {completion_a} and {completion_b}.
        parse: `text -> "A" | "B" | None` (default `parse_choice`); a raise is error, with
            the exception in the reason.
        both_orders: judge both orders (False: A-first only, no position-bias control).
        max_new_tokens, temperature, seed, batch_size, chat: as in `LLMJudge`.

    Example (a stub judge model that always names the first position):
        >>> from types import SimpleNamespace
        >>> from posttrain.policy import Completion
        >>> from posttrain.models import ByteTokenizer
        >>> def generate(prompts, **settings):
        ...     return [Completion(i, 0, p, [], "Answer: A", [], "eos")
        ...             for i, p in enumerate(prompts)]
        >>> stub = SimpleNamespace(generate=generate, tokenizer=ByteTokenizer(),
        ...                        spec=SimpleNamespace(max_seq_len=512))
        >>> [r] = LLMPairwiseJudge(stub).compare(["12"], ["13"], [{"question": "5+7="}])
        >>> r.outcome.value, r.prob_a, r.raw
        ('inconsistent', None, ('Answer: A', 'Answer: A'))
    """

    def __init__(
        self,
        policy,
        *,
        rubric: str = DEFAULT_PAIRWISE_RUBRIC,
        template: str = DEFAULT_PAIRWISE_TEMPLATE,
        parse: Callable[[str], str | None] = parse_choice,
        both_orders: bool = True,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        seed: int = 0,
        batch_size: int = 32,
        chat: bool = True,
    ) -> None:
        _check_template(
            template,
            {"rubric", "question", "completion_a", "completion_b", "reference"},
            required=("question", "completion_a", "completion_b"),
        )
        self.rubric, self.template, self.parse = rubric, template, parse
        self.both_orders = both_orders
        self._generate = _Generator(
            policy,
            chat=chat,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            batch_size=batch_size,
        )

    def _render(self, first: str, second: str, item: Mapping[str, Any]) -> str:
        return self.template.format(
            rubric=self.rubric,
            question=item["question"],
            completion_a=first,
            completion_b=second,
            reference=item.get("answer", ""),
        )

    def _verdict(self, text: str) -> tuple[str | None, str]:
        """("A" | "B", "") or (None, why not)."""
        try:
            choice = self.parse(text)
        except Exception as exc:  # noqa: BLE001 - a failing parser is the judge's failure
            return None, f"parse raised {type(exc).__name__}: {exc} on {_quote(text)}"
        if choice in ("A", "B"):
            return choice, ""
        return None, f"no A/B verdict in judge output {_quote(text)}"

    def compare(
        self,
        completions_a: Sequence[str],
        completions_b: Sequence[str],
        items: Sequence[Mapping[str, Any]],
    ) -> list[PairwiseResult]:
        """One `PairwiseResult` per pair. Raises ValueError if the lengths differ."""
        _check_lengths(completions_a, items)
        _check_lengths(completions_b, items)
        orders = 2 if self.both_orders else 1
        results: list[PairwiseResult | None] = [None] * len(items)
        prompts, where = [], []
        for i, (a, b, item) in enumerate(zip(completions_a, completions_b, items)):
            problem = _text_problem(a, item) or _text_problem(b, item)
            if problem is not None:
                results[i] = PairwiseResult(PairwiseOutcome.ERROR, None, problem)
                continue
            try:
                pair = [self._render(a, b, item)] + (
                    [self._render(b, a, item)] if orders == 2 else []
                )
            except (KeyError, TypeError) as exc:
                results[i] = PairwiseResult(
                    PairwiseOutcome.ERROR,
                    None,
                    f"cannot render the judge prompt: {type(exc).__name__}: {exc}",
                )
                continue
            prompts += pair
            where.append(i)
        generated = self._generate(prompts)
        for k, i in enumerate(where):
            texts = generated[k * orders : (k + 1) * orders]
            raw = tuple(t or "" for t, _ in texts)
            errors = [why for t, why in texts if t is None]
            if errors:
                results[i] = PairwiseResult(PairwiseOutcome.ERROR, None, errors[0], raw)
                continue
            # a verdict in the B-first order names the swapped positions
            verdicts, whys = zip(*(self._verdict(t or "") for t, _ in texts))  # no t is None
            if None in verdicts:
                results[i] = PairwiseResult(
                    PairwiseOutcome.ERROR, None, whys[verdicts.index(None)], raw
                )
                continue
            winners = [verdicts[0]] + ([{"A": "B", "B": "A"}[verdicts[1]]] if orders == 2 else [])
            if len(set(winners)) > 1:
                results[i] = PairwiseResult(
                    PairwiseOutcome.INCONSISTENT,
                    None,
                    f"A-first says {verdicts[0]}, B-first says "
                    f"{verdicts[1]} (same position both times)",
                    raw,
                )
            else:
                win = winners[0]
                results[i] = PairwiseResult(
                    PairwiseOutcome(win.lower()), 1.0 if win == "A" else 0.0, f"{win} better", raw
                )
        return results  # type: ignore[return-value]


class RewardModelPairwiseJudge:
    """Pairwise judge from a reward model: the completion with the higher reward wins.

    `prob_a = sigmoid(r_A - r_B)`, the Bradley-Terry probability that A is preferred (Bradley &
    Terry 1952; Ouyang et al. 2022, eq. 1). |r_A - r_B| <= `tie_tol` is a tie (the default
    absorbs float32 noise: the same sequence in another padded batch differs by ~1e-7). No
    position bias: each completion is scored on its own.

    Args:
        reward_model, tokenizer, batch_size: as in `RewardModelJudge`.
        tie_tol: reward difference treated as a tie (a finite number >= 0), in reward units.
    """

    def __init__(
        self, reward_model, tokenizer, *, tie_tol: float = 1e-5, batch_size: int = 32
    ) -> None:
        if not _check_real("tie_tol", tie_tol, "a finite number >= 0") >= 0:
            raise ValueError(f"tie_tol={tie_tol!r}; must be a finite number >= 0")
        self._scorer = RewardModelJudge(reward_model, tokenizer, batch_size=batch_size)
        self.tie_tol = tie_tol

    def compare(
        self,
        completions_a: Sequence[str],
        completions_b: Sequence[str],
        items: Sequence[Mapping[str, Any]],
    ) -> list[PairwiseResult]:
        """One `PairwiseResult` per pair. Raises ValueError if the lengths differ."""
        _check_lengths(completions_a, items)
        _check_lengths(completions_b, items)
        rewards = self._scorer.rewards(list(completions_a) + list(completions_b), list(items) * 2)
        n, results = len(items), []
        for r_a, r_b in zip(rewards[:n], rewards[n:]):
            if isinstance(r_a, str) or isinstance(r_b, str):
                why = r_a if isinstance(r_a, str) else str(r_b)
                results.append(PairwiseResult(PairwiseOutcome.ERROR, None, why))
                continue
            diff = r_a - r_b
            outcome = (
                PairwiseOutcome.TIE
                if abs(diff) <= self.tie_tol
                else PairwiseOutcome.A
                if diff > 0
                else PairwiseOutcome.B
            )
            prob = 0.5 if outcome is PairwiseOutcome.TIE else _sigmoid(diff)
            results.append(PairwiseResult(outcome, prob, f"r_A={r_a:.4g} r_B={r_b:.4g}"))
        return results
