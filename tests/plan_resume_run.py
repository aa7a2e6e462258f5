"""One rank of the SFT recipe runs of tests/test_resume.py that resume under another plan; run
as a subprocess on 2 gloo ranks:

    MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT python tests/plan_resume_run.py RANK WORLD OUT PHASE

PHASE "first": the SFT recipe at TINY size for `STEPS` steps, a checkpoint after every step,
into OUT/shard2 under parallel.dp_shard=2 (FSDP2: sharded checkpoints) and into OUT/replicas
with the parallel section at its defaults (two data-parallel replicas: full checkpoints).
PHASE "resume" (after the test cut both folders back to their checkpoint of step
`RESUME_FROM`): OUT/shard2 resumes with parallel.dp_shard=1 and OUT/replicas with
parallel.dp_shard=2. Each rank writes nothing itself; the recipe's files are what the test reads.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch

STEPS, RESUME_FROM = 4, 2
RUNS = {"shard2": ({"parallel.dp_shard": 2}, {"parallel.dp_shard": 1}),
        "replicas": ({"parallel.dp_shard": 1}, {"parallel.dp_shard": 2})}
"""Run folder -> (the first run's plan, the resumed run's plan)."""


def config(out: Path, **overrides):
    """The SFT recipe's TINY config of these runs (`overrides`: dotted keys)."""
    from posttrain import cli
    from posttrain.workflows import override

    sft = cli.load_recipe("sft")
    return sft, override(sft.Config(), {
        **sft.TINY, "optim.steps": STEPS, "checkpoint.every": 1, "checkpoint.keep_last": None,
        "out_dir": str(out), **overrides})


def main() -> None:
    rank, world_size, out, phase = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size,
                                         timeout=datetime.timedelta(seconds=90))
    try:
        for name, (first, resumed) in RUNS.items():
            plan = first if phase == "first" else {**resumed, "resume": True}
            sft, cfg = config(out / name, **plan)
            sft.main(cfg)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
