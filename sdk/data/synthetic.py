"""Synthetic SFT data: generate -> score (verifier or judge) -> filter -> rows with provenance.

`generate_candidates` samples `n` completions per prompt from a policy or a teacher;
`SyntheticPipeline(stages).run(rows)` applies the stages in order and returns a
`SyntheticResult`: the kept rows, each with its provenance, and `stats`, a pandas DataFrame with
one row per stage (rows_in == removed + rows_out, and each stage's rows_in is the previous
stage's rows_out). Rejection sampling is `n > 1` followed by `Score` and `MinScore(1.0)`.

    ===============  =============================================================================
    stage (name)     removes (reason in `stats.reasons`)
    ===============  =============================================================================
    score            rows whose scoring failed: outcome "timeout" / "error" (never scored 0.0);
                     every other row gets `score`, `outcome`, `reason`
    exact_dedup      repeats of a (prompt, completion) pair, whitespace runs collapsed ("duplicate")
    near_dedup       completions of the same prompt whose word-n-gram Jaccard with an earlier kept
                     one is >= threshold ("near_duplicate")
    length           completions outside [min, max] characters or tokens ("too_short", "too_long")
    min_score        rows with score < threshold ("below_threshold")
    decontaminate    rows whose prompt or completion shares an n-gram with a held-out text
                     ("held_out:<set name>", the first set that matches)
    ===============  =============================================================================

Stages are objects (`NearDedup(threshold=0.8)`) or names with options (`"exact_dedup"`,
`("length", {"max_length": 200})`), built through one registry (`build_stage`). Every option is
checked when the stage is built, and the pipeline checks that each row field a stage reads is
present or added by an earlier stage before any stage runs, so a bad config fails before
anything is scored (build the pipeline before calling `generate_candidates`, or use
`SyntheticPipeline.generate_and_run`).

Scoring without an upward import: this module is in the `data` layer, below `rewards`, so
`Score` takes a batch scorer `(completions, items) -> results` (each result with `.score` and
`.outcome`, i.e. a `VerifierResult`): a verifier through the existing runner and its time
budgets is `functools.partial(posttrain.rewards.verifier.score_batch, verifier, timeout_s=5.0)`;
a judge is passed as itself (its `judge` method has that signature) or, for a time budget, as
`partial(score_batch, judge_as_verifier(judge), timeout_s=...)`.

Example (an untrained tiny policy: its chain_sum answers are wrong, so the threshold is 0):
    >>> from functools import partial
    >>> from posttrain.envs import chain_sum_task
    >>> from posttrain.policy import Policy
    >>> from posttrain.rewards.verifier import score_batch
    >>> task = chain_sum_task(size=4, held_out_size=2)
    >>> pipeline = SyntheticPipeline([
    ...     Score(partial(score_batch, task.verifier, timeout_s=5.0)), "exact_dedup",
    ...     NearDedup(threshold=0.9), Length(min_length=1), MinScore(0.0),
    ...     Decontaminate({"held_out": task.held_out()}, n=13)])
    >>> rows = generate_candidates(Policy.from_spec("tiny-1m", seed=0), task.train_items, n=2,
    ...                            max_new_tokens=4, seed=0)
    >>> result = pipeline.run(rows)
    >>> list(result.stats.columns)
    ['stage', 'params', 'rows_in', 'removed', 'rows_out', 'reasons']
    >>> int(result.stats.rows_in.iloc[0]), sorted(result.dataset_rows[0]["provenance"])
    (8, ['generation', 'stages'])
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.core.checks import check_int
from posttrain.data.synthetic_stages import (
    DEFAULT_DECONTAMINATION_N,
    DEFAULT_NEAR_DUP_N,
    DEFAULT_NEAR_DUP_THRESHOLD,
    FAILED_OUTCOMES,
    STAGES,
    Decontaminate,
    ExactDedup,
    Length,
    MinScore,
    NearDedup,
    Score,
    Stage,
    build_stage,
)
from posttrain.policy.policy import generate_for_items

__all__ = [
    "generate_candidates",
    "GENERATED_FIELDS",
    "SyntheticPipeline",
    "SyntheticResult",
    "Stage",
    "Score",
    "ExactDedup",
    "NearDedup",
    "Length",
    "MinScore",
    "Decontaminate",
    "STAGES",
    "build_stage",
    "FAILED_OUTCOMES",
    "DEFAULT_DECONTAMINATION_N",
    "DEFAULT_NEAR_DUP_N",
    "DEFAULT_NEAR_DUP_THRESHOLD",
]


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


def generate_candidates(
    policy: Any,
    prompts: Sequence[str | Mapping[str, Any]],
    *,
    n: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    source: str = "policy",
    chat: bool = True,
    prompts_per_batch: int = 64,
) -> list[dict]:
    """`n` sampled completions of each prompt, one row each (prompt-major).

    Args:
        policy: a `posttrain.policy.Policy` (the policy itself or a teacher), or a rollout
            engine holding its weights (`posttrain.policy.rollout_engine`: "builtin" gives the
            same rows, "vllm" samples through a vLLM server); sampled through
            `posttrain.policy.generate_for_items`.
        prompts: questions (str) or task items (mappings with a str "question", e.g.
            `task.train_items`; a verifier in `Score` reads the item).
        n: samples per prompt (>= 1). max_new_tokens, temperature, top_p: sampling.
        seed: `Policy.generate` gets `seed + index of the chunk's first prompt` (deterministic).
        source: who generated, recorded on every row ("policy", "teacher:qwen2-7b", ...).
        chat: render each question as a one-turn chat prompt (what `SFTDataset` trains on) or
            feed the raw question after BOS.
        prompts_per_batch: prompts per `generate` call (memory: prompts_per_batch * n rows).

    Returns:
        Rows {"prompt" (the question), "completion", "source", "prompt_id" (index in
        `prompts`), "sample_index", "seed" (given to `generate`), "finish_reason", "item",
        "provenance": {"generation": {source, n, max_new_tokens, temperature, top_p, seed, chat}}}.

    Raises:
        ValueError: for n, max_new_tokens or prompts_per_batch < 1, a negative or non-int seed,
            an empty `source` or `prompts`, or a prompt that is neither a str nor a mapping with
            a str "question"; all checked before anything is generated.
    """
    _check_generation(prompts, n, max_new_tokens, seed, prompts_per_batch, source)
    items = [{"question": p} if isinstance(p, str) else dict(p) for p in prompts]
    generation = {
        "source": source,
        "n": n,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "chat": chat,
    }
    rows = []
    for start, chunk, completions in generate_for_items(
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
        for c in completions:
            item = chunk[c.prompt_index]
            rows.append(
                {
                    "prompt": item["question"],
                    "completion": c.text,
                    "source": source,
                    "prompt_id": start + c.prompt_index,
                    "sample_index": c.sample_index,
                    "seed": seed + start,
                    "finish_reason": c.finish_reason,
                    "item": item,
                    "provenance": {"generation": dict(generation)},
                }
            )
    return rows


GENERATED_FIELDS = (
    "prompt",
    "completion",
    "source",
    "prompt_id",
    "sample_index",
    "seed",
    "finish_reason",
    "item",
    "provenance",
)
"""The fields of every row `generate_candidates` returns."""


def _check_generation(
    prompts: Any, n: Any, max_new_tokens: Any, seed: Any, prompts_per_batch: Any, source: Any
) -> None:
    check_int("n", n, minimum=1)
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_int("prompts_per_batch", prompts_per_batch, minimum=1)
    check_int("seed", seed, minimum=0)
    if not isinstance(source, str) or not source:
        raise ValueError(f"source={source!r}; must be a non-empty str naming the generator")
    if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Sequence):
        raise ValueError(
            f"prompts must be a list of str or of items with a 'question', got a "
            f"{type(prompts).__name__}"
        )
    if not prompts:
        raise ValueError("prompts is empty; nothing to generate")
    for i, p in enumerate(prompts):
        if not (
            isinstance(p, str) or isinstance(p, Mapping) and isinstance(p.get("question"), str)
        ):
            raise ValueError(
                f"prompts[{i}] is {p!r:.80}; expected a str or a mapping with a str 'question'"
            )


# --------------------------------------------------------------------------------------------
# Pipeline and result
# --------------------------------------------------------------------------------------------


@dataclass
class SyntheticResult:
    """What `SyntheticPipeline.run` kept and what each stage removed.

    Attributes:
        dataset_rows: the kept rows: prompt, completion, source, prompt_id, sample_index, seed,
            score / outcome (after a `Score` stage), item, and "provenance": {"generation":
            sampling settings (rows from `generate_candidates`), "stages": [{name, version,
            params}, ...] of every stage the row passed}.
        stats: DataFrame, one row per stage: stage, params, rows_in, removed, rows_out,
            reasons ({reason: count}).
    """

    dataset_rows: list[dict]
    stats: Any

    def to_sft_rows(self) -> list[dict]:
        """{"prompt", "completion"} rows, what `posttrain.data.SFTDataset` reads."""
        return [{"prompt": r["prompt"], "completion": r["completion"]} for r in self.dataset_rows]

    def to_jsonl(self, path: str | os.PathLike) -> Path:
        """Write the kept rows, provenance included, one JSON object a line (values JSON cannot
        hold are written as their str). `SFTDataset(path, ...)` reads the file as it is."""
        path = Path(path)
        with path.open("w", encoding="utf-8") as f:
            for row in self.dataset_rows:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        return path


class SyntheticPipeline:
    """Stages applied in order to candidate rows (see the module docstring).

    Args:
        stages: `Stage` objects, registered names, (name, options) pairs or {"name", ...}
            mappings; built and checked here, before any row is seen.

    Raises:
        ValueError: for no stages, an unknown stage name or option, a bad option value, or a
            stage that reads a field no earlier stage adds and rows do not start with
            ("score" needs a `Score` first unless the rows carry scores: checked in `run`).
    """

    def __init__(self, stages: Sequence[Stage | str | tuple | Mapping]) -> None:
        if isinstance(stages, (str, Mapping)) or not isinstance(stages, Sequence) or not stages:
            raise ValueError(
                f"stages must be a non-empty list of stages; registered names: "
                f"{', '.join(STAGES.names())}"
            )
        self.stages = [build_stage(s) for s in stages]

    def describe(self) -> list[dict[str, Any]]:
        """[{name, version, params}] of every stage, in order (what provenance records)."""
        return [{"name": s.name, "version": s.version, "params": s.params()} for s in self.stages]

    def _check_fields(self, rows: Sequence[Mapping]) -> None:
        have = set.intersection(*(set(r) for r in rows))
        for stage in self.stages:
            missing = [f for f in stage.needs if f not in have]
            if missing:
                raise ValueError(
                    f"stage {stage.name!r} reads row field(s) {missing}, which the "
                    f"rows lack and no earlier stage adds; put a stage that adds "
                    f"them first (a Score stage adds 'score') or give rows them"
                )
            have |= set(stage.adds)

    def run(self, rows: Sequence[Mapping[str, Any]]) -> SyntheticResult:
        """Apply the stages to `rows` (rows from `generate_candidates`, or any mappings with str
        "prompt" and "completion"); the input rows are not changed.

        Raises:
            ValueError: for empty `rows`, a row without str prompt/completion, a stage reading
                a missing field (checked before any stage runs), or a stage that removes every
                row that came in (naming the stage, its params and its removal counts).
        """
        if isinstance(rows, (str, Mapping)) or not isinstance(rows, Sequence) or not rows:
            raise ValueError("rows must be a non-empty list of row mappings")
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping) or not all(
                isinstance(row.get(k), str) for k in ("prompt", "completion")
            ):
                raise ValueError(
                    f"rows[{i}] must be a mapping with str 'prompt' and "
                    f"'completion', got {row!r:.80}"
                )
        self._check_fields(rows)
        current = [_copy_row(r) for r in rows]
        table = []
        for stage in self.stages:
            kept, reasons = stage.apply(current)
            assert sum(reasons.values()) == len(current) - len(kept), (stage.name, reasons)
            table.append(
                {
                    "stage": stage.name,
                    "params": _params_text(stage.params()),
                    "rows_in": len(current),
                    "removed": len(current) - len(kept),
                    "rows_out": len(kept),
                    "reasons": dict(reasons),
                }
            )
            if not kept:
                raise ValueError(
                    f"stage {stage.name!r} ({_params_text(stage.params())}) removed "
                    f"all {len(current)} rows that came in (reasons: {reasons}); "
                    f"loosen its parameters or check the rows it got"
                )
            current = kept
        described = self.describe()
        for row in current:
            row.setdefault("provenance", {})["stages"] = described
        import pandas as pd

        return SyntheticResult(
            current,
            pd.DataFrame(
                table, columns=["stage", "params", "rows_in", "removed", "rows_out", "reasons"]
            ),
        )

    def generate_and_run(
        self, policy: Any, prompts: Sequence[str | Mapping[str, Any]], **generation: Any
    ) -> SyntheticResult:
        """`run(generate_candidates(policy, prompts, **generation))`; the pipeline is already
        checked (in `__init__`), and so are the fields its stages read (against the fields of
        generated rows, `GENERATED_FIELDS`) and the generation arguments, before sampling."""
        self._check_fields([dict.fromkeys(GENERATED_FIELDS)])
        return self.run(generate_candidates(policy, prompts, **generation))

    def __repr__(self) -> str:
        return f"SyntheticPipeline([{', '.join(s.name for s in self.stages)}])"


def _copy_row(row: Mapping[str, Any]) -> dict:
    out = dict(row)
    if isinstance(out.get("provenance"), Mapping):
        out["provenance"] = dict(out["provenance"])
    return out


def _params_text(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())
