"""The held-out measurements of an RL run (`posttrain.workflows.rl.run_sft_then_rl`) beyond
its greedy accuracy after each stage, and its report:

  - `HeldOutCurve`: a trainer callback, greedy held-out accuracy every N RL steps
    (`eval.every`; `eval_curve.csv` / `eval_curve.png`);
  - `sampled_evaluations`: sampled pass@1 / pass@k of the SFT policy and the trained one
    (`eval.samples`) and their paired difference, with its results.md lines (`sampled_lines`);
    the RFT and DPO-family runs measure theirs with it too;
  - `more_sft_baseline`: the honest baseline, more SFT on the same demonstrations instead of RL
    (`baseline.steps`), compared with the RL policy, paired;
  - `write_rl_results`: results.csv / results.json / results.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from posttrain.core.checks import check_int
from posttrain.core.figures import new_figure
from posttrain.core.metrics import read_metrics
from posttrain.policy.policy import Policy
from posttrain.rewards.evaluation import (
    EvalResult,
    SampledEvalResult,
    evaluate_sampled,
    paired_bootstrap_diff,
)
from posttrain.rl.trainer import RLTrainer
from posttrain.verifiers.reasoning_gym import task_score
from posttrain.workflows.recipe_run import RecipeRun
from posttrain.workflows.reports import (
    accuracy_table,
    demo_split_lines,
    difference_line,
    read_table,
    write_table,
)
from posttrain.workflows.rl_config import RLRunConfig
from posttrain.workflows.sft import warm_start
from posttrain.workflows.task_data import evaluate

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from reasoning_gym.dataset import ProceduralDataset  # the task's items and scorer

    from posttrain.policy.engine_slot import EngineSlot


__all__ = [
    "HeldOutCurve",
    "plot_eval_curve",
    "sampled_evaluations",
    "sampled_lines",
    "more_sft_baseline",
    "write_rl_results",
]


def _sampled(
    cfg: Any,
    policy: Policy,
    items: list[dict],
    scorer: ProceduralDataset,
    engines: EngineSlot | None,
) -> SampledEvalResult:
    """`cfg.eval.samples` answers per held-out item at temperature 1, seeded by `cfg.seed`,
    sampled by `engines.sampler(policy)` (by `policy` itself without a slot)."""
    return evaluate_sampled(
        policy if engines is None else engines.sampler(policy),
        items,
        samples=cfg.eval.samples,
        seed=cfg.seed + 1,
        max_new_tokens=cfg.eval.max_new_tokens,
        score_fn=lambda text, item: task_score(scorer, text.strip(), item),
    )


def sampled_evaluations(
    cfg: Any,
    out: Path,
    items: list[dict],
    scorer: ProceduralDataset,
    policy: Policy,
    engines: EngineSlot | None = None,
    *,
    stage: str | None = None,
    start: Path | None = None,
) -> tuple[dict[str, Any], np.ndarray | None]:
    """Sampled pass@1 / pass@k (k = `cfg.eval.samples`, temperature 1, seed `cfg.seed + 1`) of
    the starting policy (read back from `start`, default `out/sft/policy`) and of `policy`
    after the trained `stage` (default `cfg.rl.algo`; `rft`, `dpo`, ...), the stage-minus-start
    difference of per-item pass@1 (paired bootstrap), and the answer tables
    `eval_sampled_after_{sft,STAGE}.csv`; {} when `cfg.eval.samples` is 0; with them, the
    trained policy's per-item pass@1 ([N] float64, None without samples) for a baseline's
    comparison. `cfg`: a recipe config with `eval.samples`, `eval.max_new_tokens` and `seed`.
    `engines`: the run's engine slot, which samples both policies (None: each policy samples
    itself)."""
    if not cfg.eval.samples:
        return {}, None
    stage = cfg.rl.algo if stage is None else stage
    first = Policy.from_pretrained(out / "sft" / "policy" if start is None else start)
    results, per_item = {}, {}
    for name, model in (("sft", first), (stage, policy)):
        r = _sampled(cfg, model, items, scorer, engines)
        write_table(r.table, out / f"eval_sampled_after_{name}.csv")
        results[f"sampled_after_{name}"] = r.as_dict()
        per_item[name] = r.per_item_pass1
    results["sampled_difference"] = paired_bootstrap_diff(
        per_item[stage], per_item["sft"], seed=cfg.seed
    )
    return results, per_item[stage]


def sampled_lines(results: dict[str, Any], stage: str, label: str) -> list[str]:
    """results.md lines for `sampled_evaluations`' results: the sampled pass@1 / pass@k table
    of the start and of `stage` (shown as `label`), and their paired difference; [] when the
    run sampled nothing."""
    if "sampled_difference" not in results:
        return []
    k = results["sampled_after_sft"]["k"]
    return [
        f"| held-out (sampled, T=1, {k} answers each) | pass@1 | pass@{k} |",
        "|---|---|---|",
        *(
            f"| after {name} | {r['pass_at_1']:.3f} | {r['pass_at_k']:.3f} |"
            for name, r in (
                ("SFT", results["sampled_after_sft"]),
                (label, results[f"sampled_after_{stage}"]),
            )
        ),
        "",
        difference_line(f"{label} minus SFT, sampled pass@1", results["sampled_difference"]),
        "",
    ]


def more_sft_baseline(
    cfg: RLRunConfig,
    out: Path,
    items: list[dict],
    scorer: ProceduralDataset,
    after_rl: EvalResult,
    rl_per_item: np.ndarray | None,
    engines: EngineSlot | None = None,
) -> dict[str, Any]:
    """The honest baseline (`cfg.baseline`): `cfg.baseline.steps` more SFT steps from the SFT
    policy on the same demonstrations (run folder `more_sft/`), scored on the same held-out
    items, and RL minus more-SFT, paired (greedy; sampled pass@1 against `rl_per_item`, the RL
    policy's per-item pass@1, when `cfg.eval.samples`). `train_s` is the sum of the stage's
    step times (`rl_train_s` likewise for RL): training only, whole across a resume. The
    stage's SFT run samples its evaluations with its own engine (`cfg.rollout`); `engines`,
    the run's slot, samples the sampled evaluation (None: the policy itself)."""
    results = warm_start(
        cfg,
        out,
        folder="more_sft",
        init_from=out / "sft" / "policy",
        sft=cfg.baseline.warm_start(cfg.sft),
    )
    assert results is not None  # one process (the baseline is refused under a plan)
    greedy = read_table(out / "more_sft" / "eval_after.csv", required=True)["correct"].to_numpy()
    train_s = float(read_metrics(out / "more_sft")["step_time_s"].sum())
    baseline = {
        "more_sft": {
            **results["after"],
            "steps": cfg.baseline.steps,
            "lr": cfg.baseline.lr,
            "train_s": train_s,
        },
        "rl_minus_more_sft": paired_bootstrap_diff(
            after_rl.table["correct"].to_numpy(), greedy, seed=cfg.seed
        ),
    }
    if rl_per_item is not None:
        more_sft = Policy.from_pretrained(out / "more_sft" / "policy")
        r = _sampled(cfg, more_sft, items, scorer, engines)
        write_table(r.table, out / "eval_sampled_after_more_sft.csv")
        baseline["sampled_after_more_sft"] = r.as_dict()
        baseline["rl_minus_more_sft_sampled"] = paired_bootstrap_diff(
            rl_per_item, r.per_item_pass1, seed=cfg.seed
        )
    return baseline


class HeldOutCurve:
    """A trainer callback: greedy held-out accuracy of `policy` every `every` RL steps (the
    same items, scorer and answer length as the final evaluation), one CSV row per point
    (step, accuracy, ci_low, ci_high, num_items: a fraction and its 95% Wilson interval) in
    `path`, written as it comes so a live run can be read. Greedy decoding draws no random
    numbers, so the run trains exactly as without it.

    `engines` (the run's `EngineSlot`, or None for the policy itself) samples the answers.

    Call `start(step, after_sft)` once the trainer exists: it writes step 0 (the SFT policy,
    from its results) and drops rows of steps a resumed run will take again.

    Raises:
        ValueError: `every` is not an integer >= 1.
    """

    COLUMNS = ("step", "accuracy", "ci_low", "ci_high", "num_items")

    def __init__(
        self,
        policy: Policy,
        items: list[dict],
        scorer: ProceduralDataset,
        *,
        every: int,
        max_new_tokens: int,
        path: Path,
        engines: EngineSlot | None = None,
    ) -> None:
        check_int("every", every, minimum=1)
        self.policy, self.items, self.scorer, self.engines = policy, items, scorer, engines
        self.every, self.max_new_tokens, self.path = every, max_new_tokens, Path(path)

    def start(self, step: int, after_sft: dict[str, Any]) -> None:
        old = read_table(self.path)
        kept = [] if old is None else [r for r in old.to_dict("records") if 0 < r["step"] <= step]
        self._write([{"step": 0, **after_sft}, *kept])

    def __call__(self, trainer: RLTrainer, row: dict[str, Any]) -> None:
        if trainer.step_count % self.every and trainer.step_count != trainer.target_steps:
            return
        sampler = self.policy if self.engines is None else self.engines.sampler(self.policy)
        r = evaluate(sampler, self.items, self.scorer, max_new_tokens=self.max_new_tokens)
        self._write([*self.rows(), {"step": trainer.step_count, **r.as_dict()}])

    def _write(self, points: list[dict[str, Any]]) -> None:
        write_table(pd.DataFrame(points, columns=list(self.COLUMNS)), self.path)

    def rows(self) -> list[dict[str, Any]]:
        """The points so far, as dicts of `COLUMNS` (none before the first)."""
        table = read_table(self.path)
        return [] if table is None else table.to_dict("records")

    def plot(self, path: Path, *, xlabel: str) -> Figure:
        """`plot_eval_curve` of the points so far (step 0 at least: `start` wrote it)."""
        return plot_eval_curve(read_table(self.path, required=True), path, xlabel=xlabel)


def plot_eval_curve(curve: pd.DataFrame, path: Path, *, xlabel: str) -> Figure:
    """Held-out accuracy against step with its interval band, one 5 x 3 inch panel saved to
    `path` as PNG at 100 dpi.

    Args:
        curve: a `HeldOutCurve` table: columns step, accuracy, ci_low, ci_high (fractions in
            [0, 1]) and num_items, one row per point.
        path: the PNG file to write. xlabel: the x axis label (e.g. "GRPO step").

    Returns:
        The `matplotlib.figure.Figure`, made outside pyplot (`posttrain.core.figures`): the
        backend is left as it is, and it shows inline only as a notebook cell's value.
    """
    fig = new_figure(figsize=(5, 3), layout="tight")
    ax = fig.add_subplot()
    ax.fill_between(curve["step"], curve["ci_low"], curve["ci_high"], alpha=0.25)
    ax.plot(curve["step"], curve["accuracy"], marker=".")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(f"{int(curve['num_items'].iloc[0])} items, 95% Wilson interval", fontsize=9)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    return fig


def write_rl_results(run: RecipeRun, results: dict[str, Any], task: str, algo: str) -> None:
    """results.csv (the held-out accuracy of each stage), results.json and results.md."""
    stages = [
        ("before SFT", results["before_sft"]),
        ("after SFT", results["after_sft"]),
        (f"after {algo.upper()}", results[f"after_{algo}"]),
    ]
    write_table(
        pd.DataFrame([{"stage": name, **r} for name, r in stages if r is not None]),
        run.out / "results.csv",
    )
    lines = [
        f"# SFT -> {algo.upper()} on {task} {results['task_config']}",
        "",
        *demo_split_lines(results, f"{algo.upper()} prompts"),
        f"model {results['model']} ({results['params'] / 1e6:.2f}M params), "
        f"{results['sft_steps']} SFT steps ({results['sft_s']:.0f} s), "
        f"{results['rl_steps']} {algo.upper()} steps ({results['rl_s']:.0f} s), "
        f"wall {results['wall_s']:.0f} s",
        "",
        *accuracy_table(stages),
        "",
        difference_line(f"{algo.upper()} minus SFT", results["difference"]),
        "",
    ]
    lines += sampled_lines(results, algo, algo.upper())
    if "more_sft" in results:  # the honest baseline: the same demonstrations, more SFT
        b = results["more_sft"]
        lines += [
            f"Baseline: {b['steps']} more SFT steps instead (lr {b['lr']:g}; "
            f"{b['train_s']:.0f} s of training steps, {algo.upper()}'s "
            f"{results['rl_train_s']:.0f} s): greedy "
            f"{b['accuracy']:.3f} [{b['ci_low']:.3f}, {b['ci_high']:.3f}]"
            + (
                f", sampled pass@1 {results['sampled_after_more_sft']['pass_at_1']:.3f}, "
                f"pass@{results['sampled_after_more_sft']['k']} "
                f"{results['sampled_after_more_sft']['pass_at_k']:.3f}"
                if "sampled_after_more_sft" in results
                else ""
            ),
            "",
            difference_line(f"{algo.upper()} minus more SFT", results["rl_minus_more_sft"]),
        ]
        if "rl_minus_more_sft_sampled" in results:
            lines.append(
                difference_line(
                    f"{algo.upper()} minus more SFT, sampled pass@1",
                    results["rl_minus_more_sft_sampled"],
                )
            )
        lines.append("")
    if "eval_curve" in results:
        points = ", ".join(f"step {r['step']}: {r['accuracy']:.3f}" for r in results["eval_curve"])
        lines += [
            f"Held-out greedy accuracy during {algo.upper()} (eval_curve.csv/png): {points}",
            "",
        ]
    run.write(results, "\n".join(lines))
