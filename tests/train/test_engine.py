"""The one training engine under every trainer: Ctrl-C stops at a whole step with a checkpoint
(RLTrainer too), a fit after it continues as if nothing happened, and a run folder that another
live process holds is refused."""

import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from _rl_helpers import ToyTask
from _train_helpers import sft_loader, tiny_model

from posttrain.core import RunDirInUseError
from posttrain.policy import Policy
from posttrain.rl import RLAlgorithm, RLTrainer
from posttrain.train import Engine, Trainer


@pytest.fixture
def deterministic():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class InterruptingTask(ToyTask):
    """ToyTask that delivers a real SIGINT while building the prompts of RL step `at` (once):
    inside the rollout, before anything of the step is applied."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.fired = at, False

    def builders(self, batch_index, batch_size):
        if batch_index == self.at and not self.fired:
            self.fired = True
            signal.raise_signal(signal.SIGINT)
        return super().builders(batch_index, batch_size)


def _rl(run_dir, task, **kw):
    policy = Policy.from_spec("tiny-1m", seed=0)
    opt = torch.optim.AdamW(policy.model.parameters(), lr=1e-3)
    return RLTrainer(
        policy,
        opt,
        task=task,
        algo=RLAlgorithm.grpo(group_size=4, kl_coef=0.04),
        prompts_per_step=4,
        max_new_tokens=3,
        run_dir=run_dir,
        checkpoint_every=10,
        progress=False,
        seed=3,
        **kw,
    )


def test_both_trainers_stand_on_the_engine():
    assert issubclass(Trainer, Engine) and issubclass(RLTrainer, Engine)


def test_rl_ctrl_c_in_the_rollout_rolls_back_checkpoints_and_continues_exactly(
    tmp_path, capsys, deterministic
):
    full = _rl(tmp_path / "full", ToyTask())
    full.fit(4)
    cut = _rl(tmp_path / "cut", InterruptingTask(at=2))
    cut.fit(4)
    assert cut.interrupted and cut.step_count == 2
    out = capsys.readouterr().out
    assert "step 3 was rolled back" in out and "checkpoint step_000002 saved" in out
    cut.fit(4)  # continues in the same process
    assert not cut.interrupted
    assert cut.metrics["loss"].tolist() == full.metrics["loss"].tolist()
    for a, b in zip(full.policy.model.parameters(), cut.policy.model.parameters()):
        assert torch.equal(a, b)
    # the checkpoint saved at the interrupt resumes in a new trainer exactly as well
    again = _rl(
        tmp_path / "cut", ToyTask(), resume=tmp_path / "cut" / "checkpoints" / "step_000002"
    )
    again.fit(4)
    assert again.metrics["loss"].tolist() == full.metrics["loss"].tolist()


def test_rl_ctrl_c_during_the_update_finishes_the_step_then_stops(tmp_path, capsys):
    def interrupt_once(trainer, row):
        if trainer.step_count == 1:
            signal.raise_signal(signal.SIGINT)  # held: the step's row is already recorded

    trainer = _rl(tmp_path / "run", ToyTask(), callbacks=[interrupt_once])
    trainer.fit(3)
    assert trainer.interrupted and trainer.step_count == 1 and len(trainer.metrics) == 1
    assert "stopped after step 1 completed" in capsys.readouterr().out


def test_sft_ctrl_c_saves_a_checkpoint_at_the_last_whole_step(tmp_path):
    model = tiny_model(0)

    def interrupt_at_two(trainer, row):
        if trainer.step_count == 2:
            signal.raise_signal(signal.SIGINT)

    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters()),
        data=sft_loader(10, batch_size=3),
        run_dir=tmp_path,
        checkpoint_every=5,
        progress=False,
        callbacks=[interrupt_at_two],
    )
    trainer.fit(6)
    assert trainer.interrupted and trainer.step_count == 2
    assert (tmp_path / "checkpoints" / "step_000002").is_dir()


def test_a_run_folder_held_by_another_live_process_is_refused(tmp_path):
    holder = textwrap.dedent(f"""
        import sys, time
        from posttrain.core.run_lock import claim_run_dir
        claim_run_dir({str(tmp_path)!r})
        print("held", flush=True)
        time.sleep(600)   # killed below
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        model = tiny_model(0)
        with pytest.raises(
            RunDirInUseError, match=rf"in use by another live process \(pid {proc.pid}"
        ):
            Trainer(
                model,
                torch.optim.AdamW(model.parameters()),
                data=sft_loader(10, batch_size=3),
                run_dir=tmp_path,
                progress=False,
                resume=True,
            )
    finally:
        proc.kill()
        proc.wait()
    model = tiny_model(0)  # the holder is gone (reaped): the folder is free again
    Trainer(
        model,
        torch.optim.AdamW(model.parameters()),
        data=sft_loader(10, batch_size=3),
        run_dir=tmp_path,
        progress=False,
        resume=True,
    )


def test_a_run_folder_the_engine_creates_is_private(tmp_path):
    import os

    old = os.umask(0o002)
    try:
        model = tiny_model(0)
        trainer = Trainer(
            model,
            torch.optim.AdamW(model.parameters()),
            data=sft_loader(10, batch_size=3),
            run_dir=tmp_path / "run",
            checkpoint_every=1,
            progress=False,
        )
        trainer.fit(1)
    finally:
        os.umask(old)
    assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "run" / ".posttrain.lock").stat().st_mode & 0o777 == 0o600


def test_a_budget_stops_fit_at_the_first_step_boundary_past_it(tmp_path):
    """`fit(n, budget_s=B)` checks the summed `step_time_s` of every step so far before each
    step: a budget equal to the first three steps' sum takes none more, a hair above it takes
    exactly one more; the RL trainer passes it through (a budget of 0: no step)."""
    model = tiny_model(0)
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters()),
        data=sft_loader(10, batch_size=3),
        progress=False,
    )
    trainer.fit(3)
    spent = float(trainer.metrics["step_time_s"].sum())
    trainer.fit(50, budget_s=spent)
    assert trainer.step_count == 3
    trainer.fit(50, budget_s=spent + 1e-9)
    assert trainer.step_count == 4
    with pytest.raises(ValueError, match="budget_s=nan"):
        trainer.fit(50, budget_s=float("nan"))
    rl = _rl(tmp_path, ToyTask())
    rl.fit(5, budget_s=0.0)
    assert rl.step_count == 0
