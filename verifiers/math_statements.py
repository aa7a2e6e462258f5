"""Where a math completion states its final answer, and whether what it states is one answer.

A completion states a final answer in a run of boxes (`\\boxed{...}` / `\\fbox{...}` whose braces
close; boxes that only connectors separate are one multi-part answer: `\\boxed{1}, \\boxed{2} and
\\boxed{3}`), after an answer marker ("answer is", "answer:", "answer =", "####"; the last one
counts), or as its whole text. `extract_answer` finds the answer in the first of these that
`extract` names (`MathAnswerVerifier` reads it there); the rules below hold whichever that is.

A completion hedges (outcome format_error: never credited, whatever the extraction order) when:

- an alternative stands in a stated answer or right beside it: one of `ALTERNATIVES` ("or",
  also inside `\\text{}`, "maybe", "perhaps", ...): `3 (or 4)`, `3 or maybe 4`, `$3$ or $4$`,
  `\\boxed{3} or \\boxed{4}`. Several answers to one question go in one box, joined by commas
  or "and".
- a stated answer holds a relation math-verify does not compare but reads as one of its sides
  (`x \\approx 3` is read as 3, `3 \\to 4` as 4): the LaTeX commands `REFUSED_RELATIONS`, their
  Unicode forms, `~=`, `->`, `=>`, and `\\in` after a number (`3 \\in 4` is read as 4). The
  relations math-verify compares (=, <, >, \\le, \\ge, \\neq, `x \\in`) are answers (`x \\ge 5`);
  one inside a sub- or superscript (`\\lim_{x \\to 0}`) is not the answer's.
- two of its statements (box runs, the last marker) differ in value: `\\boxed{3} ... \\boxed{4}`,
  `The answer is 3. \\boxed{4}` (the verifier compares them; this module finds them).

Everything here is linear in the completion's length.

Example:
    >>> from posttrain.verifiers.math_statements import hedge, statements
    >>> [s.text for s in statements("First \\\\boxed{1}, then the answer is 2.")]
    ['1', '2']
    >>> hedge("3 (or 4)"), hedge("x \\\\ge 5"), hedge("3", after=" or 4")
    ("'or' in the answer", None, "'or' right after the answer")
    >>> print(hedge("x \\\\approx 3"))
    '\\approx' in the answer
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache

EXTRACT_SOURCES = ("boxed", "marker", "whole", "anywhere")
"""Where `MathAnswerVerifier` can take the answer from (`math_answer`'s module docstring)."""

DEFAULT_EXTRACT = ("boxed", "marker", "whole")
"""The sources tried, in order, when `extract` is not given."""

ALTERNATIVES = ("or", "maybe", "perhaps", "possibly", "alternatively")
"""Words that offer a second answer beside the first."""

REFUSED_RELATIONS = (
    "approx",
    "approxeq",
    "thickapprox",
    "sim",
    "simeq",
    "thicksim",
    "backsim",
    "backsimeq",
    "eqsim",
    "cong",
    "ncong",
    "doteq",
    "doteqdot",
    "fallingdotseq",
    "risingdotseq",
    "lesssim",
    "gtrsim",
    "lessapprox",
    "gtrapprox",
    "asymp",
    "propto",
    "varpropto",
    "equiv",
    "to",
    "rightarrow",
    "longrightarrow",
    "Rightarrow",
    "Longrightarrow",
    "implies",
    "impliedby",
    "iff",
    "leftrightarrow",
    "Leftrightarrow",
    "longleftrightarrow",
    "Longleftrightarrow",
    "mapsto",
    "longmapsto",
    "leftarrow",
    "Leftarrow",
    "longleftarrow",
    "Longleftarrow",
    "gets",
    "leadsto",
    "rightsquigarrow",
    "ll",
    "gg",
    "lll",
    "ggg",
    "prec",
    "succ",
    "preceq",
    "succeq",
    "subset",
    "subseteq",
    "supset",
    "supseteq",
    "subsetneq",
    "supsetneq",
    "notin",
    "ni",
    "parallel",
    "perp",
    "mid",
    "nmid",
    "vdash",
    "models",
)
"""LaTeX relations (without the backslash) math-verify 0.9.0 does not compare: it reads `a R b`
as one side (`\\equiv` as =, `\\lesssim` as <=, most as the right side)."""

SPANS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))
"""Math delimiters, longest first."""

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE_TOKENS = re.compile(r"\\.|[{}]", re.DOTALL)  # an escaped character, or a brace
_CONNECTOR = re.compile(
    r"(?:\s|[,;&$]|\\[()\[\],;:! ]|\\q?quad\b|and"
    r"|\\text\s*\{\s*(?:and|,)?\s*\})*"
)
_MARKER = re.compile(r"answer\s*(?:is\b|:|=)|####", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?!\d)|\n")
_WORD = "(?:" + "|".join(ALTERNATIVES) + ")"
_ALTERNATIVE = re.compile(rf"(?<![A-Za-z\\]){_WORD}(?![A-Za-z])", re.IGNORECASE)
_ALTERNATIVE_AFTER = re.compile(
    rf"[\s,;:.()\[\]$]*(?:\\(?:text\w*|mathrm|mbox)\s*\{{\s*)?\(?\s*"
    rf"{_WORD}(?![A-Za-z])",
    re.IGNORECASE,
)
_ALTERNATIVE_BEFORE = re.compile(
    rf"(?<![A-Za-z\\]){_WORD}\}}?[\s,;:(]*(?:[A-Za-z]\s*=\s*)?"
    rf"[\s$(]*(?:\\[(\[])?\s*\Z",
    re.IGNORECASE,
)
_RELATION = re.compile(
    r"\\(?:"
    + "|".join(sorted(REFUSED_RELATIONS, key=len, reverse=True))
    + r")(?![A-Za-z])|[≈≊≃≅∼≍≐≡≢∝≲≳≪≫≺≻→⟶⇒⟹⇔⟺↔↦←⇐⊂⊆⊃⊇∉∥⊥∣∤]"
    r"|~=|<=>|(?<![<>=!])=>|->|(?:^|\s)~(?=\s)"
    r"|(?<![\w^_{.])\d+(?:\.\d+)?\s*\\in(?![A-Za-z])"
)  # 3 \in 4 reads as 4
_MATH_ITEM = re.compile(
    r"\$\$[^$]+\$\$|\$(?:\\\$|[^$])+\$|\\\((?:[^\\]|\\[^()])*\\\)"
    r"|\\\[(?:[^\\]|\\[^\[\]])*\\\]|(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?!\w)"
)
_SCRIPT = re.compile(r"[_^]\s*\{(?:[^{}]|\{[^{}]*\})*\}")
_CONTEXT_CHARS = 80
_DELIMITERS = ("$", "\\(", "\\[", "\\boxed", "\\fbox")
_TEXT_GROUP = re.compile(r"\\(?:text\w*|math\w+|mbox|operatorname)\s*\{[^{}]*\}")
_PROSE_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")
_PERCENT_WORD = re.compile(r"(?<![A-Za-z])(?:percentage|percent|pct)(?![A-Za-z])", re.IGNORECASE)
_EXPONENT_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d{1,3}")
_MATH_CHARS = re.compile(r"[\d\\$]")
_NUMBER_CHARS = re.compile(r"[-+\u2212$\u20ac\u00a3\u00a5\d.,\s/%]+", re.ASCII)


@dataclass(frozen=True)
class Statement:
    """One place a completion states a final answer.

    text: the answer as `extract_answer` reads it (box contents joined by ", ", or the marker's
    text); source: where it stands ("boxed", "marker"; "whole" or "anywhere" for the answer
    those sources read); before / after: up to 80 characters of the completion just before and
    after it, where an alternative ("or 4") turns it into a hedge.
    """

    text: str
    source: str
    before: str
    after: str


def _closed_boxes(text: str) -> list[tuple[int, int, int]]:
    """(start, opening brace, closing brace) of each box whose braces close, by start. Escaped
    braces (`\\{`) do not count."""
    opens = [(match.start(), match.end() - 1) for match in _BOX_OPEN.finditer(text)]
    if not opens:
        return []
    closing: dict[int, int] = {}
    stack: list[int] = []
    for token in _BRACE_TOKENS.finditer(text):
        if token.group() == "{":
            stack.append(token.start())
        elif token.group() == "}" and stack:
            closing[stack.pop()] = token.start()
    return [(start, brace, closing[brace]) for start, brace in opens if brace in closing]


@lru_cache(maxsize=8)
def box_runs(text: str) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """The runs of boxes of `text` in order, each of (start, opening brace, closing brace):
    boxes that only connectors (commas, "and", spaces, `\\quad`, `$`) separate form one run. A
    box that encloses a counted box is not counted itself (`\\boxed{\\boxed{3}}` is the box 3).
    Cached for the last few texts: the verifier asks for the runs of one completion twice."""
    runs: list[list[tuple[int, int, int]]] = []  # each built from its last box backwards
    for box in reversed(_closed_boxes(text)):
        if runs:
            first_start = runs[-1][-1][0]
            if box[2] > first_start:
                continue  # it encloses a box already counted
            if _CONNECTOR.fullmatch(text, box[2] + 1, first_start):
                runs[-1].append(box)
                continue
        runs.append([box])
    return tuple(tuple(run[::-1]) for run in reversed(runs))


def final_boxes(text: str) -> list[str] | None:
    """The contents of the last run of boxes of `text`, in order; None when no box closes."""
    runs = box_runs(text)
    return [text[brace + 1 : end] for _, brace, end in runs[-1]] if runs else None


def last_marker(text: str) -> tuple[str, int] | None:
    """The text after the last answer marker (blank lines skipped), with where it ends in
    `text`: the math span it opens with, else up to the end of its sentence or line."""
    markers = list(_MARKER.finditer(text))
    last = markers[-1] if markers else None
    if last is None:
        return None
    start = len(text) - len(text[last.end() :].lstrip(" \t\r\n*:"))
    rest = text[start:]
    for left, right in SPANS:
        if rest.startswith(left):
            close = rest.find(right, len(left))
            if close != -1:
                return rest[: close + len(right)], start + close + len(right)
            break
    end = _SENTENCE_END.search(rest)
    stop = end.start() if end else len(rest)
    return rest[:stop].strip(" \t*"), start + stop


def statements(completion: str) -> list[Statement]:
    """Every final answer `completion` states: each run of boxes, then the last marker's answer
    (unless it holds a box, which is counted as a box, or is empty). Empty boxes are skipped."""
    found = []
    for run in box_runs(completion):
        text = ", ".join(completion[brace + 1 : end].strip() for _, brace, end in run)
        if text:
            found.append(
                Statement(
                    text,
                    "boxed",
                    _before(completion, run[0][0]),
                    completion[run[-1][2] + 1 : run[-1][2] + 1 + _CONTEXT_CHARS],
                )
            )
    marker = last_marker(completion)
    if marker and marker[0].strip() and not _BOX_OPEN.search(marker[0]):
        found.append(
            Statement(
                marker[0].strip(), "marker", "", completion[marker[1] : marker[1] + _CONTEXT_CHARS]
            )
        )
    return found


def last_math(completion: str) -> Statement | None:
    """The last math span (`$...$`, `\\(...\\)`, ...) or stand-alone number of `completion`, as a
    statement with source "anywhere": where math-verify's own search falls back to when no box or
    marker states the answer."""
    spans = list(_MATH_ITEM.finditer(completion))
    span = spans[-1] if spans else None
    if span is None:
        return None
    return Statement(
        span.group(),
        "anywhere",
        _before(completion, span.start()),
        completion[span.end() : span.end() + _CONTEXT_CHARS],
    )


def _before(text: str, start: int) -> str:
    return text[max(0, start - _CONTEXT_CHARS) : start]


def hedge(answer: str, before: str = "", after: str = "") -> str | None:
    """Why `answer` (a stated final answer, with the text just `before` and `after` it) is not
    one answer, or None when it is: an alternative in it or right beside it, or a relation
    math-verify does not compare (module docstring)."""
    alternative = _ALTERNATIVE.search(answer)
    if alternative:
        return f"'{alternative.group().lower()}' in the answer"
    relation = _RELATION.search(_without_scripts(answer))
    if relation:
        return f"'{relation.group().strip()}' in the answer"
    after_match, before_match = _ALTERNATIVE_AFTER.match(after), _ALTERNATIVE_BEFORE.search(before)
    for side, match in (("after", after_match), ("before", before_match)):
        word = _ALTERNATIVE.search(match.group()) if match else None
        if word:
            return f"'{word.group().lower()}' right {side} the answer"
    return None


def _without_scripts(text: str) -> str:
    """`text` without sub- and superscripts (`\\lim_{x \\to 0}`, `e^{i \\to}`): a relation there
    belongs to the notation, not to the answer."""
    return _SCRIPT.sub(" ", text)


def _single_span(text: str) -> bool:
    """True when `text` is exactly one math span: `$...$`, `$$...$$`, `\\(...\\)`, `\\[...\\]`."""
    for left, right in SPANS:
        if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
            inside = text[len(left) : len(text) - len(right)]
            unescaped = inside.replace("\\$", "")
            return "$" not in unescaped and (
                left == "$" or left == "$$" or (left not in inside and right not in inside)
            )
    return False


def _is_plain_number(text: str) -> bool:
    """Digits with separators, signs, `/`, `%` and a currency sign only (math-verify's number
    syntax handles these better as plain text than as LaTeX: `1 000`, `1000,99`, `$5`)."""
    return _NUMBER_CHARS.fullmatch(text) is not None and any(c.isdigit() for c in text)


def only_an_answer(text: str) -> bool:
    """True when `text` is one math span, or bare math with no prose word (3+ letters outside
    LaTeX commands and `\\text{}`), or a plain number (currency sign allowed)."""
    if _single_span(text) or _is_plain_number(text):
        return True
    if any(delimiter in text for delimiter in _DELIMITERS):
        return False
    return _PROSE_WORD.search(_PERCENT_WORD.sub(" ", _TEXT_GROUP.sub(" ", text))) is None


def positional(text: str) -> str:
    """`text` without its exponent when it is only a number in e-notation (`1.5e3` is `1500`,
    `1e-3` is `0.001`; LaTeX would read the e as Euler's number); other text as it is."""
    if _EXPONENT_NUMBER.fullmatch(text.strip()):
        return format(Decimal(text.strip()), "f")
    return text


def as_math_text(text: str) -> str:
    """The string handed to math-verify for a stand-alone answer or a reference (`math_answer`'s
    module docstring)."""
    text = positional(text)
    if _single_span(text) or _is_plain_number(text) or any(d in text for d in _DELIMITERS):
        return text
    return f"${text}$"


def extract_answer(
    completion: str, extract: str | Sequence[str] = DEFAULT_EXTRACT
) -> tuple[str, str] | None:
    """Where the answer of `completion` is, as `(answer text, source)`, or None.

    Args:
        completion: the model's text.
        extract: a source name or names from `EXTRACT_SOURCES`, tried in order.

    Returns the first source's find (its text may be empty: `\\boxed{}`); for "anywhere" the
    whole completion (math-verify searches it). Raises ValueError for an unknown source and
    TypeError when `completion` is not a str.
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    for source in check_extract(extract):
        if source == "boxed":
            boxes = final_boxes(completion)
            found = None if boxes is None else ", ".join(box.strip() for box in boxes)
        elif source == "marker":
            marker = last_marker(completion)
            found = marker[0] if marker else None
        elif source == "whole":
            text = completion.strip()
            text = text[:-1].rstrip() if text.endswith(".") else text
            found = text if text and only_an_answer(text) else None
        else:
            found = completion
        if found is not None:
            return found.strip(), source
    return None


def check_extract(extract: str | Sequence[str]) -> tuple[str, ...]:
    """`extract` as a tuple of sources; ValueError naming the allowed ones otherwise."""
    sources = (
        (extract,)
        if isinstance(extract, str)
        else tuple(extract)
        if isinstance(extract, Sequence)
        else ()
    )  # None: the error below
    bad = [s for s in sources if s not in EXTRACT_SOURCES]
    if not sources or bad or len(set(sources)) != len(sources):
        raise ValueError(
            f"extract must be one of {EXTRACT_SOURCES} or a sequence of distinct "
            f"ones (tried in order), got {extract!r}"
        )
    return sources


def hedged(stated: Sequence[Statement], text: str, answer: str, source: str) -> str | None:
    """Why the completion `text` states more than one answer (an alternative or a relation
    math-verify does not compare, in or beside a statement: `math_statements.hedge`), or None.
    The statements are its boxes and last marker, the whole text when that is the answer, and
    for "anywhere" with neither, the last math span or number (math-verify's search falls back
    to it). A marker that is not the answer read and holds no digit or LaTeX is prose."""
    extra = (
        [Statement(answer, source, "", "")]
        if source == "whole"
        else [last]
        if source == "anywhere" and not stated and (last := last_math(text))
        else []
    )
    for statement in (*stated, *extra):
        if statement.source == "marker" != source and not _MATH_CHARS.search(statement.text):
            continue  # prose ("whether the answer is positive or negative"), not an answer
        reason = hedge(statement.text, statement.before, statement.after)
        if reason:
            return f"{reason} ({statement.source}: {statement.text!r:.40})"
    return None
