"""A real-size run on CPU: the Qwen2.5-0.5B shape (posttrain.models preset "qwen2.5-0.5b": width
896, 24 layers, 151,936-token vocabulary, tied embeddings; random init, no weights) under
ParallelPlan(dp_shard=2) on 2 gloo ranks, fp32, with each rank's measured peak memory beside
`posttrain.train.memory_plan.plan_memory`'s prediction for the same setting.

Each configuration starts its ranks as fresh processes (gloo on 127.0.0.1, with
benchmarks/rank_launch.py's `launch_ranks`, as benchmarks/parallel_memory.py; one process
without a process group for a one-rank plan). Each rank:

  1. imports torch, torchtune and posttrain, joins the process group, warms up on a 1-block model
     (lazy imports, kernel set-up), then resets its peak RSS (`/proc/self/clear_refs` 5) and reads
     the baseline VmRSS;
  2. builds the whole model (`build_model(spec, seed=0)`: `plan.parallelize` broadcasts rank 0's
     weights, so every rank materialises the unsharded model first; its peak is reported apart
     as `build_peak`), applies the plan and builds the optimizer;
  3. runs the steps: SFT (`posttrain.train.Trainer`, `SFTCrossEntropy(loss_chunk_tokens=...)`,
     random-token rows, every token trained) or GRPO (`posttrain.rl.RLTrainer`, builtin engine,
     G completions per prompt, one prompt per data-parallel rank, no KL term: no reference);
     the last step runs inside `posttrain.train.memory_measure.TensorPeak` (the bytes of the
     tensors the step allocates, on top of the parameters);
  4. reports VmHWM - baseline (its peak RSS increase over the whole run, model build included),
     the tensor peak of the last step, the local bytes of its parameters, and the step times.

Planned: `plan_memory(spec, plan, MemoryBatch(...), phase=..., optimizer=..., device_type="cpu",
loss_chunk_tokens=...)["peak"]`, and its training moment without the model build
(`planned_train`) for the tensor peak. Ranks run with MALLOC_MMAP_THRESHOLD_=65536 (RSS follows
the live tensors; benchmarks/parallel_memory.py says why) and one intra-op thread each.

The optimizer is SGD without momentum (no state): AdamW's two fp32 moments (4 GiB for the whole
model) would take two ranks past the 10 GiB this shared machine allows; the plan counts states
per parameter exactly (tests/train/test_memory_plan*.py), so the comparison is about the rest.

Usage:
    python benchmarks/real_size_run.py --quick          # tiny-1m, seconds, nothing written
    python benchmarks/real_size_run.py --only sft_chunk # some configurations (names: --list)
    python benchmarks/real_size_run.py                  # every configuration, ~15 min, ~9 GiB
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallel_memory import _warm_up
from rank_launch import launch_ranks, local_bytes, status_bytes

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


@dataclass(frozen=True)
class Config:
    name: str
    model: str = "qwen2.5-0.5b"  # a posttrain.models preset
    phase: str = "sft"  # sft | grpo
    plan: dict = field(default_factory=lambda: {"dp_shard": 2})  # ParallelPlan keywords
    batch: int = 2  # SFT rows per rank; GRPO: completions per prompt (G)
    seq_len: int = 256  # SFT tokens per row; GRPO: prompt tokens (byte tokenizer) + new tokens
    chunk: int | None = 256  # loss_chunk_tokens (None: full logits)
    new_tokens: int = 16  # GRPO only
    steps: int = 2


CONFIGS = [
    Config(name="sft_chunk"),
    Config(name="sft_full", chunk=None),
    Config(name="grpo", phase="grpo", batch=4, seq_len=24),
    Config(name="grpo_1proc", phase="grpo", plan={}, batch=4, seq_len=24, steps=1),
]
QUICK = [
    Config(name="quick_sft", model="tiny-1m", batch=2, seq_len=64, chunk=32),
    Config(name="quick_grpo", model="tiny-1m", phase="grpo", batch=4, seq_len=24, steps=1),
]


def _spec(cfg: Config):
    from posttrain.models import get_preset

    return get_preset(cfg.model)


# --------------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------------


class _Task:
    """One fixed prompt per rank; reward 1 for a completion starting with an ASCII byte."""

    def builders(self, batch_index, batch_size):
        return [_Builder(f"question {batch_index}.{j}") for j in range(batch_size)]

    def held_out(self, n):
        return []


@dataclass(frozen=True)
class _Builder:
    prompt: str

    def make_envs(self, group_size):
        return [_Env(self.prompt) for _ in range(group_size)]


@dataclass(frozen=True)
class _Env:
    prompt: str

    def initial_messages(self):
        return [{"role": "user", "content": self.prompt}]

    def step(self, text):
        from posttrain.rewards import VerifierResult
        from posttrain.rl import StepResult

        score = 1.0 if text and ord(text[0]) < 128 else 0.0
        return StepResult(done=True, reward=score, verifier_result=VerifierResult.from_score(score))


def run_rank(rank: int, world: int, cfg: Config) -> dict:
    import torch
    import torch.distributed as dist

    from posttrain.models import build_model
    from posttrain.train import ParallelPlan
    from posttrain.train.memory_measure import TensorPeak

    torch.set_num_threads(1)
    spec, plan = _spec(cfg), ParallelPlan(**cfg.plan)
    if world > 1:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
        )
    _warm_up()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    baseline = status_bytes("VmRSS")
    model = build_model(spec, seed=0)
    runtime = plan.parallelize(model, spec=spec) if world > 1 else None
    build_peak = status_bytes("VmHWM") - baseline
    params = local_bytes(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    times: list[float] = []
    peak = TensorPeak()
    trainer: Any  # a Trainer (sft) or an RLTrainer (grpo)
    if cfg.phase == "sft":
        from posttrain.data import Sample, SFTLoader
        from posttrain.models import ByteTokenizer
        from posttrain.train import SFTCrossEntropy, Trainer

        data_size = plan.data_parallel_size
        g = torch.Generator().manual_seed(0)
        rows = torch.randint(0, 256, (cfg.batch * data_size * cfg.steps, cfg.seq_len), generator=g)
        loader = SFTLoader(
            [Sample.from_loss_mask(r, [True] * len(r)) for r in rows.tolist()],
            batch_size=cfg.batch * data_size,
            seed=0,
            pad_id=ByteTokenizer.PAD,
            rank=runtime.data_rank if runtime else 0,
            world_size=runtime.data_size if runtime else 1,
            shuffle=False,
        )
        trainer = Trainer(
            model,
            opt,
            data=loader,
            loss=SFTCrossEntropy(loss_chunk_tokens=cfg.chunk),
            max_grad_norm=1.0,
            progress=False,
            runtime=runtime,
        )
    else:
        from posttrain.models import ByteTokenizer
        from posttrain.policy import Policy
        from posttrain.rl import RLTrainer

        class WideBytes(ByteTokenizer):
            """The byte tokenizer, reading an id past its 272 as that id's byte (id % 256): a
            random-init model of a 151,936-token vocabulary samples such ids."""

            def decode(self, ids, *, skip_special_tokens=True):
                ids = [i if i < self.vocab_size else i % 256 for i in ids]
                return super().decode(ids, skip_special_tokens=skip_special_tokens)

        trainer = RLTrainer(
            Policy(model, WideBytes(), spec),
            opt,
            task=_Task(),
            algo=_algo(cfg),
            prompts_per_step=plan.data_parallel_size,
            max_new_tokens=cfg.new_tokens,
            micro_batch_size=cfg.batch,
            progress=False,
            runtime=runtime,
        )
    for step in range(cfg.steps):
        start = time.perf_counter()
        if step == cfg.steps - 1:
            with peak:
                trainer.step()
        else:
            trainer.step()
        times.append(time.perf_counter() - start)
    result = {
        "rank": rank,
        "baseline": baseline,
        "peak": status_bytes("VmHWM") - baseline,
        "build_peak": build_peak,
        "tensor_peak": peak.peak_bytes,
        "params": params,
        "step_times": times,
        "loss": [float(x) for x in trainer.metrics["loss"]] if "loss" in trainer.metrics else [],
    }
    if world > 1:
        dist.destroy_process_group()
    return result


# --------------------------------------------------------------------------------------------
# Launching and comparing
# --------------------------------------------------------------------------------------------


def launch(cfg: Config, folder: Path, timeout: float = 1800.0) -> list[dict]:
    """Run the ranks of `cfg` as fresh processes (`rank_launch.launch_ranks`, with
    MALLOC_MMAP_THRESHOLD_=65536); their results in rank order.

    Raises RuntimeError with the failing ranks' log tails, or when `timeout` seconds pass."""
    from posttrain.train import ParallelPlan

    return launch_ranks(
        __file__,
        cfg.name,
        ParallelPlan(**cfg.plan).world_size,
        json.dumps(dataclasses.asdict(cfg)),
        folder,
        timeout=timeout,
        fixed_malloc=True,
    )


def _algo(cfg: Config):
    """GRPO without a KL term (so no reference), one minibatch of the group."""
    from posttrain.rl import RLAlgorithm

    return RLAlgorithm.grpo(group_size=cfg.batch, kl_coef=0.0, minibatch_size=cfg.batch)


def predict(cfg: Config):
    """`plan_memory`'s DataFrame for `cfg` (per rank)."""
    from posttrain.train import ParallelPlan
    from posttrain.train.memory_plan import MemoryBatch, plan_memory

    reference = None
    if cfg.phase == "grpo":  # the trainer's rule; the model has no LoRA adapters
        from torch import nn

        from posttrain.rl.parallel import uses_reference

        reference = uses_reference(_algo(cfg), nn.Module())

    if cfg.phase == "sft":
        batch = MemoryBatch(micro_batch_size=cfg.batch, seq_len=cfg.seq_len)
        chunk = cfg.chunk
    else:
        total = cfg.seq_len
        batch = MemoryBatch(
            micro_batch_size=cfg.batch,
            seq_len=total,
            num_sequences=cfg.batch,
            max_total_len=total,
            prompt_len=total - cfg.new_tokens,
        )
        chunk = None
    return plan_memory(
        _spec(cfg),
        ParallelPlan(**cfg.plan),
        batch,
        phase=cfg.phase,
        optimizer="sgd",
        device_type="cpu",
        loss_chunk_tokens=chunk,
        reference=reference,
    )


def compare(cfg: Config, ranks: list[dict]) -> dict:
    """The report of one configuration: the worst rank's measured peaks beside the plan's."""
    import statistics

    df = predict(cfg)
    terms = df.set_index("term")["bytes"]
    planned = int(df.attrs["peak_bytes"])
    build = int(terms["model build"])
    worst = max(ranks, key=lambda r: r["peak"])
    steps = [t for r in ranks for t in r["step_times"]]
    return {
        "config": cfg.name,
        "model": cfg.model,
        "phase": cfg.phase,
        "plan": cfg.plan,
        "ranks": len(ranks),
        "batch": cfg.batch,
        "seq_len": cfg.seq_len,
        "chunk": cfg.chunk,
        "measured_peak": worst["peak"],
        "planned_peak": planned,
        "ratio": planned / worst["peak"],
        "moment": df.attrs["moment"],
        "measured_build": max(r["build_peak"] for r in ranks),
        "planned_build": build,
        "measured_tensor_peak": max(r["tensor_peak"] for r in ranks),
        "params": worst["params"],
        "step_s": statistics.median(steps),
        "step_s_range": [min(steps), max(steps)],
        "loadavg": os.getloadavg()[0],
        "terms": {k: int(v) for k, v in terms.items()},
    }


def run(configs: list[Config]) -> list[dict]:
    """Launch each configuration and compare; each one's rank results are printed first (one
    JSON line), so a long run's measurement survives a failure of the comparison."""
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in configs:
            ranks = launch(cfg, Path(tmp))
            print(json.dumps({"config": cfg.name, "ranks": ranks}), flush=True)
            reports.append(compare(cfg, ranks))
    return reports


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-1m configurations, seconds")
    parser.add_argument("--only", nargs="*", help="run only these configurations")
    parser.add_argument("--list", action="store_true", help="list the configurations")
    args = parser.parse_args(argv)
    configs = QUICK if args.quick else CONFIGS
    if args.list:
        print("\n".join(c.name for c in CONFIGS + QUICK))
        return []
    if args.only:
        known = {c.name: c for c in CONFIGS + QUICK}
        unknown = [n for n in args.only if n not in known]
        if unknown:
            parser.error(f"unknown configuration(s) {unknown}; allowed: {sorted(known)}")
        configs = [known[n] for n in args.only]
    reports = run(configs)
    for r in reports:
        print(json.dumps({k: v for k, v in r.items() if k != "terms"}))
    return reports


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, rank, world, spec, out = sys.argv
        result = run_rank(int(rank), int(world), Config(**json.loads(spec)))
        Path(out).write_text(json.dumps(result))
    else:
        main()
