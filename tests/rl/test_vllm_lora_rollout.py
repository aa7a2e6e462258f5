"""GRPO on a LoRA policy with a vLLM rollout engine (the suite's shared tiny-1m server, lent with
`_vllm_helpers.SharedServerEngine`): the server samples the merged adapters of every step
(posttrain.policy.vllm_servable.served_policy), and the trained model's base is never touched.

The bound is tests/rl/test_vllm_rollout.py's: with the server on the policy's current weights the
per-token log-prob deltas against the trainer's recomputation are fp32 rounding (< 1e-4); a
server left on the base or on the previous step's adapters (AdamW at lr 0.05 moves every adapter
entry by ~0.05 a step) is orders of magnitude off.
"""

import pytest
import torch
from _rl_helpers import toy_trainer
from _vllm_helpers import SharedServerEngine

from posttrain.models.lora import LoRAConfig
from posttrain.policy import Policy
from posttrain.train.converters import convert_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_grpo_on_a_lora_policy_samples_its_merged_adapters(vllm_server):
    policy = Policy.from_spec("tiny-1m", seed=0)
    convert_model(policy.model, [LoRAConfig(rank=4, alpha=8.0)], spec=policy.spec)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if name.endswith("lora_b.weight"):  # nonzero from the start: the adapters matter
                p.copy_(torch.full_like(p, 0.02))
    frozen = {k: v.clone() for k, v in policy.model.state_dict().items() if "lora_" not in k}
    adapters = {k: v.clone() for k, v in policy.model.state_dict().items() if "lora_" in k}
    engine = SharedServerEngine(vllm_server, version=3)
    trainer = toy_trainer(policy, rollout_engine=engine, lr=0.05)
    versions = []
    trainer.callbacks.append(
        lambda t, row: versions.append({x.policy_version for g in t.last_groups for x in g})
    )
    metrics = trainer.fit(3)
    assert versions == [{0}, {1}, {2}]
    assert (metrics["rollout_logprob_delta_max"] < 1e-4).all(), metrics["rollout_logprob_delta_max"]
    assert (metrics["weight_sync_s"] > 0).all()
    state = policy.model.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in frozen.items())  # base bit for bit
    assert any(not torch.equal(v, state[k]) for k, v in adapters.items())  # adapters trained
