"""One rank of the data-parallel SFT runs of tests/core/test_distributed.py; run as a subprocess.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT python tests/distributed_sft_run.py RANK WORLD OUT_DIR

Joins a gloo process group and runs, in this order (every rank the same):
  * each scenario of `SCENARIOS` for `STEPS` steps (per-step losses, trained tokens, final
    parameters);
  * a checkpointed run: `fit(3)` with a checkpoint every 2 steps into OUT_DIR/ckpt, then a fresh
    Trainer with resume=True continues to `RESUME_STEPS`; and an uninterrupted run of
    `RESUME_STEPS` steps;
  * a preemption: only rank 1 sends itself SIGUSR2 after step 2 (its handler records the step);
  * a loader sharded for one process under a 2-rank group (the Trainer must refuse it);
  * the SFT recipe at tiny size into OUT_DIR/recipe.
Results go to OUT_DIR/rank{RANK}.pt. `run_sft` is also imported by the test for the
single-process reference (no process group: world size 1).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
from pathlib import Path

import torch
from _train_helpers import sft_dataset

from posttrain.data import SFTLoader
from posttrain.models import build_model, get_preset
from posttrain.train import Trainer

STEPS, RESUME_STEPS = 3, 5
SCENARIOS = {
    # 17 samples: step 2's first micro-batch is the epoch's last, 1 sample: rank 1's share is
    # empty (a padding row). Clipping at 1.0 is active (gradient norms 5-10).
    "accum": dict(samples=17, batch_size=8, grad_accum_steps=2, pack=False, max_grad_norm=1.0),
    # 40 samples packed into 48-token rows: 8, 8 and 5 rows per batch (the odd one splits 3 + 2).
    "packed": dict(samples=40, batch_size=8, grad_accum_steps=1, pack=True, max_grad_norm=None),
}


def run_sft(scenario: str, *, steps: int = STEPS, **trainer_kwargs) -> dict:
    """A tiny-1m SFT run of `scenario` on whatever process group is initialised (none: one
    process). Returns {"losses", "trained_tokens", "params", "trainer"}."""
    s = SCENARIOS[scenario]
    model = build_model(get_preset("tiny-1m"), seed=0)
    loader = SFTLoader(
        sft_dataset(s["samples"], max_seq_len=48),
        batch_size=s["batch_size"],
        seed=0,
        pack=s["pack"],
        seq_len=48 if s["pack"] else None,
    )
    # SGD with momentum: parameters move linearly in the gradients, so the float rounding of a
    # 2-rank sum stays ~1e-7 in the parameters. (Adam's first steps divide by |g| and turn the
    # rounding of near-zero gradient entries into ~1e-5.) The momentum buffer is checkpointed.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(
        model,
        opt,
        data=loader,
        grad_accum_steps=s["grad_accum_steps"],
        max_grad_norm=s["max_grad_norm"],
        progress=False,
        **trainer_kwargs,
    )
    metrics = trainer.fit(steps)
    return {
        "losses": metrics["loss"].tolist(),
        "trained_tokens": metrics["trained_tokens"].tolist(),
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "trainer": trainer,
    }


def _checkpoint_and_resume(out: Path) -> dict:
    run_dir = out / "ckpt"
    first = run_sft("accum", steps=3, run_dir=run_dir, checkpoint_every=2)
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    resumed = run_sft("accum", steps=RESUME_STEPS, run_dir=run_dir, checkpoint_every=2, resume=True)
    uninterrupted = run_sft("accum", steps=RESUME_STEPS)
    return {
        "saved_after_first_fit": saved,
        "first_losses": first["losses"],
        "resumed_from": resumed["trainer"].metrics["step"].tolist()[:3],
        "resumed_losses": resumed["losses"],
        "resumed_params": resumed["params"],
        "uninterrupted_losses": uninterrupted["losses"],
        "uninterrupted_params": uninterrupted["params"],
    }


def _preemption_on_rank_1(out: Path, rank: int) -> dict:
    from posttrain.core import preemption

    calls: list[int] = []
    trainer_ref: list[Trainer] = []
    signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(trainer_ref[0].step_count))
    preemption.install(signal.SIGUSR2)

    def signal_on_rank_1(trainer, row):
        trainer_ref[:] = [trainer]
        if rank == 1 and row["step"] == 2:
            os.kill(os.getpid(), signal.SIGUSR2)

    try:
        result = run_sft("accum", steps=3, run_dir=out / "preempt", callbacks=[signal_on_rank_1])
    finally:
        preemption.uninstall()
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    return {"handler_calls": calls, "steps": result["trainer"].step_count}


def _mismatched_loader(rank: int) -> str:
    model = build_model(get_preset("tiny-1m"), seed=0)
    loader = SFTLoader(sft_dataset(8), batch_size=8, rank=0, world_size=1)
    try:
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data=loader, progress=False)
    except ValueError as e:
        return str(e)
    return ""


def _recipe(out: Path):
    from posttrain import cli

    sft = cli.load_recipe("sft")
    from posttrain.workflows import override

    cfg = override(sft.Config(), {**sft.TINY, "out_dir": str(out / "recipe")})
    return sft.main(cfg)


def main() -> None:
    rank, world_size, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    # A short timeout: a rank left alone in a collective fails instead of waiting 30 minutes.
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    try:
        results = {
            name: {k: v for k, v in run_sft(name).items() if k != "trainer"} for name in SCENARIOS
        }
        results["resume"] = _checkpoint_and_resume(out)
        results["preemption"] = _preemption_on_rank_1(out, rank)
        results["mismatch_error"] = _mismatched_loader(rank)
        results["recipe"] = _recipe(out)
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
