"""Math final-answer verifier: extract the final answer, compare exact rational values.

Extraction, first rule that applies:
    1. the last `\\boxed{...}` (or `\\fbox{...}`), nested braces allowed;
    2. the text after the last "answer is", "answer:" or "####" (case-insensitive), up to the
       end of that line;
    3. the last number in the text.
Nothing extracted -> outcome format_error.

Normalisation of the extracted text and of the item's answer: surrounding `$...$`, `\\(...\\)`,
`\\[...\\]`, `\\text{}` / `\\mathrm{}` wrappers, spaces, `\\!` `\\,` and a trailing period are
removed; a leading `+` is dropped; `−` (U+2212) is a minus sign; `1,234` and `1{,}234`
(thousands separators, groups of three) are `1234`; a `%` sign is dropped (`50%` equals `50`);
`\\frac{a}{b}`, `\\dfrac`, `\\tfrac`, `\\frac34`, `a/b` are fractions; decimals are exact
(`0.75` is 3/4). Both sides become `fractions.Fraction` and are compared exactly: equal values
compare equal (0.5 == 1/2 == \\frac{1}{2} == 0.50) and different values never do (no float
tolerance: 0.3333 != 1/3). When either side is not a number, the normalised strings are compared.

If rule 2 finds text that is not a number as a whole ("42 apples"), its first number is used.

Example:
    >>> from posttrain.verifiers.math_answer import MathAnswerVerifier, extract_answer, parse_number
    >>> verify = MathAnswerVerifier()
    >>> verify("so x = \\\\boxed{\\\\dfrac{3}{4}}", {"answer": "0.75"})
    VerifierResult(score=1.0, outcome=<Outcome.OK: 'ok'>, reason='3/4 == 3/4 (from boxed)')
    >>> verify("The answer is 0.3333.", {"answer": "1/3"}).outcome
    <Outcome.WRONG: 'wrong'>
    >>> verify("I do not know", {"answer": "7"}).outcome
    <Outcome.FORMAT_ERROR: 'format_error'>
    >>> extract_answer("15 - 43 = -28"), parse_number("$1,234.50$")
    (('-28', 'last_number'), Fraction(2469, 2))
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from posttrain.rewards.verifier import Outcome, VerifierResult, register_verifier

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_MARKER = re.compile(r"(?:answer\s*(?:is|:|=)|####)\s*", re.IGNORECASE)

# A number as it appears in running text: \frac{a}{b}, 1,234.5, 3/4, -0.75, .5, 1e-3.
# A sign counts only when it does not follow a word character or a closing bracket ("5-3" is a
# subtraction, so its last number is 3, not -3).
_SIGN = r"(?:(?<![\w)\]}])[-+\u2212])?"
_NUMBER = re.compile(
    _SIGN + r"(?:"
    r"\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}"
    r"|\\[dt]?frac\d\d"
    r"|\d{1,3}(?:,\d{3})+(?:\.\d+)?"
    r"|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?"
    r")",
    re.ASCII,
)

_FRAC = re.compile(r"^\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}$|^\\[dt]?frac(\d)(\d)$", re.ASCII)
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$", re.ASCII)
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_PLAIN = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$", re.ASCII)


def _balanced(text: str, open_index: int) -> str | None:
    """The text inside the braces that open at `open_index`, or None when they never close."""
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1:i]
    return None


def extract_answer(text: str) -> tuple[str, str] | None:
    """The final answer of `text` and the rule that found it ("boxed", "marker" or
    "last_number"), or None when there is none. See the module docstring for the rules."""
    boxes = list(_BOXED.finditer(text))
    for match in reversed(boxes):
        inside = _balanced(text, match.end() - 1)
        if inside is not None:
            return inside.strip(), "boxed"
    markers = list(_ANSWER_MARKER.finditer(text))
    if markers:
        rest = text[markers[-1].end():].split("\n", 1)[0].strip()
        if rest:
            return rest, "marker"
    numbers = list(_NUMBER.finditer(text))
    if numbers:
        return numbers[-1].group(0).strip(), "last_number"
    return None


def normalize_answer(text: str) -> str:
    """Strip the decorations listed in the module docstring (not the thousands separators)."""
    s = str(text).strip()
    for _ in range(3):   # wrappers can nest: $\text{5}$.
        before = s
        s = s.strip().rstrip(".").strip()
        for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s = s[len(left):len(s) - len(right)].strip()
        s = _WRAPPERS.sub(r"\1", s)
        if s == before:
            break
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("{,}", ",")
    s = s.replace("\\%", "%").replace("\\$", "").replace("\u2212", "-").replace("$", "")
    s = s.rstrip("%").strip()
    s = re.sub(r"\s+", " ", s).rstrip(".").strip()
    if s.startswith("+"):
        s = s[1:].strip()
    return s


def parse_number(text: str) -> Fraction | None:
    """The exact value of `text` as a Fraction, or None when it is not a single number.

    Accepts integers, decimals, scientific notation, `a/b`, `\\frac{a}{b}` (and `\\dfrac`,
    `\\tfrac`, `\\frac34`), thousands separators, a sign, and the decorations of `normalize_answer`.
    """
    s = normalize_answer(text)
    negative = False
    if s[:1] == "-":
        negative, s = True, s[1:].strip()
        if s[:1] in "-+":
            return None
    value = _parse_unsigned(s)
    if value is None:
        return None
    return -value if negative else value


def _parse_unsigned(s: str) -> Fraction | None:
    frac = _FRAC.match(s)
    if frac:
        top, bottom = (frac.group(1), frac.group(2)) if frac.group(1) is not None \
            else (frac.group(3), frac.group(4))
        numerator, denominator = parse_number(top), parse_number(bottom)
        if numerator is None or denominator is None or denominator == 0:
            return None
        return numerator / denominator
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if "/" in s:
        top, _, bottom = s.partition("/")
        numerator, denominator = _parse_plain(top.strip()), _parse_plain(bottom.strip())
        if numerator is None or denominator is None or denominator == 0:
            return None
        return numerator / denominator
    return _parse_plain(s)


def _parse_plain(s: str) -> Fraction | None:
    if not _PLAIN.match(s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


@register_verifier("math_answer")
class MathAnswerVerifier:
    """Checks a math completion's final answer against `item[answer_key]` by exact value.

    Args:
        answer_key: the item field holding the reference answer (a str or a number).
        require_boxed: only accept an answer in `\\boxed{}`; anything else is a format_error.

    Returns (per call): ok (1.0) when equal, wrong (0.0) when not, format_error (0.0) when no
    answer can be extracted. The reason says what was compared and which rule extracted it.

    Raises (per call): KeyError if the item has no `answer_key` (run_verifier records an error).
    """

    def __init__(self, *, answer_key: str = "answer", require_boxed: bool = False) -> None:
        self.answer_key = answer_key
        self.require_boxed = require_boxed

    def __call__(self, completion: str, item: Mapping[str, Any]) -> VerifierResult:
        reference = item[self.answer_key]
        _check_reference(reference, self.answer_key)
        found = extract_answer(completion or "")
        if found is None or not found[0]:
            return VerifierResult.failure(Outcome.FORMAT_ERROR, "no final answer found")
        answer, rule = found
        if self.require_boxed and rule != "boxed":
            return VerifierResult.failure(Outcome.FORMAT_ERROR, "no \\boxed{} answer")
        expected = parse_number(str(reference))
        got = parse_number(answer)
        if got is None and "=" in answer:       # "x = 5"
            got = parse_number(answer.rsplit("=", 1)[1])
        if got is None and rule == "marker":      # "42 apples"
            first = _NUMBER.search(answer)
            got = parse_number(first.group(0)) if first else None
        if expected is not None and got is not None:
            if expected == got:
                return VerifierResult(1.0, Outcome.OK, f"{got} == {expected} "
                                                       f"(from {rule})")
            return VerifierResult(0.0, Outcome.WRONG, f"expected {expected}, got "
                                                      f"{got} (from {rule})")
        want, have = _squash(str(reference)), _squash(answer)
        if want == have:
            return VerifierResult(1.0, Outcome.OK, f"{have!r} == {want!r} as text (from {rule})")
        return VerifierResult(0.0, Outcome.WRONG, f"expected {want!r:.60}, got {have!r:.60} "
                                                  f"(from {rule})")

    def __repr__(self) -> str:
        return (f"MathAnswerVerifier(answer_key={self.answer_key!r}, "
                f"require_boxed={self.require_boxed})")


def _squash(text: str) -> str:
    return normalize_answer(text).replace(" ", "")


def _check_reference(reference: Any, key: str) -> None:
    """A reference answer that is not a usable value is a data error (outcome "error" through
    `run_verifier`), never a "wrong" answer charged to the policy.

    Raises:
        ValueError: for None, NaN/inf, a non-string non-number, or an empty string.
    """
    if isinstance(reference, bool) or not isinstance(reference, (str, int, float, Fraction)):
        raise ValueError(f"item[{key!r}] must be a string or a number, got "
                         f"{type(reference).__name__}: {reference!r:.60}")
    if isinstance(reference, float) and not math.isfinite(reference):
        raise ValueError(f"item[{key!r}] is {reference}, not a usable reference answer")
    if isinstance(reference, str) and not reference.strip():
        raise ValueError(f"item[{key!r}] is an empty string")

