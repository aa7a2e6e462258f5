"""SFT run for the kill-and-resume acceptance test (tests/core/test_resume.py); run as a subprocess.

    python tests/sft_resume_run.py RUN_DIR [--steps 12] [--pause-after K] [--resume]

Deterministic: fp32, 1 thread, `torch.use_deterministic_algorithms(True)`. AdamW, warmup-cosine,
clipping, accumulation 2 x batch 2 over 24 samples (an epoch is exactly 6 steps), embedding
dropout (so the torch RNG matters), an evaluation every 4 steps that draws random numbers, and
a checkpoint every 3 steps. After each step RUN_DIR/progress holds the step number; with
--pause-after K the run sleeps after step K so the test can SIGKILL it there. At the end the
final parameters go to RUN_DIR/final.pt.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _train_helpers import sft_loader, tiny_model

from posttrain.train import Trainer, warmup_cosine_schedule

SAMPLES, BATCH, ACCUM = 24, 2, 2
STEPS_PER_EPOCH = SAMPLES // (BATCH * ACCUM)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pause-after", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    model = tiny_model(0)
    # Dropout on the token embeddings: training draws from the global torch RNG.
    model.tok_embeddings.register_forward_hook(
        lambda module, inputs, output: F.dropout(output, p=0.1, training=module.training)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = warmup_cosine_schedule(opt, warmup_steps=2, total_steps=args.steps, min_lr_ratio=0.1)

    def eval_fn(m):
        return {"noise": float(torch.rand(()))}  # draws random numbers; must not shift training

    def progress(trainer, row):
        (args.run_dir / "progress").write_text(str(row["step"]))
        if row["step"] == args.pause_after:
            time.sleep(600)  # the test kills the process here

    trainer = Trainer(
        model,
        opt,
        data=sft_loader(SAMPLES, batch_size=BATCH, seed=1),
        lr_scheduler=sched,
        grad_accum_steps=ACCUM,
        max_grad_norm=1.0,
        run_dir=args.run_dir,
        eval_fn=eval_fn,
        eval_every=4,
        checkpoint_every=3,
        keep_last=2,
        progress=False,
        seed=0,
        callbacks=[progress],
        resume=args.resume,
    )
    print(f"starting at step {trainer.step_count}", flush=True)
    trainer.fit(args.steps)
    torch.save(model.state_dict(), args.run_dir / "final.pt")


if __name__ == "__main__":
    main()
