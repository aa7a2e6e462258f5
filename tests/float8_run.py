"""One rank of the float8-under-a-plan runs of tests/train/test_float8.py; run as a subprocess.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT python tests/float8_run.py RANK 2 OUT_DIR

Runs every case of `CASES` (float8 conversion, then the plan, then AdamW) on the 2-rank gloo
group and writes {case: {"losses", "gather_dtypes"}} to OUT_DIR/float8-rank{RANK}.pt.
`run_case` with plan=None is the single-process reference on the same global batch, which the
test runs itself.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
from _train_helpers import TINY, sft_dataset, tiny_model

from posttrain.data import SFTLoader
from posttrain.train import ParallelPlan, Trainer
from posttrain.train.float8 import Float8Config, apply_float8

STEPS = 5
CASES = {
    "dp_shard2_tensorwise_f8_gather": (ParallelPlan(dp_shard=2), Float8Config(recipe="tensorwise")),
    "dp_shard2_tensorwise": (
        ParallelPlan(dp_shard=2),
        Float8Config(recipe="tensorwise", fsdp_float8_all_gather=False),
    ),
    "dp_shard2_rowwise": (ParallelPlan(dp_shard=2), Float8Config(recipe="rowwise")),
    "tp2_tensorwise": (ParallelPlan(tp=2), Float8Config(recipe="tensorwise")),
    "tp2_rowwise": (ParallelPlan(tp=2), Float8Config(recipe="rowwise")),
}


def gather_dtypes(model: torch.nn.Module) -> list[str]:
    """The dtypes FSDP2 all-gathers the weights of the first layer's q_proj and mlp.w1 in
    (what each weight's `fsdp_pre_all_gather` hands to the collective); [] without FSDP2."""
    state = (
        model.layers[0]._get_fsdp_state() if hasattr(model.layers[0], "_get_fsdp_state") else None
    )
    if state is None:
        return []
    params = {p._param_fqn: p for p in state._fsdp_param_group.fsdp_params}
    return [
        str(t.dtype)
        for name in ("layers.0.attn.q_proj.weight", "layers.0.mlp.w1.weight")
        for t in params[name].all_gather_inputs
    ]


def run_case(plan: ParallelPlan | None, config: Float8Config, *, steps: int = STEPS) -> dict:
    """TINY in float8, batch 8 x 64 packed tokens (the global batch), AdamW lr 1e-3, clipping
    at 1.0, under `plan` on the initialised process group (None: one process)."""
    model = tiny_model(0)
    apply_float8(model, config)
    runtime = None if plan is None else plan.parallelize(model, spec=TINY)
    rank, size = (0, 1) if runtime is None else (runtime.data_rank, runtime.data_size)
    loader = SFTLoader(
        sft_dataset(200),
        batch_size=8,
        shuffle=True,
        seed=0,
        pack=True,
        seq_len=64,
        rank=rank,
        world_size=size,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(model, opt, data=loader, max_grad_norm=1.0, progress=False, runtime=runtime)
    metrics = trainer.fit(steps)
    return {"losses": metrics["loss"].tolist(), "gather_dtypes": gather_dtypes(model)}


def main() -> None:
    rank, world_size, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=90)
    )
    try:
        results = {name: run_case(plan, config) for name, (plan, config) in CASES.items()}
        torch.save(results, out / f"float8-rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
