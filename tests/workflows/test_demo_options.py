"""Demonstrations that cover only part of a task (`task.demo_options`): the SFT rows come from
that slice, while the held-out items and the RL prompts come from `task.options`, and a run's
results and lineage say so. Word lengths are read off the texts themselves."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from posttrain import cli
from posttrain.workflows import override
from posttrain.workflows.lineage import data_lineage
from posttrain.workflows.task_data import build_dataset, held_out_items, training_task

LONG = {"min_word_len": 6, "max_word_len": 6}
SHORT = {"min_word_len": 3, "max_word_len": 3}


def _word(question: str) -> str:
    """The word of a spell_backward question ("Spell this word backward (...): bird")."""
    return question.rsplit(": ", 1)[1]


def _config(recipe: str):
    module = cli.load_recipe(recipe)
    return override(
        module.Config(),
        {
            **module.TINY,
            "task.name": "spell_backward",
            "task.options": LONG,
            "task.demo_options": SHORT,
            "task.train_size": 60,
            "task.eval_size": 12,
        },
    )


@pytest.fixture(scope="module")
def cfg():
    return _config("grpo")


def _answers(cfg) -> list[str]:
    """The trained (labelled) text of every SFT sample of `cfg` (an SFT config)."""
    tokenizer = cfg.model.tokenizer()
    dataset, _ = build_dataset(cfg, tokenizer, set())
    return [
        tokenizer.decode([int(t) for t in s.labels if t != -100]).strip() for s in dataset.samples
    ]


def test_sft_rows_come_from_the_demo_slice_and_held_out_items_from_the_task(cfg):
    answers = _answers(_config("sft"))
    assert len(answers) == 60 and {len(a) for a in answers} == {3}
    items, _ = held_out_items(cfg.task)
    assert len(items) == 12 and {len(_word(it["question"])) for it in items} == {6}
    task = training_task(cfg, size=40, seed=cfg.seed)
    assert {len(_word(it["question"])) for it in task.train_items} == {6}


def test_without_demo_options_the_demonstrations_are_the_task():
    plain = override(_config("sft"), {"task.demo_options": None})
    assert {len(a) for a in _answers(plain)} == {6}


def test_lineage_and_results_name_the_demonstrations_slice(cfg, tmp_path):
    spec = data_lineage(cfg)
    assert spec["options"] == LONG and spec["demo_options"] == SHORT
    assert "demo_options" not in data_lineage(override(cfg, {"task.demo_options": None}))
    module = cli.load_recipe("grpo")
    run = override(cfg, {"out_dir": str(tmp_path / "run"), "baseline.steps": 0})
    module.main(run)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["task_config"] == LONG and results["demo_config"] == SHORT
    for stage in ("sft/eval_after.csv", "eval_after_rl.csv"):  # the held-out items: long words
        questions = pd.read_csv(tmp_path / "run" / stage)["question"]
        assert len(questions) == 12 and {len(_word(q)) for q in questions} == {6}, stage
    assert "demonstrations (SFT rows) from" in (tmp_path / "run" / "results.md").read_text()
