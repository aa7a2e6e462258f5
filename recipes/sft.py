"""SFT and continued pretraining (CPT) of a policy, with held-out accuracy before and after.

Run: `posttrain run sft --config recipes/presets/sft_chain_sum.yaml [key=value ...]` (dotted
keys: `optim.lr=1e-3 task.train_size=5000`), or in a notebook
`main(Config(optim=BatchOptimConfig(steps=50, warmup_steps=5)))`. The run folder gets
`metrics.jsonl`, `checkpoints/`, `results.json` + `results.md` (held-out exact-match accuracy
before/after with 95% intervals), `loss.png`, the evaluated completions (`eval_before.csv`,
`eval_after.csv`) and the trained policy as a Hugging Face folder (`policy/`).

Data: `task.name` is a reasoning-gym task name (questions kept exactly as the task gives them)
or a JSONL/JSON file (SFT rows with "messages" or "prompt"/"completion"; CPT rows with "text");
own rows go in `data.train` (`posttrain run sft data.train=my.parquet`: JSONL/JSON/Parquet/CSV,
or a DataFrame / HF dataset in a notebook), with held-out rows scored by validation loss and
exact match (docs/guides/own_data.md).
The config and the run are `posttrain.workflows.sft` (`SFTConfig`, `run_sft`), which the other
recipes also use for their SFT warm start.

Several processes (`posttrain.launch` with more than one task, which initialises
torch.distributed): data-parallel training of the same global batch; rank 0 evaluates and writes.
With `parallel.*` set (e.g. `parallel.dp_shard=2 parallel.tp=2` on 4 ranks) the policy is split
by that `ParallelPlan` (FSDP2 / HSDP / TP; the section is the plan itself,
`posttrain.train.ParallelPlan`).
"""

from __future__ import annotations

from typing import Any

from posttrain.workflows import BatchOptimConfig, SFTConfig

Config = SFTConfig
__all__ = ["Config", "BatchOptimConfig", "TINY", "main"]

# Overrides that make the recipe finish in seconds (the recipe test runs every preset with them).
TINY: dict[str, Any] = {
    "task.train_size": 64,
    "task.eval_size": 8,
    "optim.steps": 3,
    "optim.batch_size": 8,
    "optim.warmup_steps": 1,
    "checkpoint.every": 2,
    "eval.max_new_tokens": 6,
    "progress": False,
}


def main(cfg: Config) -> dict[str, Any] | None:
    """Run SFT/CPT (`posttrain.workflows.sft.run_sft`); returns the results dict (None on the
    ranks other than 0 of a process group)."""
    from posttrain.workflows import run_sft  # the training stack loads when a run starts

    return run_sft(cfg)


if __name__ == "__main__":
    main(Config())
