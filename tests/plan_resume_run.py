"""One rank of the SFT recipe runs of tests/core/test_resume.py that resume under another plan; run
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

from pathlib import Path

from _ranks import gloo_rank

STEPS, RESUME_FROM = 4, 2
RUNS = {
    "shard2": ({"parallel.dp_shard": 2}, {"parallel.dp_shard": 1}),
    "replicas": ({"parallel.dp_shard": 1}, {"parallel.dp_shard": 2}),
}
"""Run folder -> (the first run's plan, the resumed run's plan)."""


def config(out: Path, **overrides):
    """The SFT recipe's TINY config of these runs (`overrides`: dotted keys)."""
    from posttrain import cli
    from posttrain.workflows import override

    sft = cli.load_recipe("sft")
    return sft, override(
        sft.Config(),
        {
            **sft.TINY,
            "optim.steps": STEPS,
            "checkpoint.every": 1,
            "checkpoint.keep_last": None,
            "out_dir": str(out),
            **overrides,
        },
    )


def main() -> None:
    with gloo_rank() as args:
        for name, (first, resumed) in RUNS.items():
            plan = first if args.phase == "first" else {**resumed, "resume": True}
            sft, cfg = config(args.out / name, **plan)
            sft.main(cfg)


if __name__ == "__main__":
    main()
