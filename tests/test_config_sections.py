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

import pytest
import torch

from posttrain import cli
from posttrain.workflows import (BatchOptimConfig, MoreSFTBaselineConfig, OptimConfig,
                                 SFTWarmStartConfig)
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
    optimizer, scheduler = OptimConfig(steps=4, lr=1.0, warmup_steps=2, min_lr_ratio=0.1,
                                       weight_decay=0.01).build(params)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.param_groups[0]["params"] == params
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
    assert optimizer.param_groups[0]["initial_lr"] == 1.0
    assert _lrs(optimizer, scheduler, 6) == pytest.approx([0.0, 0.5, 1.0, 0.55, 0.1, 0.1])


def test_optim_build_of_a_batch_section_is_the_same_schedule():
    optimizer, scheduler = BatchOptimConfig(steps=4, lr=2.0, warmup_steps=0, min_lr_ratio=0.0,
                                            batch_size=3).build([torch.nn.Parameter(torch.ones(1))])
    # no warmup: cosine from the peak, 2 * 0.5 * (1 + cos(pi * k / 4)) for k = 0..3, then 0
    assert _lrs(optimizer, scheduler, 5) == pytest.approx([2.0, 1.7071068, 1.0, 0.2928932, 0.0])


def test_the_warm_start_describes_its_optimizer():
    # warmup min(20, steps // 10); batch size and lr from the section; the rest the defaults
    assert SFTWarmStartConfig(steps=400, lr=3e-3, batch_size=16).optim() == BatchOptimConfig(
        steps=400, lr=3e-3, batch_size=16, warmup_steps=20)
    assert SFTWarmStartConfig(steps=55, lr=1e-3).optim().warmup_steps == 5
    assert SFTWarmStartConfig(steps=3).optim().warmup_steps == 0


def test_the_more_sft_baseline_is_the_warm_start_with_its_steps_and_lr():
    sft = SFTWarmStartConfig(steps=900, lr=3e-3, batch_size=32, demonstrations=100)
    stage = MoreSFTBaselineConfig(steps=360, lr=3e-4).warm_start(sft)
    assert stage == SFTWarmStartConfig(steps=360, lr=3e-4, batch_size=32, demonstrations=100)
    assert stage.optim() == BatchOptimConfig(steps=360, lr=3e-4, batch_size=32, warmup_steps=20)


@pytest.mark.parametrize("recipe, key, section", [
    ("sft", "optim.lr", lambda cfg: cfg.optim),
    ("dpo", "optim.lr", lambda cfg: cfg.optim),
    ("reward_model", "optim.lr", lambda cfg: cfg.optim),
    ("grpo", "optim.lr", lambda cfg: cfg.optim),
    ("grpo", "sft.lr", lambda cfg: cfg.sft.optim()),
    ("grpo", "baseline.lr", lambda cfg: cfg.baseline.warm_start(cfg.sft).optim()),
])
def test_a_learning_rate_typed_on_the_command_line_reaches_the_optimizer(recipe, key, section):
    cfg = apply_overrides(cli.load_recipe(recipe).Config(), [f"{key}=0.0123"])
    optimizer, _ = section(cfg).build([torch.nn.Parameter(torch.zeros(1))])
    assert optimizer.param_groups[0]["initial_lr"] == 0.0123
