"""Asynchronous RL run for the kill-and-resume test (tests/rl/test_async_rl.py); run as a process.

    python tests/async_rl_resume_run.py RUN_DIR --address HOST:PORT --staleness S
        [--steps 6] [--pause-after K] [--resume]

Connects to the Ray cluster at HOST:PORT (its auth token in the environment), trains tiny-1m
with GRPO on chain_sum through `AsyncRLTrainer` (one rollout actor, max_staleness S, 1 torch
thread everywhere) with a checkpoint every 2 steps. After each step RUN_DIR/progress holds the
step number and RUN_DIR/groups/step_N.json the tokens, log-probabilities and rewards trained on
in step N; with --pause-after K the run sleeps after step K (before that step's checkpoint)
so the test can SIGKILL it there. At the end: RUN_DIR/final.pt (the policy's weights) and
RUN_DIR/consumed.json (`AsyncRLTrainer.consumed`).

`run(RUN_DIR, S)` is the same run on the Ray session of the calling process: the test runs the
uninterrupted references that way, in its own process, beside the processes it kills.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import ray
import torch

from posttrain.envs import chain_sum_task
from posttrain.policy import Policy
from posttrain.rl import RLAlgorithm, RLTrainer
from posttrain.rl.async_rl import AsyncRLTrainer


def run(
    run_dir: Path,
    staleness: int,
    *,
    steps: int = 6,
    pause_after: int | None = None,
    resume: bool = False,
) -> None:
    """The run described above, on the Ray session this process is connected to."""
    torch.set_num_threads(1)
    (run_dir / "groups").mkdir(parents=True, exist_ok=True)

    def record(trainer, row):
        trained = [
            [t.completion_ids, t.logprobs, t.reward, t.policy_version]
            for g in trainer.last_groups
            for t in g
        ]
        (run_dir / "groups" / f"step_{row['step']}.json").write_text(json.dumps(trained))
        (run_dir / "progress").write_text(str(row["step"]))
        if row["step"] == pause_after:
            time.sleep(600)  # the test kills the process here

    policy = Policy.from_spec("tiny-1m", seed=0)
    trainer = RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=1e-2),
        task=chain_sum_task(size=32, held_out_size=2),
        algo=RLAlgorithm.grpo(group_size=2, kl_coef=0.0),
        prompts_per_step=2,
        max_new_tokens=4,
        progress=False,
        seed=3,
        run_dir=run_dir,
        checkpoint_every=2,
        keep_last=2,
        callbacks=[record],
        resume=resume,
    )
    print(f"starting at step {trainer.step_count}", flush=True)
    runner = AsyncRLTrainer(
        trainer, max_staleness=staleness, num_workers=1, worker_num_cpus=0.25, num_threads=1
    )
    try:
        runner.fit(steps)
    finally:
        runner.close()
    torch.save(policy.model.state_dict(), run_dir / "final.pt")
    (run_dir / "consumed.json").write_text(json.dumps(runner.consumed))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--address", required=True)
    parser.add_argument("--staleness", type=int, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pause-after", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    ray.init(address=args.address, log_to_driver=False)
    run(
        args.run_dir,
        args.staleness,
        steps=args.steps,
        pause_after=args.pause_after,
        resume=args.resume,
    )


if __name__ == "__main__":
    main()
