"""A model with its tokenizer: sampling math, batched generation with a KV cache,
teacher-forced log-probabilities, save and load.
"""

from __future__ import annotations

from posttrain.policy.policy import Policy, generate_for_items
from posttrain.policy.sampling import Completion, sampling_logprobs, token_logprobs

__all__ = ["Completion", "sampling_logprobs", "token_logprobs", "Policy", "generate_for_items"]
