"""Preference pairs by rejection sampling (`make_preference_pairs`): `n` completions per prompt
from the policy, ranked by a verifier or judge through `posttrain.rewards.verifier.score_batch`,
best against worst; `PairStats` counts what was kept, skipped and excluded.

The rows it returns are what `posttrain.data.preference.PreferenceDataset` reads.

Example:
    >>> stats = PairStats(prompts=2, samples=8, pairs=1, skipped_all_equal=1)
    >>> stats.as_dict()["pairs"], stats.as_dict()["excluded"]
    (1, {})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.policy.policy import generate_for_items
from posttrain.rewards.verifier import DEFAULT_TIMEOUT_S, Outcome, count_outcomes, score_batch

__all__ = ["PairStats", "make_preference_pairs", "usable_pairs"]


@dataclass
class PairStats:
    """Counts of `make_preference_pairs`: prompts, samples (completions drawn), pairs kept,
    skipped_all_equal (every usable candidate ranked the same), skipped_too_few (fewer than two
    usable candidates), excluded (candidates left out, by outcome: timeout / error, and
    format_error with format_error="exclude"), outcomes (of every candidate scored),
    reference_chosen (pairs whose chosen is the reference answer)."""

    prompts: int = 0
    samples: int = 0
    pairs: int = 0
    skipped_all_equal: int = 0
    skipped_too_few: int = 0
    excluded: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    reference_chosen: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_preference_pairs(
    policy: Any,
    items: Sequence[Mapping[str, Any]],
    *,
    rank: Callable[[str, Mapping[str, Any]], Any],
    n: int = 8,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    prompts_per_batch: int = 64,
    chat: bool = True,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    format_error: Literal["lowest", "exclude"] = "lowest",
    reference_answer: Callable[[Mapping[str, Any]], str] | None = None,
) -> tuple[list[dict], PairStats]:
    """Preference pairs by rejection sampling: `n` completions per item's question, ranked, and
    the best against the worst when they rank differently (best-vs-worst of n, as in RSO / the
    Llama 2 rejection-sampling recipe).

    Ranking: every candidate goes through `posttrain.rewards.verifier.score_batch(rank, ...)`,
    so `rank` is a verifier (typed `VerifierResult`s) or any `(completion, item) -> float`
    (a judge). Outcomes ok / wrong rank by score. timeout / error are excluded and counted,
    never scored 0. format_error (no answer found: the policy's fault) ranks below every scored
    candidate (`format_error="lowest"`) or is excluded ("exclude"). Ties go to the earliest
    sample.

    Args:
        policy: a `posttrain.policy.policy.Policy`, or a rollout engine holding its weights
            (`posttrain.policy.rollout_engine`: "builtin" gives the same pairs, "vllm" samples
            through a vLLM server); sampled through `posttrain.policy.generate_for_items`.
        items: mappings with a "question" (the user turn) and whatever `rank` reads.
        rank: verifier or scoring callable.
        n: completions per prompt (>= 2). max_new_tokens, temperature, top_p: sampling.
        seed: `Policy.generate` seeds, `seed + first item index` per chunk (deterministic).
        prompts_per_batch: prompts per `generate` call (memory: prompts_per_batch * n rows).
        chat: prompt with the one-turn chat template (True) or the raw question after BOS.
        timeout_s: the ranker's per-call budget. format_error: see above.
        reference_answer: `item -> str`; if given, that text joins the candidates (after the
            samples, ranked by `rank` like them), so a prompt whose samples all fail still gives
            a pair. Off-policy: off by default.

    Returns:
        rows {"prompt", "chosen", "rejected", "chosen_score", "rejected_score",
        "chosen_outcome", "rejected_outcome"} (prompt = the question; feed to
        `PreferenceDataset`), and the `PairStats`.

    Raises:
        ValueError: for n < 2, an item without a str "question", or a bad format_error.
        TypeError: `policy` is neither a Policy nor a rollout engine.
    """
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"n={n!r}; rejection sampling needs at least 2 completions per prompt")
    if format_error not in ("lowest", "exclude"):
        raise ValueError(f"format_error={format_error!r}; allowed: 'lowest', 'exclude'")
    for i, item in enumerate(items):
        if not isinstance(item.get("question"), str):
            raise ValueError(f"items[{i}] has no str 'question'")
    stats = PairStats(prompts=len(items))
    stats.outcomes = {o.value: 0 for o in Outcome}
    rows: list[dict] = []
    for _, chunk, completions in generate_for_items(
        policy,
        items,
        batch_size=prompts_per_batch,
        chat=chat,
        seed=seed,
        n=n,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
    ):
        stats.samples += len(completions)
        texts = [[c.text for c in completions[j * n : (j + 1) * n]] for j in range(len(chunk))]
        if reference_answer is not None:
            texts = [t + [reference_answer(it)] for t, it in zip(texts, chunk)]
        flat = [(t, it) for ts, it in zip(texts, chunk) for t in ts]
        results = score_batch(
            rank, [t for t, _ in flat], [it for _, it in flat], timeout_s=timeout_s
        )
        for outcome, count in count_outcomes(results).items():
            stats.outcomes[outcome] += count
        at = 0
        for ts, item in zip(texts, chunk):
            candidates = []
            for k, (text, result) in enumerate(zip(ts, results[at : at + len(ts)])):
                if result.outcome in (Outcome.TIMEOUT, Outcome.ERROR) or (
                    result.outcome is Outcome.FORMAT_ERROR and format_error == "exclude"
                ):
                    stats.excluded[result.outcome.value] = (
                        stats.excluded.get(result.outcome.value, 0) + 1
                    )
                    continue
                key = (0, 0.0) if result.outcome is Outcome.FORMAT_ERROR else (1, result.score)
                candidates.append((key, k, text, result))
            at += len(ts)
            if len(candidates) < 2:
                stats.skipped_too_few += 1
                continue
            best = max(candidates, key=lambda c: (c[0], -c[1]))
            worst = min(candidates, key=lambda c: (c[0], c[1]))
            if best[0] == worst[0] or best[2] == worst[2]:
                stats.skipped_all_equal += 1
                continue
            stats.pairs += 1
            stats.reference_chosen += reference_answer is not None and best[1] == n
            rows.append(
                {
                    "prompt": item["question"],
                    "chosen": best[2],
                    "rejected": worst[2],
                    "chosen_score": best[3].score,
                    "rejected_score": worst[3].score,
                    "chosen_outcome": best[3].outcome.value,
                    "rejected_outcome": worst[3].outcome.value,
                }
            )
    return rows, stats


def usable_pairs(
    rows: Sequence[Mapping[str, Any]], tokenizer: Any, *, max_seq_len: int, chat: bool = True
) -> tuple[list[Mapping[str, Any]], dict[str, int]]:
    """The rows of `make_preference_pairs` that `PreferenceDataset(..., max_seq_len=...)` takes,
    and the count of the others by reason (`posttrain.data.rows.BAD_ROW_REASONS`:
    "empty_response", a sampled answer that was only an end token; "overlong", prompt + answer
    past `max_seq_len`, e.g. sampled bytes that are not UTF-8 decode to U+FFFD and encode again
    to three bytes each). Such a pair is data, not an error: a recipe leaves it out, counted,
    before it splits the rest into training and validation pairs.
    """
    from posttrain.data.preference import PreferenceDataset
    from posttrain.data.rows import BadRowError

    kept: list[Mapping[str, Any]] = []
    skipped: dict[str, int] = {}
    for row in rows:
        try:
            PreferenceDataset([row], tokenizer, max_seq_len=max_seq_len, chat=chat)
        except BadRowError as e:
            skipped[e.reason] = skipped.get(e.reason, 0) + 1
            continue
        kept.append(row)
    return kept, skipped
