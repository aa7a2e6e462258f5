"""A Bradley-Terry reward model from a policy's preference pairs: SFT policy -> pairs by
rejection sampling -> reward model -> held-out pairwise accuracy. The run of
`recipes/reward_model.py` (`RewardModelRunConfig`, `run_reward_model`).

Stages, on a reasoning-gym task (the task's own question text):
  1. The policy: `model.init_from` (a HF folder), or the SFT warm start of a fresh tiny policy
     (`posttrain.workflows.sft.warm_start`, section `sft`; run folder `sft/`).
  2. Pairs (`posttrain.workflows.pairs`): `pairs.samples_per_prompt` sampled answers to each of
     `pairs.num_prompts` questions generated from `prompt_seed`, ranked by the task's verifier;
     the best against the worst when they rank differently (format_error ranks lowest;
     timeouts and errors are excluded, counted). The SFT held-out questions never become pair
     prompts. Pairs go to `pairs.jsonl`.
  3. Split by question (seeded, `split_by_question`): `held_out_fraction` of the questions give
     the held-out pairs.
  4. `RewardModel.from_policy(policy)` (the policy's backbone + a scalar head; Ouyang et al.
     2022, section 3.5) trained by the `Trainer` with the "bradley_terry" loss; held-out
     pairwise accuracy (r_chosen > r_rejected, 95% Wilson interval) before and after, and every
     `eval.every` steps in metrics.jsonl.
  5. Save `reward_model/` (`RewardModelJudge.from_pretrained` loads it; reloading is checked to
     give the same accuracy). The policy the pairs were sampled from is `model.init_from`, or
     `sft/policy/` when the run trained one.

Run folder: `results.json` / `results.md`, `metrics.jsonl`, `checkpoints/`, `pairs.jsonl`,
`reward_model/`, `sft/` (when the run trained the policy).

Own pairs (`data.train`, section `data`; `posttrain.workflows.own_pairs`): the user's
(prompt, chosen, rejected) rows replace stages 2-3: `data.eval`, or `data.eval_fraction` of the
prompts (not `held_out_fraction`), give the held-out pairs, and the policy whose backbone the
reward model starts from is `model.init_from`, or the SFT warm start on the training pairs'
chosen responses (as the reward model of Ouyang et al. 2022 starts from the SFT model). Held-out
pairwise accuracy and Bradley-Terry loss as above; no task item is sampled.

With a `parallel` plan (a job of its world size; section `parallel`): the SFT stage and the
reward model (head included, `parallelize_reward_model`) are split by it, rank 0 samples the
pairs (broadcast to the others), the pairs are sharded over the data-parallel ranks, every rank
takes part in the held-out scoring, and rank 0 saves the gathered weights; only rank 0 returns
the results (the others None).

Example:
    >>> rows = [{"prompt": p, "chosen": "1", "rejected": "2"} for p in "abcde"]
    >>> train, held = split_by_question(rows, 0.4, seed=0)
    >>> len(train), len(held), {r["prompt"] for r in held}.isdisjoint(r["prompt"] for r in train)
    (3, 2, True)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from posttrain.data import PreferenceDataset
from posttrain.preference import BradleyTerryLoss, gathered_reward_model, parallelize_reward_model
from posttrain.rewards import PairwiseAccuracy, RewardModel, load_reward_model, pairwise_accuracy
from posttrain.train import Trainer
from posttrain.workflows.own_pairs import own_pairs, own_start_policy
from posttrain.workflows.pairs import pair_loader, sampled_pairs
from posttrain.workflows.quantization import (
    convert_for_training,
    export_adapters,
    trainable_parameters,
)
from posttrain.workflows.recipe_run import RecipeRun
from posttrain.workflows.reward_model_config import (  # importable from here too
    RewardModelRunConfig,
    split_by_question,
)
from posttrain.workflows.run_state import recorded_run
from posttrain.workflows.sft import start_policy
from posttrain.workflows.task_data import training_task

if TYPE_CHECKING:
    from posttrain.policy.engine_slot import EngineSlot

__all__ = ["RewardModelRunConfig", "run_reward_model", "split_by_question"]


@recorded_run
def run_reward_model(cfg: RewardModelRunConfig) -> dict[str, Any] | None:
    """Run policy -> pairs -> reward model -> held-out pairwise accuracy; returns the results
    dict also written to `out_dir/results.json` (under a `parallel` plan on rank 0; None on the
    other ranks).

    Raises:
        ValueError: before writing anything if `out_dir` (or its `sft/`) already holds a run
            and `cfg.resume` is False, `cfg.parallel` does not fit the job, or the task's data
            does not fit the config (`check_task_fits`); later, if the pairs are too few to
            split.
        RuntimeError: if the saved reward model does not reproduce the trained one's accuracy.
    """
    run = RecipeRun.start(cfg, sub_runs=("sft",))
    with cfg.rollout.slot(run.out) as engines:  # a vllm server stops when the run ends
        return _run(run, cfg, engines)


def _run(run: RecipeRun, cfg: RewardModelRunConfig, engines: EngineSlot) -> dict[str, Any] | None:
    """`run_reward_model` after its start: `engines` samples the pairs (rank 0)."""
    out = run.out
    source: str | None = None
    rows: list[Mapping[str, Any]] = []
    pair_stats: dict[str, Any] = {}
    unusable: dict[str, int] = {}
    if cfg.data.given:  # 1-2. own pairs, and the policy: model.init_from or SFT on the chosen
        own = own_pairs(cfg.data, cfg.model.tokenizer(), max_seq_len=cfg.own_seq_len(), kto=False)
        policy, sft_results = own_start_policy(cfg, out, own)
        policy_s = run.seconds()
        train, held, source = own.train, own.held, own.name
        # pairs (kto=False); `check` asks for held-out ones
        assert isinstance(train, PreferenceDataset) and isinstance(held, PreferenceDataset)
        pairs_s = 0.0
        if run.writes:
            print(
                f"{source}: {len(train)} train, {len(held)} held-out pairs "
                f"({train.stats.as_dict()})"
            )
    else:
        # 1. the policy that samples the pairs
        policy, sft_results = start_policy(cfg, out)
        policy_s = run.seconds()

        # 2. pairs by rejection sampling, ranked by the task's verifier; split by question
        task = training_task(cfg, size=cfg.pairs.num_prompts, seed=cfg.prompt_seed)
        rows, pair_stats, unusable = sampled_pairs(
            run,
            policy,
            task,
            max_seq_len=policy.spec.max_seq_len,
            stats_file="pairs_stats.json",
            engines=engines,
        )
        train_rows, held_rows = split_by_question(rows, cfg.held_out_fraction, seed=cfg.seed)
        pairs_s = run.seconds() - policy_s
        if run.writes:
            print(
                f"{len(rows)} pairs from {pair_stats['prompts']} prompts "
                f"({len(train_rows)} train, {len(held_rows)} held out); outcomes "
                f"{pair_stats['outcomes']}" + (f"; unusable: {unusable}" if unusable else "")
            )
        seq_len = policy.spec.max_seq_len
        train = PreferenceDataset(train_rows, policy.tokenizer, max_seq_len=seq_len)
        held = PreferenceDataset(held_rows, policy.tokenizer, max_seq_len=seq_len)

    # 3. the Bradley-Terry reward model, from the policy's backbone
    tokenizer = policy.tokenizer
    held_chosen, held_rejected = _ids(held, range(len(held)))

    def held_out_accuracy(model: RewardModel) -> PairwiseAccuracy:
        return pairwise_accuracy(model, held_chosen, held_rejected)

    def eval_fn(model: RewardModel) -> dict[str, float]:
        result = held_out_accuracy(model)
        return {"pairwise_accuracy": result.accuracy, "bt_loss": result.loss}

    model = RewardModel.from_policy(policy, seed=cfg.seed)
    converters = [
        str(r)
        for r in convert_for_training(model.backbone, cfg, spec=policy.spec, verbose=run.writes)
    ]  # adapters, FP8
    before = held_out_accuracy(model)
    # the head too; before the optimizer (the plan replaces the parameters)
    runtime = None if run.checked is None else parallelize_reward_model(run.checked, model)
    o = cfg.optim
    loader = pair_loader(train, batch_size=o.batch_size, seed=cfg.seed, runtime=runtime)
    optimizer, schedule = o.build(trainable_parameters(model))
    trainer = Trainer(
        model,
        optimizer,
        data=loader,
        loss=BradleyTerryLoss(margin=cfg.margin),
        lr_scheduler=schedule,
        grad_accum_steps=o.grad_accum_steps,
        eval_fn=eval_fn,
        eval_every=cfg.eval.every,
        **run.trainer_options(runtime),
    )
    metrics = trainer.fit(o.steps)
    run.stop_if_interrupted(
        trainer, {"pairs": pair_stats, "num_pairs": len(rows)} if source is None else {}
    )
    after = held_out_accuracy(model)  # every rank, under a plan
    fit = pairwise_accuracy(model, *_ids(train, range(min(len(train), 1000))))  # memorisation
    rm_s = run.seconds() - policy_s - pairs_s
    model = gathered_reward_model(trainer.runtime)  # under a plan: every rank gathers
    if run.others_return():
        return None

    # 4. save (adapters merged into the backbone first); the saved folder must reproduce the
    # accuracy of the model it holds
    adapters = export_adapters(model.backbone, cfg, None, spec=policy.spec)
    if adapters:
        after = held_out_accuracy(model)  # the merged model, as saved
    model.save(out / "reward_model", tokenizer)
    reloaded, _ = load_reward_model(out / "reward_model")
    reloaded_accuracy = held_out_accuracy(reloaded).accuracy
    if reloaded_accuracy != after.accuracy:
        raise RuntimeError(
            f"the saved reward model gives held-out accuracy {reloaded_accuracy}, "
            f"the trained one {after.accuracy}"
        )
    results = {
        "model": cfg.model.name if cfg.model.init_from is None else cfg.model.init_from,
        "params": sum(p.numel() for p in model.parameters()),
        "policy_held_out_accuracy": (sft_results or {}).get("after"),
        **(
            {"pairs": pair_stats, "num_pairs": len(rows)}
            if source is None
            else {"dataset": source, "data": train.stats.as_dict()}
        ),
        "num_train_pairs": len(train),
        "num_held_out_pairs": len(held),
        "before": before.as_dict(),
        "after": after.as_dict(),
        "train_pairs_after": fit.as_dict(),
        "rm_steps": o.steps,
        "final_loss": float(metrics["loss"].tail(10).mean()),
        "policy_s": policy_s,
        "pairs_s": pairs_s,
        "rm_s": rm_s,
        "wall_s": run.seconds(),
        **adapters,
    }
    if converters:
        results["converters"] = converters
    if unusable:
        results["unusable_pairs"] = unusable
    run.write(results, _results_markdown(results, cfg.task.name, source))
    return run.done(results)


def _ids(
    dataset: PreferenceDataset, indices: Iterable[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of the chosen and of the rejected sequences of items `indices`."""
    return (
        [dataset[i]["chosen_ids"].tolist() for i in indices],
        [dataset[i]["rejected_ids"].tolist() for i in indices],
    )


def _results_markdown(results: dict[str, Any], task: str, source: str | None) -> str:
    """results.md: on the task's sampled pairs, or on own pairs (`source` named)."""
    split = (
        f"{results['num_train_pairs']} train / {results['num_held_out_pairs']} held-out pairs "
        "(split by prompt)"
    )
    if source is not None:
        skipped = results["data"]["skipped_by_reason"] or "none"
        origin = f"{source}: {split}; rows left out by reason: {skipped}."
    else:
        p = results["pairs"]
        origin = (
            f"{results['num_pairs']} pairs by rejection sampling from {p['prompts']} prompts x "
            f"{p['samples'] // max(1, p['prompts'])} samples (outcomes {p['outcomes']}, "
            f"skipped: all equal {p['skipped_all_equal']}, too few {p['skipped_too_few']}; "
            f"reference answer chosen in {p['reference_chosen']}); {split}."
        )
    lines = [
        f"# Bradley-Terry reward model on {source or task + ' pairs'} ({results['model']}, "
        f"{results['params'] / 1e6:.2f}M params)",
        "",
        origin,
        "",
        f"{results['rm_steps']} steps, final loss {results['final_loss']:.4f}; wall "
        f"{results['wall_s']:.0f} s (policy {results['policy_s']:.0f} s, pairs "
        f"{results['pairs_s']:.0f} s, reward model {results['rm_s']:.0f} s)",
        "",
        "| pairs | accuracy (r_chosen > r_rejected) | 95% Wilson CI | mean margin |"
        " BT loss | pairs |",
        "|---|---|---|---|---|---|",
    ]
    for key, name in (
        ("before", "held-out, before training"),
        ("after", "held-out, after training"),
        ("train_pairs_after", "training pairs, after"),
    ):
        r = results[key]
        lines.append(
            f"| {name} | {r['accuracy']:.3f} | [{r['ci_low']:.3f}, "
            f"{r['ci_high']:.3f}] | {r['mean_margin']:+.3f} | {r['loss']:.4f} | "
            f"{r['num_pairs']} |"
        )
    policy = results.get("policy_held_out_accuracy")
    if policy:
        lines += [
            "",
            f"sampling policy held-out greedy accuracy {policy['accuracy']:.3f} "
            f"[{policy['ci_low']:.3f}, {policy['ci_high']:.3f}]",
        ]
    return "\n".join(lines) + "\n"
