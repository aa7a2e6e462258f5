"""GRPO from the main job's SFT policy: posttrain `RLTrainer` vs TRL `GRPOTrainer`, same settings,
scored by the same held-out evaluation.

Start point: the SFT stage of `make run` (`posttrain.workflows.sft.warm_start` with the defaults of
`RLRunConfig`: tiny-2m, 900 steps on chain_sum), or an existing run folder (`--sft-run`, its
`sft/policy`). Both trainers load that HF folder (posttrain `Policy.from_pretrained`, TRL
`AutoModelForCausalLM.from_pretrained`; logits checked to agree) and train on the main job's RL
task (`ReasoningGymTask`, the 500 held-out questions removed) with the main job's settings:
P prompts x G samples per step, temperature 1, top-p 1, the main job's max new tokens, stop at
<|eos|> / <|end|>, group mean/std advantages, PPO clip 0.2, per-sequence token-mean loss (TRL
`loss_type="grpo"`), k3 KL to the frozen start with beta, 1 PPO epoch, one optimizer step per
step, AdamW (weight decay 0) at lr with 5 linear warm-up steps then constant, clip grad norm 1.0,
fp32. TRL gets the byte tokenizer as a `PreTrainedTokenizerFast` and the rendered prompt text
(both built and checked as in `benchmarks/grpo_step.py`), and the task's own verifier as its
reward function.

Evaluation, the same for the start and both results: the main job's 500 held-out questions,
greedy accuracy, sampled pass@1 (S samples per question at temperature 1) and pass@S, each
trainer minus the start and TRL minus posttrain with a paired bootstrap over the questions
(95% percentile interval, 10k resamples). Writes docs/benchmarks/grpo_vs_trl.md and
docs/benchmarks/figures/grpo_vs_trl.png (training reward and KL per step, both trainers).

Usage:
    python benchmarks/grpo_vs_trl.py                       # SFT stage + both trainers (~30 min)
    python benchmarks/grpo_vs_trl.py --sft-run runs/grpo-X # start from an existing main-job run
    python benchmarks/grpo_vs_trl.py --quick               # smoke run at tiny size, nothing written
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
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

from posttrain.envs import ReasoningGymTask  # noqa: E402
from posttrain.policy import Policy  # noqa: E402
from posttrain.rewards.evaluation import (
    evaluate_generations,
    paired_bootstrap_diff,  # noqa: E402
    wilson_interval,
)
from posttrain.rl import RLTrainer  # noqa: E402
from posttrain.train.schedules import warmup_cosine_schedule  # noqa: E402
from posttrain.workflows import RLRunConfig  # noqa: E402
from posttrain.workflows.config import override  # noqa: E402
from posttrain.workflows.rl import RL_TINY  # noqa: E402
from posttrain.workflows.sft import held_out_items, warm_start  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks"
WARMUP_STEPS = 5


def main_job_config(quick: bool, out: Path, preset: str | None = None) -> RLRunConfig:
    """`RLRunConfig`'s defaults, the chain_sum job that was `make run`'s when this comparison
    was made (or its RL_TINY shrink for --quick), with the run folder `out`."""
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
        cfg = override(
            cfg, {"out_dir": str(out), "progress": False, "eval.every": 0, "baseline.steps": 0}
        )
    if quick:
        cfg = override(cfg, {**RL_TINY, "out_dir": str(out)})
    return cfg


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

    hf_tok = hf_byte_tokenizer()
    dataset, items, _ = trl_dataset(task, hf_tok)
    score = task.score_fn()

    def task_reward(prompts, completions, idx, **kwargs):
        return [float(score(c, items[i])) for c, i in zip(completions, idx)]

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
        reward_funcs=task_reward,
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


def plot(curves: dict[str, dict], path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, c in curves.items():
        for ax, key in zip(axes, ("reward", "kl")):
            y = c.get(key)
            if y is None or len(y) == 0:
                continue
            w = min(window, len(y))
            smooth = np.convolve(y, np.ones(w) / w, mode="valid")
            ax.plot(np.arange(w, len(y) + 1), smooth, label=name)
    axes[0].set_title(f"training reward (mean of {window} steps)")
    axes[1].set_title(f"KL to the start (k3, mean of {window} steps)")
    for ax in axes:
        ax.set_xlabel("GRPO step")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_line(argv: list[str] | None, sft_run: Path | None) -> str:
    """The command as run, with the `--sft-run` folder written `RUN` (a report names the
    command that makes its start, not a folder on the machine that ran it).

    >>> command_line(["--sft-run", "/tmp/x", "--steps", "5"], Path("/tmp/x"))
    '--sft-run RUN --steps 5'
    """
    words = list(sys.argv[1:] if argv is None else argv)
    return grpo_step.command_line(words, {} if sft_run is None else {"--sft-run": "RUN"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sft-run",
        type=Path,
        default=None,
        help="a main-job run folder whose sft/policy is the start (default: run "
        "the SFT stage first)",
    )
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (main job's: 100)")
    parser.add_argument("--lr", type=float, default=None, help="main job's: 1e-4")
    parser.add_argument("--beta", type=float, default=None, help="KL coefficient (main job's)")
    parser.add_argument(
        "--config",
        default=None,
        help="a grpo preset (YAML) for the task and settings instead of "
        "RLRunConfig's chain_sum defaults; writes grpo_vs_trl_<preset>.md",
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
        cfg = main_job_config(args.quick, run, args.config)
        steps = args.steps or cfg.optim.steps
        lr = args.lr or cfg.optim.lr
        beta = cfg.rl.algorithm().kl_coef if args.beta is None else args.beta
        t0 = time.perf_counter()
        if args.sft_run is None:
            warm_start(cfg, run)
        sft_s = time.perf_counter() - t0
        folder = run / "sft" / "policy"
        items, ds = held_out_items(cfg.task)
        score = lambda text, item: ds.score_answer(text.strip(), item)  # noqa: E731 (the job's)
        task = ReasoningGymTask(
            name=cfg.task.name,
            size=cfg.task.train_size,
            seed=cfg.seed,
            config=dict(cfg.task.options),
            held_out_size=cfg.task.eval_size,
            held_out_seed=cfg.task.eval_seed,
        )
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
    reward_lines = []
    for name, c in curves.items():
        r, q = c["reward"], max(1, len(c["reward"]) // 4)
        reward_lines.append(
            f"- {name}: training reward {r[:q].mean():.3f} (first {q} steps) -> "
            f"{r[-q:].mean():.3f} (last {q}); {seconds[name]:.0f} s for "
            f"{steps} steps"
        )
    setup = [
        f"- Start: the main job's SFT stage ({cfg.model.name}, {cfg.sft.steps} steps, seed "
        f"{cfg.seed}"
        + (
            f", {sft_s:.0f} s)"
            if args.sft_run is None
            else "; `--sft-run RUN` names the folder of a finished `posttrain run grpo"
            + (f" --config {args.config}" if args.config else "")
            + " out_dir=RUN`, whose `sft/policy` is the start)"
        ),
        f"- Task: reasoning-gym {cfg.task.name} {dict(cfg.task.options)}, RL pool "
        f"{cfg.task.train_size} items minus the held-out questions; held-out "
        f"{len(items)} questions (seed {cfg.task.eval_seed})",
        f"- Both trainers: {steps} steps of {cfg.rl.prompts_per_step} prompts x G="
        f"{cfg.rl.group_size}, temperature {cfg.sampling.temperature:g}, top-p "
        f"{cfg.sampling.top_p:g}, {cfg.sampling.max_new_tokens} new tokens, clip 0.2, k3 KL beta "
        f"{beta:g}, lr {lr:g} (AdamW, {min(WARMUP_STEPS, steps)} warm-up steps then constant, "
        f"weight decay 0), clip grad norm {cfg.optim.max_grad_norm:g}, fp32; TRL's optimizer is "
        "its default fused AdamW, posttrain's torch.optim.AdamW; TRL shuffles the prompts, "
        "posttrain takes them in order",
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
    tag = "" if args.config is None else "_" + Path(args.config).stem
    figure = args.out / "figures" / f"grpo_vs_trl{tag}.png"
    plot(curves, figure, window=max(1, min(10, steps // 5)))
    md = args.out / f"grpo_vs_trl{tag}.md"
    md.write_text(
        "# GRPO from the main job's SFT policy: posttrain vs TRL `GRPOTrainer`\n\n"
        "Produced by `python benchmarks/grpo_vs_trl.py`.\n\n"
        + text
        + f"\n![training reward and KL per step](figures/{figure.name})\n"
    )
    print(f"wrote {md} and {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
