"""SFT and continued pretraining (CPT) of a policy with held-out accuracy before and after: the
`recipes/sft.py` run (`SFTConfig`, `run_sft`) and the SFT warm start that the GRPO, PPO, DPO and
reward-model recipes begin with (`warm_start`).

Data: `task.name` is a reasoning-gym task (questions kept exactly as the task gives them) or a
JSONL/JSON file (SFT rows with "messages" or "prompt"/"completion"; CPT rows with "text").
Held-out items: `task.eval_size` distinct questions generated from `task.eval_seed`
(`held_out_items`); the training rows drop every one of those questions.

Several processes (`posttrain.launch` with more than one task, which initialises
torch.distributed): data-parallel training of the same global batch; rank 0 evaluates and writes.
With a `parallel` plan (a `ParallelPlan`) the policy is split by it before the optimizer is
built, the loader shards over the plan's data-parallel ranks, and after training every rank
gathers the full weights (`unsharded_policy`) so that rank 0 evaluates and saves a plain policy.

Example:
    >>> cfg = SFTConfig(optim=BatchOptimConfig(steps=5, warmup_steps=20))
    Traceback (most recent call last):
    ...
    ValueError: Config.optim.warmup_steps=20 exceeds Config.optim.steps=5; lower warmup_steps
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from posttrain.core.distributed import barrier, rank_and_world_size
from posttrain.core.stage_files import read_stage_file
from posttrain.data.loader import SFTLoader
from posttrain.data.rows import BadRowError
from posttrain.data.sft import (CPTDataset, SFTDataset, load_sft_rows, load_text_documents,
                                reasoning_gym_sft_rows)
from posttrain.policy.policy import Policy
from posttrain.rewards.evaluation import EvalResult, evaluate_generations
from posttrain.train.plan_compat import runtime_of
from posttrain.train.runtime import Runtime
from posttrain.train.trainer import Trainer
from posttrain.verifiers.reasoning_gym_gold import GoldReport, check_gold
from posttrain.workflows.config import (ROOT, BatchOptimConfig, CheckpointConfig, EvalConfig,
                                        ModelConfig, SFTWarmStartConfig, TaskConfig, choice, fail,
                                        flags, ints, run_fields, validate)
from posttrain.workflows.parallel import ParallelPlan, check_parallel, plan_of
from posttrain.workflows.quantization import (AdaptersConfig, QuantizationConfig,
                                              check_converted_run, convert_for_training,
                                              export_adapters, finish_quantized,
                                              trainable_parameters)
from posttrain.workflows.run_state import recorded_run
from posttrain.workflows.reports import (accuracy_of, accuracy_table, plot_curves, read_table,
                                         start_run, stop_if_interrupted, write_results,
                                         write_table)

__all__ = ["SFTConfig", "run_sft", "warm_start", "start_policy", "held_out_items", "evaluate",
           "check_seq_len", "check_task_fits", "unsharded_policy", "MODES", "PROBE_ITEMS"]

MODES = ("sft", "cpt")


PROBE_ITEMS = 64
"""Training items (the first ones the run trains on) whose lengths `check_task_fits` measures."""


def check_seq_len(cfg: Any, at: str) -> None:
    """The lengths of `cfg` fit `cfg.model` (its preset's or folder's limit L): `max_seq_len`,
    where the config has one, is an int in [2, L] (a row needs a prompt token and a trained
    one), and `max_new_tokens` of the `eval` and `sampling` sections, where present, is below L
    (a prompt takes a token at least). Whether the task's own prompts leave that room needs
    the data: `check_task_fits`, before a run writes anything."""
    limit = cfg.model.max_seq_len()
    if hasattr(cfg, "max_seq_len"):
        ints(cfg, at, ("max_seq_len",), minimum=2)
        if limit is not None and cfg.max_seq_len > limit:
            raise fail(f"{at}.max_seq_len", cfg.max_seq_len,
                       f"at most {limit}, the longest sequence {at}.model holds")
    for section in ("eval", "sampling"):
        new_tokens = getattr(getattr(cfg, section, None), "max_new_tokens", None)
        if limit is not None and new_tokens is not None and new_tokens >= limit:
            raise fail(f"{at}.{section}.max_new_tokens", new_tokens, f"below {limit}, the "
                       f"longest sequence {at}.model holds (the prompt takes a token at least)")


@dataclass(kw_only=True)
class SFTConfig:
    """SFT/CPT configuration; every field has a default that runs (400 steps of 64 on 2-term,
    1-2-digit chain_sum). Raises ValueError in `__post_init__` naming the dotted field."""

    mode: str = "sft"                 # sft | cpt (plain text, every token trained)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: BatchOptimConfig = field(default_factory=BatchOptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelPlan = field(default_factory=ParallelPlan)
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    max_seq_len: int = 128
    pack: bool = False
    seed: int = 0
    out_dir: str = "runs/sft"
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self)

    def check(self, at: str) -> None:
        choice(f"{at}.mode", self.mode, MODES)
        check_seq_len(self, at)
        run_fields(self, at)
        flags(self, at, ("pack",))
        check_parallel(self, at, divisible=("optim.batch_size",))
        check_converted_run(self, at)
        if self.eval.every:
            raise fail(f"{at}.eval.every", self.eval.every, "0: SFT has no validation set")
        if self.task.eval_size and self.task.is_file:
            raise ValueError(f"{at}.task.eval_size > 0 needs a reasoning-gym task (its scorer); "
                             f"got the file {self.task.name!r}: set task.eval_size=0")


def _reasoning_gym(task: TaskConfig, size: int, seed: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(task.name, size=size, seed=seed, **task.options)


def held_out_items(task: TaskConfig) -> tuple[list[dict], Any]:
    """`task.eval_size` distinct task items from `task.eval_seed` and the task dataset (its
    scorer).

    The training set drops every row whose question is among these, so the evaluation is held
    out even on small tasks whose question space the training set covers (2-term, 1-2 digit
    chain_sum has about 8k distinct questions). Items whose upstream gold fails its check
    (`posttrain.verifiers.reasoning_gym_gold.check_gold`) are skipped, as the RL task skips them.
    """
    ds = _reasoning_gym(task, size=4 * task.eval_size + 100, seed=task.eval_seed)
    items, seen = [], set()
    for item in check_gold(task.name, ds, ds):
        if item["question"] not in seen:
            seen.add(item["question"])
            items.append(item)
    if len(items) < task.eval_size:
        raise ValueError(f"{task.name} gave only {len(items)} distinct questions for "
                         f"task.eval_size={task.eval_size}; lower task.eval_size")
    return items[:task.eval_size], ds


def build_dataset(cfg: SFTConfig, tokenizer, exclude: set[str], gold: Any = None, *,
                  size: int | None = None):
    """The training dataset of `cfg` (SFTDataset or CPTDataset) without questions in `exclude`,
    and the number of rows dropped for that. Items of a reasoning-gym task whose upstream gold
    fails its check are not trained on; they are counted in `gold` (a `GoldReport`; a new one
    when None), as the RL task counts them. `size`: the first `size` rows only (a probe)."""
    task, dataset_cls = cfg.task, SFTDataset if cfg.mode == "sft" else CPTDataset
    if task.is_file:
        rows = load_sft_rows(task.name) if cfg.mode == "sft" else load_text_documents(task.name)
        return dataset_cls(rows[:size], tokenizer, max_seq_len=cfg.max_seq_len), 0
    gold = GoldReport(task.name) if gold is None else gold
    train_size = task.train_size if size is None else min(size, task.train_size)
    rows = reasoning_gym_sft_rows(task.name, size=train_size, seed=cfg.seed,
                                  item_filter=lambda ds, items: check_gold(task.name, ds, items, gold),
                                  **task.options)
    kept = [r for r in rows if r["messages"][0]["content"] not in exclude]
    if not kept:
        raise ValueError("every training row is a held-out question; raise task.train_size")
    if cfg.mode == "cpt":
        kept = [f"{r['messages'][0]['content']} {r['messages'][1]['content']}" for r in kept]
    return dataset_cls(kept, tokenizer, max_seq_len=cfg.max_seq_len), len(rows) - len(kept)


def check_task_fits(cfg: Any, at: str = ROOT) -> None:
    """What a recipe config asks of its task's data, checked after `validate(cfg)` and before
    the run writes anything (the recipes call it before `start_run`):

      * `task.eval_size` distinct held-out questions exist (`held_out_items`);
      * every held-out prompt, rendered as evaluation renders it, leaves room in `cfg.model`
        for `eval.max_new_tokens`, and the first `PROBE_ITEMS` training prompts (from `seed`,
        or `prompt_seed` where the config has one) for `sampling.max_new_tokens`;
      * SFT/CPT (a config with `mode`): `max_seq_len` keeps a trained token of one of the
        first `PROBE_ITEMS` training rows at least (longer rows are cut, or dropped and
        counted, when the run builds its dataset);
      * preference pairs (a config with `max_seq_len` and `pairs`): `max_seq_len` holds the
        longest of those prompts with a full `sampling.max_new_tokens` answer (or the task's
        own answer, with `pairs.reference_answer`) and the end of the turn.

    Bounds that need no data (types, ranges, the model's own limit) are the config's own
    `check` (`check_seq_len`). Lengths are token counts of `cfg.model`'s tokenizer.

    Raises:
        ValueError: naming the dotted field, its allowed bound and the lengths measured.
    """
    validate(cfg)
    task, model = cfg.task, cfg.model
    limit, tokenizer = model.max_seq_len(), model.tokenizer()
    chat = getattr(cfg, "mode", "sft") == "sft"
    if task.eval_size and not task.is_file:
        try:
            items, _ = held_out_items(task)
        except ValueError as e:
            raise ValueError(f"{at}.task.eval_size={task.eval_size}: {e}") from None
        _check_room(f"{at}.eval.max_new_tokens", cfg.eval.max_new_tokens,
                    _prompt_lengths(tokenizer, items, chat), limit, "held-out prompt")
        _check_not_all_held_out(cfg, at, {it["question"] for it in items})
    if task.is_file:
        if not Path(task.name).is_file():
            raise ValueError(f"{at}.task.name={task.name!r}: no such data file")
        probe = []
    else:
        probe = list(_reasoning_gym(task, size=min(PROBE_ITEMS, task.train_size),
                                    seed=getattr(cfg, "prompt_seed", cfg.seed)))
    sampling = getattr(cfg, "sampling", None)
    if sampling is not None and probe:
        _check_room(f"{at}.sampling.max_new_tokens", sampling.max_new_tokens,
                    _prompt_lengths(tokenizer, probe, chat), limit, "training prompt")
    if hasattr(cfg, "mode"):
        _check_rows_fit(cfg, at, tokenizer)
    elif hasattr(cfg, "max_seq_len") and hasattr(cfg, "pairs") and probe:
        _check_pairs_fit(cfg, at, tokenizer, probe)


def _check_not_all_held_out(cfg: Any, at: str, held_out: set[str]) -> None:
    """A run's training items (`task.train_size` from `seed`; the warm start's
    `sft.demonstrations`; the reward model's `pairs.num_prompts` from `prompt_seed`) drop the
    held-out questions: up to `PROBE_ITEMS` of them, not every one may be held out."""
    task = cfg.task
    sizes = [("task.train_size", task.train_size, cfg.seed)]
    if getattr(getattr(cfg, "sft", None), "demonstrations", None) is not None:
        sizes.append(("sft.demonstrations", cfg.sft.demonstrations, cfg.seed))
    if hasattr(cfg, "prompt_seed"):
        sizes.append(("pairs.num_prompts", cfg.pairs.num_prompts, cfg.prompt_seed))
    for key, n, seed in sizes:
        if n <= PROBE_ITEMS and all(it["question"] in held_out
                                    for it in _reasoning_gym(task, size=n, seed=seed)):
            raise fail(f"{at}.{key}", n, f"larger: every one of the first {n} training "
                       f"questions is a held-out one (task.eval_seed={task.eval_seed} draws "
                       "the held-out split; another eval_seed keeps them apart)")


def _prompt_lengths(tokenizer, items: list[dict], chat: bool) -> list[int]:
    """Token counts of the items' questions as `generate_for_items` renders them."""
    if chat:
        return [len(tokenizer.render_prompt([{"role": "user", "content": it["question"]}]))
                for it in items]
    return [len(tokenizer.encode(it["question"], add_bos=True)) for it in items]


def _check_room(name: str, new_tokens: int, lengths: list[int], limit: int | None,
                what: str) -> None:
    longest = max(lengths, default=0)
    if limit is not None and longest + new_tokens > limit:
        raise fail(name, new_tokens, f"at most {limit - longest}: the longest {what} has "
                   f"{longest} tokens and the model holds {limit}")


def _check_rows_fit(cfg: SFTConfig, at: str, tokenizer) -> None:
    try:
        build_dataset(cfg, tokenizer, set(), size=PROBE_ITEMS)
    except BadRowError:
        raise  # a malformed row of a data file: the data's error, not max_seq_len's
    except ValueError as e:
        raise fail(f"{at}.max_seq_len", cfg.max_seq_len, "larger: no training row keeps a "
                   f"trained token within it ({e})") from None


def _check_pairs_fit(cfg: Any, at: str, tokenizer, probe: list[dict]) -> None:
    prompt = [{"role": "user", "content": probe[0]["question"]}]
    end = (len(tokenizer.render_chat(prompt + [{"role": "assistant", "content": "x"}]).input_ids)
           - len(tokenizer.render_prompt(prompt)) - len(tokenizer.encode("x")))
    needed = []
    for item, length in zip(probe, _prompt_lengths(tokenizer, probe, chat=True)):
        answer = len(tokenizer.encode(str(item["answer"]))) if cfg.pairs.reference_answer else 0
        needed.append(length + max(cfg.sampling.max_new_tokens, answer) + max(end, 1))
    if max(needed) > cfg.max_seq_len:
        raise fail(f"{at}.max_seq_len", cfg.max_seq_len, f"at least {max(needed)}: the longest of "
                   f"the first {len(probe)} training prompts with an answer of "
                   f"sampling.max_new_tokens={cfg.sampling.max_new_tokens} tokens"
                   f"{' (or the task answer)' if cfg.pairs.reference_answer else ''} and the "
                   "end of the turn")


def evaluate(policy: Policy, items: list[dict], ds, *, max_new_tokens: int,
             chat: bool = True) -> EvalResult:
    """Greedy held-out accuracy scored by the task dataset `ds`. A CPT model saw "question
    answer" as plain text, so it is evaluated with `chat=False` (it continues the raw question)."""
    return evaluate_generations(policy, items, max_new_tokens=max_new_tokens, chat=chat,
                                score_fn=lambda text, item: ds.score_answer(text.strip(), item))


def warm_start(cfg: Any, out: Path, *, folder: str = "sft", init_from: Path | None = None,
               sft: SFTWarmStartConfig | None = None) -> dict[str, Any]:
    """The SFT stage of a recipe whose `cfg` has `model`, `task`, `eval`, `sft`
    (`SFTWarmStartConfig`), `seed`, `progress` and `resume`: `run_sft` into `out/folder` (the
    policy lands in `out/folder/policy`), or, when resuming a run whose stage finished, its saved
    results. Returns the SFT results dict.

    `init_from` (a policy folder) replaces the fresh `cfg.model.name` policy and `sft` replaces
    `cfg.sft` (steps, learning rate, batch, demonstrations; its `optim()` is the stage's
    optimizer): the RL recipes' more-SFT baseline continues the warm start's policy this way
    on the same demonstrations (`MoreSFTBaselineConfig.warm_start`).
    """
    sft = cfg.sft if sft is None else sft
    task = cfg.task
    if sft.demonstrations is not None:  # the first N items of the same generator
        task = dataclasses.replace(task, train_size=sft.demonstrations)
    model = ModelConfig(name=cfg.model.name,
                        init_from=None if init_from is None else str(init_from))
    sft_cfg = SFTConfig(model=model, task=task,
                        eval=EvalConfig(max_new_tokens=cfg.eval.max_new_tokens),
                        optim=sft.optim(), checkpoint=CheckpointConfig(every=max(1, sft.steps // 10)),
                        seed=cfg.seed, out_dir=str(out / folder), resume=cfg.resume,
                        progress=cfg.progress, parallel=cfg.parallel)
    done = _finished_results(out / folder) if cfg.resume else None
    return done if done is not None else run_sft(sft_cfg)


def _finished_results(out: Path) -> dict[str, Any] | None:
    """The results of a finished stage in `out`; None if it did not finish, was interrupted, or
    its held-out table `eval_after.csv` (which later stages read) is gone: the stage then runs
    again from its last checkpoint.

    Raises:
        StageFileError: if `results.json` or `eval_after.csv` was cut or changed after it was
            written (`posttrain.core.stage_files`).
    """
    data = read_stage_file(out / "results.json")
    results = None if data is None else json.loads(data)
    if results is None or results.get("interrupted"):
        return None
    return None if "after" in results and read_table(out / "eval_after.csv") is None else results


def start_policy(cfg: Any, out: Path) -> tuple[Policy, dict[str, Any] | None]:
    """The policy a preference or reward-model recipe starts from: `cfg.model.init_from` (a HF
    folder), or the SFT warm start's (`warm_start`, which also returns its results)."""
    if cfg.model.init_from is not None:
        return Policy.from_pretrained(cfg.model.init_from), None
    results = warm_start(cfg, out)
    return Policy.from_pretrained(out / "sft" / "policy"), results


def unsharded_policy(policy: Policy, runtime: Runtime | None = None) -> Policy:
    """A plain `Policy` with the full weights of `policy` (a collective when its model is split
    by a ParallelPlan, whose `runtime` is given: every rank calls it and gets the copy; `policy`
    itself otherwise), for evaluation and `save` on rank 0.

    Raises:
        ValueError: for a policy split by a plan given without its runtime.
    """
    runtime = runtime_of(policy.model) if runtime is None else runtime
    if runtime.plan is None:
        return policy
    from posttrain.models.specs import build_model

    param = next(policy.model.parameters())
    model = build_model(policy.spec, device=param.device, dtype=param.dtype, seed=0)
    model.load_state_dict(runtime.full_state_dict())
    return Policy(model, policy.tokenizer, policy.spec)


@recorded_run
def run_sft(cfg: SFTConfig) -> dict[str, Any] | None:
    """Run SFT/CPT; returns the results dict also written to `out_dir/results.json`.

    Under an initialised `torch.distributed` process group (`posttrain.launch`), the ranks train
    data-parallel (`cfg.optim.batch_size` is the global batch and must be divisible by the world
    size), or under `cfg.parallel`'s plan when it has one (the batch divisible by its
    data-parallel size); rank 0 alone writes (config, evaluations, plot, policy, results) while
    the others wait at a barrier, and only rank 0 returns the results; the other ranks return
    None.

    Raises ValueError before writing anything if `out_dir` already holds a run and
    `cfg.resume` is False (on every rank: all of them read the folder before rank 0 writes),
    or the task's data does not fit the config (`check_task_fits`).
    """
    check_task_fits(cfg)
    out = start_run(cfg)
    writes = rank_and_world_size()[0] == 0
    policy = (Policy.from_pretrained(cfg.model.init_from) if cfg.model.init_from
              else Policy.from_spec(cfg.model.name, seed=cfg.seed))
    items, ds = held_out_items(cfg.task) if cfg.task.eval_size else ([], None)
    gold = GoldReport(cfg.task.name)
    dataset, dropped = build_dataset(cfg, policy.tokenizer, {it["question"] for it in items}, gold)
    results: dict[str, Any] = {"mode": cfg.mode, "dataset": cfg.task.name,
                               "steps": cfg.optim.steps, "data": dataset.stats.as_dict(),
                               "held_out_rows_dropped": dropped}
    chat = cfg.mode == "sft"
    if writes:
        print(f"{policy}\n{cfg.mode} data: {dataset.stats.as_dict()}, "
              f"{dropped} rows dropped as held-out questions"
              + (f", gold check: {gold}" if gold.checked else ""))
        before = read_table(out / "eval_before.csv") if items and cfg.resume else None
        if before is not None:  # a resumed run: the evaluation before training is done
            results["before"] = accuracy_of(before)
        elif items:
            before = evaluate(policy, items, ds, max_new_tokens=cfg.eval.max_new_tokens, chat=chat)
            write_table(before.table, out / "eval_before.csv")
            results["before"] = before.as_dict()

    # The loader shards each global batch over the ranks of the process group, if there is one
    # (under a plan: over its data-parallel ranks, after the plan split the policy).
    o, plan = cfg.optim, plan_of(cfg)
    # adapters, FP8 or QAT (when the config sets them), before the plan and the optimizer
    reports = convert_for_training(policy.model, cfg, spec=policy.spec, verbose=writes)
    if reports:
        results["converters"] = [str(r) for r in reports]
    runtime, shard = None, {}
    if plan is not None:
        runtime = plan.parallelize(policy.model, spec=policy.spec)
        shard = {"rank": runtime.data_rank, "world_size": runtime.data_size}
    loader = SFTLoader(dataset, batch_size=o.batch_size, seed=cfg.seed, pack=cfg.pack,
                       seq_len=cfg.max_seq_len if cfg.pack else None, **shard)
    optimizer, schedule = o.build(trainable_parameters(policy.model))
    trainer = Trainer(policy.model, optimizer, data=loader, lr_scheduler=schedule,
                      grad_accum_steps=o.grad_accum_steps, max_grad_norm=o.max_grad_norm,
                      run_dir=out, checkpoint_every=cfg.checkpoint.every,
                      keep_last=cfg.checkpoint.keep_last, progress=cfg.progress, seed=cfg.seed,
                      resume=cfg.resume, runtime=runtime)
    metrics = trainer.fit(o.steps)
    stop_if_interrupted(trainer, out, results)
    policy = unsharded_policy(policy, trainer.runtime)  # every rank, under a plan
    if writes:
        _finish(policy, cfg, metrics, items, ds, results)
    barrier()  # the other ranks return once the results are on disk
    return results if writes else None


def _finish(policy: Policy, cfg: SFTConfig, metrics: pd.DataFrame, items: list[dict], ds,
            results: dict[str, Any]) -> None:
    """After training (rank 0): plot, held-out accuracy, policy and results files."""
    out = Path(cfg.out_dir)
    results["final_loss"] = float(metrics["loss"].iloc[-1])
    results["tokens_per_s"] = float(metrics["tokens_per_s"].median())
    plot_curves(metrics, out / "loss.png", [("loss", "loss (token mean)")],
                xlabel="optimizer step", log_y=True)
    if items:
        after = evaluate(policy, items, ds, max_new_tokens=cfg.eval.max_new_tokens,
                         chat=cfg.mode == "sft")
        write_table(after.table, out / "eval_after.csv")
        results["after"] = after.as_dict()
    evaluate_after = (lambda p: evaluate(p, items, ds, max_new_tokens=cfg.eval.max_new_tokens,
                                         chat=cfg.mode == "sft")) if items else None
    results.update(finish_quantized(policy, cfg, out, evaluate_after))  # QAT: convert, evaluate
    # LoRA: the adapter alone (adapter/), then merged into the base that policy/ holds
    results.update(export_adapters(policy.model, cfg, out, spec=policy.spec))
    policy.save(out / "policy")
    lines = [f"# {results['mode']} on {results['dataset']}, {results['steps']} steps", "",
             f"final loss {results['final_loss']:.4f}, median {results['tokens_per_s']:.0f} "
             "trained tokens/s", ""]
    if "after" in results:
        lines += accuracy_table([(k, results.get(k))
                                 for k in ("before", "after", "after_converted")])
    write_results(out, results, "\n".join(lines) + "\n")
