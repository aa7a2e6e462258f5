"""Preference pairs by rejection sampling: the stage the DPO-family run
(`posttrain.workflows.preference`) and the reward-model run (`posttrain.workflows.reward_model`)
share, and the `pairs` section's meaning in both.

`pairs.samples_per_prompt` completions of each of the first `pairs.num_prompts` training
questions of a reasoning-gym task, sampled from the starting policy (section `sampling`; by
the engine of section `rollout`: builtin, or a vllm server in the run folder's vllm/) and
ranked by the task's verifier; the best against the worst where they rank differently
(`posttrain.preference.pairs.make_preference_pairs`); with `pairs.reference_answer` the task's
own answer joins the candidates. The pairs and their statistics are stage files of the run
folder (`cached_pairs`: read back, checked, on resume); under a plan rank 0 samples them and
broadcasts them to the other ranks. A pair whose answer is empty, or too long once decoded and
encoded again, is data: left out and counted (`usable_pairs`) before any split.

Both runs' configs are a `PairsRunConfig`: the stages they share (the starting policy and its SFT
warm start, the pairs and their sampling, the trained model's optimizer, checkpoints, plan,
adapters and quantisation, the run folder), each with the run's own defaults over them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from posttrain.data.preference_batches import PreferenceLoader
from posttrain.policy.policy import Policy
from posttrain.preference.pairs import make_preference_pairs, usable_pairs
from posttrain.preference.parallel import ShardedPreferenceLoader
from posttrain.train.runtime import Runtime
from posttrain.workflows.pairs_config import PairsRunConfig  # importable from here too
from posttrain.workflows.recipe_run import RecipeRun
from posttrain.workflows.reports import cached_pairs, on_rank_zero

if TYPE_CHECKING:
    from posttrain.policy.engine_slot import EngineSlot

__all__ = ["PairsRunConfig", "sampled_pairs", "reference_answer", "pair_loader"]


def reference_answer(item: Mapping[str, Any]) -> str:
    """The task's own answer text, as a candidate completion."""
    return str(item["answer"])


def sampled_pairs(
    run: RecipeRun,
    policy: Policy,
    task: Any,
    *,
    max_seq_len: int,
    stats_file: str,
    engines: EngineSlot | None = None,
) -> tuple[list[Mapping[str, Any]], dict[str, Any], dict[str, int]]:
    """The pairs of `run` (whose config has `pairs`, `sampling`, `seed` and `resume`) from
    `policy` on `task` (a `ReasoningGymTask`: its `train_items` and `verifier`).

    Args:
        engines: the run's engine slot (`RolloutConfig.slot`): the pairs are sampled by
            `engines.sampler(policy)` (nothing starts when they are read back on resume);
            None samples with `policy` itself.
        max_seq_len: the longest pair (prompt and answer, in tokens) the next stage takes.
        stats_file: the run folder's file of the sampling statistics.

    Returns:
        (rows, statistics, unusable): the usable pairs ({"prompt", "chosen", "rejected"}), the
        `PairStats` dict, and the pairs left out by reason ({} when none).

    Raises:
        StageFileError: on resume, if `pairs.jsonl` or the statistics were cut or changed.
    """
    cfg = run.cfg

    def make() -> tuple[list[dict], dict[str, Any]]:
        s = cfg.sampling
        rows, stats = make_preference_pairs(
            policy if engines is None else engines.sampler(policy),
            task.train_items[: cfg.pairs.num_prompts],
            rank=task.verifier,
            n=cfg.pairs.samples_per_prompt,
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=cfg.seed,
            reference_answer=reference_answer if cfg.pairs.reference_answer else None,
        )
        return rows, stats.as_dict()

    def pairs() -> tuple[list[dict], dict[str, Any]]:
        return cached_pairs(run.out, resume=cfg.resume, make=make, stats_file=stats_file)

    sampled, stats = pairs() if run.plan is None else on_rank_zero(pairs)
    rows, unusable = usable_pairs(sampled, policy.tokenizer, max_seq_len=max_seq_len)
    return rows, stats, unusable


def pair_loader(
    dataset: Any, *, batch_size: int, seed: int, runtime: Runtime | None
) -> PreferenceLoader:
    """The training loader of pairs (or KTO rows) in `dataset`: `batch_size` per global batch in
    a `seed`ed order; with the `runtime` of a model split by a plan, this rank's share of each
    batch (`ShardedPreferenceLoader` over the runtime's data-parallel ranks)."""
    if runtime is None:
        return PreferenceLoader(dataset, batch_size=batch_size, seed=seed)
    return ShardedPreferenceLoader(
        dataset,
        batch_size=batch_size,
        seed=seed,
        rank=runtime.data_rank,
        world_size=runtime.data_size,
    )
