"""SFT warm start -> rejection-sampling fine-tuning (RFT) rounds -> held-out evaluation: the run
of `recipes/rft.py` (`RFTRunConfig`, `run_rft`), the main job's structure with RFT in place of
RL (`posttrain.workflows.rl.run_sft_then_rl`).

Stages, on a reasoning-gym task (the task's own question text):
  1. SFT of a fresh policy (`posttrain.workflows.sft.warm_start`, run folder `sft/`): it
     evaluates the held-out items before and after and saves the policy.
  2. `rft.rounds` rounds from the SFT policy (`posttrain.workflows.rft.rft_rounds`: sample k per
     prompt, keep the verified ones, fine-tune on them), on the task's training items without the
     held-out questions; one row per round in `metrics.jsonl` (pass rate, kept share, tokens
     trained, seconds), round folders `rounds/round_<r>/`. With `eval.every` N > 0, held-out
     greedy accuracy after every N-th round and the last (`eval_curve.csv` / `eval_curve.png`,
     round 0 being the SFT policy).
  3. Held-out greedy accuracy after RFT, RFT minus SFT with a paired-bootstrap interval; with
     `eval.samples` k > 0, sampled pass@1 and pass@k after SFT and after RFT (temperature 1,
     seed `seed + 1`, as the RL run's `posttrain.workflows.rl_evaluation` samples) and their
     paired difference.

Run folder: `results.json` / `results.md`, `metrics.jsonl`, `eval_after_rft.csv`,
`eval_sampled_after_{sft,rft}.csv`, `policy/` (HF format), `sft/`, `rounds/`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pandas as pd

from posttrain.policy.policy import Policy
from posttrain.rewards.evaluation import paired_bootstrap_diff
from posttrain.train.parallel import ParallelPlan
from posttrain.workflows.recipe_run import RecipeRun
from posttrain.workflows.reports import (
    accuracy_table,
    demo_split_lines,
    difference_line,
    read_table,
    write_table,
)
from posttrain.workflows.rft import rft_rounds
from posttrain.workflows.rft_config import RFT_TINY, RFTConfig, RFTRunConfig
from posttrain.workflows.rl_evaluation import (
    plot_eval_curve,
    sampled_evaluations,
    sampled_lines,
)
from posttrain.workflows.run_state import recorded_run
from posttrain.workflows.sft import warm_start
from posttrain.workflows.task_data import evaluate, held_out_items, training_task

if TYPE_CHECKING:
    from reasoning_gym.dataset import ProceduralDataset

    from posttrain.policy.engine_slot import EngineSlot

__all__ = ["RFTConfig", "RFTRunConfig", "RFT_TINY", "run_rft"]


@recorded_run
def run_rft(cfg: RFTRunConfig) -> dict[str, Any]:
    """Run SFT -> RFT rounds -> held-out evaluation; returns the results dict also written to
    `out_dir/results.json` (and results.md).

    Raises:
        ValueError: before writing anything if `out_dir` (or its `sft/`) already holds a run
            and `cfg.resume` is False, or the task's data does not fit the config
            (`check_task_fits`); later, as `posttrain.workflows.rft.sample_verified` (a
            verifier whose every check failed).
        RunInterrupted: on Ctrl-C (checkpointed; `resume=True` continues).
    """
    run = RecipeRun.start(cfg, sub_runs=("sft",))
    with cfg.rollout.slot(run.out) as engines:  # a vllm server stops when the run ends
        return _run(run, cfg, engines)


def _run(run: RecipeRun, cfg: RFTRunConfig, engines: EngineSlot) -> dict[str, Any]:
    out = run.out

    # 1. SFT warm start (evaluates before and after on the held-out items); one process
    sft_results = warm_start(_warm_start_view(cfg), out)
    assert sft_results is not None  # one process: the stage returned its results
    sft_s = run.seconds()
    items, scorer = held_out_items(cfg.task)

    # 2. RFT rounds from the SFT policy, on the task without the held-out questions
    policy = Policy.from_pretrained(out / "sft" / "policy")
    task = training_task(cfg, size=cfg.task.train_size, seed=cfg.seed, held_out=items)
    print(f"RFT task: {task.stats()}")
    curve = _Curve(cfg, items, scorer, engines, out / "eval_curve.csv", sft_results["after"])
    trackers = run.trackers
    policy, rounds = rft_rounds(
        policy,
        task,
        cfg.rft,
        cfg.sampling,
        out=out,
        seed=cfg.seed,
        sampler=engines.sampler,
        resume=cfg.resume,
        after_round=curve if cfg.eval.every else None,
        log=None if trackers is None else trackers.log,
        checkpoint_every=cfg.checkpoint.every,
        keep_last=cfg.checkpoint.keep_last,
        progress=cfg.progress,
    )
    rft_s = run.seconds() - sft_s

    # 3. Held-out evaluation after RFT, paired with the SFT policy on the same items
    after = evaluate(engines.sampler(policy), items, scorer, max_new_tokens=cfg.eval.max_new_tokens)
    write_table(after.table, out / "eval_after_rft.csv")
    after_sft = read_table(out / "sft" / "eval_after.csv", required=True)
    results: dict[str, Any] = {
        "method": "rft",
        "model": cfg.model.name,
        "params": policy.num_parameters(),
        "task": cfg.task.name,
        **cfg.task.report(),
        "eval_size": cfg.task.eval_size,
        "before_sft": sft_results.get("before"),
        "after_sft": sft_results["after"],
        "after_rft": after.as_dict(),
        "difference": paired_bootstrap_diff(
            after.table["correct"].to_numpy(), after_sft["correct"].to_numpy(), seed=cfg.seed
        ),
        "sft_steps": cfg.sft.steps,
        "rounds": len(rounds),
        "rounds_planned": cfg.rft.rounds,
        "kept": sum(r["kept"] for r in rounds),
        "trained_tokens": sum(r["trained_tokens"] for r in rounds),
        "sft_s": sft_s,
        "rft_s": rft_s,
        "rft_train_s": sum(r["step_time_s"] for r in rounds),
        **sampled_evaluations(cfg, out, items, scorer, policy, engines, stage="rft")[0],
    }
    if cfg.rft.budget_s is not None:
        results["budget_s"] = cfg.rft.budget_s
    if cfg.eval.every:
        results["eval_curve"] = curve.rows()
        plot_eval_curve(pd.DataFrame(curve.rows()), out / "eval_curve.png", xlabel="RFT round")
    if cfg.rollout.engine != "builtin":
        results["rollout_engine"] = cfg.rollout.engine
    policy.save(out / "policy")
    results["wall_s"] = run.seconds()
    run.write(results, _markdown(results, rounds))
    return run.done(results)


def _warm_start_view(cfg: RFTRunConfig) -> SimpleNamespace:
    """What `warm_start` reads of a recipe config, with the plan of one process (an RFT run has
    no `parallel` section)."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return SimpleNamespace(**fields, parallel=ParallelPlan())


class _Curve:
    """`after_round` of `rft_rounds`: greedy held-out accuracy after every `eval.every`-th
    round and the last, one row per point (round, accuracy, ci_low, ci_high, num_items) in a
    CSV; round 0 is the SFT policy (its results)."""

    COLUMNS = ("step", "accuracy", "ci_low", "ci_high", "num_items")

    def __init__(
        self,
        cfg: RFTRunConfig,
        items: list[dict],
        scorer: ProceduralDataset,
        engines: EngineSlot,
        path: Path,
        after_sft: dict[str, Any],
    ) -> None:
        self.cfg, self.items, self.scorer, self.engines, self.path = (
            cfg,
            items,
            scorer,
            engines,
            path,
        )
        if cfg.eval.every:
            old = read_table(path) if cfg.resume else None  # rows of rounds before a restart
            kept = [] if old is None else [r for r in old.to_dict("records") if r["step"] > 0]
            self._write([{"step": 0, **after_sft}, *kept])

    def __call__(self, round_: int, policy: Policy) -> dict[str, Any]:
        every, last = self.cfg.eval.every, self.cfg.rft.rounds
        if round_ % every and round_ != last:
            return {}
        r = evaluate(
            self.engines.sampler(policy),
            self.items,
            self.scorer,
            max_new_tokens=self.cfg.eval.max_new_tokens,
        )
        points = [p for p in self.rows() if p["step"] != round_]
        point = r.as_dict()
        self._write([*points, {"step": round_, **point}])
        return {"heldout_accuracy": point["accuracy"]}

    def rows(self) -> list[dict[str, Any]]:
        table = read_table(self.path)
        return [] if table is None else table.to_dict("records")

    def _write(self, points: list[dict[str, Any]]) -> None:
        write_table(pd.DataFrame(points, columns=list(self.COLUMNS)), self.path)


def _markdown(results: dict[str, Any], rounds: list[dict[str, Any]]) -> str:
    """results.md: the held-out table, the paired differences and the table of rounds."""
    stages = [
        ("before SFT", results["before_sft"]),
        ("after SFT", results["after_sft"]),
        ("after RFT", results["after_rft"]),
    ]
    lines = [
        f"# SFT -> RFT on {results['task']} {results['task_config']}",
        "",
        *demo_split_lines(results, "RFT prompts"),
        f"model {results['model']} ({results['params'] / 1e6:.2f}M params), "
        f"{results['sft_steps']} SFT steps ({results['sft_s']:.0f} s), {results['rounds']} of "
        f"{results['rounds_planned']} RFT rounds ({results['rft_s']:.0f} s; step seconds "
        f"{results['rft_train_s']:.0f}"
        + (f" of a {results['budget_s']:g} s budget" if "budget_s" in results else "")
        + f"), wall {results['wall_s']:.0f} s",
        "",
        *accuracy_table(stages),
        "",
        difference_line("RFT minus SFT", results["difference"]),
        "",
    ]
    lines += sampled_lines(results, "rft", "RFT")
    lines += [
        "| round | pass rate (train prompts) | prompts solved | kept | kept share | SFT steps "
        "| tokens trained | step seconds |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['round']} | {r['pass_rate']:.3f} | {r['prompts_solved']} / {r['prompts']} "
            f"| {r['kept']} | {r['kept_share']:.3f} | {r['sft_steps']} | {r['trained_tokens']} "
            f"| {r['step_time_s']:.1f} |"
            for r in rounds
        ),
        "",
    ]
    if not results["kept"]:
        lines += ["No round kept a verified sample: the policy is the SFT policy.", ""]
    return "\n".join(lines)
