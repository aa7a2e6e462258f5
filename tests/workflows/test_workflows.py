"""A recipe run as a whole: Ctrl-C inside the SFT warm start stops the run there (a checkpoint,
results marked interrupted, no RL stage, exit code 130), `resume=true` continues it to the same
end as an uninterrupted run, and a resume whose config differs is refused by name."""

import json
import signal

import pytest
import torch

from posttrain import cli
from posttrain.train.trainer import Trainer
from posttrain.workflows import RunInterrupted, override


def _grpo(out, **changes):
    module = cli.load_recipe("grpo")
    changes = {**module.TINY, "sft.steps": 4, "out_dir": str(out), **changes}
    return module, override(module.Config(), changes)


@pytest.fixture
def ctrl_c_at_sft_step_3(monkeypatch):
    """A real SIGINT, once, as the SFT trainer starts its 3rd step."""
    step, fired = Trainer.step, []

    def step_with_ctrl_c(self):
        if self.step_count == 2 and not fired:
            fired.append(True)
            signal.raise_signal(signal.SIGINT)
        return step(self)

    monkeypatch.setattr(Trainer, "step", step_with_ctrl_c)
    return fired


def test_ctrl_c_in_the_warm_start_stops_the_run_and_resume_finishes_it_exactly(
    tmp_path, ctrl_c_at_sft_step_3, monkeypatch
):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module, cfg = _grpo(tmp_path / "cut")
        with pytest.raises(RunInterrupted, match="interrupted after step 2 of 4"):
            module.main(cfg)
        sft = tmp_path / "cut" / "sft"
        results = json.loads((sft / "results.json").read_text())
        assert results["interrupted"] is True and results["steps_done"] == 2
        assert (sft / "checkpoints" / "step_000002").is_dir()
        assert not (tmp_path / "cut" / "results.json").exists()  # no RL stage ran
        assert not (tmp_path / "cut" / "metrics.jsonl").exists()

        monkeypatch.undo()
        module, cfg = _grpo(tmp_path / "cut", resume=True)
        resumed = module.main(cfg)
        module, cfg = _grpo(tmp_path / "full")
        full = module.main(cfg)
    finally:
        torch.set_num_threads(threads)
    assert resumed["after_sft"] == full["after_sft"] and resumed["after_grpo"] == full["after_grpo"]
    assert resumed["before_sft"] == full["before_sft"]
    read = lambda run: [
        json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
    assert read(tmp_path / "cut") == read(tmp_path / "full")
    assert read(tmp_path / "cut" / "sft") == read(tmp_path / "full" / "sft")


def test_the_command_line_exits_130_on_ctrl_c(tmp_path, ctrl_c_at_sft_step_3, capsys):
    module = cli.load_recipe("grpo")
    args = [f"{k}={v}" for k, v in {**module.TINY, "sft.steps": 4}.items()]
    assert cli.main(["run", "grpo", *args, f"out_dir={tmp_path / 'run'}"]) == 130
    err = capsys.readouterr().err
    assert "interrupted after step 2 of 4" in err
    assert f"continue it with: posttrain resume {tmp_path / 'run'}" in err


def test_a_resume_with_another_setting_is_refused_naming_it(tmp_path):
    module, cfg = _grpo(tmp_path / "run")
    module.main(cfg)
    module, cfg = _grpo(tmp_path / "run", resume=True, **{"optim.lr": 5e-4})
    with pytest.raises(
        ValueError,
        match=r"resume: .*config.json has optim.lr=0.0002, this run "
        r"has optim.lr=0.0005",
    ):
        module.main(cfg)
    module, cfg = _grpo(tmp_path / "run", resume=True, progress=True, **{"checkpoint.every": 2})
    module.main(cfg)  # progress and checkpointing may change


def test_an_init_from_tokenizer_that_turns_the_task_into_unk_is_refused_before_any_work(tmp_path):
    from types import SimpleNamespace

    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from posttrain.workflows import TaskConfig, check_tokenizer_covers_task

    letters = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz", start=2)}
    backend = Backend(models.WordLevel({"[UNK]": 0, "</s>": 1, **letters}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    folder = tmp_path / "policy"
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "unk_token": "[UNK]"})
    )
    cfg = SimpleNamespace(model=SimpleNamespace(init_from=str(folder)), task=TaskConfig())
    with pytest.raises(
        ValueError,
        match=r"Config.model.init_from=.*turns \d+% of the task's "
        r"tokens into the unknown token",
    ):
        check_tokenizer_covers_task(cfg)
    # the same vocabulary with digits, space and punctuation covers chain_sum: it passes
    more = {c: i for i, c in enumerate(" 0123456789+-=:.,?ABCDEFGHIJKLMNOPQRSTUVWXYZ", start=28)}
    backend = Backend(
        models.WordLevel({"[UNK]": 0, "</s>": 1, **letters, **more}, unk_token="[UNK]")
    )
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.save(str(folder / "tokenizer.json"))
    check_tokenizer_covers_task(cfg)


def test_sampled_pass_at_k_of_the_rl_run_is_read_from_its_answer_tables(tmp_path):
    """The results' sampled pass@1 / pass@k recomputed from the saved answers (one row per
    answer: item, sample, correct), and the answers rescored with the task's own scorer."""
    import pandas as pd

    from posttrain.workflows.sft import held_out_items

    module, cfg = _grpo(tmp_path / "run", **{"eval.samples": 3, "sft.steps": 2})
    results = module.main(cfg)
    items, ds = held_out_items(cfg.task)
    for stage in ("sft", "grpo"):
        table = pd.read_csv(
            tmp_path / "run" / f"eval_sampled_after_{stage}.csv", keep_default_na=False
        )
        assert len(table) == 3 * len(items) and sorted(set(table["sample"])) == [0, 1, 2]
        rescored = [
            ds.score_answer(str(c).strip(), items[i]) >= 1.0
            for c, i in zip(table["completion"], table["item"])
        ]
        assert rescored == table["correct"].tolist()
        per_item = table.groupby("item")["correct"]
        got = results[f"sampled_after_{stage}"]
        assert got["pass_at_1"] == pytest.approx(per_item.mean().mean())
        assert got["pass_at_k"] == pytest.approx(per_item.any().mean()) and got["k"] == 3
    assert results["sampled_difference"]["difference"] == pytest.approx(
        results["sampled_after_grpo"]["pass_at_1"] - results["sampled_after_sft"]["pass_at_1"]
    )


def test_a_small_warm_start_trains_on_the_first_demonstrations_and_rl_on_the_whole_pool(tmp_path):
    """`sft.demonstrations=N`: the SFT stage's rows are the first N items of the task (minus
    held-out questions), the same items that open the RL stage's larger prompt pool."""
    import json

    from posttrain.data import reasoning_gym_sft_rows
    from posttrain.envs import ReasoningGymTask

    module, cfg = _grpo(tmp_path / "run", **{"sft.demonstrations": 5, "sft.steps": 2})
    module.main(cfg)
    sft = json.loads((tmp_path / "run" / "sft" / "results.json").read_text())
    task = ReasoningGymTask(
        name=cfg.task.name,
        size=cfg.task.train_size,
        seed=cfg.seed,
        config=dict(cfg.task.options),
        held_out_size=cfg.task.eval_size,
        held_out_seed=cfg.task.eval_seed,
    )
    pool = [item["question"] for item in task.train_items]
    first = [
        r["messages"][0]["content"]
        for r in reasoning_gym_sft_rows(cfg.task.name, size=5, seed=cfg.seed, **cfg.task.options)
    ]
    held = {it["question"] for it in task.held_out()}
    kept = [q for q in first if q not in held]
    assert sft["data"]["rows"] == len(kept) <= 5 < len(pool)
    assert pool[: len(kept)] == kept
