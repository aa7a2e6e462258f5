"""A model with its tokenizer: sampling math, batched generation with a KV cache,
teacher-forced log-probabilities, save and load.
"""

from __future__ import annotations

from posttrain.policy.policy import Completion, sampling_logprobs, token_logprobs, Policy

__all__ = ["Completion", "sampling_logprobs", "token_logprobs", "Policy"]
