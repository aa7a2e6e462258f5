"""Own prompt data for the RL recipes (grpo, ppo): `data.train` (a prompts file, a DataFrame, a
HF dataset or a list of dicts) scored by reward functions (`rewards.funcs`), in place of a
reasoning-gym task. The run itself is `posttrain.workflows.rl.run_sft_then_rl`.

    posttrain run grpo data.train=prompts.jsonl rewards.funcs=[mypkg.rewards:accuracy]

Rows are `posttrain.data.sources`' RL-prompt records: a "prompt" (a str, or a list of chat
messages) and any other columns (an "answer", metadata), which reach the reward functions as
keyword lists; prompt/completion rows give their completion as the "answer". The `data:`
section is the SFT recipe's (`posttrain.workflows.own_data.DataConfig`): held-out rows are
`data.eval`, or else `data.eval_fraction` of `data.train` drawn with `data.seed` (left out of
training), at most `data.eval_rows` of them; the `task.*` keys are unused.

The stages, decided by the rows:

  1. Warm start (run folder `sft/`): SFT on prompt -> answer of the training rows that have an
     "answer" (the first `sft.demonstrations` of them when set), rendered as the RL prompts
     are, with the held-out rows that have one as its validation rows (`val_loss`,
     `val_exact_match` before and after). Skipped when no training row has an answer: RL then
     starts from `model.init_from` (a HF folder) or a fresh `model.name`.
  2. RL on every training row (`posttrain.envs.PromptTask`), scored by the reward functions;
     `reward/<name>` per function in metrics.jsonl.
  3. The held-out rows, answered greedily (`eval.max_new_tokens`) by the starting policy and
     by the RL policy (`PromptHeldOut`): `reward_mean`, the mean weighted reward over the rows
     the functions scored (failures counted in `reward_failures`, never averaged in as 0.0),
     each function's mean, and `exact_match` (answer equal to the row's "answer", both stripped
     of surrounding white space) over the rows that have an answer; RL minus start of both,
     paired over the rows (bootstrap). `eval.every` N > 0: the same every N RL steps
     (`eval_curve.csv` / `eval_curve.png`).
  4. `baseline.steps` > 0 and answers: the honest baseline, that many more SFT steps on the
     same demonstrations (run folder `more_sft/`), scored and compared with RL the same way.
     Without answers there is nothing to imitate and no baseline runs (results.json says so).

Not with own prompts: sampled pass@k (`eval.samples` is the task's) and a `parallel` plan.

The rows' reading and the held-out scoring are in `posttrain.workflows.prompt_rows`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from posttrain.policy.policy import Policy
from posttrain.workflows.data_config import DataConfig
from posttrain.workflows.prompt_rows import (
    PromptHeldOut,
    PromptHeldOutCurve,
    chat_rows,
    paired_diffs,
    prompt_data,
    summary,
    write_demonstrations,
)
from posttrain.workflows.quantization import export_adapters
from posttrain.workflows.recipe_run import RecipeRun
from posttrain.workflows.reports import read_table, write_table
from posttrain.workflows.rl_config import RLRunConfig
from posttrain.workflows.rl_stage import plot_rl_curves, rl_trainer
from posttrain.workflows.sft import warm_start

if TYPE_CHECKING:
    from posttrain.policy.engine_slot import EngineSlot

__all__ = ["run_own_prompts", "write_prompt_results"]


def run_own_prompts(run: RecipeRun, cfg: RLRunConfig, engines: EngineSlot) -> dict[str, Any]:
    """The RL run on `cfg.data`'s rows (the stages of the module docstring) after its start
    (`posttrain.workflows.rl.run_sft_then_rl`): `engines` samples the rollouts and the
    held-out answers. One process (the config refuses a parallel plan). Returns the results
    dict also written to results.json (and .csv/.md)."""
    out, algo = run.out, cfg.rl.algo
    rewards = cfg.rewards.functions()
    data = prompt_data(cfg.data)
    held = (
        PromptHeldOut(data.held, rewards, max_new_tokens=cfg.eval.max_new_tokens)
        if data.held
        else None
    )

    # 1. SFT warm start on prompt -> answer (the held-out rows with one: its validation rows)
    demonstrations = data.demonstrations(cfg.sft.demonstrations)
    sft_data, sft_results = None, None
    if demonstrations:
        val = chat_rows(data.held)
        sft_data = DataConfig(
            train=write_demonstrations(demonstrations, out / "demonstrations.jsonl"),
            eval=write_demonstrations(val, out / "demonstrations_eval.jsonl") if val else None,
            eval_fraction=0.0,
            eval_rows=max(1, len(val)),
        )
        init_from = None if cfg.model.init_from is None else Path(cfg.model.init_from)
        sft_results = warm_start(cfg, out, init_from=init_from, data=sft_data)
        policy = Policy.from_pretrained(out / "sft" / "policy")
    elif cfg.model.init_from is not None:  # no answers: RL starts from the model as it is
        policy = Policy.from_pretrained(cfg.model.init_from)
    else:
        policy = Policy.from_spec(cfg.model.name, seed=cfg.seed)
    sft_s = run.seconds()
    before = None if held is None else _evaluated(held, policy, engines, out, "eval_before_rl")

    # 2. RL on every training row, scored by the reward functions
    print(f"RL task: {len(data.train)} prompt rows ({len(data.held)} held out), {rewards}")
    if cfg.eval.samples:  # said once: sampled pass@k is a task's measurement
        print(f"eval.samples={cfg.eval.samples} unused: own prompt rows are scored greedily")
    curve = None
    if cfg.eval.every and held is not None and before is not None:
        curve = PromptHeldOutCurve(
            policy, held, every=cfg.eval.every, path=out / "eval_curve.csv", engines=engines
        )
    trainer, converters = rl_trainer(
        run, cfg, engines, policy, data.task(rewards), [curve] if curve else []
    )
    if curve and before is not None:
        curve.start(trainer.step_count, summary(before))
    metrics = trainer.fit(cfg.optim.steps)
    run.stop_if_interrupted(trainer, {"algo": algo, "sft": sft_results})
    rl_s = run.seconds() - sft_s
    plot_rl_curves(cfg, metrics, out)
    if curve:
        curve.plot(out / "eval_curve.png", xlabel=f"{algo.upper()} step")

    # 3. The held-out rows after RL, paired with the starting policy's answers
    results: dict[str, Any] = {
        "algo": algo,
        "model": cfg.model.init_from or cfg.model.name,
        "params": policy.num_parameters(),
        "data": {
            "train": _source_name(cfg.data.train),
            "train_rows": len(data.train),
            "held_out_rows": len(data.held),
            "demonstrations": len(demonstrations),
        },
        "rewards": {"funcs": list(cfg.rewards.funcs), "weights": list(rewards.weights)},
        "sft": sft_results,
        "sft_steps": cfg.sft.steps if demonstrations else 0,
        "rl_steps": cfg.optim.steps,
        "sft_s": sft_s,
        "rl_s": rl_s,
        "rl_train_s": float(metrics["step_time_s"].sum()),
        "rl_final_reward_mean": float(metrics["reward_mean"].tail(10).mean()),
    }
    after = None
    if held is not None and before is not None:
        after = _evaluated(held, policy, engines, out, f"eval_after_{algo}", reuse=False)
        results["before_rl"], results[f"after_{algo}"] = summary(before), summary(after)
        results["difference"] = paired_diffs(after, before, seed=cfg.seed)
    if curve:
        results["eval_curve"] = curve.rows()
    if converters:
        results["converters"] = converters
    results.update(export_adapters(policy.model, cfg, out, spec=policy.spec))  # adapter/
    policy.save(out / "policy")
    results["wall_s"] = run.seconds()
    write_prompt_results(run, results)
    if cfg.baseline.steps:  # after the RL results are on disk: a failed baseline loses none
        if sft_data is None or held is None or after is None:
            results["more_sft_skipped"] = (
                "no training row has an answer to imitate"
                if sft_data is None
                else "no held-out rows to compare on"
            )
        else:
            engines.close()  # its SFT stage holds its own engine
            warm_start(
                cfg,
                out,
                folder="more_sft",
                init_from=out / "sft" / "policy",
                sft=cfg.baseline.warm_start(cfg.sft),
                data=sft_data,
            )
            more_policy = Policy.from_pretrained(out / "more_sft" / "policy")
            more = _evaluated(held, more_policy, engines, out, "eval_after_more_sft", reuse=False)
            results["more_sft"] = {**summary(more), "steps": cfg.baseline.steps}
            results["rl_minus_more_sft"] = paired_diffs(after, more, seed=cfg.seed)
        results["wall_s"] = run.seconds()
        write_prompt_results(run, results)
    return run.done(results)


def _evaluated(
    held: PromptHeldOut,
    policy: Policy,
    engines: EngineSlot,
    out: Path,
    name: str,
    *,
    reuse: bool = True,
) -> pd.DataFrame:
    """`held.evaluate` of `policy`, written to `out/<name>.csv`; with `reuse`, the table a
    resumed run wrote before (the starting policy's answers do not change)."""
    path = out / f"{name}.csv"
    table = read_table(path) if reuse else None
    if table is None:
        table = held.evaluate(engines.sampler(policy))
        write_table(table, path)
    return table


def _source_name(source: Any) -> str:
    return str(source) if isinstance(source, (str, Path)) else f"a {type(source).__name__}"


def _metric_line(name: str, metrics: dict[str, Any] | None) -> str:
    if not metrics:
        return f"| {name} | - | - | - |"
    reward = metrics.get("reward_mean")
    exact = metrics.get("exact_match")
    return (
        f"| {name} | {'-' if reward is None else f'{reward:.3f}'} | "
        f"{metrics.get('reward_failures', 0)} | {'-' if exact is None else f'{exact:.3f}'} |"
    )


def write_prompt_results(run: RecipeRun, results: dict[str, Any]) -> None:
    """results.csv (the held-out metrics of each stage), results.json and results.md."""
    algo = results["algo"]
    stages = [
        ("before RL", results.get("before_rl")),
        (f"after {algo.upper()}", results.get(f"after_{algo}")),
    ]
    if isinstance(results.get("more_sft"), dict):
        stages.append(("more SFT instead", results["more_sft"]))
    kept = [(name, m) for name, m in stages if m]
    if kept:
        write_table(pd.DataFrame([{"stage": n, **m} for n, m in kept]), run.out / "results.csv")
    data = results["data"]
    lines = [
        f"# {algo.upper()} on {data['train']}: {data['train_rows']} prompt rows, "
        f"{data['held_out_rows']} held out",
        "",
        f"model {results['model']} ({results['params'] / 1e6:.2f}M params), rewards "
        f"{results['rewards']['funcs']} x {results['rewards']['weights']}; "
        + (
            f"{results['sft_steps']} SFT steps on {data['demonstrations']} answers "
            f"({results['sft_s']:.0f} s), "
            if data["demonstrations"]
            else "no warm start (no answers), "
        )
        + f"{results['rl_steps']} {algo.upper()} steps ({results['rl_s']:.0f} s), "
        f"wall {results['wall_s']:.0f} s",
        "",
    ]
    if kept:
        lines += [
            "| held-out (greedy) | mean reward | failures | exact match |",
            "|---|---|---|---|",
            *(_metric_line(name, m) for name, m in stages),
            "",
        ]
    for key, title in (
        ("difference", f"{algo.upper()} minus start"),
        ("rl_minus_more_sft", f"{algo.upper()} minus more SFT"),
    ):
        for metric, d in results.get(key, {}).items():
            lines.append(
                f"{title}, {metric.replace('_', ' ')}: {d['difference']:+.3f} "
                f"[{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] over {d['num_items']} rows "
                "(paired bootstrap)"
            )
    if "more_sft_skipped" in results:
        lines.append(f"More-SFT baseline not run: {results['more_sft_skipped']}")
    run.write(results, "\n".join(lines) + "\n")
