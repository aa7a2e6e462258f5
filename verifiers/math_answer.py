"""Math final-answer verifier on Math-Verify: locate the answer, let math-verify parse and compare.

Parsing (LaTeX and plain expressions to SymPy) and equivalence (numbers, fractions, sets,
intervals, matrices, equations, percentages, units) are math-verify's
(https://github.com/huggingface/Math-Verify, `math_verify.parse` / `math_verify.verify`). This
module decides where the answer is taken from and types the result; verifiers/math_verify_calls.py
makes the calls (math-verify loaded with its fixes, extraction configs by name, its timeout typed).

Where the answer is taken from (`extract=`, one name or several tried in order; the first that
locates an answer decides, and what it finds is the answer even if it does not parse):

    ==========  =================================================================================
    source      the answer is
    ==========  =================================================================================
    boxed       the content of the last `\\boxed{...}` / `\\fbox{...}` whose braces close, with
                the boxes just before it that only connectors separate (`\\boxed{1}, \\boxed{2}
                and \\boxed{3}` is the answer 1, 2, 3)
    marker      the text after the last "answer is", "answer:", "answer =" or "####"
                (case-insensitive), up to the end of its sentence or line
    whole       the whole completion, when it is only an answer: one math span (`$...$`,
                `$$...$$`, `\\(...\\)`, `\\[...\\]`), a plain number, or bare text with no word of
                3+ letters outside LaTeX commands (e.g. the content of an <answer> tag)
    anywhere    math-verify's own search of the whole completion, in its priority order
                ("final answer is", `\\boxed{}`, "answer:", then the last LaTeX span or the last
                number that stands alone). It includes that last-number fallback, so it is
                not a default; it is what Math-Verify's published tests use.
    ==========  =================================================================================

Default `DEFAULT_EXTRACT = ("boxed", "marker", "whole")`: no "last number of anything" fallback,
so "AZYUK2A" holds no answer (format_error) and `\\frac{1+\\sqrt{5}}{2}` is one value, not 2.

Reading: a boxed answer is parsed as `\\boxed{...}` (math-verify's boxed handling); the whole
text, and a marker's text that is only an answer, are read like the reference; other marker
text ("42 apples") goes to math-verify's answer-anchored patterns. The reference
`item[answer_key]` is read as it is when it holds math delimiters (`$`, `\\(`, `\\[`, `\\boxed`:
e.g. a worked solution), as plain text when it is a number (`1 000`, `1,000.99`, `1000,99`,
`3/4`, `28%`: math-verify's number syntax, where a comma before one or two digits is a decimal
comma), and as LaTeX (wrapped in `$...$`) otherwise (`\\sqrt{2}`, `2x+1`, `12:00`). A number as
reference (by the `numbers` ABCs: int, Fraction, Decimal, numpy scalars) is written without an
exponent (1e-05 is `0.00001`; `np.float32(0.1)` is `0.1`, its shortest form); U+2212 is a minus.

Equivalence is math-verify's (symbolic; a percentage equal to its number and to its fraction:
`50\\%` equals 50 and 0.5) with two of its rules replaced (verifiers/math_rules.py): numbers
compare exactly where both sides are exact (1/2^99 != 1/2^98, 100! != 100! + 1) and, where one is
a float, at `float_rounding` significant digits and no fewer decimals (0.333333 equals 1/3 at 6,
0.3333 does not, 1e-7 does not equal 2e-7); with `strict=True` variables keep their case (X != x).

One answer (verifiers/math_statements.py): a completion that states more than one is a
format_error whatever the extraction order: an alternative in or beside a stated answer
(`3 (or 4)`, `$3$ or $4$`, `\\boxed{3} or \\boxed{4}`), a relation math-verify does not compare
(`x \\approx 3`, `3 \\to 4`; =, <, \\le, \\neq, \\in and the like are answers), or two
statements (box runs, the last marker) whose values differ (`\\boxed{3} ... \\boxed{4}`).
Where the reference itself reads so (`x = 1 or x = 2`), the first two rules do not apply: the
answer is compared with it as written.

Outcomes: ok (1.0) equivalent; wrong (0.0) not; format_error (0.0) no answer where `extract`
looks, more than one answer stated, an answer math-verify reads nothing from, or one over
`max_answer_chars`; error the reference cannot be used (a data problem, never charged to the
policy: ValueError for a missing value, a returned result when math-verify reads nothing from
it), the completion is not a str (TypeError: None is the caller's data, not the policy's answer)
or math-verify itself raised; timeout math-verify's own timeout fired.

Timeouts: math-verify bounds each parse and each comparison with `signal.alarm`, which works only
in a process's main thread. There this verifier uses it (`math_verify_timeout_s`, whole seconds)
and reports outcome timeout; on any other thread it is switched off and the caller's budget
(`run_verifier`'s `timeout_s`) bounds the call. The alarm cancels any SIGALRM timer the main
thread had set. The extraction done here (boxed, marker, whole) is linear in the completion's
length and a located answer is at most `max_answer_chars` long; "anywhere" runs math-verify's
regular expressions on the whole text (1.4 s for 30,000 unclosed `\\boxed{`).

Example:
    >>> from posttrain.verifiers.math_answer import MathAnswerVerifier, extract_answer
    >>> verify = MathAnswerVerifier()
    >>> verify("so x = \\\\boxed{\\\\dfrac{3}{4}}", {"answer": "0.75"}).outcome
    <Outcome.OK: 'ok'>
    >>> verify("The answer is 0.3333.", {"answer": "1/3"}).outcome
    <Outcome.WRONG: 'wrong'>
    >>> verify("The answer is 3 (or 4).", {"answer": "4"}).outcome
    <Outcome.FORMAT_ERROR: 'format_error'>
    >>> verify("I do not know", {"answer": "7"}).outcome, verify("AZYUK2A", {"answer": 2}).outcome
    (<Outcome.FORMAT_ERROR: 'format_error'>, <Outcome.FORMAT_ERROR: 'format_error'>)
    >>> verify("$[0,1)$", {"answer": "$[0,1)$"}).ok, verify("1 000", {"answer": 1000}).ok
    (True, True)
    >>> extract_answer("First \\\\boxed{1}, finally \\\\boxed{\\\\frac{1}{2}}.")
    ('\\\\frac{1}{2}', 'boxed')
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np

from posttrain.rewards.verifier import Outcome, VerifierResult, register_verifier
from posttrain.verifiers.math_statements import (
    DEFAULT_EXTRACT,
    Statement,
    as_math_text,
    check_extract,
    extract_answer,
    hedge,
    hedged,
    only_an_answer,
    positional,
    statements,
)
from posttrain.verifiers.math_verify_calls import (
    MAX_MATH_VERIFY_TIMEOUT_S,
    TARGETS,
    MathVerifyTimeout,
    extraction_configs,
    load_math_verify,
    parse,
    parse_reference,
    verify_pair,
)

MAX_STATEMENTS = 8
"""A completion with this many statements (box runs, last marker; distinct texts) besides the
answer read is a format_error without comparing them (each costs a math-verify parse)."""


def _check_int(name: str, value: Any, low: int, high: int, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _shown(parsed: Sequence) -> str:
    strings = [p for p in parsed if isinstance(p, str)]
    return strings[-1] if strings else str(parsed[0])


@register_verifier("math_answer")
class MathAnswerVerifier:
    """Checks a math completion's final answer against `item[answer_key]` with math-verify.

    Args:
        answer_key: the item field holding the reference answer (a str or a number, numpy too).
        extract: where the answer is taken from: a name or names from `EXTRACT_SOURCES`,
            tried in order (default `DEFAULT_EXTRACT` = boxed, then marker, then whole; see the
            module docstring).
        targets: math-verify extraction configs: names from `TARGETS` or
            `math_verify.LatexExtractionConfig` / `ExprExtractionConfig` objects.
        float_rounding: where a float takes part, the significant digits (of the larger side)
            and the least number of decimals both sides must agree to (default 6; module
            docstring, verifiers/math_rules.py); exact numbers compare exactly.
        strict: math-verify's `strict`: variable names matter, in their case (X != x), and sets
            differ from tuples; False lowercases symbols and matches variables by position.
        allow_set_relation_comp: compare a relation with a set (`1 < x < 2` with `(1, 2)`) even
            when the reference is the set (math-verify's option).
        max_answer_chars: a located answer (boxed, marker, whole) longer than this is a
            format_error, so that math-verify's work on it stays bounded (2,000 characters parse
            in well under 1 s here); "anywhere" hands math-verify the whole completion.
        math_verify_timeout_s: math-verify's own timeout for each parse and each comparison, in
            whole seconds (it uses `signal.alarm`; main thread only, see the module docstring);
            None disables it.

    Returns (per call): a VerifierResult: ok, wrong, format_error, error or timeout (module
    docstring); the reason says what was compared and where the answer came from.

    Raises:
        ValueError: at construction, for an unknown or missing (None) extract source or target,
            a bad `float_rounding` or `max_answer_chars`, a `math_verify_timeout_s` outside 1 ..
            `MAX_MATH_VERIFY_TIMEOUT_S`, a `strict` / `allow_set_relation_comp` not a bool; per
            call, for a reference that is None, NaN/inf, empty or not a string or number.
        TypeError: per call, for a non-str completion (None): the caller's data, not the policy's
            format_error. Through `run_verifier` these are outcome error (RL excludes them).
        KeyError: per call, if the item has no `answer_key` (outcome error through `run_verifier`).
    """

    def __init__(
        self,
        *,
        answer_key: str = "answer",
        extract: str | Sequence[str] = DEFAULT_EXTRACT,
        targets: Sequence[Any] = TARGETS,
        float_rounding: int = 6,
        strict: bool = True,
        allow_set_relation_comp: bool = False,
        max_answer_chars: int = 2000,
        math_verify_timeout_s: int | None = 2,
    ) -> None:
        self.answer_key = answer_key
        self.extract = check_extract(extract)
        self.targets = extraction_configs(targets)
        _check_int("float_rounding", float_rounding, 0, 10**6, "an int from 0 to 10**6 (decimals)")
        _check_int("max_answer_chars", max_answer_chars, 1, 10**9, "an int from 1 to 10**9")
        if math_verify_timeout_s is not None:
            _check_int(
                "math_verify_timeout_s",
                math_verify_timeout_s,
                1,
                MAX_MATH_VERIFY_TIMEOUT_S,
                f"None or an int from 1 to {MAX_MATH_VERIFY_TIMEOUT_S} (s, signal.alarm)",
            )
        if not (isinstance(strict, bool) and isinstance(allow_set_relation_comp, bool)):
            raise ValueError(
                f"strict and allow_set_relation_comp must be True or False, got "
                f"{strict!r} and {allow_set_relation_comp!r}"
            )
        self.float_rounding, self.max_answer_chars = float_rounding, max_answer_chars
        self.strict, self.allow_set_relation_comp = strict, allow_set_relation_comp
        self.math_verify_timeout_s = math_verify_timeout_s

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        load_math_verify()  # import where it is unpickled, not inside the first call's budget

    def __call__(self, completion: str, item: Mapping[str, Any]) -> VerifierResult:
        reference = _reference_text(item[self.answer_key], self.answer_key).replace("\u2212", "-")
        try:
            gold = parse_reference(reference, self.targets, self.math_verify_timeout_s, self.strict)
        except MathVerifyTimeout as exc:
            return VerifierResult.failure(Outcome.TIMEOUT, f"reference: {exc}")
        except Exception as exc:  # noqa: BLE001 - math-verify's parser failed: the checker's fault
            return VerifierResult.failure(
                Outcome.ERROR,
                f"math-verify raised parsing the reference {reference!r:.60}: {type(exc).__name__}",
            )
        if not gold:
            return VerifierResult.failure(
                Outcome.ERROR,
                f"math-verify reads no answer from the reference "
                f"item[{self.answer_key!r}] = {reference!r:.60}",
            )
        text = completion.replace("\u2212", "-") if isinstance(completion, str) else completion
        found = extract_answer(text, self.extract)  # TypeError when not a str
        if found is None or not found[0]:
            where = found[1] if found else " / ".join(self.extract)
            return VerifierResult.failure(Outcome.FORMAT_ERROR, f"no answer found ({where})")
        answer, source = found
        if source != "anywhere" and len(answer) > self.max_answer_chars:
            return VerifierResult.failure(
                Outcome.FORMAT_ERROR,
                f"the answer ({source}) is "
                f"{len(answer)} characters long, over max_answer_chars="
                f"{self.max_answer_chars}",
            )
        stated = statements(text)
        # A reference that itself reads as several answers or a relation ("x = 1 or x = 2",
        # "x \\approx 3") is the question's own form: math-verify compares it as written.
        one_answer = hedge(reference) is None
        reason = hedged(stated, text, answer, source) if one_answer else None
        if reason:
            return VerifierResult.failure(Outcome.FORMAT_ERROR, f"not one answer: {reason}")
        try:
            pred = self._parse_answer(answer, source)
        except MathVerifyTimeout as exc:
            return VerifierResult.failure(Outcome.TIMEOUT, f"completion: {exc}")
        except Exception as exc:  # noqa: BLE001
            return VerifierResult.failure(
                Outcome.ERROR,
                f"math-verify raised parsing the completion ({source}): {type(exc).__name__}",
            )
        if not pred:
            return VerifierResult.failure(
                Outcome.FORMAT_ERROR, f"math-verify reads no answer from {answer!r:.60} ({source})"
            )
        reasons = [
            hedge(p) for p in pred if one_answer and source == "anywhere" and isinstance(p, str)
        ]
        if any(reasons):  # what math-verify's own search found
            return VerifierResult.failure(
                Outcome.FORMAT_ERROR, f"not one answer: {next(filter(None, reasons))} (anywhere)"
            )
        return self._one_value(stated, answer, source, pred) or self._compare(gold, pred, source)

    def _parse_answer(self, answer: str, source: str) -> list:
        return parse(
            self._math_text(answer, source),
            self._configs(answer, source),
            self.math_verify_timeout_s,
            self.strict,
        )

    def _one_value(
        self, stated: Sequence[Statement], answer: str, source: str, pred: Sequence
    ) -> VerifierResult | None:
        """None when every other statement of the completion (`stated`: box runs, last marker)
        has the value of the answer read (`pred`); else format_error (two different final
        answers) or timeout. Statements math-verify reads nothing from are not counted."""
        others = list(
            dict.fromkeys(
                (s.text, s.source) for s in stated if s.text != answer or source == "anywhere"
            )
        )
        if len(others) >= MAX_STATEMENTS:
            return VerifierResult.failure(
                Outcome.FORMAT_ERROR,
                f"not one answer: {len(others)} "
                f"statements (boxes, marker) besides the answer read, "
                f"over MAX_STATEMENTS={MAX_STATEMENTS}",
            )
        for other, where in others:
            try:
                parsed = self._parse_answer(other, where)
            except MathVerifyTimeout as exc:
                return VerifierResult.failure(Outcome.TIMEOUT, f"completion: {exc}")
            except Exception:  # noqa: BLE001 - unreadable: not counted as a statement
                continue
            if not parsed:
                continue
            same = self._compare(parsed, pred, source)
            if same.outcome is Outcome.TIMEOUT:
                return same
            if not same.ok:
                return VerifierResult.failure(
                    Outcome.FORMAT_ERROR,
                    f"not one answer: {_shown(pred)!r:.40} ({source}) and "
                    f"{other!r:.40} ({where}) differ",
                )
        return None

    def _math_text(self, answer: str, source: str) -> str:
        if source == "boxed":
            return f"\\boxed{{{positional(answer)}}}"
        if source == "anywhere":
            return answer
        if source == "marker" and not only_an_answer(answer):
            return f"answer: {answer}"  # "42 apples": math-verify's answer-anchored patterns
        return as_math_text(answer)

    def _configs(self, answer: str, source: str) -> tuple:
        if source == "marker" and not only_an_answer(answer):
            return tuple(
                dataclasses.replace(c, try_extract_without_anchor=False) for c in self.targets
            )
        return self.targets

    def _compare(self, gold: Sequence, pred: Sequence, source: str) -> VerifierResult:
        """math_verify.verify on every (reference, answer) pair, as verify itself does, one
        pair at a time so that a timeout and an error are told apart from "not equal"."""
        timed_out, failures, compared = False, [], 0
        for g in gold:
            for p in pred:
                try:
                    equal = verify_pair(
                        g,
                        p,
                        float_rounding=self.float_rounding,
                        strict=self.strict,
                        allow_set_relation_comp=self.allow_set_relation_comp,
                        timeout_s=self.math_verify_timeout_s,
                    )
                except MathVerifyTimeout:
                    timed_out = True
                    continue
                except Exception as exc:  # noqa: BLE001 - one pair failed; others may compare
                    failures.append(type(exc).__name__)
                    continue
                compared += 1
                if equal:
                    return VerifierResult(
                        1.0,
                        Outcome.OK,
                        f"{_shown(pred)!r:.60} == {_shown(gold)!r:.60} (from {source})",
                    )
        if timed_out:
            return VerifierResult.failure(
                Outcome.TIMEOUT,
                f"math-verify comparison ran past {self.math_verify_timeout_s} s (from {source})",
            )
        if not compared:
            return VerifierResult.failure(
                Outcome.ERROR, f"math-verify raised comparing: {', '.join(sorted(set(failures)))}"
            )
        return VerifierResult(
            0.0,
            Outcome.WRONG,
            f"expected {_shown(gold)!r:.60}, got {_shown(pred)!r:.60} (from {source})",
        )

    def __repr__(self) -> str:
        return (
            f"MathAnswerVerifier(answer_key={self.answer_key!r}, extract={self.extract!r}, "
            f"float_rounding={self.float_rounding}, strict={self.strict})"
        )


def _reference_text(reference: Any, key: str) -> str:
    """The reference answer as text; ValueError (outcome error through `run_verifier`, a data
    error never charged to the policy) for None, a bool, NaN/inf, an empty string, or neither a
    str nor a number. Numbers go by the `numbers` ABCs (numpy scalars from pandas / HF datasets
    too): an Integral is its integer, a Rational its fraction, a Decimal its digits, another Real
    the shortest text of its own type's value (`np.float32(0.1)` is "0.1"), with no exponent."""
    if isinstance(reference, str) and reference.strip():
        return str(reference).strip()
    if isinstance(reference, str) or isinstance(reference, Decimal) and not reference.is_finite():
        raise ValueError(f"item[{key!r}] is {reference!r}, not a usable reference answer")
    if isinstance(reference, Decimal):
        return format(reference, "f")
    if (
        isinstance(reference, bool)
        or type(reference).__name__ == "bool_"
        or not isinstance(reference, numbers.Real)
    ):
        raise ValueError(
            f"item[{key!r}] must be a string or a real number (int, float, "
            f"Fraction, Decimal, numpy scalar), got {type(reference).__name__}: "
            f"{reference!r:.60}"
        )
    if isinstance(reference, numbers.Integral):
        return str(int(reference))
    if isinstance(reference, numbers.Rational):
        return str(Fraction(int(reference.numerator), int(reference.denominator)))
    value = float(reference)
    if not math.isfinite(value):
        raise ValueError(f"item[{key!r}] is {reference}, not a usable reference answer")
    if isinstance(reference, np.floating):
        return np.format_float_positional(reference, unique=True, trim="-")
    return format(Decimal(repr(value)), "f")
