"""GRPO step time: posttrain `RLTrainer` vs TRL `GRPOTrainer` on the same tiny weights (CPU).

Both sides train the same model, side by side in one process: the posttrain `tiny-2m` preset
(Qwen2, byte vocabulary of 272, tied embeddings) built with `build_model(seed=0)`, and the
`Qwen2ForCausalLM` that transformers loads (`AutoModelForCausalLM.from_pretrained`) from the folder
`posttrain.models.hf.save_hf_checkpoint` writes (its generation_config lists the byte tokenizer's
stop ids, EOS and <|end|>, so TRL's `generate` stops where `Policy.generate` does); their logits
are checked to agree before timing.

Same work per optimizer step on both sides: P chain_sum prompts (reasoning-gym, rendered by the
byte tokenizer's chat format, ~71-73 tokens), G completions each (temperature 1, top-p 1, at most
16 new tokens, stopping at EOS / <|end|>), the chain_sum verifier as the reward (1 correct, 0
otherwise), group-normalised advantages (mean and std over the group), PPO clip 0.2, per-sequence
token-mean loss (TRL `loss_type="grpo"`), k3 KL to a frozen reference with beta 0.04, 1 PPO
epoch, one optimizer step per step (P x G rows in one minibatch), AdamW (weight decay 0, constant
lr), clip grad norm 1.0, fp32.

TRL gets a `PreTrainedTokenizerFast` built for the byte vocabulary (ids 0..255 = bytes through a
ByteLevel BPE without merges, ids 256..271 = the special tokens as added tokens; checked to encode
every prompt to exactly posttrain's ids) and a dataset whose "prompt" column is the rendered prompt
text (so TRL tokenizes it to the same ids), plus an "idx" column the reward function uses to find
the item (both built in `trl_inputs.py`). TRL: `per_device_train_batch_size=P*G`,
`num_generations=G`, `steps_per_generation=1`, `num_iterations=1`, `use_cpu=True`, `use_vllm=False`,
`report_to=[]`, `logging_strategy="no"`, otherwise its defaults (optimizer `adamw_torch_fused`;
`--same-optimizer` gives it posttrain's plain `torch.optim.AdamW`).

Timing: a step's time runs from the end of the previous optimizer step to the end of this one
(prompt fetch, generation, reward, advantages, reference and policy forward, backward, update and
each framework's bookkeeping), by wall time and by this process's CPU time. Blocks run
round-robin (posttrain, TRL, posttrain without a shared prefix; `pairs.run_interleaved`),
`--repeats` rounds (default 5); each block is `--warmup` untimed + `--steps` timed steps and counts
the completion tokens its timed steps sampled on each side (TRL's from the `completion_ids` its
reward function gets). Reported: per step and per completion token, median [min, max] over blocks,
and the per-pair ratios (blocks of the same round) by wall and by CPU time, with the shape
(prompt and completion lengths) the ratio depends on.

Usage:
    python benchmarks/grpo_step.py              # writes docs/benchmarks/grpo_step.md
    python benchmarks/grpo_step.py --quick      # smoke run, nothing written
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import platform
import statistics
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from pairs import Run, fmt, ratio_cells, run_interleaved, spread
from timing import StepClock, cpu_model
from trl_inputs import (
    CPU_ARGS,
    GRPO_ARGS,
    check_same_model,
    hf_byte_tokenizer,
    on_step_end,
    trl_dataset,
    trl_optimizers,
)

from posttrain.envs import chain_sum_task
from posttrain.models import ByteTokenizer, build_model, get_preset, save_hf_checkpoint
from posttrain.policy import Policy
from posttrain.rl import RLAlgorithm, RLTrainer

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"

UNSHARED = "posttrain, no shared prefix"
DIFFERENCES = """## Where the two setups differ

- Scoring: posttrain scores a group's G rows in one packed sequence per prompt (the prompt once,
  each completion attending to it and to itself; `posttrain.policy.shared_prefix`), for the
  policy's forward + backward and the reference's forward; TRL scores each of the P x G rows
  with its prompt. The third row of the table is posttrain with this switched off.

- Prompt order: posttrain trains on items `step*P .. step*P+P-1` of the task in order; TRL's
  `RepeatSampler` draws a shuffled P prompts from the same items. Prompts are all 71-73 tokens, so
  the amount of work per step is the same up to a token or two.
- Completion lengths are not forced to 16: both sides stop at <|eos|> or <|end|> (the same stop
  ids; TRL reads them from the checkpoint's generation_config). With these untrained weights most
  completions hit the 16-token limit; the measured mean lengths are given above for each side.
- Old log-probs: posttrain takes them from the sampler (no extra forward); TRL with
  `num_iterations=1, steps_per_generation=1` uses the detached current log-probs (no extra forward
  either). Both run one frozen-reference forward for the KL term and one policy forward+backward.
- Generation: posttrain's `Policy.generate` (its own KV cache, stop handling by mask) vs
  transformers' `generate` as TRL calls it (padding-free off, `disable_compile=True`, no vLLM).
- Reward: the same chain_sum verifier with the same timeout on both sides; posttrain calls it
  through the environment (`env.step`), TRL through a plain reward function on the decoded text.
- Optimizer: TRL's default `adamw_torch_fused` vs posttrain's plain `torch.optim.AdamW` (for-loop
  on CPU); negligible at 2M parameters (`--same-optimizer` removes the difference).
- Bookkeeping: TRL accumulates its metrics each step (logging off, so nothing is printed);
  posttrain appends a metrics row each step (no run_dir, so nothing is written).
- The machine is shared (see the load average): absolute numbers carry that noise; blocks
  alternate so both sides see similar load, and per-pair ratios are given by wall time and by
  CPU time (the work done, which the load does not lower).
"""


@dataclass(frozen=True)
class Setup:
    preset: str
    prompts: int
    group_size: int
    max_new_tokens: int
    warmup: int
    steps: int
    repeats: int
    threads: int
    beta: float = 0.04
    lr: float = 1e-5
    max_grad_norm: float = 1.0
    seed: int = 0


# --------------------------------------------------------------------------------------------
# The task, seen by both sides
# --------------------------------------------------------------------------------------------


def make_task(setup: Setup):
    size = setup.prompts * (setup.warmup + setup.steps) * setup.repeats * 2 + 64
    return chain_sum_task(size=size, held_out_size=2, seed=setup.seed)


# --------------------------------------------------------------------------------------------
# The two sides
# --------------------------------------------------------------------------------------------


def build_posttrain(model, spec, task, setup: Setup, share_prefix: bool = True):
    policy = Policy(model, ByteTokenizer(), spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)
    clock = StepClock()
    trainer = RLTrainer(
        policy,
        optimizer,
        task=task,
        algo=RLAlgorithm.grpo(group_size=setup.group_size, kl_coef=setup.beta),
        prompts_per_step=setup.prompts,
        max_new_tokens=setup.max_new_tokens,
        temperature=1.0,
        max_grad_norm=setup.max_grad_norm,
        progress=False,
        seed=setup.seed,
        callbacks=[lambda _t, _row: clock.tick()],
        share_prefix=share_prefix,
    )
    return trainer, clock


def run_posttrain_block(trainer: RLTrainer, clock: StepClock, setup: Setup) -> Run:
    """`warmup` + `steps` optimizer steps; their completion tokens are the metrics rows'
    `sampled_tokens` (every sampled token, the stop token included)."""
    clock.clear()
    for _ in range(setup.warmup + setup.steps):
        trainer.step()
    tokens = trainer.metrics["sampled_tokens"].tolist()[-(setup.warmup + setup.steps) :]
    return clock.block_run(setup, [int(t) for t in tokens])


def build_trl(folder: Path, task, setup: Setup, out_dir: Path, same_optimizer: bool):
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    hf_tok = hf_byte_tokenizer()
    dataset, items, lengths = trl_dataset(task, hf_tok)
    score = task.score_fn()
    counted: list[tuple[int, float]] = []  # per step: completion tokens, mean reward

    def chain_sum_reward(prompts, completions, idx, completion_ids, **kwargs):
        rewards = [float(score(c, items[i])) for c, i in zip(completions, idx)]
        # TRL's completion ids end at the first stop id, which they keep (as posttrain counts)
        counted.append((sum(len(ids) for ids in completion_ids), statistics.mean(rewards)))
        return rewards

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    clock = StepClock()
    config = GRPOConfig(
        output_dir=str(out_dir),
        max_steps=setup.warmup + setup.steps,
        per_device_train_batch_size=setup.prompts * setup.group_size,
        num_generations=setup.group_size,
        max_completion_length=setup.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        beta=setup.beta,
        learning_rate=setup.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=setup.max_grad_norm,
        seed=setup.seed,
        **GRPO_ARGS,
        **CPU_ARGS,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=chain_sum_reward,
        args=config,
        train_dataset=dataset,
        processing_class=hf_tok,
        callbacks=[on_step_end(clock.tick)],
        optimizers=trl_optimizers(model, setup.lr, same_optimizer),
    )
    return trainer, clock, lengths, counted


def run_trl_block(trainer, clock: StepClock, setup: Setup, counted: list) -> Run:
    """One `train()` of `warmup` + `steps` steps; its completion tokens are counted by the reward
    function from the `completion_ids` TRL passes it (its own metrics are cleared by the log
    call that ends `train()`), once per step (one generation per step)."""
    clock.clear()
    before = len(counted)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return clock.block_run(setup, [tokens for tokens, _ in counted[before:]])


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def command_line(argv: list[str], placeholders: dict[str, str]) -> str:
    """The command as run, with the value of each flag in `placeholders` written as its
    placeholder: a report names the command, not a folder on the machine that ran it.

    >>> command_line(["--work", "/tmp/x", "--seeds", "0", "--plot=/tmp/c.png"],
    ...              {"--work": "WORK", "--plot": "PLOT"})
    '--work WORK --seeds 0 --plot=PLOT'
    """
    words = list(argv)
    for flag, placeholder in placeholders.items():
        words = [f"{flag}={placeholder}" if w.startswith(f"{flag}=") else w for w in words]
        words = [placeholder if i and words[i - 1] == flag else w for i, w in enumerate(words)]
    return " ".join(words)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-2m")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps starting each block")
    parser.add_argument(
        "--repeats", type=int, default=5, help="rounds of blocks (posttrain/TRL pairs)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient (both sides)")
    parser.add_argument(
        "--same-optimizer",
        action="store_true",
        help="give TRL posttrain's torch.optim.AdamW instead of its fused default",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 repeat of 1 + 2 steps, nothing written"
    )
    parser.add_argument("--out", type=Path, default=DOCS, help="folder for grpo_step.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 2, 1, 1
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--warmup, --steps and --repeats must be >= 1")

    import transformers
    import trl

    load = os.getloadavg()
    if load[0] > 0.5 * (os.cpu_count() or 1):
        print(
            f"warning: load average {load[0]:.1f} on {os.cpu_count()} CPUs; other processes will "
            "skew the blocks",
            flush=True,
        )
    argv_used = sys.argv[1:] if argv is None else argv

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    setup = Setup(
        preset=args.preset,
        prompts=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        warmup=args.warmup,
        steps=args.steps,
        repeats=args.repeats,
        threads=args.threads,
        beta=args.beta,
    )
    spec = get_preset(setup.preset)
    model = build_model(spec, seed=setup.seed)
    n_params = sum(p.numel() for p in model.parameters())
    task = make_task(setup)
    tok = ByteTokenizer()
    rows_per_step = setup.prompts * setup.group_size

    with tempfile.TemporaryDirectory() as tmp:
        folder = save_hf_checkpoint(
            model,
            spec,
            Path(tmp) / "ckpt",
            bos_token_id=tok.bos_id,
            eos_token_id=tok.eos_id,
            pad_token_id=tok.pad_id,
            generation_config={
                "bos_token_id": tok.bos_id,
                "pad_token_id": tok.pad_id,
                "eos_token_id": sorted(tok.stop_ids),
            },
        )
        trl_trainer, trl_clock, prompt_lengths, trl_counted = build_trl(
            folder, task, setup, Path(tmp) / "trl_out", args.same_optimizer
        )
        diff = check_same_model(model, trl_trainer.model)
        unshared, unshared_clock = build_posttrain(
            copy.deepcopy(model), spec, task, setup, share_prefix=False
        )
        ours, our_clock = build_posttrain(model, spec, task, setup)
        print(
            f"{setup.preset}: {n_params / 1e6:.2f}M params; max |logit diff| {diff:.1e}; "
            f"prompt tokens {min(prompt_lengths)}-{max(prompt_lengths)} (mean "
            f"{statistics.mean(prompt_lengths):.1f}); TRL eos ids {trl_trainer.eos_token_ids}; "
            f"TRL optimizer {type(trl_trainer.create_optimizer()).__name__}"
            f"{' (fused)' if trl_trainer.optimizer.defaults.get('fused') else ''}",
            flush=True,
        )
        runs = run_interleaved(
            {
                "posttrain": lambda _: run_posttrain_block(ours, our_clock, setup),
                "TRL": lambda _: run_trl_block(trl_trainer, trl_clock, setup, trl_counted),
                UNSHARED: lambda _: run_posttrain_block(unshared, unshared_clock, setup),
            },
            setup.repeats,
            warmup=False,  # each block starts with its own warm-up steps
        )
        assert torch.get_num_threads() == setup.threads, torch.get_num_threads()
        steps_done = setup.repeats * (setup.warmup + setup.steps)
        ours_len = ours.metrics["response_length"].tolist()
        ours_reward = ours.metrics["reward_mean"].tolist()
        trl_len = [tokens / rows_per_step for tokens, _ in trl_counted]
        trl_reward = [reward for _, reward in trl_counted]
        assert len(ours_len) == len(trl_len) == steps_done, (len(ours_len), len(trl_len))
        rollout_share = statistics.median(ours.metrics["rollout_s"] / ours.metrics["step_time_s"])
    load_end = os.getloadavg()

    def mean(xs):
        return f"{statistics.mean(xs):.2f}" if xs else "n/a"

    trl_opt = (
        "torch.optim.AdamW (same as posttrain)"
        if args.same_optimizer
        else "its default `adamw_torch_fused` (torch.optim.AdamW(fused=True))"
    )
    shape = (
        f"{setup.prompts} prompts x G={setup.group_size} = {rows_per_step} completions per step; "
        f"prompt {min(prompt_lengths)}-{max(prompt_lengths)} tokens (mean "
        f"{statistics.mean(prompt_lengths):.1f}); at most {setup.max_new_tokens} new tokens, "
        f"measured mean {mean(ours_len)} (posttrain) and {mean(trl_len)} (TRL) per completion"
    )
    setup_lines = [
        f"- CPU: {cpu_model()}; {os.cpu_count()} CPUs visible; {setup.threads} threads "
        f"(`torch.set_num_threads`), OpenMP wait policy "
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset (OpenMP default)')}, fp32",
        f"- Versions: Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, trl {trl.__version__}",
        f"- Model: `{setup.preset}` (Qwen2, {spec.num_layers} layers, d_model {spec.embed_dim}, "
        f"vocab {spec.vocab_size}, tied embeddings): {n_params:,} parameters; max |logit diff| "
        f"posttrain vs transformers {diff:.1e}",
        f"- Shape (the ratios depend on it): {shape}; chain_sum prompts, temperature 1, stop at "
        f"<|eos|> / <|end|> on both sides",
        f"- Completion tokens: what each side sampled, the stop token included (posttrain: the "
        f"metrics rows' `sampled_tokens`; TRL: the `completion_ids` its reward function is "
        f"given); mean reward: posttrain {mean(ours_reward)}, TRL {mean(trl_reward)}",
        f"- posttrain: median share of a step spent in rollout (generation + verifier): "
        f"{rollout_share:.0%}",
        f"- Algorithm: GRPO, group mean/std advantages, clip 0.2, seq-mean-token-mean loss, k3 KL "
        f"beta {setup.beta:g} to a frozen reference, 1 PPO epoch, 1 minibatch of "
        f"{rows_per_step} rows, AdamW lr {setup.lr:g} weight decay 0, clip grad norm "
        f"{setup.max_grad_norm:g}; posttrain torch.optim.AdamW (for-loop), TRL {trl_opt}",
        f"- Timing: {setup.repeats} rounds of blocks interleaved (posttrain, TRL, then "
        f"{UNSHARED}: the same trainer scoring every row on its own, `share_prefix=False`; "
        f"`benchmarks/pairs.py`), each {setup.warmup} warm-up + {setup.steps} timed optimizer "
        f"steps (generation + reward + update); a block's value: its timed steps' wall seconds, "
        f"CPU seconds (`time.process_time` of this one process) and completion tokens; per-pair "
        f"ratios are of blocks of the same round; median [min, max] over blocks or rounds",
        f"- Load average (1 min) at start / end: {load[0]:.2f} / {load_end[0]:.2f} on "
        f"{os.cpu_count()} CPUs (other processes share this machine)",
        f"- Command: `python benchmarks/grpo_step.py {command_line(argv_used, {'--out': 'OUT'})}`",
    ]
    lines = [
        "| trainer | s / step, wall | s / step, CPU | completion tokens / step "
        "| ms / completion token, wall | ms / completion token, CPU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, rs in runs.items():
        cells = [
            fmt(*spread([r.wall_s / setup.steps for r in rs]), digits=3),
            fmt(*spread([r.cpu_s / setup.steps for r in rs]), digits=3),
            fmt(*spread([r.work / setup.steps for r in rs]), digits=0),
            fmt(*spread([1e3 * r.wall_s / r.work for r in rs]), digits=2),
            fmt(*spread([1e3 * r.cpu_s / r.work for r in rs]), digits=2),
        ]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    lines += [
        "",
        "| per-pair ratio, X / posttrain (time X takes over posttrain's) | per step, wall "
        "| per step, CPU | per completion token, wall | per completion token, CPU |",
        "|---|---:|---:|---:|---:|",
    ]
    headline = {}
    for name in ("TRL", UNSHARED):
        step = ratio_cells(runs["posttrain"], runs[name], per_work=False)
        token = ratio_cells(runs["posttrain"], runs[name])
        headline[name] = (step, token)
        lines.append(
            f"| {name} | {step['wall']} | {step['cpu']} | {token['wall']} | {token['cpu']} |"
        )
    step, token = headline["TRL"]
    summary = (
        f"TRL / posttrain: per step {step['wall']} by wall time, {step['cpu']} by CPU time; per "
        f"completion token {token['wall']} (wall), {token['cpu']} (CPU); shape: {shape}; "
        f"shared-prefix scoring: {UNSHARED} / posttrain per step {headline[UNSHARED][0]['cpu']} "
        "by CPU time"
    )
    text = "\n".join(setup_lines) + "\n\n" + "\n".join(lines) + "\n\n" + summary + "\n"
    print("\n" + text)
    if args.quick:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    md = args.out / "grpo_step.md"
    md.write_text(
        f"# GRPO step time: posttrain `RLTrainer` vs TRL `GRPOTrainer` (CPU)\n\n"
        f"Produced by `python benchmarks/grpo_step.py`.\n\n{text}\n{DIFFERENCES}"
    )
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
