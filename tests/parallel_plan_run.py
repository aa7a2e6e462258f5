"""One rank of the parallel-plan runs of tests/train/test_parallel_plans.py; run as a subprocess.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT python tests/parallel_plan_run.py RANK WORLD OUT_DIR
    PHASE

PHASE "four" (4 ranks): the 4-rank plans of `PLANS_4`, whose dp_shard=4 run also checkpoints after
steps 2 and 3 into OUT_DIR/ckpt4 (kept for the reshard phase); rank 0 exports the full weights of
the dp_shard=2 x tp=2 run as a HF folder OUT_DIR/hf. PHASE "kill" (2 ranks): dp_shard=2 towards
`RESUME_STEPS` steps with a checkpoint every 2 steps into OUT_DIR/killed; every rank SIGKILLs itself
after step 3 (one step after the checkpoint). PHASE "two" (2 ranks): the 2-rank plans of `PLANS_2`
and, with a no-grad forward before the optimizer is built, of `LOOKED_2`; dp_shard=2 through the
deprecated spelling (`plan.apply`, `plan_state`, `Trainer(..., plan=plan)`); the bitwise resume of
OUT_DIR/killed under the same plan against an uninterrupted run; the refusals of a misused plan; two
reshard resumes of OUT_DIR/ckpt4 (saved under dp_shard=4) under dp_shard=2 and under tp=2, and the
full state dict of a sharded run; the chunked loss under dp_shard=2 and under tp=2 (untied).
PHASE "sp_fresh" (2 ranks started as fresh interpreters): one sp=2 step, to record which packages
that path imports (the other phases fork from a server that has imported verl already).
Results go to OUT_DIR/{PHASE}-rank{RANK}.pt. `run_plan` with plan=None is the single-process
reference the test runs itself.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
from pathlib import Path

import torch
from _train_helpers import TINY, sft_dataset

from posttrain.data import SFTLoader
from posttrain.models import build_model, get_preset, save_hf_checkpoint
from posttrain.train import ParallelPlan, SFTCrossEntropy, Trainer, full_state_dict, plan_state
from posttrain.train.memory_measure import TensorPeak

STEPS, RESUME_STEPS = 3, 5
UNTIED = dataclasses.replace(TINY, tie_word_embeddings=False)
# The load-balancing loss is per rank (not invariant to splitting a batch over ranks): off here.
MOE = dataclasses.replace(get_preset("tiny-moe"), router_aux_loss_coef=0.0, max_seq_len=64)
PLANS_2 = {
    "dp_shard2": (ParallelPlan(dp_shard=2), TINY),
    "dp_replicate2": (ParallelPlan(dp_replicate=2), TINY),
    "tp2": (ParallelPlan(tp=2), TINY),
    "tp2_untied": (ParallelPlan(tp=2), UNTIED),
    "dp_shard2_ac": (ParallelPlan(dp_shard=2, activation_checkpointing=True), TINY),
    "dp_shard2_bf16": (
        ParallelPlan(dp_shard=2, param_dtype="bfloat16", reduce_dtype="float32"),
        TINY,
    ),
    "sp2": (ParallelPlan(sp=2), TINY),
    "sp2_packed": (ParallelPlan(sp=2), TINY),
    "ep2": (ParallelPlan(ep=2), MOE),
    "pp2_1f1b": (ParallelPlan(pp=2), TINY),
    "pp2_gpipe_untied": (ParallelPlan(pp=2, pp_schedule="gpipe", n_microbatches=4), UNTIED),
}
PLANS_4 = {
    "dp_shard4": (ParallelPlan(dp_shard=4), TINY),
    "dp_shard2_tp2": (ParallelPlan(dp_shard=2, tp=2), TINY),
    "hsdp2x2": (ParallelPlan(dp_replicate=2, dp_shard=2), TINY),
    "dp_shard2_sp2": (ParallelPlan(dp_shard=2, sp=2), TINY),
    "dp_shard2_sp2_packed": (ParallelPlan(dp_shard=2, sp=2), TINY),
    "ep2_dp_shard2": (ParallelPlan(ep=2, dp_shard=2), MOE),
    "ep2_dp_replicate2": (ParallelPlan(ep=2, dp_replicate=2), MOE),
    "pp2_dp_shard2": (ParallelPlan(pp=2, dp_shard=2), TINY),
    "pp2_dp_replicate2_packed": (ParallelPlan(pp=2, dp_replicate=2), TINY),
}
PACKED_SEQ_LEN = 47  # odd: the sequence-parallel slices need padding (and a padded mask)


LOOKED_2 = {"dp_shard2_looked": ParallelPlan(dp_shard=2), "sp2_looked": ParallelPlan(sp=2)}
"""The notebook habit of PHASE "two": apply the plan, look at logits under torch.no_grad(), then
build the optimizer (`run_plan(..., look_first=True)`)."""


def look_at_logits(model: torch.nn.Module) -> torch.Tensor:
    """A forward under torch.no_grad() on two 8-token rows, as a notebook cell looks at logits."""
    tokens = torch.arange(16).reshape(2, 8) % TINY.vocab_size
    with torch.no_grad():
        return model(tokens)


def run_plan(
    plan: ParallelPlan | None,
    spec=TINY,
    *,
    steps: int = STEPS,
    optimizer: str = "sgd",
    packed: bool = False,
    look_first: bool = False,
    deprecated: bool = False,
    **trainer_kwargs,
) -> dict:
    """A TINY SFT run: 17 rows (packed: 40 rows into 47-token rows with a block-causal mask),
    batch 8 x accumulation 2, clipping at 1.0 (active), under
    `plan` on the initialised process group (None: a plain model, one process). `look_first`:
    a no-grad forward between `plan.parallelize` and building the optimizer. `deprecated`: the
    earlier spelling (`plan.apply`, `plan_state`, `plan=`). Returns {"losses", "trained_tokens",
    "grad_norms", "params" (full, on every rank), "trainer"}."""
    model = build_model(spec, seed=0)
    runtime, data_rank, data_size = None, 0, 1
    if plan is not None and deprecated:
        model = plan.apply(model, spec=spec)
        data_rank, data_size = plan_state(model).data_rank, plan.data_parallel_size
        trainer_kwargs["plan"] = plan
    elif plan is not None:
        runtime = plan.parallelize(model, spec=spec)
        data_rank, data_size = runtime.data_rank, runtime.data_size
    if look_first:
        look_at_logits(model)
    loader = SFTLoader(
        sft_dataset(40 if packed else 17, max_seq_len=PACKED_SEQ_LEN),
        batch_size=8,
        seed=0,
        rank=data_rank,
        world_size=data_size,
        pack=packed,
        seq_len=PACKED_SEQ_LEN if packed else None,
    )
    # SGD with momentum moves the weights linearly in the gradients (float rounding of the
    # sharded sums stays ~1e-7); AdamW's first steps divide by |g| and amplify it.
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    trainer = Trainer(
        model,
        opt,
        data=loader,
        grad_accum_steps=2,
        max_grad_norm=1.0,
        progress=False,
        runtime=runtime,
        **trainer_kwargs,
    )
    metrics = trainer.fit(steps)
    return {
        "losses": metrics["loss"].tolist(),
        "trained_tokens": metrics["trained_tokens"].tolist(),
        "grad_norms": metrics["grad_norm"].tolist(),
        "params": full_state_dict(model if runtime is None else runtime),
        "trainer": trainer,
    }


def _strip(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "trainer"}


def phase_four(out: Path) -> dict:
    # the dp_shard=4 run is also the checkpointed one the reshard tests resume: one run for both
    saving = {"dp_shard4": {"run_dir": out / "ckpt4", "checkpoint_every": 2}}
    results = {
        name: _strip(run_plan(plan, spec, packed=name.endswith("packed"), **saving.get(name, {})))
        for name, (plan, spec) in PLANS_4.items()
    }
    results["adamw_dp_shard2_tp2"] = _strip(
        run_plan(ParallelPlan(dp_shard=2, tp=2), optimizer="adamw")
    )
    if torch.distributed.get_rank() == 0:  # HF export of the sharded dp_shard=2 x tp=2 run
        plain = build_model(TINY, seed=1)
        plain.load_state_dict(results["dp_shard2_tp2"]["params"])
        save_hf_checkpoint(plain, TINY, out / "hf")
    return results


def phase_two(out: Path, rank: int) -> dict:
    results = {
        name: _strip(run_plan(plan, spec, packed=name.endswith("packed")))
        for name, (plan, spec) in PLANS_2.items()
    }
    results.update(
        {name: _strip(run_plan(plan, look_first=True)) for name, plan in LOOKED_2.items()}
    )
    results["dp_shard2_deprecated"] = _strip(run_plan(ParallelPlan(dp_shard=2), deprecated=True))
    # the chunked head and log-softmax (5 tokens a chunk) on FSDP2's gathered root, measured by
    # TensorPeak (FSDP2 frees the storages of gathered parameters that tensors still refer to)
    with TensorPeak() as peak:
        chunked = run_plan(ParallelPlan(dp_shard=2), loss=SFTCrossEntropy(loss_chunk_tokens=5))
    results["dp_shard2_chunked"] = {**_strip(chunked), "tensor_peak": peak.peak_bytes}
    # the chunked loss under tp=2 with the untied head column-parallel (each chunk's logits
    # all-gathered over the tp ranks, in forward and again in the recomputing backward)
    chunked = run_plan(ParallelPlan(tp=2), UNTIED, loss=SFTCrossEntropy(loss_chunk_tokens=5))
    results["tp2_untied_chunked"] = _strip(chunked)
    looked = ParallelPlan(dp_shard=2).parallelize(build_model(TINY, seed=0), spec=TINY).model
    look_at_logits(looked)
    results["looked_types"] = {
        name: type(p).__name__
        for name, p in looked.named_parameters()
        if not name.startswith("layers.")
    }
    plan = ParallelPlan(dp_shard=2)
    found = sorted(p.name for p in (out / "killed" / "checkpoints").iterdir())
    resumed = run_plan(
        plan, steps=RESUME_STEPS, run_dir=out / "killed", checkpoint_every=2, resume=True
    )
    results["same_plan"] = {
        "found": found,
        "resumed": _strip(resumed),
        "uninterrupted": _strip(run_plan(plan, steps=RESUME_STEPS)),
        "restored_rows": resumed["trainer"].metrics["step"].tolist(),
    }
    results["errors"] = _misuse()
    results["memory_agreement"] = _memory_agreement(rank)
    # every rank of a sharded save is told the checkpoint's final folder (not the staging one)
    saved = run_plan(plan, steps=1, run_dir=out / "saved")["trainer"].save_checkpoint()
    results["saved"] = {"path": str(saved), "is_dir": saved.is_dir()}
    for name, plan in {
        "reshard_dp_shard2": ParallelPlan(dp_shard=2),
        "reshard_tp2": ParallelPlan(tp=2),
    }.items():
        run_dir = out / name
        if rank == 0:
            shutil.copytree(out / "ckpt4", run_dir)
        torch.distributed.barrier()
        resumed = run_plan(plan, steps=RESUME_STEPS, run_dir=run_dir, resume=True)
        results[name] = _strip(resumed)
    return results


def phase_kill(out: Path) -> None:
    def kill_after_step_3(trainer, row):
        if row["step"] == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    run_plan(
        ParallelPlan(dp_shard=2),
        steps=RESUME_STEPS,
        run_dir=out / "killed",
        checkpoint_every=2,
        callbacks=[kill_after_step_3],
    )


def _memory_agreement(rank: int) -> str:
    """The trainer's memory check when the ranks read different free memory (rank 0: 1 TiB,
    rank 1: 1 KiB): "fits", or the refusal's message."""
    import posttrain.train.memory_check as memory_check

    runtime = ParallelPlan(dp_shard=2).parallelize(build_model(TINY, seed=0), spec=TINY)
    loader = SFTLoader(sft_dataset(8), batch_size=4, rank=rank, world_size=2)
    read = memory_check.device_memory_bytes
    memory_check.device_memory_bytes = lambda: 1 << 40 if rank == 0 else 1 << 10
    try:
        memory_check.check_memory(runtime, loader, phase="sft")
        return "fits"
    except ValueError as e:
        return str(e)
    finally:
        memory_check.device_memory_bytes = read


def _misuse() -> dict[str, str]:
    """The error messages of: an optimizer built before plan.parallelize, a plan passed to a
    Trainer (the deprecated plan=) but never applied, a split model without its runtime, a
    runtime of another model, a loader sharded over all ranks instead of the data ranks, and an
    optimizer built after a forward with grad that no backward followed."""
    errors = {}
    loader = SFTLoader(sft_dataset(8), batch_size=4, rank=0, world_size=1)

    def attempt(name, build):
        try:
            build()
        except ValueError as e:
            errors[name] = str(e)

    def before():
        model = build_model(TINY, seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        runtime = ParallelPlan(tp=2).parallelize(model, spec=TINY)
        Trainer(model, opt, data=loader, progress=False, runtime=runtime)

    def not_applied():
        model = build_model(TINY, seed=0)
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            data=loader,
            progress=False,
            plan=ParallelPlan(tp=2),
        )

    def without_runtime():
        model = ParallelPlan(tp=2).parallelize(build_model(TINY, seed=0), spec=TINY).model
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data=loader, progress=False)

    def other_model():
        runtime = ParallelPlan(tp=2).parallelize(build_model(TINY, seed=0), spec=TINY)
        model = build_model(TINY, seed=0)
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            data=loader,
            progress=False,
            runtime=runtime,
        )

    def data_sharding():
        runtime = ParallelPlan(dp_shard=2).parallelize(build_model(TINY, seed=0), spec=TINY)
        Trainer(
            runtime.model,
            torch.optim.SGD(runtime.model.parameters(), lr=0.1),
            data=loader,
            progress=False,
            runtime=runtime,
        )

    for name, build in {
        "optimizer_before_apply": before,
        "not_applied": not_applied,
        "without_runtime": without_runtime,
        "other_model": other_model,
        "data_sharding": data_sharding,
    }.items():
        attempt(name, build)
    # a forward with grad that no backward follows leaves FSDP2's root gathered
    runtime = ParallelPlan(dp_shard=2).parallelize(build_model(TINY, seed=0), spec=TINY)
    model = runtime.model
    model(torch.arange(16).reshape(2, 8))
    shards = SFTLoader(
        sft_dataset(8), batch_size=4, rank=runtime.data_rank, world_size=runtime.data_size
    )
    attempt(
        "gathered_copies",
        lambda: Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            data=shards,
            progress=False,
            runtime=runtime,
        ),
    )
    # the refusal resharded the model: an optimizer built now holds its parameters
    Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data=shards,
        progress=False,
        runtime=runtime,
    )
    return errors


def main() -> None:
    # imported here: tests/launch/test_launch_plans.py ships this module by value to jobs, which
    # cannot import the test helpers
    from _ranks import gloo_rank

    with gloo_rank() as (rank, _, out, phase):
        if phase == "kill":
            phase_kill(out)
            return
        if phase == "sp_fresh":
            results = {"sp2": _strip(run_plan(ParallelPlan(sp=2), steps=1))}
        else:
            results = phase_four(out) if phase == "four" else phase_two(out, rank)
        # sp ran without verl's package (posttrain.train.sequence_parallel._ulysses)
        results["verl_imported"] = "verl" in sys.modules
        torch.save(results, out / f"{phase}-rank{rank}.pt")


if __name__ == "__main__":
    main()
