"""The stages of `posttrain.data.synthetic.SyntheticPipeline`: scoring, deduplication, length,
score threshold and decontamination, each a small frozen dataclass with a name, a version and
its parameters, chosen by name through one registry (`STAGES`, `build_stage`).

A stage's `apply(rows)` returns (kept rows, {removal reason: count}); the table of stages, their
removal reasons and the sources of the defaults is in `posttrain.data.synthetic`.

Example:
    >>> rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "1+1=", "completion": " 2 "}]
    >>> kept, removed = build_stage("exact_dedup").apply(rows)
    >>> len(kept), removed
    (1, {'duplicate': 1})
    >>> build_stage(("near_dedup", {"threshold": 1.5}))
    Traceback (most recent call last):
    ...
    ValueError: NearDedup.threshold=1.5; must be a finite number in [0, 1]
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable

from posttrain.core.checks import check_int
from posttrain.core.registry import Registry

if TYPE_CHECKING:
    from posttrain.models.tokenizer import Tokenizer

__all__ = [
    "Stage",
    "Score",
    "ExactDedup",
    "NearDedup",
    "Length",
    "MinScore",
    "Decontaminate",
    "STAGES",
    "build_stage",
    "jaccard",
    "word_ngrams",
    "decontamination_ngrams",
    "FAILED_OUTCOMES",
    "DEFAULT_DECONTAMINATION_N",
    "DEFAULT_NEAR_DUP_N",
    "DEFAULT_NEAR_DUP_THRESHOLD",
]

FAILED_OUTCOMES = ("timeout", "error")
"""Outcomes whose rows `Score` removes: the scorer failed, so the row has no score."""

DEFAULT_DECONTAMINATION_N = 13
"""GPT-3's contamination n-gram length (Brown et al. 2020, "Language Models are Few-Shot
Learners", Appendix C: 13-gram overlap), the common default since."""

DEFAULT_NEAR_DUP_N, DEFAULT_NEAR_DUP_THRESHOLD = 5, 0.8
"""Word 5-gram shingles and Jaccard >= 0.8, after Lee et al. 2022 ("Deduplicating Training Data
Makes Language Models Better", NearDup: MinHash over space-tokenised 5-gram shingles, pairs at
an estimated Jaccard of about 0.8 and above)."""


# --------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------


@runtime_checkable
class Stage(Protocol):
    """One step of a `SyntheticPipeline`.

    `apply(rows)` returns (kept rows, {removal reason: count}) with the counts summing to the
    rows removed; it may add fields to the rows it keeps (it owns the copies it is given).
    `needs` / `adds` name the row fields it reads / writes (checked before the pipeline runs);
    `version` goes into every kept row's provenance with `params()` (JSON-able).
    """

    name: str
    version: str
    needs: tuple[str, ...]
    adds: tuple[str, ...]

    def params(self) -> dict[str, Any]: ...

    def apply(self, rows: list[dict]) -> tuple[list[dict], dict[str, int]]: ...


STAGES: Registry[Callable[..., Stage]] = Registry("synthetic-data stage")


def build_stage(spec: Stage | str | tuple | Mapping) -> Stage:
    """A stage from an object (returned as is), a registered name ("exact_dedup"), a
    (name, options) pair or a mapping {"name": ..., **options}.

    Raises:
        ValueError: for an unknown name (listing the registered ones), an unknown option of a
            built-in stage (listing its options) or a bad option value.
    """
    if isinstance(spec, Stage):
        return spec
    if isinstance(spec, str):
        name, options = spec, {}
    elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], Mapping):
        name, options = spec[0], dict(spec[1])
    elif isinstance(spec, Mapping) and "name" in spec:
        options = {k: v for k, v in spec.items() if k != "name"}
        name = spec["name"]
    else:
        raise ValueError(
            f"stage {spec!r:.80} is not a Stage, a registered name, a "
            f"(name, options) pair or a mapping with a 'name'; registered names: "
            f"{', '.join(STAGES.names())}"
        )
    unknown = sorted(set(options) - _OPTIONS[name]) if name in _OPTIONS else []
    if unknown:
        raise ValueError(
            f"stage {name!r} has no option(s) {unknown}; allowed: "
            f"{', '.join(sorted(_OPTIONS[name]))}"
        )
    return STAGES.build(name, **options)


_OPTIONS: dict[str, set[str]] = {}
_C = TypeVar("_C", bound=type)


def _register(name: str) -> Callable[[_C], _C]:
    """Register a built-in stage (a dataclass) under `name`, remembering its options."""

    def decorator(cls: _C) -> _C:
        _OPTIONS[name] = {f.name for f in dataclasses.fields(cast(Any, cls))}
        STAGES.register(name)(cls)
        return cls

    return decorator


def _real(
    owner: str, name: str, value: Any, low: float | None = None, high: float | None = None
) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (low is None or value >= low) and (high is None or value <= high):
        return
    where = (
        (f" in [{low:g}, {high:g}]" if high is not None else f" >= {low:g}")
        if (low is not None)
        else ""
    )
    raise ValueError(f"{owner}.{name}={value!r}; must be a finite number{where}")


def _describe(fn: Any) -> str:
    """A short, stable description of a scorer for the stats table and provenance."""
    if hasattr(fn, "func") and hasattr(fn, "keywords"):  # functools.partial
        args = [repr(a)[:120] for a in fn.args] + [f"{k}={v!r}" for k, v in fn.keywords.items()]
        return f"{getattr(fn.func, '__name__', repr(fn.func))}({', '.join(args)})"
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        return f"{type(owner).__name__}.{fn.__name__}"
    return getattr(fn, "__qualname__", None) or repr(fn)[:120]


@_register("score")
@dataclass(frozen=True)
class Score:
    """Scores every row; removes the rows whose scoring failed (outcome timeout / error),
    counted by outcome. Kept rows get "score", "outcome" (a str) and "reason".

    Args:
        scorer: `(completions, items) -> results` (see the module docstring: a verifier via
            `partial(score_batch, verifier, timeout_s=...)`), or a `Judge` (its `judge` method).
        name: the stage's name in the stats table.

    Each row's item is `row["item"]` (set by `generate_candidates`), else {"question": prompt}.

    Raises:
        TypeError: when built, if `scorer` is not callable and has no `judge` method; when run,
            if it returns something other than one result with `.score`/`.outcome` per row.
    """

    scorer: Any
    name: str = "score"
    version = "1"
    needs = ("prompt", "completion")
    adds = ("score", "outcome", "reason")

    def __post_init__(self) -> None:
        if not callable(getattr(self.scorer, "judge", None)) and not callable(self.scorer):
            raise TypeError(
                f"Score.scorer must be a batch scorer (completions, items) -> results "
                f"or a Judge, got a {type(self.scorer).__name__}"
            )

    def _fn(self) -> Callable:
        judge = getattr(self.scorer, "judge", None)
        return judge if callable(judge) else self.scorer

    def params(self) -> dict[str, Any]:
        return {"scorer": _describe(self._fn())}

    def apply(self, rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
        items = [r.get("item") or {"question": r["prompt"]} for r in rows]
        results = self._fn()([r["completion"] for r in rows], items)
        if (
            not isinstance(results, Sequence)
            or len(results) != len(rows)
            or not all(hasattr(x, "score") and hasattr(x, "outcome") for x in results)
        ):
            raise TypeError(
                f"stage {self.name!r}: the scorer returned {results!r:.120} for "
                f"{len(rows)} rows; it must return one VerifierResult per row (a "
                f"per-completion Verifier goes through "
                f"functools.partial(score_batch, verifier, timeout_s=...))"
            )
        kept, removed = [], Counter[str]()
        for row, res in zip(rows, results):
            outcome = str(getattr(res.outcome, "value", res.outcome))
            if outcome in FAILED_OUTCOMES:
                removed[outcome] += 1
                continue
            row.update(
                score=float(res.score), outcome=outcome, reason=str(getattr(res, "reason", ""))
            )
            kept.append(row)
        return kept, dict(removed)


def _normalized(text: str) -> str:
    return " ".join(text.split())


@_register("exact_dedup")
@dataclass(frozen=True)
class ExactDedup:
    """Keeps the first row of each (prompt, completion) pair, whitespace runs collapsed and
    ends stripped ("a  b\\n" == "a b"); case and punctuation count."""

    name: str = "exact_dedup"
    version = "1"
    needs = ("prompt", "completion")
    adds = ()

    def params(self) -> dict[str, Any]:
        return {"normalize": "whitespace"}

    def apply(self, rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
        seen, kept = set(), []
        for row in rows:
            key = (_normalized(row["prompt"]), _normalized(row["completion"]))
            if key not in seen:
                seen.add(key)
                kept.append(row)
        return kept, ({"duplicate": len(rows) - len(kept)} if len(kept) < len(rows) else {})


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """Shingles of `text`: its whitespace-separated words, n at a time; a text of fewer than n
    words (but at least one) is one shingle, its whole word sequence; "" has none.

    Example:
        >>> sorted(word_ngrams("a b c", 2)), word_ngrams("a", 3)
        ([('a', 'b'), ('b', 'c')], {('a',)})
    """
    words = text.split()
    if 0 < len(words) < n:
        return {tuple(words)}
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: set, b: set) -> float:
    """|a & b| / |a | b|; 1.0 for two empty sets (two empty texts are the same text)."""
    return len(a & b) / len(a | b) if a or b else 1.0


@_register("near_dedup")
@dataclass(frozen=True)
class NearDedup:
    """Among the completions of one prompt (in row order), drops each whose word-n-gram
    Jaccard similarity with an earlier kept one is >= `threshold`.

    Exact Jaccard over all pairs of one prompt's completions: O(k^2) for k completions per
    prompt, meant for the small groups of rejection sampling (k = n). `datasketch` (MinHash
    LSH) is not a dependency of this project; for corpora where k is large, dedupe with MinHash
    first. Defaults: `DEFAULT_NEAR_DUP_N`, `DEFAULT_NEAR_DUP_THRESHOLD` (Lee et al. 2022).

    Args:
        threshold: Jaccard in [0, 1]; 1.0 drops only completions with the same shingle set.
        n: words per shingle (>= 1).

    Example (shingles {ab, bc, cd} and {ab, bc, ce}: 2 shared of 4, Jaccard 0.5):
        >>> rows = [{"prompt": "p", "completion": "a b c d"},
        ...         {"prompt": "p", "completion": "a b c e"}]
        >>> [len(NearDedup(threshold=t, n=2).apply(rows)[0]) for t in (0.5, 0.6)]
        [1, 2]
    """

    threshold: float = DEFAULT_NEAR_DUP_THRESHOLD
    n: int = DEFAULT_NEAR_DUP_N
    name: str = "near_dedup"
    version = "1"
    needs = ("prompt", "completion")
    adds = ()

    def __post_init__(self) -> None:
        _real("NearDedup", "threshold", self.threshold, 0.0, 1.0)
        check_int("NearDedup.n", self.n, minimum=1)

    def params(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "n": self.n, "method": "exact_jaccard"}

    def apply(self, rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
        kept_by_prompt: dict[str, list[set]] = {}
        kept = []
        for row in rows:
            shingles = word_ngrams(row["completion"], self.n)
            earlier = kept_by_prompt.setdefault(_normalized(row["prompt"]), [])
            if any(jaccard(shingles, other) >= self.threshold for other in earlier):
                continue
            earlier.append(shingles)
            kept.append(row)
        removed = len(rows) - len(kept)
        return kept, ({"near_duplicate": removed} if removed else {})


@_register("length")
@dataclass(frozen=True)
class Length:
    """Keeps completions with min <= length <= max (either bound optional), in characters
    (`unit="chars"`) or tokens (`unit="tokens"`: `len(tokenizer.encode(text))`, no BOS/EOS),
    of the completion with surrounding whitespace stripped: a blank completion has length 0,
    as `SFTDataset` sees it (it refuses an empty assistant turn).

    Raises:
        ValueError: for a negative bound, min > max, no bound at all, or `unit="tokens"`
            without a tokenizer.
    """

    min_length: int | None = None
    max_length: int | None = None
    unit: str = "chars"
    tokenizer: Tokenizer | None = None
    name: str = "length"
    version = "1"
    needs = ("completion",)
    adds = ()

    def __post_init__(self) -> None:
        check_int("Length.min_length", self.min_length, minimum=0, optional=True)
        check_int("Length.max_length", self.max_length, minimum=0, optional=True)
        if self.unit not in ("chars", "tokens"):
            raise ValueError(f"Length.unit={self.unit!r}; allowed: 'chars', 'tokens'")
        if self.unit == "tokens" and self.tokenizer is None:
            raise ValueError("Length.unit='tokens' needs a tokenizer (Length(..., tokenizer=tok))")
        if self.min_length is None and self.max_length is None:
            raise ValueError("Length needs min_length, max_length or both")
        low, high = self.min_length, self.max_length
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"Length.min_length={self.min_length} > Length.max_length="
                f"{self.max_length}; min_length must be <= max_length"
            )

    def params(self) -> dict[str, Any]:
        return {"min_length": self.min_length, "max_length": self.max_length, "unit": self.unit}

    def apply(self, rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
        kept, removed = [], Counter[str]()
        tokenizer = self.tokenizer
        for row in rows:
            text = row["completion"].strip()
            if self.unit == "tokens":
                assert tokenizer is not None  # __post_init__ refuses unit "tokens" without one
                size = len(tokenizer.encode(text))
            else:
                size = len(text)
            if self.min_length is not None and size < self.min_length:
                removed["too_short"] += 1
            elif self.max_length is not None and size > self.max_length:
                removed["too_long"] += 1
            else:
                kept.append(row)
        return kept, dict(removed)


@_register("min_score")
@dataclass(frozen=True)
class MinScore:
    """Keeps rows with `score >= threshold` (rejection sampling keeps the verified ones:
    `MinScore(1.0)` after a verifier's `Score`)."""

    threshold: float = 1.0
    name: str = "min_score"
    version = "1"
    needs = ("score",)
    adds = ()

    def __post_init__(self) -> None:
        _real("MinScore", "threshold", self.threshold)

    def params(self) -> dict[str, Any]:
        return {"threshold": self.threshold}

    def apply(self, rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
        kept = [r for r in rows if r["score"] >= self.threshold]
        removed = len(rows) - len(kept)
        return kept, ({"below_threshold": removed} if removed else {})


_TOKEN = re.compile(r"\w+|[^\w\s]")


def decontamination_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """Word n-grams for decontamination: lowercased words and single symbol characters
    ("3 + 4 = 7" is 5 tokens: 3, +, 4, =, 7); a text of fewer than n tokens has none."""
    tokens = _TOKEN.findall(text.lower())
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


@_register("decontaminate")
@dataclass(frozen=True)
class Decontaminate:
    """Removes every row whose prompt or completion shares any n-gram (`decontamination_ngrams`)
    with any text of any held-out set.

    Default n = 13, GPT-3's (Brown et al. 2020, Appendix C), the common practice for web-scale
    text. A text of fewer than n tokens has no n-gram and matches nothing, so for short items
    (a chain_sum question is ~14 tokens, its answer 1-2) pass a small n; a small n also matches
    shared templates ("the final answer to"), so give the held-out texts that identify an item.

    Args:
        held_out: set name -> texts (str) or items (mappings: their "question" and "answer").
        n: tokens per n-gram (>= 1).
    """

    held_out: Mapping[str, Sequence[str | Mapping[str, Any]]]
    n: int = DEFAULT_DECONTAMINATION_N
    name: str = "decontaminate"
    version = "1"
    needs = ("prompt", "completion")
    adds = ()

    def __post_init__(self) -> None:
        check_int("Decontaminate.n", self.n, minimum=1)
        if not isinstance(self.held_out, Mapping) or not self.held_out:
            raise ValueError(
                f"Decontaminate.held_out={self.held_out!r:.80}; must be a non-empty "
                f"dict of set name -> list of texts or items"
            )
        grams: dict[tuple[str, ...], str] = {}
        for set_name, texts in self.held_out.items():
            if isinstance(texts, (str, bytes, Mapping)) or not isinstance(texts, Sequence):
                raise ValueError(
                    f"Decontaminate.held_out[{set_name!r}] is a "
                    f"{type(texts).__name__}; must be a list of texts or items"
                )
            for text in texts:
                for part in _texts_of(text, set_name):
                    for gram in decontamination_ngrams(part, self.n):
                        grams.setdefault(gram, str(set_name))
        object.__setattr__(self, "_grams", grams)

    def params(self) -> dict[str, Any]:
        return {"n": self.n, "held_out": {str(k): len(v) for k, v in self.held_out.items()}}

    def apply(self, rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
        kept, removed = [], Counter[str]()
        grams: dict[tuple[str, ...], str] = vars(self)["_grams"]  # set in __post_init__
        for row in rows:
            hit = next(
                (
                    grams[g]
                    for field_ in ("prompt", "completion")
                    for g in decontamination_ngrams(row[field_], self.n)
                    if g in grams
                ),
                None,
            )
            if hit is None:
                kept.append(row)
            else:
                removed[f"held_out:{hit}"] += 1
        return kept, dict(removed)


def _texts_of(entry: Any, set_name: Any) -> list[str]:
    if isinstance(entry, str):
        return [entry]
    if isinstance(entry, Mapping):
        return [str(entry[k]) for k in ("question", "answer") if entry.get(k) is not None]
    raise ValueError(
        f"Decontaminate.held_out[{set_name!r}] holds a {type(entry).__name__}; "
        f"entries must be str or mappings with 'question'/'answer'"
    )
