"""Rejection-sampling fine-tuning (RFT), also called expert iteration: sample k completions of
each prompt from the current policy, keep the ones the task's verifier accepts, fine-tune the
policy on them with the SFT loss, and repeat for N rounds.

The method: expert iteration (Anthony et al. 2017, "Thinking Fast and Slow with Deep Learning
and Tree Search": an apprentice imitates what a stronger search finds, round after round);
STaR (Zelikman et al. 2022, "STaR: Bootstrapping Reasoning With Reasoning": keep the sampled
rationales that reach the correct answer, fine-tune on them, repeat); ReST-EM (Singh et al. 2023,
"Beyond Human Data: Scaling Self-Training for Problem-Solving with Language Models": an E-step
samples and keeps the completions with binary reward 1, at most a fixed number per problem, and
an M-step fine-tunes on them). Here each round continues from the current policy with a fresh
optimizer (STaR and ReST-EM restart from the base model every iteration; continuing is RAFT's
choice, Dong et al. 2023).

What is kept, in this order (each step a `posttrain.data.synthetic` stage; the table of what each
removed is `filter_stats.csv` of the round):

    score           the task's verifier through `posttrain.rewards.verifier.score_batch` and the
                    task's time budget: a sample whose check timed out or raised is removed and
                    counted ("timeout" / "error"), never scored 0.0
    min_score       score >= 1.0: full credit only (a partial credit, e.g. countdown's 0.05, is
                    not a verified answer)
    length          a blank completion (nothing to train on) is removed
    exact_dedup     with `rft.keep="distinct"`: repeats of a (prompt, completion) pair
    max_per_prompt  with `rft.max_per_prompt` m: the first m kept samples of each prompt
                    (`MaxPerPrompt`, ReST-EM's cap)

Building blocks: `MaxPerPrompt` (the cap, a pipeline stage), `keep_stages` (the stages after
scoring), `sample_verified` (one round's samples and what is kept), `fine_tune` (one round's SFT
steps on the kept rows, under a time budget), `rft_rounds` (the loop: per-round metrics rows in
`out/metrics.jsonl`, round folders `out/rounds/round_<r>/`, resumable). The recipe's run (SFT
warm start, the rounds, held-out evaluation) is `posttrain.workflows.rft_run.run_rft`.

Example (a cap of one kept sample per prompt):
    >>> rows = [{"prompt": "1+1=", "completion": c} for c in ("2", "2", "3")]
    >>> MaxPerPrompt(1).apply(rows)
    ([{'prompt': '1+1=', 'completion': '2'}], {'over_max_per_prompt': 2})
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from posttrain.core.checkpoint_files import write_text_atomic
from posttrain.core.checks import check_int
from posttrain.core.metrics import MetricsLog
from posttrain.data.loader import SFTLoader
from posttrain.data.sft import SFTDataset
from posttrain.data.synthetic import (
    ExactDedup,
    Length,
    MinScore,
    Score,
    SyntheticPipeline,
    generate_candidates,
)
from posttrain.policy.policy import Policy
from posttrain.rewards.verifier import score_batch
from posttrain.train.losses import SFTCrossEntropy
from posttrain.train.trainer import Trainer
from posttrain.workflows.config import SamplingConfig
from posttrain.workflows.quantization import trainable_parameters
from posttrain.workflows.reports import stop_if_interrupted, write_table
from posttrain.workflows.rft_config import RFTConfig

if TYPE_CHECKING:
    from posttrain.policy.policy import Sampler

__all__ = [
    "VERIFIED_SCORE",
    "MaxPerPrompt",
    "RoundSamples",
    "keep_stages",
    "sample_verified",
    "fine_tune",
    "rft_rounds",
    "round_seed",
]

VERIFIED_SCORE = 1.0
"""The score a sample needs to be kept: the verifier's full credit."""

ROUND_SEED_STRIDE = 100_003
"""Round r samples with seed `seed + r * ROUND_SEED_STRIDE` (`round_seed`)."""


def round_seed(seed: int, round_: int) -> int:
    """The sampling seed of round `round_` (1-based) of a run seeded `seed`."""
    return seed + round_ * ROUND_SEED_STRIDE


def _prompt_key(text: str) -> str:
    return " ".join(text.split())


@dataclass(frozen=True)
class MaxPerPrompt:
    """A `SyntheticPipeline` stage: keeps the first `max_per_prompt` rows of each prompt (in
    row order; prompts compared with whitespace runs collapsed, as `ExactDedup` compares them),
    removing the rest as "over_max_per_prompt". ReST-EM caps the correct samples per problem
    the same way (Singh et al. 2023, section 3: at most 10 per problem) so that easy prompts do
    not fill the fine-tuning set.

    Raises:
        ValueError: `max_per_prompt` is not an int >= 1.
    """

    max_per_prompt: int
    name: str = "max_per_prompt"
    version = "1"
    needs = ("prompt",)
    adds = ()

    def __post_init__(self) -> None:
        check_int("MaxPerPrompt.max_per_prompt", self.max_per_prompt, minimum=1)

    def params(self) -> dict[str, Any]:
        return {"max_per_prompt": self.max_per_prompt}

    def apply(self, rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
        seen: Counter[str] = Counter()
        kept = []
        for row in rows:
            key = _prompt_key(row["prompt"])
            if seen[key] < self.max_per_prompt:
                kept.append(row)
            seen[key] += 1
        removed = len(rows) - len(kept)
        return kept, ({"over_max_per_prompt": removed} if removed else {})


def keep_stages(rft: RFTConfig) -> list[Any]:
    """The stages after scoring that `rft` asks for: `MinScore(VERIFIED_SCORE)`,
    `Length(min_length=1)`, `ExactDedup` (keep "distinct"), `MaxPerPrompt` (max_per_prompt)."""
    stages: list[Any] = [MinScore(VERIFIED_SCORE), Length(min_length=1)]  # `Stage`s
    if rft.keep == "distinct":
        stages.append(ExactDedup())
    if rft.max_per_prompt is not None:
        stages.append(MaxPerPrompt(rft.max_per_prompt))
    return stages


@dataclass
class RoundSamples:
    """One round's samples and what was kept.

    Attributes:
        rows: the kept rows (`generate_candidates` rows with score, outcome, reason and
            provenance), in sample order.
        stats: one row per stage: stage, params, rows_in, removed, rows_out, reasons
            (`SyntheticResult.stats`; only "score" when no sample was verified).
        counts: prompts, samples (prompts x k), scoring_failed (timeout / error), verified
            (score >= 1.0), prompts_solved (prompts with a verified sample), kept; and
            pass_rate = verified / samples, solved_share = prompts_solved / prompts,
            kept_share = kept / samples (fractions).
        sample_s: wall seconds of sampling, scoring and filtering.
    """

    rows: list[dict]
    stats: pd.DataFrame
    counts: dict[str, Any]
    sample_s: float


def sample_verified(
    sampler: Sampler,
    items: Sequence[Mapping[str, Any]],
    verifier: Any,
    rft: RFTConfig,
    sampling: SamplingConfig,
    *,
    seed: int,
    timeout_s: float | None,
) -> RoundSamples:
    """`rft.samples_per_prompt` completions of each item from `sampler` (a `Policy` or a
    rollout engine holding its weights), scored by `verifier` (a `Verifier`: `(completion,
    item) -> VerifierResult`, run by `score_batch` with `timeout_s` seconds a call), kept by
    `keep_stages(rft)`.

    Raises:
        ValueError: from the pipeline, if every sample's scoring failed (timeout or error:
            the verifier, not the policy, is broken) or every verified sample is blank.
    """
    start = time.perf_counter()
    rows = generate_candidates(
        sampler,
        list(items),
        n=rft.samples_per_prompt,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=seed,
    )
    score: list[Any] = [Score(partial(score_batch, verifier, timeout_s=timeout_s))]
    scored = SyntheticPipeline(score).run(rows)
    verified = [r for r in scored.dataset_rows if r["score"] >= VERIFIED_SCORE]
    kept, stats = [], scored.stats
    if verified:
        result = SyntheticPipeline(keep_stages(rft)).run(scored.dataset_rows)
        kept, stats = result.dataset_rows, pd.concat([stats, result.stats], ignore_index=True)
    prompts, samples = len(items), len(rows)
    solved = len({r["prompt_id"] for r in verified})
    counts = {
        "prompts": prompts,
        "samples": samples,
        "scoring_failed": samples - len(scored.dataset_rows),
        "verified": len(verified),
        "prompts_solved": solved,
        "kept": len(kept),
        "pass_rate": len(verified) / samples,
        "solved_share": solved / prompts,
        "kept_share": len(kept) / samples,
    }
    return RoundSamples(kept, stats, counts, time.perf_counter() - start)


def fine_tune(
    policy: Policy,
    rows: Sequence[Mapping[str, Any]],
    rft: RFTConfig,
    *,
    seed: int,
    run_dir: Path | None = None,
    budget_s: float | None = None,
    **trainer_options: Any,
) -> Trainer:
    """`rft.steps` SFT steps of `policy` (in place) on `rows` ({"prompt", "completion"}: the
    completion is the assistant turn, as sampled), a fresh optimizer and schedule
    (`rft.optim()`), batches of `rft.batch_size` in a `seed`ed order, masked cross-entropy
    normalised by the step's trained tokens (`SFTCrossEntropy`). `budget_s`: stop at the first
    step boundary where the summed `step_time_s` reaches it (None: all steps). Checkpoints,
    resume, progress and callbacks go to `Trainer` (`trainer_options`, with `run_dir`).

    Returns:
        The trainer (its `metrics`, `step_count`, `interrupted`).

    Raises:
        ValueError: for no rows, or rows with nothing to train (from `SFTDataset`).
    """
    dataset = SFTDataset(
        [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows],
        policy.tokenizer,
        max_seq_len=policy.spec.max_seq_len,
    )
    o = rft.optim()
    optimizer, schedule = o.build(trainable_parameters(policy.model))
    trainer = Trainer(
        policy.model,
        optimizer,
        data=SFTLoader(dataset, batch_size=o.batch_size, seed=seed),
        loss=SFTCrossEntropy(loss_chunk_tokens=o.loss_chunk_tokens),
        lr_scheduler=schedule,
        grad_accum_steps=o.grad_accum_steps,
        max_grad_norm=o.max_grad_norm,
        run_dir=run_dir,
        seed=seed,
        **trainer_options,
    )
    trainer.fit(o.steps, budget_s=budget_s)
    return trainer


def rft_rounds(
    policy: Policy,
    task: Any,
    rft: RFTConfig,
    sampling: SamplingConfig,
    *,
    out: Path,
    seed: int = 0,
    sampler: Callable[[Policy], Sampler] | None = None,
    resume: bool = False,
    after_round: Callable[[int, Policy], Mapping[str, Any]] | None = None,
    log: Callable[[dict[str, Any]], None] | None = None,
    **trainer_options: Any,
) -> tuple[Policy, list[dict[str, Any]]]:
    """Run `rft.rounds` rounds of RFT from `policy` on `task` (a `ReasoningGymTask`: its
    `train_items`, `verifier` and `timeout_s`); returns the policy after the last round and one
    metrics row per round, also appended to `out/metrics.jsonl`.

    Round r (1-based) samples the training items `(r-1) P .. r P - 1` (P =
    `rft.prompts_per_round`, wrapping around the training items) with seed `round_seed(seed,
    r)` (`sample_verified`), then fine-tunes on what it kept (`fine_tune`; nothing when it kept
    nothing). Its folder `out/rounds/round_<r>/` holds `kept.jsonl` (the kept rows, provenance
    included), `filter_stats.csv`, the SFT steps' `metrics.jsonl` and `checkpoints/`, the
    policy after it (`policy/`) and `round.json` (its row; written last: the round is done).

    Args:
        sampler: `policy -> sampler` of each round (the run's `EngineSlot.sampler`, which
            syncs an engine apart from the policy); None: the policy samples itself.
        resume: finished rounds are read back (the policy of the last one), an unfinished one
            reuses its kept rows and continues its SFT steps from their checkpoint.
        after_round: `(round, policy) -> {name: value}` added to the round's row (e.g. a
            held-out accuracy); its time is not counted in the budget.
        log: also called with each new row (e.g. experiment trackers).
        trainer_options: `Trainer` keywords (checkpoint_every, keep_last, progress, callbacks).

    Row of round r: step and round (r), the counts of `RoundSamples.counts`, sft_steps,
    trained_tokens (summed over its steps), loss (its last step's; absent when it trained
    nothing), sample_s, train_s (its SFT steps' summed `step_time_s`), step_time_s = sample_s +
    train_s, spent_s (the rounds so far together: what `rft.budget_s` bounds), and what
    `after_round` adds. Times are wall seconds (`time.perf_counter`).

    Raises:
        RunInterrupted: on Ctrl-C during a round's SFT steps (checkpointed; resume continues).
        ValueError: as `sample_verified`.
    """
    metrics = MetricsLog(out)
    rows: list[dict[str, Any]] = []
    train_items = list(task.train_items)
    for r in range(1, rft.rounds + 1):
        folder = out / "rounds" / f"round_{r}"
        if resume and (folder / "round.json").is_file():  # finished before the restart
            rows.append(json.loads((folder / "round.json").read_text()))
            policy = Policy.from_pretrained(folder / "policy")
            continue
        if resume and not metrics.rows:  # the finished rounds' rows, nothing a killed run added
            metrics.reset(rows)
        spent = sum(row["step_time_s"] for row in rows)
        if rft.budget_s is not None and spent >= rft.budget_s:
            break
        start = (r - 1) * rft.prompts_per_round
        items = [train_items[(start + i) % len(train_items)] for i in range(rft.prompts_per_round)]
        samples = _round_samples(
            folder, policy, items, task, rft, sampling, round_seed(seed, r), sampler, resume
        )
        left = None if rft.budget_s is None else rft.budget_s - spent - samples.sample_s
        row: dict[str, Any] = {"step": r, "round": r, **samples.counts}
        trained = None
        if samples.rows and (left is None or left > 0):
            trained = fine_tune(
                policy,
                samples.rows,
                rft,
                seed=seed + r,
                run_dir=folder,
                budget_s=left,
                resume=resume,
                **trainer_options,
            )
            stop_if_interrupted(trained, out, {"rounds_done": r - 1})
        t = trained.metrics if trained is not None else pd.DataFrame()
        train_s = float(t["step_time_s"].sum()) if len(t) else 0.0
        if len(t):  # a round that trained nothing has no loss
            row["loss"] = float(t["loss"].iloc[-1])
        row.update(
            sft_steps=len(t),
            trained_tokens=int(t["trained_tokens"].sum()) if len(t) else 0,
            sample_s=samples.sample_s,
            train_s=train_s,
            step_time_s=samples.sample_s + train_s,
            spent_s=spent + samples.sample_s + train_s,
        )
        if after_round is not None:
            row.update(after_round(r, policy))
        policy.save(folder / "policy")
        write_text_atomic(folder / "round.json", json.dumps(row))
        metrics.append(row)
        if log is not None:
            log(row)
        rows.append(row)
    if resume and len(metrics.rows) != len(rows):  # every round had finished before
        metrics.reset(rows)
    return policy, rows


def _round_samples(
    folder: Path,
    policy: Policy,
    items: list[dict],
    task: Any,
    rft: RFTConfig,
    sampling: SamplingConfig,
    seed: int,
    sampler: Callable[[Policy], Sampler] | None,
    resume: bool,
) -> RoundSamples:
    """The round's `sample_verified`, or, on resume, what it kept before the restart
    (`kept.jsonl`, `samples.json`; written once sampling ended)."""
    done = folder / "samples.json"
    if resume and done.is_file():
        saved = json.loads(done.read_text())
        kept = [json.loads(line) for line in (folder / "kept.jsonl").read_text().splitlines()]
        stats = pd.read_csv(folder / "filter_stats.csv")
        return RoundSamples(kept, stats, saved["counts"], saved["sample_s"])
    samples = sample_verified(
        policy if sampler is None else sampler(policy),
        items,
        task.verifier,
        rft,
        sampling,
        seed=seed,
        timeout_s=task.timeout_s,
    )
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        folder / "kept.jsonl",
        "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in samples.rows),
    )
    write_table(samples.stats, folder / "filter_stats.csv")
    write_text_atomic(done, json.dumps({"counts": samples.counts, "sample_s": samples.sample_s}))
    return samples
