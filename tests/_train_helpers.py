"""Shared pieces of the trainer/resume tests: a tiny model, variable-length SFT rows, loaders.

Imported by tests/train/test_trainer.py, tests/core/test_resume.py and the subprocess script
tests/sft_resume_run.py (which runs with tests/ on sys.path).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from posttrain.data import SFTDataset, SFTLoader
from posttrain.models import ByteTokenizer, ModelSpec, build_model

# Smaller than the tiny-1m preset (2 layers, 64 wide) so a step takes milliseconds.
TINY = ModelSpec(
    family="qwen2",
    vocab_size=272,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=64,
    intermediate_dim=128,
    max_seq_len=64,
    rope_base=1e6,
    norm_eps=1e-6,
    tie_word_embeddings=True,
)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """TINY with its (tied) embedding drawn at std 0.02 (the HF init) from `seed`, so initial
    logits are small (loss near log V) whatever initialisation `build_model` uses."""
    model = build_model(TINY, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.tok_embeddings.weight.normal_(0.0, 0.02, generator=gen)
    return model


def sft_rows(n: int) -> list[dict]:
    """Prompt/completion rows whose lengths (and trained-token counts) all differ."""
    rows = []
    for i in range(n):
        a, b = 3 + 7 * i, 11 + 5 * i
        completion = f"{a + b}" + " ok" * (i % 4)
        rows.append({"prompt": f"{a}+{b}=" + "?" * (i % 3), "completion": completion})
    return rows


def sft_dataset(n: int, max_seq_len: int = 32) -> SFTDataset:
    return SFTDataset(sft_rows(n), ByteTokenizer(), max_seq_len=max_seq_len)


def sft_loader(
    n: int,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    pack: bool = False,
    seq_len: int | None = None,
) -> SFTLoader:
    return SFTLoader(
        sft_dataset(n),
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        pack=pack,
        seq_len=seq_len,
    )


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different[:5]}"


def assert_grads_close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-6) -> None:
    """Largest difference of two lists of float32 tensors (gradients, parameters) <= tol,
    relative to the largest magnitude in `a` where that exceeds 1: float32 resolves ~1.2e-7
    relative, so an absolute 1e-6 on values of 20 (IPO gradients) would ask for bitwise
    equality from two summation orders."""
    assert len(a) == len(b)
    scale = max(1.0, max(float(x.abs().max()) for x in a))
    worst = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
    assert worst <= tol * scale, f"largest difference {worst:.3g} > {tol} * {scale:.3g}"


def last_step(out_dir: Path) -> int:
    """The step of the last complete row of `out_dir/metrics.jsonl` (0 before the first)."""
    try:
        lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            continue
    return 0
