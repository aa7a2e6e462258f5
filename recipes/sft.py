"""SFT and continued pretraining (CPT) of a policy, with held-out accuracy before and after.

Run: `posttrain run sft --config recipes/presets/sft_chain_sum.yaml [key=value ...]`, or in a
notebook `main(Config(num_steps=50))`. The run folder gets `metrics.jsonl`, `checkpoints/`,
`results.json` + `results.md` (held-out exact-match accuracy before/after with 95% intervals),
`loss.png`, the evaluated completions (`eval_before.csv`, `eval_after.csv`) and the trained policy
as a Hugging Face folder (`policy/`).

Data: `dataset` is a reasoning-gym task name (questions kept exactly as the task gives them) or a
JSONL/JSON file (SFT rows with "messages" or "prompt"/"completion"; CPT rows with "text").

Several processes (`posttrain.launch` with more than one task, which initialises
torch.distributed): data-parallel training of the same global batch; rank 0 evaluates and writes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from posttrain.data import (CPTDataset, SFTDataset, SFTLoader, load_sft_rows, load_text_documents,
                            reasoning_gym_sft_rows)
from posttrain.core import (require_finite, require_folder, require_int,
                                     require_positive)
from posttrain.core import barrier, rank_and_world_size
from posttrain.rewards import EvalResult, evaluate_generations
from posttrain.models import PRESETS
from posttrain.policy import Policy
from posttrain.core import check_new_run_dir
from posttrain.train import Trainer, warmup_cosine_schedule

MODES = ("sft", "cpt")


@dataclass(kw_only=True)
class Config:
    """SFT/CPT recipe configuration; every field has a default that runs.

    Raises ValueError in `__post_init__` naming the field and what is allowed.
    """

    mode: str = "sft"                 # sft | cpt
    model: str = "tiny-1m"            # a preset name (posttrain.models.specs.PRESETS) ...
    init_from: str | None = None      # ... or a HF folder to start from
    dataset: str = "chain_sum"        # reasoning-gym task name, or a .jsonl/.json file
    task_config: dict = field(default_factory=lambda: {
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    train_size: int = 20000
    eval_size: int = 500              # held-out items (0: no accuracy evaluation)
    eval_seed: int = 10_000
    max_seq_len: int = 128
    pack: bool = False
    batch_size: int = 64
    grad_accum_steps: int = 1
    num_steps: int = 400
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    max_grad_norm: float | None = 1.0
    checkpoint_every: int = 100
    keep_last: int = 2
    max_new_tokens: int = 16
    seed: int = 0
    out_dir: str = "runs/sft"
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Config.mode={self.mode!r}; allowed: {', '.join(MODES)}")
        if self.init_from is None and self.model not in PRESETS:
            raise ValueError(f"Config.model={self.model!r}; allowed presets: "
                             f"{', '.join(sorted(PRESETS))} (or set init_from to a HF folder)")
        require_folder(self, "init_from")
        require_int(self, ("train_size", "max_seq_len", "batch_size", "grad_accum_steps",
                           "num_steps", "max_new_tokens"), minimum=1)
        require_int(self, ("eval_size", "warmup_steps", "checkpoint_every", "keep_last"),
                    minimum=0)
        if self.warmup_steps > self.num_steps:
            raise ValueError(f"Config.warmup_steps={self.warmup_steps} exceeds "
                             f"num_steps={self.num_steps}; lower warmup_steps")
        require_positive(self, ("lr",))
        require_finite(self, ("weight_decay",))
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"Config.min_lr_ratio={self.min_lr_ratio!r}; must be in [0, 1]")
        require_positive(self, ("max_grad_norm",), optional=True)
        if self.eval_size and _is_file(self.dataset):
            raise ValueError("Config.eval_size > 0 needs a reasoning-gym dataset (its scorer); "
                             f"got the file {self.dataset!r}: set eval_size=0")


# Overrides that make the recipe finish in seconds (the recipe test runs every preset with them).
TINY = dict(train_size=64, eval_size=8, num_steps=3, batch_size=8, checkpoint_every=2, warmup_steps=1,
            max_new_tokens=6, progress=False)


def _is_file(dataset: str) -> bool:
    return dataset.endswith((".jsonl", ".json", ".txt"))


def _reasoning_gym(cfg: Config, size: int, seed: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(cfg.dataset, size=size, seed=seed, **cfg.task_config)


def held_out_items(cfg: Config) -> tuple[list[dict], Any]:
    """`cfg.eval_size` distinct task items from `cfg.eval_seed` and the task dataset (its scorer).

    The training set drops every row whose question is among these, so the evaluation is held
    out even on small tasks whose question space the training set covers (2-term, 1-2 digit
    chain_sum has about 8k distinct questions).
    """
    ds = _reasoning_gym(cfg, size=4 * cfg.eval_size + 100, seed=cfg.eval_seed)
    items, seen = [], set()
    for item in ds:
        if item["question"] not in seen:
            seen.add(item["question"])
            items.append(item)
    if len(items) < cfg.eval_size:
        raise ValueError(f"{cfg.dataset} gave only {len(items)} distinct questions for "
                         f"eval_size={cfg.eval_size}; lower eval_size")
    return items[:cfg.eval_size], ds


def build_dataset(cfg: Config, tokenizer, exclude: set[str]):
    """The training dataset of `cfg` (SFTDataset or CPTDataset) without questions in `exclude`,
    and the number of rows dropped for that."""
    if _is_file(cfg.dataset):
        if cfg.mode == "sft":
            return SFTDataset(load_sft_rows(cfg.dataset), tokenizer, max_seq_len=cfg.max_seq_len), 0
        return CPTDataset(load_text_documents(cfg.dataset), tokenizer, max_seq_len=cfg.max_seq_len), 0
    rows = reasoning_gym_sft_rows(cfg.dataset, size=cfg.train_size, seed=cfg.seed, **cfg.task_config)
    kept = [r for r in rows if r["messages"][0]["content"] not in exclude]
    if not kept:
        raise ValueError("every training row is a held-out question; raise train_size")
    if cfg.mode == "sft":
        return SFTDataset(kept, tokenizer, max_seq_len=cfg.max_seq_len), len(rows) - len(kept)
    docs = [f"{r['messages'][0]['content']} {r['messages'][1]['content']}" for r in kept]
    return CPTDataset(docs, tokenizer, max_seq_len=cfg.max_seq_len), len(rows) - len(kept)


def evaluate(policy: Policy, cfg: Config, items: list[dict], ds) -> EvalResult:
    # A CPT model saw "question answer" as plain text, so it continues the raw question.
    return evaluate_generations(policy, items, max_new_tokens=cfg.max_new_tokens,
                                chat=cfg.mode == "sft",
                                score_fn=lambda text, item: ds.score_answer(text.strip(), item))


def warm_start(out: Path, *, model: str, task_config: dict, train_size: int, eval_size: int,
               eval_seed: int, batch_size: int, steps: int, lr: float, max_new_tokens: int,
               seed: int, progress: bool, resume: bool,
               train: bool = True) -> tuple[Config, dict[str, Any] | None]:
    """The SFT stage that the GRPO, DPO and reward-model recipes start from: this recipe's
    `main` into `out/sft` (the policy lands in `out/sft/policy`), or, when resuming a run whose
    SFT stage finished, its saved results. Returns (the SFT Config, its results dict); with
    `train=False` (a recipe starting from another policy) only the Config, for its held-out
    items and evaluation settings, and None."""
    sft_cfg = Config(model=model, task_config=dict(task_config), train_size=train_size,
                     eval_size=eval_size, eval_seed=eval_seed, batch_size=batch_size,
                     num_steps=steps, lr=lr, warmup_steps=min(20, steps // 10),
                     checkpoint_every=steps, max_new_tokens=max_new_tokens, seed=seed,
                     out_dir=str(out / "sft"), progress=progress)
    if not train:
        return sft_cfg, None
    if resume and (out / "sft" / "results.json").is_file():
        return sft_cfg, json.loads((out / "sft" / "results.json").read_text())
    return sft_cfg, main(sft_cfg)


def main(cfg: Config) -> dict[str, Any] | None:
    """Run the recipe; returns the results dict also written to `out_dir/results.json`.

    Under an initialised `torch.distributed` process group (`posttrain.launch`), the ranks train
    data-parallel (`cfg.batch_size` is the global batch and must be divisible by the world size);
    rank 0 alone writes (config, evaluations, plot, policy, results) while the others wait at a
    barrier, and only rank 0 returns the results; the other ranks return None.

    Raises ValueError before writing anything if `out_dir` already holds a run and
    `cfg.resume` is False (on every rank: all of them read the folder before rank 0 writes).
    """
    out = Path(cfg.out_dir)
    writes = rank_and_world_size()[0] == 0
    if not cfg.resume:
        check_new_run_dir(out)
    barrier()  # every rank has checked the folder before rank 0 writes into it
    if writes:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    torch.manual_seed(cfg.seed)
    policy = (Policy.from_pretrained(cfg.init_from) if cfg.init_from
              else Policy.from_spec(cfg.model, seed=cfg.seed))
    items, ds = held_out_items(cfg) if cfg.eval_size else ([], None)
    dataset, dropped = build_dataset(cfg, policy.tokenizer, {it["question"] for it in items})
    results: dict[str, Any] = {"mode": cfg.mode, "dataset": cfg.dataset, "steps": cfg.num_steps,
                               "data": dataset.stats.as_dict(), "held_out_rows_dropped": dropped}
    if writes:
        print(f"{policy}\n{cfg.mode} data: {dataset.stats.as_dict()}, "
              f"{dropped} rows dropped as held-out questions")
        if items and not cfg.resume:
            before = evaluate(policy, cfg, items, ds)
            before.table.to_csv(out / "eval_before.csv", index=False)
            results["before"] = before.as_dict()

    # The loader shards each global batch over the ranks of the process group, if there is one.
    loader = SFTLoader(dataset, batch_size=cfg.batch_size, seed=cfg.seed, pack=cfg.pack,
                       seq_len=cfg.max_seq_len if cfg.pack else None)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    schedule = warmup_cosine_schedule(optimizer, warmup_steps=cfg.warmup_steps,
                                      total_steps=cfg.num_steps, min_lr_ratio=cfg.min_lr_ratio)
    trainer = Trainer(policy.model, optimizer, data=loader, lr_scheduler=schedule,
                      grad_accum_steps=cfg.grad_accum_steps, max_grad_norm=cfg.max_grad_norm,
                      run_dir=out, checkpoint_every=cfg.checkpoint_every, keep_last=cfg.keep_last,
                      progress=cfg.progress, seed=cfg.seed, resume=cfg.resume)
    metrics = trainer.fit(cfg.num_steps)
    if writes:
        _finish(policy, cfg, metrics, items, ds, results)
    barrier()  # the other ranks return once the results are on disk
    return results if writes else None


def _finish(policy: Policy, cfg: Config, metrics: pd.DataFrame, items: list[dict], ds,
            results: dict[str, Any]) -> None:
    """After training (rank 0): plot, held-out accuracy, policy and results files."""
    out = Path(cfg.out_dir)
    results["final_loss"] = float(metrics["loss"].iloc[-1])
    results["tokens_per_s"] = float(metrics["tokens_per_s"].median())
    _plot_loss(metrics, out / "loss.png")
    if items:
        after = evaluate(policy, cfg, items, ds)
        after.table.to_csv(out / "eval_after.csv", index=False)
        results["after"] = after.as_dict()
    policy.save(out / "policy")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(_results_markdown(results))
    print(_results_markdown(results))


def _results_markdown(results: dict[str, Any]) -> str:
    lines = [f"# {results['mode']} on {results['dataset']}, {results['steps']} steps", "",
             f"final loss {results['final_loss']:.4f}, median {results['tokens_per_s']:.0f} "
             "trained tokens/s", ""]
    if "after" in results:
        lines += ["| held-out | accuracy | 95% CI | items |", "|---|---|---|---|"]
        for key in ("before", "after"):
            if key in results:
                r = results[key]
                lines.append(f"| {key} | {r['accuracy']:.3f} | [{r['ci_low']:.3f}, "
                             f"{r['ci_high']:.3f}] | {r['num_items']} |")
    return "\n".join(lines) + "\n"


def _plot_loss(metrics: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(metrics["step"], metrics["loss"], lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (token mean)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main(Config())
