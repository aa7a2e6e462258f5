"""Config sections build what they describe: `OptimConfig.build` is the one place a recipe's
optimizer and learning-rate schedule are made, and the SFT warm start and the more-SFT baseline
describe their optimizer through it (`SFTWarmStartConfig.optim`,
`MoreSFTBaselineConfig.warm_start`).

Reference values are computed by hand from the schedule's formula (linear warmup from 0, then
half a cosine down to `min_lr_ratio`):

    steps=4, warmup_steps=2, min_lr_ratio=0.1, lr=1.0:
      step 0: 0/2 = 0.0     step 1: 1/2 = 0.5     step 2: cosine at p=0: 1.0
      step 3: p=1/2: 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55     step 4, 5: the floor 0.1
"""

from __future__ import annotations

import typing

import pytest
import torch

from posttrain import cli
from posttrain.workflows import (
    BatchOptimConfig,
    MoreSFTBaselineConfig,
    OptimConfig,
    SFTWarmStartConfig,
)
from posttrain.workflows.recipes import apply_overrides


def _lrs(optimizer, scheduler, n: int) -> list[float]:
    """The learning rate each of `n` training steps runs at."""
    lrs = []
    for _ in range(n):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_optim_build_makes_adamw_with_the_warmup_cosine_schedule():
    params = [torch.nn.Parameter(torch.zeros(3))]
    optimizer, scheduler = OptimConfig(
        steps=4, lr=1.0, warmup_steps=2, min_lr_ratio=0.1, weight_decay=0.01
    ).build(params)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.param_groups[0]["params"] == params
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
    assert optimizer.param_groups[0]["initial_lr"] == 1.0
    assert _lrs(optimizer, scheduler, 6) == pytest.approx([0.0, 0.5, 1.0, 0.55, 0.1, 0.1])


def test_optim_build_of_a_batch_section_is_the_same_schedule():
    optimizer, scheduler = BatchOptimConfig(
        steps=4, lr=2.0, warmup_steps=0, min_lr_ratio=0.0, batch_size=3
    ).build([torch.nn.Parameter(torch.ones(1))])
    # no warmup: cosine from the peak, 2 * 0.5 * (1 + cos(pi * k / 4)) for k = 0..3, then 0
    assert _lrs(optimizer, scheduler, 5) == pytest.approx([2.0, 1.7071068, 1.0, 0.2928932, 0.0])


def test_the_warm_start_describes_its_optimizer():
    # warmup min(20, steps // 10); batch size and lr from the section; the rest the defaults
    assert SFTWarmStartConfig(steps=400, lr=3e-3, batch_size=16).optim() == BatchOptimConfig(
        steps=400, lr=3e-3, batch_size=16, warmup_steps=20
    )
    assert SFTWarmStartConfig(steps=55, lr=1e-3).optim().warmup_steps == 5
    assert SFTWarmStartConfig(steps=3).optim().warmup_steps == 0


def test_the_more_sft_baseline_is_the_warm_start_with_its_steps_and_lr():
    sft = SFTWarmStartConfig(steps=900, lr=3e-3, batch_size=32, demonstrations=100)
    stage = MoreSFTBaselineConfig(steps=360, lr=3e-4).warm_start(sft)
    assert stage == SFTWarmStartConfig(steps=360, lr=3e-4, batch_size=32, demonstrations=100)
    assert stage.optim() == BatchOptimConfig(steps=360, lr=3e-4, batch_size=32, warmup_steps=20)


@pytest.mark.parametrize(
    "recipe, key, section",
    [
        ("sft", "optim.lr", lambda cfg: cfg.optim),
        ("dpo", "optim.lr", lambda cfg: cfg.optim),
        ("reward_model", "optim.lr", lambda cfg: cfg.optim),
        ("grpo", "optim.lr", lambda cfg: cfg.optim),
        ("grpo", "sft.lr", lambda cfg: cfg.sft.optim()),
        ("grpo", "baseline.lr", lambda cfg: cfg.baseline.warm_start(cfg.sft).optim()),
    ],
)
def test_a_learning_rate_typed_on_the_command_line_reaches_the_optimizer(recipe, key, section):
    cfg = apply_overrides(cli.load_recipe(recipe).Config(), [f"{key}=0.0123"])
    optimizer, _ = section(cfg).build([torch.nn.Parameter(torch.zeros(1))])
    assert optimizer.param_groups[0]["initial_lr"] == 0.0123


# ------------------------------------------------------------------ the parallel section
def test_dotted_keys_build_the_parallel_plan_itself():
    from posttrain.train import ParallelPlan
    from posttrain.workflows import SFTConfig, override, plan_of

    cfg = apply_overrides(
        SFTConfig(),
        [
            "parallel.dp_shard=2",
            "parallel.pp_schedule=gpipe",
            "parallel.param_dtype=bfloat16",
            "parallel.activation_checkpointing=true",
        ],
    )
    want = ParallelPlan(
        dp_shard=2, pp_schedule="gpipe", param_dtype="bfloat16", activation_checkpointing=True
    )
    assert cfg.parallel == want and plan_of(cfg) == want
    # a YAML preset's nested mapping, and back to the defaults: no plan
    assert (
        override(
            cfg,
            {
                "parallel": {
                    "dp_shard": 1,
                    "pp_schedule": "1f1b",
                    "param_dtype": None,
                    "activation_checkpointing": False,
                }
            },
        ).parallel
        == ParallelPlan()
    )
    assert (
        plan_of(
            override(
                cfg,
                {
                    "parallel": {
                        "dp_shard": 1,
                        "pp_schedule": "1f1b",
                        "param_dtype": None,
                        "activation_checkpointing": False,
                    }
                },
            )
        )
        is None
    )


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("parallel.tp", 0, r"^Config\.parallel\.tp=0; must be "),
        ("parallel.dp_shard", True, r"^Config\.parallel\.dp_shard=True; must be "),
        (
            "parallel.pp_schedule",
            "zigzag",
            r"^Config\.parallel\.pp_schedule='zigzag'; allowed: "
            r"gpipe, 1f1b$",
        ),
        ("parallel.n_microbatches", 2, r"^Config\.parallel\.n_microbatches=2 needs pp > 1"),
        ("parallel.cpu_offload", "yes", r"^Config\.parallel\.cpu_offload='yes'; must be a bool$"),
    ],
)
def test_a_bad_parallel_field_is_named_by_its_dotted_key(key, value, message):
    """The plan checks itself when built ("ParallelPlan.tp=0; ..."); the config machinery
    names the field where the user set it."""
    from posttrain.workflows import SFTConfig, override

    with pytest.raises(ValueError, match=message):
        override(SFTConfig(), {key: value})


def test_the_command_line_types_a_named_value_field():
    from posttrain.train import ParallelPlan
    from posttrain.workflows.recipes import config_annotation

    assert (
        typing.get_origin(
            config_annotation(cli.load_recipe("sft").Config(), "parallel.pp_schedule")
        )
        is typing.Literal
    )
    with pytest.raises(ValueError, match=r"Config\.parallel\.pp_schedule='1'; allowed"):
        apply_overrides(cli.load_recipe("sft").Config(), ["parallel.pp_schedule=1"])
    assert apply_overrides(
        cli.load_recipe("sft").Config(), ["parallel.pp=2", "parallel.pp_schedule=1f1b"]
    ).parallel == ParallelPlan(pp=2)
