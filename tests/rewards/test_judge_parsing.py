"""Verdict parsers: `parse_score` reads the whole last number and `parse_choice` the verdict;
the linear-time parsers agree with the backtracking patterns they replaced, and stay fast on
degenerate and 1 MB replies."""

import random
import re
import string

import pytest
from _waits import thread_cpu_s

from posttrain.rewards import parse_choice, parse_score


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Score: 3 ... on reflection Score: 8", 8.0),
        ("SCORE=4.5", 4.5),
        ("I'd give it 7", None),
        ("", None),
        ("Score: 7/10", 7.0),
        ("Score: 7.5", 7.5),
        ("Score: 7.", 7.0),
        ("Score: -1", -1.0),
        ("Score: 1e3", 1000.0),
        ("Score: 1.2.3", None),
        ("Score: 12", 12.0),
        ("Score: 1e5.5", None),
        ("score=+4e-1", 0.4),
        ("Score:   \n 6", 6.0),
    ],
)
def test_parse_score_reads_the_whole_last_number(text, expected):
    assert parse_score(text) == expected


def test_parse_choice():
    assert parse_choice("Answer: A") == "A"
    assert parse_choice("The better answer is B.") == "B"
    assert parse_choice("b") == "B"
    assert parse_choice("Answer: C") is None
    assert parse_choice("A and B are both fine") is None


# The backtracking patterns the parsers used before: the slow reference on short texts.
_OLD_SCORE = re.compile(r"score\s*[:=]\s*([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)(?!\.?\d)", re.I)
_OLD_CHOICE = re.compile(
    r"(?:answer|better|choice|winner)\s*(?:is)?\s*[:=]?\s*\(?\[?\b([AB])\b", re.I
)


def test_linear_parsers_agree_with_the_backtracking_patterns():
    """On 3,000 random short texts over the parsers' own vocabulary, the possessive patterns find
    what the old backtracking ones found; the one intended difference is a malformed exponent
    ("Score: 1e5.5": None now, 1.0 before)."""
    words = [
        "score",
        "Score",
        "answer",
        "better",
        "is",
        ":",
        "=",
        " ",
        "  ",
        "\n",
        "1",
        "7",
        "12",
        ".",
        "e",
        "-",
        "+",
        "A",
        "B",
        "a",
        "(",
        "[",
        "x",
        "/10",
    ]
    keys = ["score", "Score:", "score =", "answer", "Answer:", "better is", "winner"]
    values = ["7", "12", "-1", "+3", "1.5", "1e3", "7.", "1.2.3", "A", "B", "(a)", "[B]", "AB"]
    rng = random.Random(0)
    found = 0
    for _ in range(3000):
        text = "".join(
            [rng.choice(words) for _ in range(rng.randint(0, 3))]
            + [rng.choice(keys), rng.choice(["", " ", ":", "  \n "]), rng.choice(values)]
            + [rng.choice(words) for _ in range(rng.randint(0, 3))]
        )
        found += parse_score(text) is not None or parse_choice(text) is not None
        old = _OLD_CHOICE.findall(text)
        bare = text.strip().strip(string.punctuation + " ").upper()
        assert parse_choice(text) == (
            old[-1].upper() if old else bare if bare in ("A", "B") else None
        ), text
        if not re.search(r"\de[-+]?\d+\.\d", text):
            old = _OLD_SCORE.findall(text)
            assert parse_score(text) == (float(old[-1]) if old else None), text
    assert found > 500  # the texts do hold verdicts


@pytest.mark.parametrize(
    "text,score,choice",
    [
        ("answer" + " " * 3000, None, None),  # 165 s with the old choice pattern
        ("Answer is" + " " * 3000 + "B", None, "B"),
        (" " * 3000, None, None),
        ("Score:" + " " * 3000 + "7", 7.0, None),
        (" " * 2**20, None, None),  # 1 MB replies from here on
        ("answer" + " " * 2**20, None, None),
        ("answer is " * (2**20 // 10), None, None),
        ("Score: 7 " + " " * 2**20 + "Answer: B", 7.0, "B"),
        ("Score: " + "1" * 2**19 + "." + "1" * 2**19 + ".1", None, None),
        ("score: " * (2**20 // 7), None, None),
        ("A" * 2**20, None, None),
    ],
)
def test_parsers_are_fast_on_degenerate_and_1mb_replies(text, score, choice):
    """Linear: milliseconds of CPU; cubic: hours (CPU seconds: waiting for a core does not
    count)."""
    parsed, cpu_s = thread_cpu_s(lambda: (parse_score(text), parse_choice(text)))
    assert parsed == (score, choice)
    assert cpu_s < 2.0, cpu_s
