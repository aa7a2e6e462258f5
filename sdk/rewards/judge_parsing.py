"""Reading a verdict out of a judge model's text, in linear time.

`parse_score` ("Score: 7") is the default parser of `posttrain.rewards.judges.LLMJudge`,
`parse_choice` ("Answer: B") that of `posttrain.rewards.pairwise.LLMPairwiseJudge`; both are
re-exported there. A judge model's reply is untrusted text of any length (a degenerate policy
writes thousands of spaces), so both run in time linear in `len(text)`: every quantifier is
possessive (`*+`, `++`, `?+`: it never gives back what it matched), so no match attempt
backtracks. A pattern such as `answer\\s*(?:is)?\\s*[:=]?\\s*` with plain quantifiers tries every
way of splitting a run of n spaces between its three `\\s*`, O(n^3): 165 s for a reply of
"answer" and 3,000 spaces. With possessive quantifiers the first `\\s*+` takes the whole run and
the rest match empty; since each element's characters are disjoint from the next one's, giving
back could never have produced another match, so the results are the same.

Example:
    >>> parse_score("Reasoning... Score: 7"), parse_choice("The better answer is B.")
    (7.0, 'B')
    >>> parse_choice("answer" + " " * 3000) is None   # milliseconds, not minutes
    True
"""

from __future__ import annotations

import re
import string

__all__ = ["parse_score", "parse_choice"]

# The whole number: "Score: 1e3" is 1000 (not 1), "Score: 7.5" is 7.5, "Score: 7/10" is 7. The
# look-ahead refuses a number that goes on ("1.2.3"); being possessive, a malformed exponent
# ("1e5.5") is refused too instead of falling back to "1".
_SCORE = re.compile(
    r"score\s*+[:=]\s*+([-+]?+\d++(?:\.\d++)?+(?:e[-+]?+\d++)?+)(?!\.?\d)", re.IGNORECASE
)

_CHOICE = re.compile(
    r"(?:answer|better|choice|winner)\s*+(?:is)?+\s*+[:=]?+\s*+\(?+\[?+"
    r"\b([AB])\b",
    re.IGNORECASE,
)


def parse_score(text: str) -> float | None:
    """The number after the last "Score:" (or "score ="), case-insensitive; None if absent.

    The whole number is read, sign and exponent included ("Score: -1" is -1.0, "Score: 1e3" is
    1000.0: out of a 0-10 range, hence an `error` outcome of the judge, never 1); a "/10" after
    it is ignored; a malformed number ("Score: 1.2.3", "Score: 1e5.5") is None. Linear time.

    Example:
        >>> parse_score("Reasoning... Score: 7"), parse_score("score = 3.5 / 10"), parse_score("7")
        (7.0, 3.5, None)
    """
    matches = _SCORE.findall(text)
    return float(matches[-1]) if matches else None


def parse_choice(text: str) -> str | None:
    """ "A" or "B" from a pairwise judge's text: the letter after the last "Answer:" / "Better:" /
    "Choice:" / "Winner:" (an "is", a colon, "(" or "[" may come between), or the whole text when
    it is just the letter (punctuation and case ignored); None otherwise. Linear time.

    Example:
        >>> parse_choice("Answer: B"), parse_choice(" a. "), parse_choice("both are fine")
        ('B', 'A', None)
    """
    matches = _CHOICE.findall(text)
    if matches:
        return matches[-1].upper()
    bare = text.strip().strip(string.punctuation + " ").upper()
    return bare if bare in ("A", "B") else None
