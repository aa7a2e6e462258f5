"""Tutorial 02's GRPO run as a recipe module (`Config`, `main`), so that `posttrain.sweep` can run
it per rollout engine and seed (benchmarks/grpo_engine_learning.py).

The run is notebooks/02_grpo_reasoning.ipynb's, with the seed and the rollout engine as fields:
the *echo a digit* task ("say 7" -> "7"; 60 training prompts over six verbs, 20 held-out prompts
over two unseen verbs, scored by the `exact_match` verifier), tiny-1m (policy seed = `seed`), 50
SFT steps of 32 rows at lr 3e-3, then `RLAlgorithm.grpo(group_size=8)` with AdamW lr 2e-3, 16
prompts x 8 samples per step, at most 4 new tokens, temperature 1, the rollouts sampled by
`rollout.engine` (`posttrain.workflows.rl_config.RLRolloutConfig`, the section of `posttrain run
grpo rollout.engine=...`).

Held-out accuracy is measured with the trained policy's own `Policy.generate` whatever engine
sampled the rollouts (one evaluator for both): greedy on the 20 held-out prompts, and sampled
at temperature 1 eight times each (160 answers, evaluation seed 1), before GRPO, every
`eval_every` steps and after the last step.

The run folder holds what a recipe's does: config.json, lineage.json, metrics.jsonl (one row per
GRPO step: reward_mean, accuracy, and for an engine apart from the policy the sampler-vs-trainer
columns rollout_kl_mean, rollout_logprob_delta_max/_mean), eval_curve.csv (step, greedy,
sampled), eval_after_rl.csv (the 160 sampled held-out answers after GRPO, one row each:
question, correct) and results.json, whose headline `after_grpo.accuracy` is the sampled
held-out accuracy after GRPO (what `Sweep.summary` averages and pairs item by item).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.workflows.rl_config import RLRolloutConfig

__all__ = ["Config", "EchoTask", "echo_items", "main", "metrics_of", "warm_start"]

TRAIN_VERBS = ("say", "echo", "copy", "repeat", "write", "give")
HELD_OUT_VERBS = ("print", "type")


def echo_items() -> tuple[list[dict], list[dict]]:
    """(training items, held-out items) of tutorial 02: {"question": "say 7", "answer": "7"};
    the 60 training items shuffled with `random.Random(0)`, the 20 held-out ones in order."""
    train = [{"question": f"{v} {d}", "answer": str(d)} for v in TRAIN_VERBS for d in range(10)]
    random.Random(0).shuffle(train)
    held = [{"question": f"{v} {d}", "answer": str(d)} for v in HELD_OUT_VERBS for d in range(10)]
    return train, held


@dataclass
class EchoTask:
    """Tutorial 02's `EnvDataset`: the builders of a step's prompts, cycling through `train`."""

    train: list[dict]
    held: list[dict]

    def builders(self, batch_index: int, batch_size: int) -> list[Any]:
        from posttrain.envs import ReasoningGymGroupBuilder
        from posttrain.verifiers import get_verifier

        verifier = get_verifier("exact_match")
        start = batch_index * batch_size
        return [
            ReasoningGymGroupBuilder(
                self.train[(start + j) % len(self.train)], task="echo", verifier=verifier
            )
            for j in range(batch_size)
        ]

    def held_out(self, n: int) -> list[dict]:
        return self.held[:n]


@dataclass(kw_only=True)
class Config:
    """One run: tutorial 02's settings (module docstring); `rollout.engine` picks the sampler.

    Raises ValueError in `__post_init__` for a step count or size below its minimum, and what
    `RLRolloutConfig.check` raises (the engine name, with the allowed ones)."""

    rollout: RLRolloutConfig = field(default_factory=RLRolloutConfig)
    sft_steps: int = 50
    rl_steps: int = 30
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 4
    eval_every: int = 5
    threads: int = 1
    seed: int = 0
    out_dir: str = "runs/echo_grpo"
    resume: bool = False
    progress: bool = False

    def __post_init__(self) -> None:
        self.rollout.check("Config.rollout")
        for name, low in (("sft_steps", 0), ("rl_steps", 1), ("prompts_per_step", 1),
                          ("group_size", 2), ("max_new_tokens", 1), ("eval_every", 0),
                          ("threads", 1)):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Config.{name}={value!r}; must be an integer >= {low}")


def _held_out(policy: Any, held: list[dict]) -> tuple[dict[str, float], Any]:
    """Greedy accuracy on `held`, sampled accuracy (T=1, 8 answers each, seed 1) and the sampled
    answers' table (question, completion, correct)."""
    from posttrain.rewards import as_score_fn, evaluate_generations
    from posttrain.verifiers import get_verifier

    score = as_score_fn(get_verifier("exact_match"))
    greedy = evaluate_generations(policy, held, score_fn=score, max_new_tokens=4)
    sampled = evaluate_generations(
        policy, held * 8, score_fn=score, max_new_tokens=4, temperature=1.0, seed=1
    )
    figures = {"greedy": greedy.accuracy, **sampled.as_dict()}
    return figures, sampled.table


def warm_start(seed: int, steps: int) -> Any:
    """Tutorial 02's SFT warm start: tiny-1m (seed `seed`) after `steps` SFT steps of 32 rows
    (prompt -> answer) at lr 3e-3 on the training items; the `Policy` GRPO starts from."""
    import torch

    from posttrain.data import SFTDataset, SFTLoader
    from posttrain.policy import Policy
    from posttrain.train import Trainer

    train, _ = echo_items()
    policy = Policy.from_spec("tiny-1m", seed=seed)
    rows = [{"prompt": item["question"], "completion": item["answer"]} for item in train]
    loader = SFTLoader(SFTDataset(rows, policy.tokenizer, max_seq_len=32), batch_size=32, seed=seed)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=3e-3)
    sft = Trainer(
        policy.model, optimizer, data=loader, max_grad_norm=1.0, seed=seed, progress=False
    )
    sft.fit(steps)
    return policy


def main(cfg: Config, engine: Any = None) -> dict[str, Any]:
    """SFT warm start -> GRPO with `cfg.rollout.engine` -> held-out accuracy; returns the
    results dict (also results.json).

    Args:
        cfg: the run.
        engine: a `RolloutEngine` instance to sample with instead of building
            `cfg.rollout.engine` (e.g. a running `VLLMEngine`); it stays the caller's to close,
            and is synced to the policy before the first rollout. config.json still records
            `cfg.rollout.engine`: pass the matching name.

    Raises:
        ValueError: `engine` of another kind than `cfg.rollout.engine`; what `RLTrainer` and the
            engine's start raise (`VLLMUnavailable` without the vLLM venv).
    """
    from posttrain.workflows.run_state import recorded_run

    if engine is not None and engine.name != cfg.rollout.engine:
        raise ValueError(
            f"engine={engine!r} is a {engine.name!r} engine but Config.rollout.engine="
            f"{cfg.rollout.engine!r}; pass an engine of that name"
        )
    return recorded_run(_run)(cfg, engine)


def _run(cfg: Config, engine: Any) -> dict[str, Any]:
    import pandas as pd
    import torch

    from posttrain.rl import RLAlgorithm, RLTrainer
    from posttrain.workflows.reports import start_run, write_results, write_table

    torch.set_num_threads(cfg.threads)
    out = start_run(cfg)
    train, held = echo_items()
    policy = warm_start(cfg.seed, cfg.sft_steps)
    before, _ = _held_out(policy, held)
    curve = [{"step": 0, "greedy": before["greedy"], "sampled": before["accuracy"]}]

    def evaluate(trainer: RLTrainer, row: dict) -> None:
        step = trainer.step_count
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.rl_steps:
            figures, _ = _held_out(policy, held)
            curve.append(
                {"step": step, "greedy": figures["greedy"], "sampled": figures["accuracy"]}
            )

    rl = RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=2e-3),
        task=EchoTask(train, held),
        algo=RLAlgorithm.grpo(group_size=cfg.group_size),
        prompts_per_step=cfg.prompts_per_step,
        max_new_tokens=cfg.max_new_tokens,
        run_dir=out,
        seed=cfg.seed,
        progress=cfg.progress,
        callbacks=[evaluate],
        **{
            **cfg.rollout.trainer_options(),
            **({"rollout_engine": engine} if engine is not None else {}),
        },
    )
    metrics = rl.fit(cfg.rl_steps)
    after, table = _held_out(policy, held)
    curve.append({"step": cfg.rl_steps, "greedy": after["greedy"], "sampled": after["accuracy"]})
    write_table(pd.DataFrame(curve), out / "eval_curve.csv")
    write_table(table[["question", "completion", "correct"]], out / "eval_after_rl.csv")
    tail = min(5, len(metrics))
    results = {
        "algo": "grpo",
        "engine": cfg.rollout.engine,
        "seed": cfg.seed,
        "before_grpo": before,
        "after_grpo": after,
        "reward_first": float(metrics["reward_mean"].head(tail).mean()),
        "reward_last": float(metrics["reward_mean"].tail(tail).mean()),
        "steps": int(len(metrics)),
    }
    markdown = (
        f"# echo GRPO, rollout engine {cfg.rollout.engine}, seed {cfg.seed}\n\n"
        f"mean reward, first {tail} steps {results['reward_first']:.3f}, last {tail} steps "
        f"{results['reward_last']:.3f}; held-out sampled accuracy {before['accuracy']:.3f} -> "
        f"{after['accuracy']:.3f}, greedy {before['greedy']:.3f} -> {after['greedy']:.3f}\n"
    )
    write_results(out, results, markdown)
    return results


def metrics_of(out_dir: str | Path) -> Any:
    """The GRPO metrics of a run folder (its metrics.jsonl, one row per step), as a DataFrame."""
    import pandas as pd

    return pd.read_json(Path(out_dir) / "metrics.jsonl", lines=True)
