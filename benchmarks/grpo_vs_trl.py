"""GRPO from a job's SFT policy: posttrain `RLTrainer` vs TRL `GRPOTrainer`, same settings,
scored by the same held-out evaluation.

The job: `RLRunConfig`'s defaults (chain_sum, `make run`'s when this comparison was first made),
a grpo preset (`--config`), or the main job now (`--main-job`: the grpo recipe's `Config`, SFT on
3-5 letter spell_backward words, `task.demo_options`; GRPO and evaluation on 6-letter words,
`task.options`). Start: the job's SFT stage (`posttrain.workflows.sft.warm_start`), or a run
folder of that job (`--sft-run`, its `sft/policy`). Both trainers load that HF folder (posttrain
`Policy.from_pretrained`, TRL `AutoModelForCausalLM.from_pretrained`; logits checked to agree)
and train on the job's RL task (`training_task`, the held-out questions removed) with its
settings: P prompts x G samples per step, temperature 1, top-p 1, its max new tokens, stop at
<|eos|> / <|end|>, group mean/std advantages, PPO clip 0.2, per-sequence token-mean loss (TRL
`loss_type="grpo"`), k3 KL to the frozen start with beta (none at 0), 1 PPO epoch, one optimizer
step per step, AdamW (weight decay 0) at lr with 5 linear warm-up steps then constant, clip grad
norm 1.0, fp32, and its DAPO soft overlong punishment if `rl.overlong_buffer_len` > 0 (posttrain:
`cfg.rl.algorithm()`; TRL: `get_soft_overlong_punishment`, a second reward function). TRL gets
the byte tokenizer as a `PreTrainedTokenizerFast` and the rendered prompt text (both built and
checked as in `benchmarks/grpo_step.py`), and the task's own verifier as its reward function.

Evaluation, the same for the start and both results: the job's 500 held-out questions, greedy
accuracy, sampled pass@1 (S samples per question at temperature 1) and pass@S, each trainer
minus the start and TRL minus posttrain with a paired bootstrap over the questions (95%
percentile interval, 10k resamples). Writes docs/benchmarks/grpo_vs_trl.md and
docs/benchmarks/figures/grpo_vs_trl.png (training reward, and KL at beta > 0, per step, both
trainers); grpo_vs_trl_PRESET.* with --config PRESET, grpo_vs_trl_main_job.* with --main-job.

Usage:
    python benchmarks/grpo_vs_trl.py                       # SFT stage + both trainers (~30 min)
    python benchmarks/grpo_vs_trl.py --sft-run runs/grpo-X # start from a run of that job
    python benchmarks/grpo_vs_trl.py --main-job            # the main job (grpo recipe's Config)
    python benchmarks/grpo_vs_trl.py --main-job --sft-run runs/grpo-X  # from a main-job run
    python benchmarks/grpo_vs_trl.py --config recipes/presets/grpo_spell_backward.yaml
    python benchmarks/grpo_vs_trl.py --quick               # smoke run at tiny size, nothing written
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_step  # noqa: E402
from timing import cpu_model  # noqa: E402
from trl_inputs import (  # noqa: E402
    CPU_ARGS,
    GRPO_ARGS,
    check_same_model,
    hf_byte_tokenizer,
    on_step_end,
    trl_dataset,
)

from posttrain.policy import Policy  # noqa: E402
from posttrain.rewards.evaluation import (
    evaluate_generations,
    paired_bootstrap_diff,  # noqa: E402
    wilson_interval,
)
from posttrain.rl import RLTrainer  # noqa: E402
from posttrain.train.schedules import warmup_cosine_schedule  # noqa: E402
from posttrain.verifiers.reasoning_gym import task_score  # noqa: E402
from posttrain.workflows import RLRunConfig  # noqa: E402
from posttrain.workflows.config import override  # noqa: E402
from posttrain.workflows.rl import RL_TINY  # noqa: E402
from posttrain.workflows.sft import held_out_items, warm_start  # noqa: E402
from posttrain.workflows.task_data import training_task  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks"
WARMUP_STEPS = 5


def main_job_config(
    quick: bool, out: Path, preset: str | None = None, main_job: bool = False
) -> RLRunConfig:
    """`RLRunConfig`'s defaults, the chain_sum job that was `make run`'s when this comparison
    was first made, a grpo preset over them (`preset`), or the main job now (`main_job`: the
    grpo recipe's `Config`); without held-out curve or baseline, shrunk by RL_TINY for --quick,
    with the run folder `out`."""
    if main_job:
        from posttrain.workflows.recipes import load_recipe

        cfg = load_recipe("grpo").Config(out_dir=str(out), progress=False)
    else:
        cfg = RLRunConfig(out_dir=str(out), progress=False)
    if preset is not None:  # a grpo recipe preset over those defaults (e.g. spell_backward's)
        from posttrain.workflows.recipes import load_config_file

        cfg = load_config_file(cfg, preset)
        if cfg.adapters.method != "none" or cfg.quantization != type(cfg.quantization)():
            raise ValueError(
                f"{preset}: adapters or quantization are set; this comparison "
                "trains the full fp32 model on both sides, so it takes presets "
                "without them"
            )
    if preset is not None or main_job:
        cfg = override(
            cfg, {"out_dir": str(out), "progress": False, "eval.every": 0, "baseline.steps": 0}
        )
    if quick:  # the overlong buffer must fit in the tiny max new tokens
        tiny_tokens = RL_TINY["sampling.max_new_tokens"]
        buffer = min(cfg.rl.overlong_buffer_len, tiny_tokens)
        cfg = override(cfg, {**RL_TINY, "rl.overlong_buffer_len": buffer, "out_dir": str(out)})
    return cfg


def check_start(cfg: RLRunConfig, run: Path) -> None:
    """Raises ValueError if the run folder `run` (`--sft-run`) recorded another task than
    `cfg`'s (its `config.json`; a folder without one is taken as it is): the start must have
    been trained for the task both trainers then train and are scored on."""
    path = run / "config.json"
    if not path.is_file():
        return
    task = json.loads(path.read_text()).get("task", {})
    ours = dataclasses.asdict(cfg.task)
    keys = ("name", "options", "demo_options")
    differ = [k for k in keys if task.get(k) != ours[k]]
    if differ:
        raise ValueError(
            f"{run} was a run of task {[task.get(k) for k in keys]}, this comparison's job has "
            f"{[ours[k] for k in keys]} (differing: {differ}); pass the job that made it "
            "(--main-job for `posttrain run grpo`, or --config PRESET)"
        )


def evaluate(policy: Policy, items, score, *, samples: int, max_new_tokens: int) -> dict:
    """Greedy correct [N] and sampled correct [S, N] (temperature 1, seed 1) on `items`."""
    greedy = evaluate_generations(policy, items, score_fn=score, max_new_tokens=max_new_tokens)
    sampled = evaluate_generations(
        policy,
        list(items) * samples,
        score_fn=score,
        temperature=1.0,
        max_new_tokens=max_new_tokens,
        seed=1,
    )
    return {
        "greedy": greedy.table["correct"].to_numpy(bool),
        "sampled": sampled.table["correct"].to_numpy(bool).reshape(samples, len(items)),
    }


def train_posttrain(folder: Path, task, cfg: RLRunConfig, steps: int, lr: float, beta: float):
    """The main job's RL stage (`run_sft_then_rl`) from `folder`: returns (policy, metrics)."""
    policy = Policy.from_pretrained(folder)
    algo = dataclasses.replace(cfg.rl.algorithm(), kl_coef=beta)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=lr, weight_decay=0.0)
    schedule = warmup_cosine_schedule(
        optimizer, warmup_steps=min(WARMUP_STEPS, steps), total_steps=steps, min_lr_ratio=1.0
    )
    trainer = RLTrainer(
        policy,
        optimizer,
        task=task,
        algo=algo,
        prompts_per_step=cfg.rl.prompts_per_step,
        max_new_tokens=cfg.sampling.max_new_tokens,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        lr_scheduler=schedule,
        max_grad_norm=cfg.optim.max_grad_norm,
        progress=False,
        seed=cfg.seed,
    )
    metrics = trainer.fit(steps)
    return policy, {
        "reward": metrics["reward_mean"].to_numpy(),
        "kl": metrics["kl"].to_numpy() if "kl" in metrics else None,
    }


def train_trl(folder: Path, task, cfg: RLRunConfig, steps: int, lr: float, beta: float, work: Path):
    """TRL `GRPOTrainer` with the same settings from `folder`: returns (policy, metrics)."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    from trl.rewards import get_soft_overlong_punishment

    hf_tok = hf_byte_tokenizer()
    dataset, items, _ = trl_dataset(task, hf_tok)
    score = task.score_fn()

    def task_reward(prompts, completions, idx, **kwargs):
        return [float(score(c, items[i])) for c, i in zip(completions, idx)]

    # DAPO's soft overlong punishment, as posttrain's `overlong_penalty` (of len(completion_ids),
    # the stop token counted): TRL keeps a sampled completion up to and including its first
    # EOS id (`completion_mask = sequence_indices <= eos_idx` in `_generate_single_turn`) and
    # gives those ids to every reward function, so its length counts the stop token too. TRL
    # sums the reward functions weighted by `reward_weights`.
    reward_funcs: list[Any] = [task_reward]  # what TRL calls, summed with `weights`
    weights = [1.0]
    if cfg.rl.overlong_buffer_len > 0:
        max_len, buffer = cfg.sampling.max_new_tokens, cfg.rl.overlong_buffer_len
        reward_funcs.append(get_soft_overlong_punishment(max_len, soft_punish_cache=buffer))
        weights.append(cfg.rl.overlong_penalty_factor)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    P, G = cfg.rl.prompts_per_step, cfg.rl.group_size
    config = GRPOConfig(
        output_dir=str(work / "trl_out"),
        max_steps=steps,
        per_device_train_batch_size=P * G,
        num_generations=G,
        max_completion_length=cfg.sampling.max_new_tokens,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        beta=beta,
        reward_weights=weights,
        learning_rate=lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=min(WARMUP_STEPS, steps),
        # None (off): transformers' Trainer then clips nothing, though the field says float
        max_grad_norm=cast(Any, cfg.optim.max_grad_norm),
        seed=cfg.seed,
        **GRPO_ARGS,
        **CPU_ARGS,
    )
    curves: dict[str, list[float]] = {"reward": [], "kl": []}

    def record_curves() -> None:  # TRL clears its metrics when it logs the final summary
        for key, values in curves.items():
            values.extend(trainer._metrics["train"].get(key, [])[-1:])

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=dataset,
        processing_class=hf_tok,
        callbacks=[on_step_end(record_curves)],
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    saved = work / "trl_policy"
    trained: Any = trainer.model  # a transformers PreTrainedModel
    trained.save_pretrained(saved)
    for name in os.listdir(folder):  # the byte tokenizer's files, so Policy can load the folder
        if "token" in name and not (saved / name).exists():
            shutil.copy(folder / name, saved / name)
    policy = Policy.from_pretrained(saved)
    check_same_model(policy.model, trained)
    return policy, {key: np.asarray(values) if values else None for key, values in curves.items()}


def summary_rows(results: dict[str, dict]) -> list[str]:
    lines = [
        "| policy | greedy accuracy [95% Wilson] | sampled pass@1 | pass@S |",
        "|---|---|---:|---:|",
    ]
    for name, r in results.items():
        n, k = r["greedy"].size, int(r["greedy"].sum())
        lo, hi = wilson_interval(k, n)
        lines.append(
            f"| {name} | {k / n:.3f} [{lo:.3f}, {hi:.3f}] | "
            f"{r['sampled'].mean():.3f} | {r['sampled'].any(0).mean():.3f} |"
        )
    return lines


def diff_rows(results: dict[str, dict], pairs: list[tuple[str, str]]) -> list[str]:
    lines = [
        "| comparison | greedy, points [95% CI] | sampled pass@1, points [95% CI] |",
        "|---|---|---|",
    ]
    for a, b in pairs:
        cells = []
        for key, per_item in (("greedy", lambda x: x), ("sampled", lambda x: x.mean(0))):
            d = paired_bootstrap_diff(per_item(results[a][key]), per_item(results[b][key]))
            cells.append(
                f"{100 * d['difference']:+.1f} [{100 * d['ci_low']:+.1f}, "
                f"{100 * d['ci_high']:+.1f}]"
            )
        lines.append(f"| {a} minus {b} | {cells[0]} | {cells[1]} |")
    return lines


def has_kl(curves: dict[str, dict]) -> bool:
    """Whether either trainer recorded a KL curve (neither does at beta 0)."""
    return any(c.get("kl") is not None and len(c["kl"]) for c in curves.values())


def plot(curves: dict[str, dict], path: Path, window: int) -> None:
    """Each trainer's training reward per step, and its KL to the start where one has it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"reward": "training reward", "kl": "KL to the start (k3)"}
    keys = ["reward", "kl"] if has_kl(curves) else ["reward"]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name, c in curves.items():
            y = c.get(key)
            if y is None or len(y) == 0:
                continue
            w = min(window, len(y))
            smooth = np.convolve(y, np.ones(w) / w, mode="valid")
            ax.plot(np.arange(w, len(y) + 1), smooth, label=name)
        ax.set_title(f"{titles[key]} (mean of {window} steps)")
        ax.set_xlabel("GRPO step")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_line(argv: list[str] | None, sft_run: Path | None) -> str:
    """The command as run, with the `--sft-run` folder written `RUN` and the `--out` folder
    `OUT` (a report names the command that makes it, not folders on the machine that ran it).

    >>> command_line(["--sft-run", "/tmp/x", "--steps", "5", "--out", "/tmp/o"], Path("/tmp/x"))
    '--sft-run RUN --steps 5 --out OUT'
    """
    words = list(sys.argv[1:] if argv is None else argv)
    run = {} if sft_run is None else {"--sft-run": "RUN"}
    return grpo_step.command_line(words, {**run, "--out": "OUT"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sft-run",
        type=Path,
        default=None,
        help="a main-job run folder whose sft/policy is the start (default: run "
        "the SFT stage first)",
    )
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (the job's)")
    parser.add_argument("--lr", type=float, default=None, help="the job's")
    parser.add_argument("--beta", type=float, default=None, help="KL coefficient (the job's)")
    job = parser.add_mutually_exclusive_group()
    job.add_argument(
        "--config",
        default=None,
        help="a grpo preset (YAML) for the task and settings instead of "
        "RLRunConfig's chain_sum defaults; writes grpo_vs_trl_<preset>.md",
    )
    job.add_argument(
        "--main-job",
        action="store_true",
        help="the grpo recipe's Config (the main job, `posttrain run grpo`) instead of "
        "RLRunConfig's chain_sum defaults; writes grpo_vs_trl_main_job.md",
    )
    parser.add_argument("--samples", type=int, default=8, help="S samples per held-out question")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, nothing written")
    parser.add_argument("--out", type=Path, default=DOCS)
    args = parser.parse_args(argv)

    import transformers
    import trl

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run = args.sft_run or work / "run"
        cfg = main_job_config(args.quick, run, args.config, args.main_job)
        steps = args.steps or cfg.optim.steps
        lr = args.lr or cfg.optim.lr
        beta = cfg.rl.algorithm().kl_coef if args.beta is None else args.beta
        t0 = time.perf_counter()
        if args.sft_run is None:
            warm_start(cfg, run)  # SFT on the demonstrations (`task.demo_options` where set)
        else:
            check_start(cfg, run)
        sft_s = time.perf_counter() - t0
        folder = run / "sft" / "policy"
        # the RL task and held-out items as `run_sft_then_rl` builds them (`task.options`)
        items, ds = held_out_items(cfg.task)
        score = lambda text, item: task_score(ds, text.strip(), item)  # noqa: E731 (the job's)
        task = training_task(cfg, size=cfg.task.train_size, seed=cfg.seed, held_out=items)
        ev = dict(samples=args.samples, max_new_tokens=cfg.eval.max_new_tokens)
        results, curves, seconds = {}, {}, {}
        results["SFT start"] = evaluate(Policy.from_pretrained(folder), items, score, **ev)
        for name, train in (("posttrain GRPO", train_posttrain), ("TRL GRPO", train_trl)):
            t = time.perf_counter()
            extra = (work,) if train is train_trl else ()
            policy, curves[name] = train(folder, task, cfg, steps, lr, beta, *extra)
            seconds[name] = time.perf_counter() - t
            results[name] = evaluate(policy, items, score, **ev)
            print(
                f"{name}: {steps} steps in {seconds[name]:.0f} s; greedy "
                f"{results[name]['greedy'].mean():.3f}, pass@1 "
                f"{results[name]['sampled'].mean():.3f}",
                flush=True,
            )

    table = summary_rows(results)
    diffs = diff_rows(
        results,
        [
            ("posttrain GRPO", "SFT start"),
            ("TRL GRPO", "SFT start"),
            ("TRL GRPO", "posttrain GRPO"),
        ],
    )
    reward_lines, buffer, factor = [], cfg.rl.overlong_buffer_len, cfg.rl.overlong_penalty_factor
    for name, c in curves.items():
        r, q = c["reward"], max(1, len(c["reward"]) // 4)
        reward_lines.append(
            f"- {name}: training reward {r[:q].mean():.3f} (first {q} steps) -> "
            f"{r[-q:].mean():.3f} (last {q}); {seconds[name]:.0f} s for "
            f"{steps} steps" + (" (the reward includes the overlong punishment)" if buffer else "")
        )
    made_by = (
        "posttrain run grpo"  # the main job, or a preset over RLRunConfig's defaults
        if args.main_job
        else f"posttrain run grpo --config {args.config or 'recipes/presets/grpo_chain_sum.yaml'}"
    )
    setup = [
        f"- Start: the main job's SFT stage ({cfg.model.name}, {cfg.sft.steps} steps, seed "
        f"{cfg.seed}"
        + (
            f", {sft_s:.0f} s)"
            if args.sft_run is None
            else f"; `--sft-run RUN` names the folder of a finished `{made_by} out_dir=RUN`, "
            "whose `sft/policy` is the start)"
        ),
        f"- Task: reasoning-gym {cfg.task.name} {dict(cfg.task.options)}, RL pool "
        f"{cfg.task.train_size} items minus the held-out questions; held-out "
        f"{len(items)} questions (seed {cfg.task.eval_seed})"
        + (
            f"; the SFT demonstrations are {cfg.task.name} {dict(cfg.task.demo_options)}"
            if cfg.task.demo_options is not None
            else ""
        ),
        f"- Both trainers: {steps} steps of {cfg.rl.prompts_per_step} prompts x G="
        f"{cfg.rl.group_size}, temperature {cfg.sampling.temperature:g}, top-p "
        f"{cfg.sampling.top_p:g}, {cfg.sampling.max_new_tokens} new tokens, clip 0.2, "
        + (f"k3 KL beta {beta:g}" if beta else "no KL term (beta 0)")
        + f", lr {lr:g} (AdamW, {min(WARMUP_STEPS, steps)} warm-up steps then constant, "
        f"weight decay 0), clip grad norm {cfg.optim.max_grad_norm:g}, fp32; TRL's optimizer is "
        "its default fused AdamW, posttrain's torch.optim.AdamW; TRL shuffles the prompts, "
        "posttrain takes them in order",
        "- Overlong punishment (DAPO's soft one, eq. 13): "
        + (
            f"{factor:g} x min(-(L - {cfg.sampling.max_new_tokens - buffer}) / {buffer}, 0) added "
            "to the reward of a completion of L tokens (the stop token counted); posttrain "
            f"through `rl.overlong_buffer_len={buffer}`, TRL through "
            f"`trl.rewards.get_soft_overlong_punishment(max_completion_len="
            f"{cfg.sampling.max_new_tokens}, soft_punish_cache={buffer})`, a second reward "
            f"function of weight {factor:g}"
            if buffer
            else "none, on both sides"
        ),
        f"- Evaluation (both, and the start): greedy and {args.samples} samples per question at "
        f"temperature 1, {cfg.eval.max_new_tokens} new tokens, the task's scorer; differences by "
        "paired bootstrap over the questions (pass@1 per question = share of its samples right)",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, trl "
        f"{trl.__version__}; {cpu_model()}, {args.threads} thread(s); load average at start "
        f"{load[0]:.2f}, at end {os.getloadavg()[0]:.2f}",
        f"- Command: `python benchmarks/grpo_vs_trl.py {command_line(argv, args.sft_run)}`",
    ]
    text = "\n".join(setup + [""] + table + [""] + diffs + [""] + reward_lines) + "\n"
    print("\n" + text)
    if args.quick:
        return 0
    tag = "_main_job" if args.main_job else "_" + Path(args.config).stem if args.config else ""
    figure = args.out / "figures" / f"grpo_vs_trl{tag}.png"
    plot(curves, figure, window=max(1, min(10, steps // 5)))
    md = args.out / f"grpo_vs_trl{tag}.md"
    md.write_text(
        "# GRPO from the main job's SFT policy: posttrain vs TRL `GRPOTrainer`\n\n"
        "Produced by `python benchmarks/grpo_vs_trl.py`.\n\n"
        + text
        + f"\n![training reward{' and KL' if has_kl(curves) else ''} per step]"
        + f"(figures/{figure.name})\n"
    )
    print(f"wrote {md} and {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
