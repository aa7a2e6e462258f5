"""SFT warm start -> RL -> held-out greedy accuracy before SFT, after SFT and after RL: the run
of `recipes/grpo.py` (the main job, `make run`) and `recipes/ppo.py` (the same stages with PPO).

Stages, on a reasoning-gym task (the task's own question text):
  1. SFT of a fresh policy (`posttrain.workflows.sft.warm_start`, run folder `sft/`): it
     evaluates the held-out items before and after and saves the policy.
  2. RL with `posttrain.rl.trainer.RLTrainer` from the SFT policy, `cfg.rl.algorithm()` (an
     `RLAlgorithm` preset: GRPO, PPO with GAE and a value head, ...).
  3. The same held-out evaluation after RL, and RL minus SFT with a paired-bootstrap interval.

Held-out items: `task.eval_size` distinct questions from `task.eval_seed`; SFT drops every
training row with one of them, and the RL task (`ReasoningGymTask` with the same held-out seed)
drops them from its training items; the run checks both sets are the same.

Optional stages: `eval.every` N > 0 evaluates held-out greedy accuracy every N RL steps
(`HeldOutCurve`: `eval_curve.csv` / `eval_curve.png`, step 0 being the SFT policy);
`baseline.steps` N > 0 runs the honest baseline after RL: N more SFT steps from the SFT policy on
the same demonstrations (run folder `more_sft/`), scored like the RL policy and compared with
it, paired (`rl_minus_more_sft`, `rl_minus_more_sft_sampled`), with both stages' wall times.
These measurements and the report are in `posttrain.workflows.rl_evaluation`.

Run folder: `results.csv` / `results.md` / `results.json`, `metrics.jsonl` (one row per RL
step), `rl_curves.png` (and `rl_reward_terms.png`, each reward function's mean, with
`rewards.funcs`), `eval_after_rl.csv`, `checkpoints/`, `policy/` (HF format), `sft/`.

Own prompt rows instead of a task (`data.train` with `rewards.funcs`): the stages of
`posttrain.workflows.rl_data` (the warm start on the rows' answers where they have them; the
held-out rows scored by mean reward and exact match). The RL stage's trainer is built in
`posttrain.workflows.rl_stage` for both.

With a `parallel` plan (`Config.parallel`, a job of its world size): the SFT stage and the RL
policy and its reference are split by it (this module applies it to both; `RLTrainer` applies
none), each data-parallel rank samples its share of the
prompts (`posttrain.rl.parallel`), and after training rank 0 evaluates and saves the gathered
full weights while the other ranks wait; only rank 0 returns the results (the others None).

The config (`RLRunConfig`, `RL_TINY`) is in `posttrain.workflows.rl_config` and the task check
(`check_gym_task`) in `posttrain.workflows.task_data`; each name still imports from here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from posttrain.core.distributed import rank_and_world_size
from posttrain.policy.policy import Policy
from posttrain.rewards.evaluation import paired_bootstrap_diff
from posttrain.workflows.quantization import export_adapters
from posttrain.workflows.recipe_run import RecipeRun
from posttrain.workflows.reports import read_table, write_table
from posttrain.workflows.rl_config import RL_TINY, RLRunConfig
from posttrain.workflows.rl_data import run_own_prompts
from posttrain.workflows.rl_evaluation import (
    HeldOutCurve,
    more_sft_baseline,
    sampled_evaluations,
    write_rl_results,
)
from posttrain.workflows.rl_stage import plot_rl_curves, rl_trainer
from posttrain.workflows.run_state import recorded_run
from posttrain.workflows.sft import warm_start
from posttrain.workflows.task_data import (
    check_gym_task,
    evaluate,
    held_out_items,
    training_task,
)

if TYPE_CHECKING:
    from posttrain.policy.engine_slot import EngineSlot

__all__ = ["RLRunConfig", "run_sft_then_rl", "RL_TINY", "check_gym_task"]


@recorded_run
def run_sft_then_rl(cfg: RLRunConfig) -> dict[str, Any] | None:
    """Run SFT -> RL -> held-out evaluation; returns the results dict also written to
    `out_dir/results.json` (and .csv/.md); under a `parallel` plan, on rank 0 only (None on
    the other ranks).

    Raises ValueError before writing anything if `out_dir` (or its `sft/`) already holds a run
    and `cfg.resume` is False, or the task's data does not fit the config (`check_task_fits`).
    """
    run = RecipeRun.start(cfg, sub_runs=("sft",))
    with cfg.rollout.slot(run.out) as engines:  # a vllm server stops when the run ends
        return _run(run, cfg, engines)


def _run(run: RecipeRun, cfg: RLRunConfig, engines: EngineSlot) -> dict[str, Any] | None:
    """`run_sft_then_rl` after its start: `engines` samples the rollouts (an engine apart from
    the policy is lent to the trainer) and the held-out evaluations after the SFT stage."""
    if cfg.data.given:
        return run_own_prompts(run, cfg, engines)
    out, plan = run.out, run.plan

    # 1. SFT warm start (evaluates before and after on the held-out items)
    sft_results = warm_start(cfg, out)
    sft_s = run.seconds()
    items, scorer = held_out_items(cfg.task)

    # 2. RL from the SFT policy, on the same task without the held-out questions
    policy = Policy.from_pretrained(out / "sft" / "policy")
    task = training_task(cfg, size=cfg.task.train_size, seed=cfg.seed, held_out=items)
    if (builder := cfg.rewards.builder()) is not None:  # own reward functions score the items
        task = dataclasses.replace(task, builder=builder)
    if rank_and_world_size()[0] == 0:  # items kept, dropped as held out or for a bad gold
        print(f"RL task: {task.stats()}")
    curve = (
        HeldOutCurve(
            policy,
            items,
            scorer,
            every=cfg.eval.every,
            max_new_tokens=cfg.eval.max_new_tokens,
            path=out / "eval_curve.csv",
            engines=engines,
        )
        if cfg.eval.every
        else None
    )
    trainer, converters = rl_trainer(run, cfg, engines, policy, task, [curve] if curve else [])
    if curve:  # (one process: refused under a plan, where rank > 0 has no results)
        assert sft_results is not None  # one process: its SFT stage returned the results
        curve.start(trainer.step_count, sft_results["after"])
    o, q = cfg.optim, cfg.quantization
    metrics = trainer.fit(o.steps)
    run.stop_if_interrupted(
        trainer, {"algo": cfg.rl.algo, "after_sft": (sft_results or {}).get("after")}
    )
    if plan is not None:
        policy = trainer.gathered_policy()  # every rank; then rank 0 alone evaluates and writes
    if run.others_return():
        return None
    assert sft_results is not None  # this process writes: its SFT stage returned the results
    rl_s = run.seconds() - sft_s
    plot_rl_curves(cfg, metrics, out)
    if curve:
        curve.plot(out / "eval_curve.png", xlabel=f"{cfg.rl.algo.upper()} step")

    # 3. Held-out evaluation after RL; paired comparison with the SFT policy on the same items
    after_rl = evaluate(
        engines.sampler(policy), items, scorer, max_new_tokens=cfg.eval.max_new_tokens
    )
    write_table(after_rl.table, out / "eval_after_rl.csv")
    after_sft = read_table(out / "sft" / "eval_after.csv", required=True)
    diff = paired_bootstrap_diff(
        after_rl.table["correct"].to_numpy(), after_sft["correct"].to_numpy(), seed=cfg.seed
    )
    sampled, rl_per_item = sampled_evaluations(cfg, out, items, scorer, policy, engines)
    adapters = export_adapters(policy.model, cfg, out, spec=policy.spec)  # adapter/, merged
    policy.save(out / "policy")
    algo_name = cfg.rl.algo
    results = {
        "algo": algo_name,
        "model": cfg.model.name,
        "params": policy.num_parameters(),
        **cfg.task.report(),
        "eval_size": cfg.task.eval_size,
        "before_sft": sft_results.get("before"),
        "after_sft": sft_results["after"],
        f"after_{algo_name}": after_rl.as_dict(),
        "difference": diff,
        "sft_steps": cfg.sft.steps,
        "rl_steps": o.steps,
        "sft_s": sft_s,
        "rl_s": rl_s,
        "wall_s": run.seconds(),
        "rl_train_s": float(metrics["step_time_s"].sum()),
        "rl_final_reward_mean": float(metrics["reward_mean"].tail(10).mean()),
        **sampled,
        **adapters,
    }
    if curve:
        results["eval_curve"] = curve.rows()
    if converters:
        results["converters"] = converters
    if q.rollout != "none":
        results["rollout_quantization"] = q.rollout
    if cfg.rollout.engine != "builtin":
        results["rollout_engine"] = cfg.rollout.engine
    if q.rollout != "none" or cfg.rollout.engine != "builtin":  # the train/infer mismatch
        results["rollout_kl_mean"] = float(metrics["rollout_kl_mean"].mean())
    write_rl_results(run, results, cfg.task.name, algo_name)
    if cfg.baseline.steps:  # after the RL results are on disk: a failed baseline loses none
        engines.close()  # its SFT stage holds its own engine; the sampled one starts anew
        results.update(more_sft_baseline(cfg, out, items, scorer, after_rl, rl_per_item, engines))
        results["wall_s"] = run.seconds()
        write_rl_results(run, results, cfg.task.name, algo_name)
    return run.done(results)
