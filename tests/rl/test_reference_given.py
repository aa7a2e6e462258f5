"""The reference an `RLTrainer` scores with (`posttrain.rl.parallel.checked_reference`), in one
process: a copy of the policy when none is given, the given one frozen, and refusals by name of a
reference where none is used and of what is not a module. (Under a plan the trainer applies no
plan: a missing or plain reference beside a split policy is refused on 2 ranks,
tests/rl/test_plans_trainers.py::test_misused_rl_plans_are_refused_with_what_to_do.)"""

from __future__ import annotations

import pytest
import torch

from posttrain.models import ByteTokenizer, build_model
from posttrain.policy import Policy
from posttrain.rl.parallel import checked_reference, frozen_reference
from posttrain.train.runtime import LocalRuntime

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def policy() -> Policy:
    return Policy.from_spec("tiny-1m", seed=0)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_without_a_reference_the_policy_is_copied_and_frozen(policy):
    runtime = LocalRuntime(policy.model, replicas=False)
    ref = checked_reference(None, policy, runtime=runtime, needed=True)
    assert ref is not None and ref is not policy.model
    assert _same_weights(ref, policy.model) and not ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    assert checked_reference(None, policy, runtime=runtime, needed=False) is None


def test_a_given_reference_is_used_frozen(policy):
    other = build_model(policy.spec, seed=1)
    ref = checked_reference(
        other, policy, runtime=LocalRuntime(policy.model, replicas=False), needed=True
    )
    assert ref is other and not other.training
    assert not any(p.requires_grad for p in other.parameters())


def test_frozen_reference_is_a_plain_copy_of_the_weights_now(policy):
    ref = frozen_reference(policy)
    assert type(ref) is type(policy.model) and _same_weights(ref, policy.model)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())


def test_a_reference_where_none_is_used_or_not_a_module_is_refused(policy):
    runtime = LocalRuntime(policy.model, replicas=False)
    with pytest.raises(ValueError, match=r"reference= was given, but .* kl_coef is 0"):
        checked_reference(build_model(policy.spec, seed=1), policy, runtime=runtime, needed=False)
    with pytest.raises(TypeError, match="reference=.*must be an nn.Module"):
        checked_reference({"w": 1}, policy, runtime=runtime, needed=True)  # type: ignore[arg-type]


def test_the_trainer_takes_the_given_reference(policy):
    from posttrain.envs import chain_sum_task
    from posttrain.rl import RLAlgorithm, RLTrainer

    model = build_model(policy.spec, seed=0)
    trainee = Policy(model, ByteTokenizer(), policy.spec)
    other = build_model(policy.spec, seed=1)
    trainer = RLTrainer(
        trainee,
        torch.optim.SGD(model.parameters(), lr=0.1),
        task=chain_sum_task(size=8, held_out_size=2),
        algo=RLAlgorithm.grpo(group_size=2, kl_coef=0.1),
        prompts_per_step=2,
        max_new_tokens=2,
        reference=other,
        progress=False,
    )
    assert trainer.reference is other
