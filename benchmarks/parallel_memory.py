"""Per-rank memory of parallel plans, measured against `posttrain.train.memory_plan.plan_memory`,
and step time per plan, on CPU with gloo.

For each configuration (a model size, a `ParallelPlan`, a per-rank micro-batch B x T) the ranks
start as fresh processes (gloo on 127.0.0.1, as tests/parallel_plan_run.py; one process without a
process group for the one-rank plan). Each rank:

  1. imports torch, torchtune and posttrain, joins the process group, makes its random-token rows
     (every token trained: B x (T - 1) per micro-batch), and warms up: a 1-block, 64-wide model
     runs one forward, backward and AdamW step and is deleted, so lazy imports and one-time kernel
     set-up happen before the baseline;
  2. resets the peak RSS (`/proc/self/clear_refs` 5 resets VmHWM) and reads the baseline VmRSS;
  3. builds the model (`build_model(spec, seed=0)`), applies the plan, builds AdamW (lr 1e-4, weight
     decay 0) and a `posttrain.train.Trainer` (clipping at 1.0, no accumulation) and runs `--steps`
     SFT steps;
  4. reports VmHWM - baseline (its peak RSS increase), the local bytes of its parameters and
     optimizer state and of its gradients at the optimizer step (from the tensors themselves), and
     the step times.

The measured peak of a configuration is its largest rank's; the prediction is `plan_memory(spec,
plan, MemoryBatch(B, T), device_type="cpu")["peak"]`. Ranks run with MALLOC_MMAP_THRESHOLD_=65536:
glibc then serves every allocation of 64 KiB or more with mmap and returns it to the system when
freed, so RSS follows the live tensors. With glibc's default (a threshold that grows up to 32 MiB
after each large free) freed heap chunks stay resident: the step-time runs keep the default, and
their table shows the difference.

Threads: one intra-op thread per rank. On a shared 2-core machine a 2-thread process spin-waits
whenever a neighbour takes a core (11 s of CPU per step instead of ~2.5 in a trial run), so the
one-process plan uses one core, 2-rank plans two, 4-rank plans oversubscribe two. Step time: the
median of the steps after the first, wall and CPU (all ranks); the step-time plans share one
global batch (8 rows x 256 tokens, 12M parameters).

The report (the generated block of docs/benchmarks/parallel_memory.md and its figure) is written
by `parallel_memory_report.py`.

Usage:
    python benchmarks/parallel_memory.py            # ~8 min; writes the generated block of
                                                    # docs/benchmarks/parallel_memory.md and
                                                    # the figure
    python benchmarks/parallel_memory.py --quick    # two tiny configurations, nothing written
    python benchmarks/parallel_memory.py --only 30m_dp4_T1024   # some configurations, nothing
                                                                # written
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from parallel_memory_report import DOC, FIGURE, plot, report, write_doc
from rank_launch import launch_ranks, local_bytes, status_bytes

MiB = 2**20


def model_specs():
    from posttrain.models import ModelSpec, get_preset

    def qwen(D, L, H, F):
        return ModelSpec(
            family="qwen2",
            vocab_size=272,
            num_layers=L,
            num_heads=H,
            num_kv_heads=2,
            embed_dim=D,
            intermediate_dim=F,
            max_seq_len=1024,
            rope_base=1e6,
            norm_eps=1e-6,
            tie_word_embeddings=True,
        )

    return {
        "1m": get_preset("tiny-1m").replace(max_seq_len=1024),
        "12m": get_preset("tiny-10m"),
        "30m": qwen(512, 8, 8, 2048),
        "47m": qwen(640, 8, 10, 2560),
    }


@dataclass(frozen=True)
class Config:
    name: str
    model: str  # key of model_specs()
    plan: dict = field(default_factory=dict)  # ParallelPlan keywords
    batch: int = 4  # rows per micro-batch on one data-parallel rank
    seq_len: int = 256
    steps: int = 3
    group: str = "validation"  # validation | dp_sweep | other_axes | step_time
    malloc: str = "fixed"  # fixed (MALLOC_MMAP_THRESHOLD_=65536) | default


CONFIGS = [
    Config(name="1m_1proc_T1024", model="1m", batch=8, seq_len=1024),
    Config(name="12m_1proc_T512", model="12m", batch=2, seq_len=512),
    Config(
        name="12m_1proc_ac_T512",
        model="12m",
        plan={"activation_checkpointing": True},
        batch=2,
        seq_len=512,
    ),
    Config(name="12m_dp2_T256", model="12m", plan={"dp_shard": 2}, batch=4, seq_len=256),
    Config(name="30m_tp2_T512", model="30m", plan={"tp": 2}, batch=2, seq_len=512),
    Config(name="30m_dp4_T1024", model="30m", plan={"dp_shard": 4}, batch=1, seq_len=1024),
    Config(
        name="47m_dp2_tp2_T128", model="47m", plan={"dp_shard": 2, "tp": 2}, batch=2, seq_len=128
    ),
    # per-rank memory against dp_shard at a fixed per-rank micro-batch
    *[
        Config(
            name=f"47m_dp{n}_T256",
            model="47m",
            plan={"dp_shard": n} if n > 1 else {},
            batch=2,
            seq_len=256,
            group="dp_sweep",
        )
        for n in (1, 2, 4)
    ],
    # the other axes, as sharding.py / sequence_parallel.py / pipeline.py implement them
    Config(
        name="12m_sp2_T512", model="12m", plan={"sp": 2}, batch=2, seq_len=512, group="other_axes"
    ),
    Config(
        name="12m_pp2_1f1b_T512",
        model="12m",
        plan={"pp": 2},
        batch=2,
        seq_len=512,
        group="other_axes",
    ),
    Config(
        name="12m_pp2_gpipe_T512",
        model="12m",
        plan={"pp": 2, "n_microbatches": 2, "pp_schedule": "gpipe"},
        batch=2,
        seq_len=512,
        group="other_axes",
    ),
    # step time per plan at one global batch (8 rows x 256 tokens), glibc's default malloc
    *[
        Config(
            name=f"12m_{tag}_step",
            model="12m",
            plan=plan,
            batch=8 // dp,
            seq_len=256,
            group="step_time",
            malloc="default",
        )
        for tag, plan, dp in (
            ("1proc", {}, 1),
            ("dp2", {"dp_shard": 2}, 2),
            ("tp2", {"tp": 2}, 1),
            ("dp4", {"dp_shard": 4}, 4),
            ("dp2_tp2", {"dp_shard": 2, "tp": 2}, 2),
            ("hsdp2x2", {"dp_replicate": 2, "dp_shard": 2}, 4),
        )
    ],
]
QUICK = [
    Config(name="1m_1proc_T128", model="1m", batch=4, seq_len=128, steps=2),
    Config(name="1m_dp2_T128", model="1m", plan={"dp_shard": 2}, batch=4, seq_len=128, steps=2),
]


# --------------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------------


def _warm_up() -> None:
    import torch
    import torch.distributed.fsdp  # noqa: F401  (what plan.parallelize imports)
    import torch.distributed.tensor.parallel  # noqa: F401
    import torchtune.models.llama3  # noqa: F401
    import torchtune.training  # noqa: F401

    from posttrain.models import build_model

    spec = model_specs()["1m"].replace(
        num_layers=1, embed_dim=64, intermediate_dim=64, num_heads=4, num_kv_heads=2
    )
    model = build_model(spec, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (2, 16))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    del model, opt, x


def run_rank(rank: int, world: int, cfg: Config) -> dict:
    import torch
    import torch.distributed as dist

    from posttrain.data import Sample, SFTLoader
    from posttrain.models import ByteTokenizer, build_model
    from posttrain.train import ParallelPlan, Trainer

    torch.set_num_threads(1)
    spec, plan = model_specs()[cfg.model], ParallelPlan(**cfg.plan)
    # a one-rank plan with activation checkpointing is applied too (on a 1-rank gloo group)
    applied = world > 1 or plan.activation_checkpointing
    if applied:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
        )
    global_batch = cfg.batch * plan.data_parallel_size
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (global_batch * cfg.steps, cfg.seq_len), generator=g).tolist()
    samples = [Sample.from_loss_mask(r, [True] * len(r)) for r in rows]
    _warm_up()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    baseline, baseline_file = status_bytes("VmRSS"), status_bytes("RssFile")

    model = build_model(spec, seed=0)
    runtime = plan.parallelize(model, spec=spec) if applied else None
    data_rank, data_size = (0, 1) if runtime is None else (runtime.data_rank, runtime.data_size)
    loader = SFTLoader(
        samples,
        batch_size=global_batch,
        seed=0,
        pad_id=ByteTokenizer.PAD,
        rank=data_rank,
        world_size=data_size,
        shuffle=False,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    grads: list[int] = []
    opt.register_step_pre_hook(
        lambda o, args, kwargs: grads.append(
            local_bytes(p.grad for p in model.parameters() if p.grad is not None)
        )
    )
    build_peak = status_bytes("VmHWM") - baseline
    clock: list[tuple[float, float]] = []  # (wall, this process's CPU time) after every step

    def tick(_trainer, _row) -> None:
        clock.append((time.perf_counter(), time.process_time()))

    trainer = Trainer(
        model,
        opt,
        data=loader,
        max_grad_norm=1.0,
        progress=False,
        runtime=runtime,
        callbacks=[tick],
    )
    trainer.fit(cfg.steps)
    peak = status_bytes("VmHWM") - baseline
    states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    result = {
        "rank": rank,
        "baseline": baseline,
        "peak": peak,
        "build_peak": build_peak,
        "code_pages": status_bytes("RssFile") - baseline_file,
        "params": local_bytes(model.parameters()),
        "optimizer": local_bytes(states),
        "grads": max(grads),
        "step_times": trainer.metrics["step_time_s"].tolist(),
        "cpu_times": [b[1] - a[1] for a, b in zip(clock, clock[1:])],
        "threads": torch.get_num_threads(),
        "loss": trainer.metrics["loss"].tolist(),
    }
    if applied:
        dist.destroy_process_group()
    return result


# --------------------------------------------------------------------------------------------
# Launching and comparing
# --------------------------------------------------------------------------------------------


def launch(cfg: Config, folder: Path, timeout: float = 300.0) -> list[dict]:
    """Run the ranks of `cfg` as fresh processes; returns their results (rank order)."""
    from posttrain.train import ParallelPlan

    return launch_ranks(
        __file__,
        cfg.name,
        ParallelPlan(**cfg.plan).world_size,
        json.dumps(dataclasses.asdict(cfg)),
        folder,
        timeout=timeout,
        fixed_malloc=cfg.malloc == "fixed",
    )


def predict(cfg: Config):
    from posttrain.train import ParallelPlan
    from posttrain.train.memory_plan import MemoryBatch, plan_memory

    spec = model_specs()[cfg.model]
    return plan_memory(
        spec,
        ParallelPlan(**cfg.plan),
        MemoryBatch(micro_batch_size=cfg.batch, seq_len=cfg.seq_len),
        device_type="cpu",
    )


def compare(cfg: Config, ranks: list[dict]) -> dict:
    import statistics

    from posttrain.train import ParallelPlan

    df = predict(cfg).set_index("term")
    spec = model_specs()[cfg.model]
    worst = max(ranks, key=lambda r: r["peak"])
    steps = [t for r in ranks for t in r["step_times"][1:]]
    cpu = [sum(step) for step in zip(*(r["cpu_times"] for r in ranks))]  # all ranks, per step
    return {
        "config": cfg.name,
        "group": cfg.group,
        "plan": str(ParallelPlan(**cfg.plan)),
        "ranks": len(ranks),
        "params_M": spec.num_parameters() / 1e6,
        "B": cfg.batch,
        "T": cfg.seq_len,
        "predicted_MiB": df.loc["peak", "bytes"] / MiB,
        "measured_MiB": worst["peak"] / MiB,
        "ratio": worst["peak"] / df.loc["peak", "bytes"],
        "min_rank_MiB": min(r["peak"] for r in ranks) / MiB,
        "moment": df.loc["peak", "note"].removeprefix("max over moments: "),
        "pred_static_MiB": (df.loc["parameters", "bytes"] + df.loc["optimizer state", "bytes"])
        / MiB,
        "meas_static_MiB": max(r["params"] + r["optimizer"] for r in ranks) / MiB,
        "pred_grads_MiB": df.loc["gradients", "bytes"] / MiB,
        "meas_grads_MiB": max(r["grads"] for r in ranks) / MiB,
        "build_MiB": max(r["build_peak"] for r in ranks) / MiB,
        "overhead_MiB": (worst["peak"] - df.loc["peak", "bytes"]) / MiB,
        "code_MiB": worst["code_pages"] / MiB,
        "pred_build_MiB": df.loc["model build", "bytes"] / MiB,
        "step_s": statistics.median(steps) if steps else float("nan"),
        "cpu_s": statistics.median(cpu) if cpu else float("nan"),
        "threads": worst["threads"],
        "tokens_per_step": cfg.batch
        * ParallelPlan(**cfg.plan).data_parallel_size
        * (cfg.seq_len - 1),
    }


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="two tiny configurations (~40 s); nothing written"
    )
    parser.add_argument(
        "--only", nargs="+", default=None, help="configuration names to run (nothing written)"
    )
    parser.add_argument("--out", type=Path, default=DOC, help="the report to update")
    parser.add_argument(
        "--worker", nargs=4, metavar=("RANK", "WORLD", "CONFIG", "OUT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.worker:
        rank, world, spec, out = args.worker
        result = run_rank(int(rank), int(world), Config(**json.loads(spec)))
        Path(out).write_text(json.dumps(result))
        return 0
    configs = QUICK if args.quick else CONFIGS
    if args.only:
        known = {c.name: c for c in CONFIGS + QUICK}
        unknown = [n for n in args.only if n not in known]
        if unknown:
            parser.error(f"unknown configuration(s) {unknown}; known: {', '.join(known)}")
        configs = [known[n] for n in args.only]
    start, results, load0 = time.perf_counter(), [], _load()
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in configs:
            t0 = time.perf_counter()
            row = compare(cfg, launch(cfg, Path(tmp)))
            results.append(row)
            print(
                f"{cfg.name:28s} {row['plan']:32s} predicted {row['predicted_MiB']:7.1f} MiB  "
                f"measured {row['measured_MiB']:7.1f} MiB  ratio {row['ratio']:.3f}  (terms: "
                f"the report)  ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    elapsed = time.perf_counter() - start
    command = "python benchmarks/parallel_memory.py" + (" --quick" if args.quick else "")
    block = report(results, elapsed, command, (load0, _load()))
    if args.quick or args.only:
        print(block)
        return 0
    plot(results, FIGURE)
    write_doc(block, args.out)
    print(f"wrote {args.out} and {FIGURE} ({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
