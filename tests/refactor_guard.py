"""Fingerprint of one recipe preset run at tiny size: per-step metrics and final-weight checksums.

Run as a script (a fresh process, so that the thread and kernel settings below hold before
torch is imported):

    python tests/refactor_guard.py CASE OUT_DIR     # prints FINGERPRINT CASE {json}
    python tests/refactor_guard.py sft,cpt,dpo OUT_ROOT   # each case in OUT_ROOT/CASE

The fingerprint pins behaviour across a refactoring: `tests/project/test_refactor_guard.py` compares
it with `tests/fixtures/refactor_guard.json`, recorded from the code before the move. To make the
floating-point results independent of which x86 CPU runs them, the process uses one thread and fixes
the instruction set of ATen's vector kernels, MKL and oneDNN to AVX2 (`ATEN_CPU_CAPABILITY`,
`MKL_CBWR`, `ONEDNN_MAX_CPU_ISA`; set by `guard_env`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

# case -> (recipe, preset file or None, extra Config overrides: dotted keys, as on the command line)
CASES: dict[str, tuple[str, str | None, dict]] = {
    "sft": ("sft", "sft_chain_sum.yaml", {}),
    "cpt": ("sft", "cpt_chain_sum.yaml", {}),
    "dpo": ("dpo", "dpo_chain_sum.yaml", {}),
    "ipo": ("dpo", "ipo_chain_sum.yaml", {}),
    "simpo": ("dpo", "simpo_chain_sum.yaml", {}),
    "kto": ("dpo", "kto_chain_sum.yaml", {}),
    "orpo": ("dpo", "dpo_chain_sum.yaml", {"loss": "orpo"}),
    "reward_model": ("reward_model", "reward_model_chain_sum.yaml", {}),
    # eval.samples, eval.every and baseline.steps 0: the sampled evaluation, the held-out curve
    # and the more-SFT baseline came after the recording
    "grpo": (
        "grpo",
        "grpo_chain_sum.yaml",
        {"eval.samples": 0, "eval.every": 0, "baseline.steps": 0},
    ),
    "ppo": ("ppo", None, {"eval.samples": 0}),
}

# Metric names that measure time, not behaviour (and names ending in "_s": seconds).
_TIMING_WORDS = ("time", "_per_s", "elapsed", "seconds", "mfu")


def _is_timing(key: str) -> bool:
    return key.endswith("_s") or any(w in key for w in _TIMING_WORDS)


def guard_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a fingerprint process runs in (1 thread, AVX2 kernels)."""
    env = dict(os.environ if base is None else base)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        ATEN_CPU_CAPABILITY="avx2",
        MKL_CBWR="AVX2",
        ONEDNN_MAX_CPU_ISA="AVX2",
        PYTHONHASHSEED="0",
    )
    return env


def _weights_sha256(folder: Path) -> dict[str, str]:
    """sha256 of every weight file (safetensors, .pt, reward-model json) under `folder`."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.suffix in {".safetensors", ".bin"} and path.is_file():
            out[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _metrics(run: Path) -> dict[str, list[dict]]:
    """Every metrics.jsonl under the run folder: its rows without timing fields."""
    out = {}
    for path in sorted(run.rglob("metrics.jsonl")):
        rows = []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            rows.append(_drop_timing(row))
        out[str(path.relative_to(run))] = rows
    return out


def _drop_timing(value):
    """`value` (parsed JSON) without keys that measure time."""
    if isinstance(value, dict):
        return {k: _drop_timing(v) for k, v in sorted(value.items()) if not _is_timing(k)}
    if isinstance(value, list):
        return [_drop_timing(v) for v in value]
    return value


def _evaluations(run: Path) -> dict[str, str]:
    """sha256 of every evaluation table (the completions themselves) under the run folder, with
    CRLF row ends read as LF (tables were written with LF rows when the fixture was recorded)."""
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes().replace(b"\r\n", b"\n")).hexdigest()
        for p in sorted(run.rglob("eval*.csv"))
    }


def fingerprint(case: str, out_dir: str) -> dict:
    """Run `case` at tiny size into `out_dir` and return its fingerprint."""
    import torch

    from posttrain import cli
    from posttrain.workflows import override

    torch.set_num_threads(1)
    recipe, preset, extra = CASES[case]
    module = cli.load_recipe(recipe)
    cfg = module.Config()
    if preset is not None:
        cfg = cli.load_config_file(cfg, str(Path(cli.recipe_dirs()[1]) / "presets" / preset))
    # the recipe's TINY (dotted keys), the case's extras and the run folder, validated once
    cfg = override(cfg, {**getattr(module, "TINY", {}), **extra, "out_dir": out_dir})
    module.main(cfg)
    run = Path(out_dir)
    results = {
        str(p.relative_to(run)): _drop_timing(json.loads(p.read_text()))
        for p in sorted(run.rglob("results.json"))
    }
    return {
        "metrics": _metrics(run),
        "weights": _weights_sha256(run),
        "evaluations": _evaluations(run),
        "results": results,
    }


if __name__ == "__main__":
    # CASE OUT_DIR: one case; CASE,CASE,... OUT_ROOT: each case into OUT_ROOT/CASE, one after the
    # other in this process (the stack imports once). One line per case: FINGERPRINT CASE {json}.
    cases, out = sys.argv[1].split(","), Path(sys.argv[2])
    os.chdir(out.parent)
    for case in cases:
        result = fingerprint(case, str(out if len(cases) == 1 else out / case))
        print(f"FINGERPRINT {case} " + json.dumps(result, sort_keys=True), flush=True)
