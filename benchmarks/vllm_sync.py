"""Weight-sync time against model size for the vLLM engine (`VLLMServer.sync_weights`).

For each preset: start one server (float32), sync the same policy `--repeats` times (the first
is a warm-up and is not reported), print a Markdown row with the median of each step (save to
/dev/shm, reload_weights in the server, reset_prefix_cache). Wall-clock seconds: on a shared
machine read them as ranges.

    nice -n 19 .venv/bin/python benchmarks/vllm_sync.py tiny-1m tiny-10m d768-l12

Needs the vLLM venv (scripts/vllm-up.sh). Each preset costs one server start (~2 minutes).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from posttrain.models.specs import ModelSpec, get_preset
from posttrain.policy import Policy
from posttrain.policy.vllm_server import VLLMServer

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("presets", nargs="+")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    print("| model | params | safetensors | save s | reload s | reset s | total s |")
    print("|---|---|---|---|---|---|---|")
    for preset in args.presets:
        policy = Policy.from_spec(EXTRA.get(preset) or get_preset(preset), seed=0)
        with tempfile.TemporaryDirectory() as run, VLLMServer.start(policy, run) as server:
            syncs = [server.sync_weights(policy) for _ in range(args.repeats)][1:]
        med = {
            k: statistics.median(getattr(s, k) for s in syncs)
            for k in ("save_s", "reload_s", "reset_s", "total_s")
        }
        size = f"{policy.num_parameters() / 1e6:.1f}M | {syncs[0].nbytes / 2**20:.1f} MiB"
        steps = " | ".join(f"{med[k]:.4f}" for k in ("save_s", "reload_s", "reset_s", "total_s"))
        print(f"| {preset} | {size} | {steps} |", flush=True)


if __name__ == "__main__":
    main()
