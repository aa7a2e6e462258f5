"""Weight-sync time against model size for the vLLM engine (`VLLMServer.sync_weights`), plain
and with LoRA adapters (merged at each sync: `posttrain.policy.vllm_servable.served_policy`).

For each model: start one server (float32, eager) for the plain policy and a LoRA copy of it
(`--lora-rank`, q/k/v/o projections, nonzero adapters); sync each once as a warm-up, then
`--repeats` rounds syncing the plain one and the LoRA one in turn (so both see the same load);
close the server. Each Markdown row gives the median of each step (save: merge + safetensors
to /dev/shm; reload: reload_weights in the server; reset: reset_prefix_cache) with its range
(min-max), the bytes written, and the 1-minute load average before and after the model's syncs.
Wall-clock
seconds on a shared machine: read them as ranges. The process runs `--threads` torch threads
(default 1: on a loaded 2-core machine two threads spin-wait, and the merge's small matmuls took
~40x longer, 1.3 s instead of 0.03 s at 12M parameters).

    nice -n 19 .venv/bin/python benchmarks/vllm_sync.py              # tiny-1m tiny-10m-h64 d768-l12

Models: presets, tiny-10m-h64 (~12M parameters: tiny-10m with heads of 64, which vLLM's CPU
attention serves; tiny-10m's 40 it does not) and d768-l12 (~104M). Needs the vLLM venv
(scripts/vllm-up.sh); each model costs one server start (~1-2 minutes), one server at a time.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import platform
import statistics
import tempfile

import torch

from posttrain.models.specs import ModelSpec, get_preset
from posttrain.policy import Policy
from posttrain.policy.vllm_server import VLLMServer, WeightSync

# Larger than the presets: tiny-10m's shape at width 768 and 12 layers (~104M parameters).
EXTRA = {
    "d768-l12": ModelSpec(
        family="qwen2",
        vocab_size=272,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        embed_dim=768,
        intermediate_dim=3072,
        max_seq_len=1024,
        rope_base=1e6,
        norm_eps=1e-6,
        tie_word_embeddings=True,
    )
}
STEPS = ("save_s", "reload_s", "reset_s", "total_s")
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")


def model_spec(name: str) -> ModelSpec:
    """A preset, d768-l12 or tiny-10m-h64 (tiny-10m with 5 query heads and 1 key-value head of
    64 dims)."""
    if name == "tiny-10m-h64":
        return dataclasses.replace(get_preset("tiny-10m"), num_heads=5, num_kv_heads=1)
    return EXTRA[name] if name in EXTRA else get_preset(name)


def to_lora(policy: Policy, rank: int) -> None:
    """Convert `policy` in place as a trainer does, adapters drawn nonzero (B ~ N(0, 0.01))."""
    from posttrain.models.lora import LoRAConfig
    from posttrain.train.converters import convert_model

    config = LoRAConfig(rank=rank, alpha=2.0 * rank, modules=LORA_MODULES)
    convert_model(policy.model, [config], spec=policy.spec)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if name.endswith("lora_b.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)


def timed(server: VLLMServer, policies: dict[str, Policy], repeats: int) -> dict[str, list]:
    """One warm-up sync of each policy, then `repeats` rounds syncing each once in turn (so
    every row sees the same load): label -> its syncs; "load" -> the load average before / after."""
    for policy in policies.values():
        server.sync_weights(policy)
    before = os.getloadavg()[0]
    syncs: dict[str, list] = {label: [] for label in policies}
    for _ in range(repeats):
        for label, policy in policies.items():
            syncs[label].append(server.sync_weights(policy))
    syncs["load"] = [f"{before:.1f} / {os.getloadavg()[0]:.1f}"]
    return syncs


def cell(syncs: list[WeightSync], step: str) -> str:
    values = [getattr(s, step) for s in syncs]
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", default=["tiny-1m", "tiny-10m-h64", "d768-l12"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=16, help="0: no LoRA rows")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of this process (the trainer's)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; median (min-max) of "
        f"{args.repeats} syncs after a warm-up, seconds, float32"
    )
    print("| model | params | safetensors | save | reload | reset | total | load before / after |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        policies = {name: Policy.from_spec(model_spec(name), seed=0)}
        if args.lora_rank:
            lora = copy.deepcopy(policies[name])
            to_lora(lora, args.lora_rank)
            policies[f"{name} + LoRA r{args.lora_rank} merged"] = lora
        with tempfile.TemporaryDirectory() as run, VLLMServer.start(policies[name], run) as server:
            syncs = timed(server, policies, args.repeats)
        params = policies[name].num_parameters()
        for label in policies:
            size = f"{params / 1e6:.1f}M | {syncs[label][0].nbytes / 2**20:.1f} MiB"
            steps = " | ".join(cell(syncs[label], k) for k in STEPS)
            print(f"| {label} | {size} | {steps} | {syncs['load'][0]} |", flush=True)


if __name__ == "__main__":
    main()
