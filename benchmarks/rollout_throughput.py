"""Rollout tokens/s: vLLM (the managed server) vs `Policy.generate` vs transformers `generate`.

Three engines sample from the same weights and the same prompts:

- vllm: `posttrain.policy.vllm_server.VLLMServer` (vLLM's OpenAI server in its own venv, one
  request per sample, all of a call's requests in flight at once: `max_concurrency` = the call's
  samples), started from `Policy.save`'s folder;
- builtin: `Policy.generate` (torchtune model, KV cache, one prefill per distinct prompt);
- transformers: `AutoModelForCausalLM.from_pretrained` of that same folder (logits checked
  against the torchtune model first), `generate(do_sample=True, num_return_sequences=n)`.

Two shapes: grouped (8 prompts x n=8 samples, the GRPO case) and distinct (64 prompts, n=1); random
byte prompts of `--prompt-len` tokens, `--new-tokens` new tokens, temperature 1 (no top-k/top-p),
fp32. The tokenizer has no stop ids, so no engine stops early; tokens/s counts the tokens each
engine returned (`len(token_ids)` per sample; transformers' rows past the prompt), not the ones
asked for.

Threads: posttrain's process runs `torch.set_num_threads(t)`; the vLLM server is started per
thread count with `VLLM_CPU_OMP_THREADS_BIND` = cores 0..t-1 and `OMP_NUM_THREADS=t` (its
default, "auto", binds one core of two and reserves the other). Both run with OpenMP's PASSIVE
wait policy (`posttrain.core.threads.apply_thread_env`, as the `posttrain` command sets it; an
explicit `OMP_WAIT_POLICY` is kept).

Each cell (model x shape x threads): one untimed warm-up per engine, then `--reps` (default 5)
timed runs interleaved (vllm, builtin, transformers, vllm, ...; `pairs.run_interleaved`) so the
load of a shared machine falls on all alike. Reported: the median tokens/s with the range over
runs, and the ratios vllm/builtin and vllm/transformers of tokens per wall second and per CPU
second (the median of the per-run ratios, with their range), the median CPU seconds of a run
(this process's for builtin and transformers; for vllm, the server's process group's, read from
/proc: its API server, engine core and worker), and the 1-minute load average before and after
the cell.

Usage:
    nice -n 19 .venv/bin/python benchmarks/rollout_throughput.py tiny-10m-h64 d768-l12
    nice -n 19 .venv/bin/python benchmarks/rollout_throughput.py --quick   # tiny-1m, ~3 min

`main(["--quick"], server=...)` measures a running tiny-1m server instead of starting one (the
test suite's shared server: its weights are replaced by the benchmark policy's, its core binding
is its own).

Models: presets, tiny-10m-h64 (~12M parameters) or d768-l12 (~104M, from benchmarks/vllm_sync.py);
vLLM's CPU attention takes head dims 32, 64, 80, 96, 112, 128, ... only. Needs the vLLM venv
(scripts/vllm-up.sh); one server start (~1-2 minutes) per model and thread count. The report is
docs/benchmarks/rollout_throughput.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from pairs import Run, fmt, group_cpu_s, rates, ratio_cells, run_interleaved, spread

if TYPE_CHECKING:
    from posttrain.policy import Policy
    from posttrain.policy.vllm_server import VLLMServer

ENGINES = ("vllm", "builtin", "transformers")


class Shape(NamedTuple):
    """`prompts` distinct prompts, each sampled `n` times."""

    name: str
    prompts: int
    n: int


SHAPES = (Shape("grouped", 8, 8), Shape("distinct", 64, 1))
QUICK_SHAPES = (Shape("grouped", 2, 2), Shape("distinct", 4, 1))


HEADER = (
    "| model | prompts x n | threads | vllm tok/s | builtin tok/s | transformers tok/s "
    "| vllm/builtin, wall | vllm/builtin, CPU | vllm/transformers, wall "
    "| vllm/transformers, CPU | CPU s per run: vllm, builtin, transformers "
    "| load before-after |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def table_row(
    model: str,
    shape: Shape,
    threads: int,
    runs: dict[str, list[Run]],
    load: tuple[float, float],
) -> str:
    """One Markdown row of a cell: tokens/s median [min, max] per engine (wall time), the
    per-pair ratios of tokens per wall second and per CPU second, the median CPU seconds of a
    run per engine."""
    speed = " | ".join(fmt(*spread(rates(runs[e]))) for e in ENGINES)
    ratios = " | ".join(
        f"{cells['wall']} | {cells['cpu']}"
        for cells in (ratio_cells(runs["vllm"], runs[e]) for e in ("builtin", "transformers"))
    )
    cpu = ", ".join(f"{statistics.median(r[2] for r in runs[e]):.1f}" for e in ENGINES)
    return (
        f"| {model} | {shape.prompts} x {shape.n} | {threads} | {speed} | {ratios} | {cpu} "
        f"| {load[0]:.1f}-{load[1]:.1f} |"
    )


@contextlib.contextmanager
def vllm_threads(threads: int) -> Iterator[None]:
    """Environment for a vLLM server started inside: its engine bound to cores 0..threads-1."""
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")}
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bound_cores(log_path: Path) -> str:
    """The cores vLLM's log says its engine threads were bound to, or '?'."""
    found = re.findall(r"core ids=(\[[0-9, ]*\])", log_path.read_text(errors="replace"))
    return found[-1] if found else "?"


def model_spec(name: str):
    """A preset, d768-l12 (benchmarks/vllm_sync.py) or tiny-10m-h64: tiny-10m with 5 query heads
    and 1 key-value head of 64 dims (vLLM's CPU attention has no kernel for tiny-10m's 40)."""
    import dataclasses

    from vllm_sync import EXTRA

    from posttrain.models import get_preset

    if name == "tiny-10m-h64":
        return dataclasses.replace(get_preset("tiny-10m"), num_heads=5, num_kv_heads=1)
    return EXTRA[name] if name in EXTRA else get_preset(name)


def hf_model(policy, folder: Path):
    """transformers' model of `Policy.save`'s folder; its logits checked against the policy."""
    import torch
    from transformers import AutoModelForCausalLM

    policy.save(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the tokenizer has no stop ids: never stop early
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(ids).logits - policy.model(ids)).abs().max().item()
    if diff > 1e-3:
        raise RuntimeError(f"transformers and torchtune logits differ by {diff}")
    return hf


def engines_for(policy, server, hf, prompts: list[list[int]], n: int, new_tokens: int):
    """name -> fn(seed) -> tokens generated, for one shape."""
    import torch

    ids_BP = torch.tensor(prompts)
    sampling = dict(n=n, max_new_tokens=new_tokens, temperature=1.0)

    def vllm(seed: int) -> int:
        return sum(len(c.token_ids) for c in server.generate(prompts, seed=seed, **sampling))

    def builtin(seed: int) -> int:
        return sum(len(c.token_ids) for c in policy.generate(prompts, seed=seed, **sampling))

    def transformers(seed: int) -> int:
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids_BP,
                attention_mask=torch.ones_like(ids_BP),
                do_sample=True,
                temperature=1.0,
                top_k=0,  # off, as in the other engines
                top_p=1.0,
                num_return_sequences=n,
                max_new_tokens=new_tokens,
                pad_token_id=256,
            )
        return out[:, ids_BP.shape[1] :].numel()  # no eos: every row runs to new_tokens

    return {"vllm": vllm, "builtin": builtin, "transformers": transformers}


@contextlib.contextmanager
def served(
    policy: Policy, folder: Path, threads: int, max_concurrency: int, given: VLLMServer | None
) -> Iterator[VLLMServer]:
    """A vLLM server of `policy` with its engine bound to `threads` cores, stopped afterwards;
    or `given`, a running server, synced to `policy`'s weights and left running.

    Raises:
        ValueError: `given`'s tokenizer has stop ids (its samples could end early).
    """
    if given is not None:
        if given.tokenizer.stop_ids:
            raise ValueError(
                f"the given server's tokenizer stops at ids {sorted(given.tokenizer.stop_ids)}; "
                "the benchmark counts every asked token: give it a tokenizer without stop ids"
            )
        given.sync_weights(policy)
        yield given
        return
    from posttrain.policy.vllm_server import VLLMServer

    with (
        vllm_threads(threads),
        VLLMServer.start(policy, folder, max_concurrency=max_concurrency) as server,
    ):
        yield server


def main(argv: list[str] | None = None, *, server: VLLMServer | None = None) -> int:
    """The command; `server`: a running server to measure instead of starting one (--quick only,
    one model and thread count)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["tiny-10m-h64", "d768-l12"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--quick", action="store_true", help="tiny-1m, 1 thread, tiny shapes, 4 new tokens, 1 rep"
    )
    args = parser.parse_args(argv)
    shapes = SHAPES
    if args.quick:
        args.models, args.threads, args.prompt_len, args.new_tokens, args.reps = (
            ["tiny-1m"], [1], 8, 4, 1,
        )  # fmt: skip
        shapes = QUICK_SHAPES
    for t in args.threads:
        if not 1 <= t <= (os.cpu_count() or 1):
            parser.error(f"--threads {t}: each must be in 1..{os.cpu_count()} (this machine)")
    if args.reps < 1 or args.new_tokens < 1 or args.prompt_len < 1:
        parser.error("--reps, --new-tokens and --prompt-len must be >= 1")
    if server is not None and not args.quick:
        parser.error("a running server is measured with --quick only")

    from posttrain.core.threads import apply_thread_env

    apply_thread_env()  # OMP_WAIT_POLICY=PASSIVE (unless set) before torch, here and in the server
    import torch
    import transformers
    from generation import NoStopByteTokenizer

    from posttrain.policy import Policy
    from posttrain.policy.vllm_server import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason is not None:
        print(f"rollout_throughput.py needs the vLLM venv: {reason}", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    most = max(s.prompts for s in shapes)
    all_prompts = torch.randint(0, 256, (most, args.prompt_len), generator=gen).tolist()
    print(
        f"# torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{args.prompt_len} prompt tokens, {args.new_tokens} new tokens, temperature 1, fp32, "
        f"{args.reps} interleaved runs per engine after a warm-up",
        flush=True,
    )
    rows = []
    for name in args.models:
        policy = Policy.from_spec(model_spec(name), tokenizer=NoStopByteTokenizer(), seed=0)
        policy.model.eval()
        label = f"{name} ({policy.num_parameters() / 1e6:.1f}M)"
        with tempfile.TemporaryDirectory() as tmp:
            hf = hf_model(policy, Path(tmp) / "hf")
            for threads in args.threads:
                torch.set_num_threads(threads)
                with served(policy, Path(tmp) / f"t{threads}", threads, most, server) as vllm:
                    pgid, log_path = vllm.pgid, vllm.log_path
                    assert pgid is not None and log_path is not None  # started, not attached
                    print(f"## {label}, {threads} threads; vLLM cores "
                          f"{bound_cores(log_path)}", flush=True)  # fmt: skip
                    for shape in shapes:
                        engines = engines_for(
                            policy, vllm, hf, all_prompts[: shape.prompts], shape.n,
                            args.new_tokens,
                        )  # fmt: skip
                        before = os.getloadavg()[0]
                        clocks: dict[str, Callable[[], float]] = {
                            "vllm": functools.partial(group_cpu_s, pgid)
                        }
                        runs = run_interleaved(engines, args.reps, clocks)
                        load = (before, os.getloadavg()[0])
                        rows.append(table_row(label, shape, threads, runs, load))
                        print(rows[-1], flush=True)
    print("\n" + HEADER)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
