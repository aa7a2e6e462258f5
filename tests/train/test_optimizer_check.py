"""Every trainer refuses, when it is built, an optimizer that does not hold exactly the model's
current trainable parameters (by identity), naming them: tensors that are not the model's (built
before a converter or a plan replaced them) and trainable ones left out; frozen ones may be held.
The check is the engine's (`Engine._start`, `posttrain.train.optimizer_check`), so `Trainer` (SFT,
the DPO family, reward models, distillation) and `RLTrainer` go through the same one; under a
ParallelPlan the same refusals run on 2 processes (tests/train/test_parallel_plans.py,
tests/rl/test_plans_trainers.py)."""

from __future__ import annotations

import pytest
import torch
from _train_helpers import TINY, sft_loader, tiny_model

from posttrain.models import ByteTokenizer
from posttrain.models.lora import LoRAConfig
from posttrain.policy import Policy
from posttrain.rl import RLAlgorithm, RLTrainer, ValueHead
from posttrain.train import Trainer, convert_model
from posttrain.train.optimizer_check import check_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _trainer(model, optimizer):
    return Trainer(model, optimizer, data=sft_loader(4, batch_size=2), progress=False)


def _message(model, optimizer) -> str:
    with pytest.raises(ValueError) as error:
        _trainer(model, optimizer)
    return str(error.value)


def test_an_optimizer_over_the_trainable_parameters_is_accepted_in_any_groups():
    model = tiny_model()
    params = list(model.parameters())
    _trainer(model, torch.optim.SGD(params, lr=0.1))
    _trainer(
        model, torch.optim.SGD([{"params": params[:3], "lr": 0.01}, {"params": params[3:]}], lr=0.1)
    )


def test_a_parameter_left_out_is_named():
    model = tiny_model()
    held = [p for name, p in model.named_parameters() if name != "norm.scale"]
    message = _message(model, torch.optim.SGD(held, lr=0.1))
    assert message.startswith(
        "optimizer: does not hold 1 trainable parameter(s) of the model: "
        "norm.scale (they would receive gradients but never change)"
    )
    assert "or freeze what should not train with requires_grad_(False)" in message


def test_frozen_parameters_may_be_held_and_stay_as_they_are():
    """Frozen parameters get no gradient, so an optimizer over all of them is harmless: LoRA with
    AdamW(model.parameters()) and progressive unfreezing are accepted; the frozen ones do not
    move, the trainable ones do."""
    model = tiny_model()
    convert_model(model, [LoRAConfig(rank=2, alpha=4.0, modules=("q_proj",))], spec=TINY)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = _trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    trainer.fit(2)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert moved and moved <= trainable, (moved, trainable)


def test_an_optimizer_built_before_lora_names_the_frozen_base_and_the_missing_adapters():
    """LoRA on q_proj of both layers after the optimizer: the two q_proj weights are new
    tensors (LoRALinear's), the other 24 base parameters are now frozen, and the optimizer
    holds none of the 2 x 2 adapter matrices, which alone train."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    convert_model(model, [LoRAConfig(rank=2, alpha=4.0, modules=("q_proj",))], spec=TINY)
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(adapters) == 4
    message = _message(model, optimizer)
    assert message.startswith(
        "optimizer: holds 2 parameter(s) the model no longer has: "
        "layers.0.attn.q_proj.weight, layers.1.attn.q_proj.weight; it was "
        "built before convert_model applied 'lora'"
    )
    assert "frozen" not in message  # the 24 base parameters it still holds are harmless
    assert f"does not hold 4 trainable parameter(s) of the model: {', '.join(adapters)}" in message


def test_a_tensor_of_another_model_is_refused_by_shape():
    model = tiny_model()
    stray = torch.nn.Parameter(torch.zeros(3, 5))
    message = _message(model, torch.optim.SGD([*model.parameters(), stray], lr=0.1))
    assert message.startswith(
        "optimizer: holds 1 tensor(s) that are not parameters of the "
        "model: a tensor of shape [3, 5]"
    )


def test_rl_trainer_names_a_value_head_the_optimizer_does_not_hold():
    """PPO builds a value head when none is given; the optimizer then cannot hold it."""
    policy = Policy(tiny_model(), ByteTokenizer(), TINY)
    with pytest.raises(
        ValueError,
        match=r"^optimizer: does not hold 2 trainable parameter\(s\) "
        r"of the model: value_head\.proj\.weight, "
        r"value_head\.proj\.bias",
    ):
        RLTrainer(
            policy,
            torch.optim.SGD(policy.model.parameters(), lr=0.1),
            task=None,
            algo=RLAlgorithm.ppo(group_size=1),
            prompts_per_step=2,
            max_new_tokens=2,
            progress=False,
        )
    head = ValueHead(TINY.embed_dim)
    RLTrainer(
        policy,
        torch.optim.SGD([*policy.model.parameters(), *head.parameters()], lr=0.1),
        task=None,
        algo=RLAlgorithm.ppo(group_size=1),
        prompts_per_step=2,
        max_new_tokens=2,
        value_head=head,
        progress=False,
    )


def test_check_optimizer_names_the_argument_it_is_given():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(
        ValueError,
        match=r"^policy_optimizer: does not hold 1 trainable "
        r"parameter\(s\) of the model: bias",
    ):
        check_optimizer(torch.optim.SGD([model.weight], lr=0.1), model, argument="policy_optimizer")
