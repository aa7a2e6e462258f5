"""The typed sections that every recipe `Config` nests (`cfg.optim.lr`, `cfg.task.options`).

Sections do not validate themselves; the recipe `Config` that holds them does, in its
`__post_init__` (`validate(self)`, `posttrain.workflows.config_paths`, importable from here too
with `override` and `config_keys`): it walks every section, calls each one's `check(at)` with
its dotted path, then its own `check` for what spans sections. So a bad value reads
`Config.optim.lr=nan; must be a finite number > 0`, wherever it was set.

Example:
    >>> from dataclasses import dataclass, field
    >>> @dataclass(kw_only=True)
    ... class Config:
    ...     optim: BatchOptimConfig = field(default_factory=BatchOptimConfig)
    ...     def __post_init__(self):
    ...         validate(self)
    >>> cfg = override(Config(), {"optim.lr": 1e-4, "optim.steps": 50})
    >>> cfg.optim.lr, cfg.optim.steps
    (0.0001, 50)
    >>> override(cfg, {"optim": {"warmup_steps": 2}}).optim  # doctest: +NORMALIZE_WHITESPACE
    BatchOptimConfig(steps=50, lr=0.0001, weight_decay=0.0, warmup_steps=2, min_lr_ratio=0.1,
                max_grad_norm=1.0, loss_chunk_tokens=None, batch_size=64, grad_accum_steps=1)
    >>> override(Config(), {"optim.lr": float("nan")})
    Traceback (most recent call last):
    ...
    ValueError: Config.optim.lr=nan; must be a finite number > 0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.workflows.config_paths import ROOT, config_keys, override, validate
from posttrain.workflows.field_checks import (
    SEED_MAX,
    choice,
    fail,
    finite,
    flags,
    folder_path,
    ints,
    positive,
    run_fields,
    seeds,
)
from posttrain.workflows.rl_algo_config import RLConfig
from posttrain.workflows.rollout_config import RolloutConfig
from posttrain.workflows.stack_checks import check_task_name, stack_checks_deferred

__all__ = [
    "ModelConfig",
    "TaskConfig",
    "OptimConfig",
    "BatchOptimConfig",
    "SamplingConfig",
    "RolloutConfig",
    "EvalConfig",
    "RLEvalConfig",
    "CheckpointConfig",
    "SFTWarmStartConfig",
    "PairsConfig",
    "RLConfig",
    "ROOT",
    "SEED_MAX",
    "validate",
    "override",
    "config_keys",
    "fail",
    "run_fields",
    "flags",
    "folder_path",
]

DATA_FILE_SUFFIXES = (".jsonl", ".json", ".txt")
OWN_DATA_SUFFIXES = (".parquet", ".csv", ".tsv", ".arrow", ".xlsx")
"""Data-file suffixes that `task.name` does not read: they are refused naming `data.train`."""


POLICY_FILES = ("config.json",)
"""Files a policy folder (`Policy.save`, a HF checkpoint) holds, besides its weights and one of
`TOKENIZER_FILES`."""
TOKENIZER_FILES = ("posttrain_tokenizer.json", "tokenizer.json")
"""A policy folder's tokenizer: posttrain's byte tokenizer, or a Hugging Face tokenizer."""


@dataclass(kw_only=True)
class ModelConfig:
    """The starting policy: a preset (`posttrain.models.specs.PRESETS`) or a HF folder."""

    name: str = "tiny-1m"  # a preset name ...
    init_from: str | None = None  # ... or a HF folder to start from (then `name` is unused)

    def check(self, at: str) -> None:
        if self.init_from is None:
            if stack_checks_deferred():  # the presets are ModelSpecs (torch)
                return
            from posttrain.models.specs import PRESETS

            choice(f"{at}.name", self.name, sorted(PRESETS))
            return
        folder_path(
            self, at, "init_from", "a policy: config.json, weights and a tokenizer; or None"
        )
        folder = Path(self.init_from)
        missing = [f for f in POLICY_FILES if not (folder / f).is_file()]
        if not any((folder / f).is_file() for f in TOKENIZER_FILES):
            missing.append(" or ".join(TOKENIZER_FILES))
        if not folder.is_dir() or missing:
            why = "no such folder" if not folder.is_dir() else f"it has no {', '.join(missing)}"
            raise fail(
                f"{at}.init_from",
                self.init_from,
                f"None or a policy folder (Policy.save / a HF checkpoint); {why}",
            )

    def tokenizer(self) -> Any:
        """The policy's tokenizer: `ByteTokenizer` for a preset, the folder's otherwise."""
        from posttrain.models.tokenizer import ByteTokenizer, load_tokenizer

        return ByteTokenizer() if self.init_from is None else load_tokenizer(self.init_from)

    def max_seq_len(self) -> int | None:
        """The longest sequence the model holds: its preset's, or the HF folder's config."""
        if self.init_from is None:
            from posttrain.models.specs import PRESETS

            return PRESETS[self.name].max_seq_len
        import json

        path = Path(self.init_from) / "config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        return config.get("max_position_embeddings")


@dataclass(kw_only=True)
class TaskConfig:
    """The task: a reasoning-gym name with its options (or, for SFT, a data file), the training
    size and the held-out split (`eval_size` distinct questions generated from `eval_seed`).

    `demo_options` (None, or a mapping of the task's options): the demonstrations, the SFT rows
    of every recipe's SFT stage (and of the RL recipes' more-SFT baseline), are generated with
    these instead of `options`; the held-out items and the prompts of RL and of preference pairs
    still come from `options`. Demonstrations that cover only part of the task: e.g.
    `options={min_word_len: 6, max_word_len: 7}` with `demo_options={min_word_len: 3,
    max_word_len: 5}` trains SFT on short words and holds out, and lets RL train on, long ones."""

    name: str = "chain_sum"  # a reasoning-gym task, or a .jsonl/.json/.txt file (SFT)
    options: dict = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    )
    train_size: int = 20000
    eval_size: int = 500  # held-out items (0: no accuracy evaluation, SFT only)
    eval_seed: int = 10_000
    demo_options: dict | None = None

    @property
    def is_file(self) -> bool:
        return self.name.endswith(DATA_FILE_SUFFIXES)

    def report(self) -> dict[str, Any]:
        """The task's options as a run's results give them: `task_config`, and `demo_config`
        where the demonstrations have their own (`demo_options`)."""
        extra = {} if self.demo_options is None else {"demo_config": self.demo_options}
        return {"task_config": self.options, **extra}

    @property
    def train_options(self) -> dict:
        """The options the SFT rows are generated with: `demo_options`, else `options`."""
        return self.options if self.demo_options is None else self.demo_options

    def check(self, at: str) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise fail(
                f"{at}.name",
                self.name,
                f"a reasoning-gym task name or a {'/'.join(DATA_FILE_SUFFIXES)} data file",
            )
        ints(self, at, ("train_size",), minimum=1)
        ints(self, at, ("eval_size",), minimum=0)
        seeds(self, at, ("eval_seed",))
        if not isinstance(self.options, dict):
            raise fail(f"{at}.options", self.options, "a mapping of the task's options")
        if self.demo_options is not None and not isinstance(self.demo_options, dict):
            raise fail(
                f"{at}.demo_options",
                self.demo_options,
                "None (the demonstrations use task.options) or a mapping of the task's options",
            )
        if self.is_file:
            if self.demo_options is not None:
                raise fail(f"{at}.demo_options", self.demo_options, "None for a data file")
            if self.options:
                raise fail(
                    f"{at}.options",
                    self.options,
                    "empty for a data file (own data goes in data.train=FILE instead)",
                )
            return
        if Path(self.name).suffix in OWN_DATA_SUFFIXES:
            raise fail(
                f"{at}.name",
                self.name,
                "a reasoning-gym task name; own data files go in data.train=FILE (sft, cpt)",
            )
        try:
            check_task_name(self.name)
        except ValueError as e:
            raise ValueError(f"{at}.name={self.name!r}: {e}") from None
        if stack_checks_deferred():  # the options are checked by the task's config class
            return
        from posttrain.verifiers.reasoning_gym import check_task_config

        for key in ("options", "demo_options"):
            options = getattr(self, key)
            try:
                if options is not None:
                    check_task_config(self.name, options)
            except ValueError as e:
                raise ValueError(f"{at}.{key}={options!r}: {e}") from None


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warmup over `warmup_steps` (None: `min(20, steps // 10)`) then cosine
    decay to `min_lr_ratio * lr`, over `steps` optimizer steps; gradients clipped to
    `max_grad_norm` (None: off). RL uses it as is (its batch is `rl.prompts_per_step` x
    `rl.group_size`); the recipes with batches `BatchOptimConfig`.

    `loss_chunk_tokens` (None, or an int >= 1): the stage's loss runs the output projection and
    log-softmax over that many trained tokens at a time instead of holding [B, T, V] fp32 logits
    (`posttrain.policy.chunked_ce`: SFT/CPT cross-entropy, the DPO family's and KTO's
    log-probs, every RL scoring); equal up to float rounding. Not under parallel.sp or
    parallel.pp > 1; the reward model's loss has no vocabulary head to chunk."""

    steps: int = 400
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int | None = 20
    min_lr_ratio: float = 0.1
    max_grad_norm: float | None = 1.0
    loss_chunk_tokens: int | None = None

    @property
    def warmup(self) -> int:
        """The warmup length in optimizer steps: `warmup_steps`, or `min(20, steps // 10)` when
        it is None."""
        return min(20, self.steps // 10) if self.warmup_steps is None else self.warmup_steps

    def check(self, at: str) -> None:
        ints(self, at, ("steps",), minimum=1)
        ints(self, at, ("warmup_steps",), minimum=0, optional=True)
        if self.warmup_steps is not None and self.warmup_steps > self.steps:
            raise ValueError(
                f"{at}.warmup_steps={self.warmup_steps} exceeds {at}.steps="
                f"{self.steps}; lower warmup_steps"
            )
        positive(self, at, ("lr",))
        positive(self, at, ("max_grad_norm",), optional=True)
        finite(self, at, ("weight_decay",), low=0.0)
        finite(self, at, ("min_lr_ratio",), low=0.0, high=1.0)
        ints(self, at, ("loss_chunk_tokens",), minimum=1, optional=True)

    def build(self, params: Iterable[Any]) -> tuple[Any, Any]:
        """The optimizer and learning-rate schedule these settings describe, over `params`
        (the parameters that train, e.g. `trainable_parameters(model)`; built after any
        `ParallelPlan` was applied, which replaces them).

        Returns:
            `(torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay), scheduler)`: the
            scheduler is `posttrain.train.warmup_cosine_schedule` (a `LambdaLR`): step k of
            training runs at `lr * k / warmup` during warmup, then cosine to
            `min_lr_ratio * lr` at `steps`. Gradient clipping (`max_grad_norm`) is the trainer's.

        Raises:
            ValueError: from the optimizer for empty `params`.
        """
        import torch

        from posttrain.train.schedules import warmup_cosine_schedule

        optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        return optimizer, warmup_cosine_schedule(
            optimizer,
            warmup_steps=self.warmup,
            total_steps=self.steps,
            min_lr_ratio=self.min_lr_ratio,
        )


@dataclass(kw_only=True)
class BatchOptimConfig(OptimConfig):
    """`OptimConfig` over micro-batches of `batch_size` (sequences, pairs or rows), accumulated
    `grad_accum_steps` times per optimizer step."""

    batch_size: int = 64
    grad_accum_steps: int = 1

    def check(self, at: str) -> None:
        super().check(at)
        ints(self, at, ("batch_size", "grad_accum_steps"), minimum=1)


@dataclass(kw_only=True)
class SamplingConfig:
    """How completions are sampled (RL rollouts, preference pairs, a demo)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8

    def check(self, at: str) -> None:
        positive(self, at, ("temperature",))
        finite(self, at, ("top_p",), low=0.0, high=1.0)
        if self.top_p == 0:
            raise fail(f"{at}.top_p", self.top_p, "in (0, 1]")
        ints(self, at, ("max_new_tokens",), minimum=1)


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out greedy evaluation (answers up to `max_new_tokens`), and validation metrics every
    `every` optimizer steps where a recipe has a validation set (0: none)."""

    max_new_tokens: int = 16
    every: int = 0

    def check(self, at: str) -> None:
        ints(self, at, ("max_new_tokens",), minimum=1)
        ints(self, at, ("every",), minimum=0)


@dataclass(kw_only=True)
class RLEvalConfig(EvalConfig):
    """`EvalConfig` plus `samples` answers per held-out item at temperature 1 after SFT and
    after RL: sampled pass@1 and pass@`samples` (0: greedy only)."""

    samples: int = 8

    def check(self, at: str) -> None:
        super().check(at)
        ints(self, at, ("samples",), minimum=0)


@dataclass(kw_only=True)
class CheckpointConfig:
    """A checkpoint every `every` optimizer steps (0: none), keeping the newest `keep_last`
    (None: all); `permissions`: who may read the run folder, private (0600/0700), group
    (0640/0750) or shared (0660/2770), for every file the run writes; None: the environment's
    `POSTTRAIN_RUN_PERMISSIONS`, private if unset (`posttrain.core.run_permissions`)."""

    every: int = 100
    keep_last: int | None = 2
    permissions: str | None = None

    def check(self, at: str) -> None:
        from posttrain.core.run_permissions import PERMISSIONS

        ints(self, at, ("every",), minimum=0)
        ints(self, at, ("keep_last",), minimum=1, optional=True)
        if self.permissions is not None:
            choice(f"{at}.permissions", self.permissions, tuple(PERMISSIONS))


@dataclass(kw_only=True)
class SFTWarmStartConfig(BatchOptimConfig):
    """The SFT stage that GRPO, PPO, DPO and the reward model start from (run folder `sft/`), on
    the recipe's task: its optimizer settings are this section's own (`sft.lr`, `sft.steps`,
    `sft.batch_size`, `sft.weight_decay`, `sft.min_lr_ratio`, `sft.max_grad_norm`, ... as in
    `BatchOptimConfig`; warmup min(20, steps // 10) unless `sft.warmup_steps` is set);
    `demonstrations` N: on its first N training items only (those whose question is held out
    are left out as always; the later stages still use all `task.train_size`: RL on a large
    pool of prompts with a small warm start); None: on all of them."""

    warmup_steps: int | None = None
    demonstrations: int | None = None

    def check(self, at: str) -> None:
        super().check(at)
        ints(self, at, ("demonstrations",), minimum=1, optional=True)

    def optim(self) -> BatchOptimConfig:
        """The stage's `optim` section (`.build(params)` makes the optimizer and schedule):
        this section's optimizer fields, the warmup as a number of steps."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(BatchOptimConfig)}
        return BatchOptimConfig(**{**fields, "warmup_steps": self.warmup})


@dataclass(kw_only=True)
class MoreSFTBaselineConfig:
    """The honest baseline of an RL run: instead of RL, `steps` more SFT steps from the SFT
    policy on the same demonstrations (`sft.demonstrations` included), with the `sft` section's
    batch and optimizer settings but at `lr`, warmup min(20, steps // 10), then cosine (run
    folder `more_sft/`), scored on the same held-out items as the RL policy (greedy, sampled
    pass@1, pass@k) and compared with it, paired. 0: no baseline. Choose `steps` so that the
    stage takes about the RL stage's wall time; the results report both times."""

    steps: int = 0
    lr: float = 3e-4

    def check(self, at: str) -> None:
        ints(self, at, ("steps",), minimum=0)
        positive(self, at, ("lr",))

    def warm_start(self, sft: SFTWarmStartConfig) -> SFTWarmStartConfig:
        """The SFT stage this baseline runs: the recipe's `sft` section (its batch, optimizer
        settings and demonstrations) with this section's `steps` and `lr`, warmup derived from
        `steps`."""
        return dataclasses.replace(sft, steps=self.steps, lr=self.lr, warmup_steps=None)


@dataclass(kw_only=True)
class PairsConfig:
    """Preference pairs by rejection sampling: `samples_per_prompt` completions of each of
    `num_prompts` questions, best vs worst by the task's verifier; with `reference_answer` the
    task's own answer joins the candidates (off-policy)."""

    num_prompts: int = 2048
    samples_per_prompt: int = 8
    reference_answer: bool = False

    def check(self, at: str) -> None:
        ints(self, at, ("num_prompts", "samples_per_prompt"), minimum=2)  # best vs worst
        flags(self, at, ("reference_answer",))
