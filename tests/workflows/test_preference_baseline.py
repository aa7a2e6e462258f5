"""The DPO-family run as an equal-compute baseline: `eval.samples` adds sampled pass@1 / pass@k
of the start and the trained policy (as the RL and RFT runs measure theirs), and `budget_s`
bounds the pairs' sampling, the reference log-probs and the training steps together."""

from __future__ import annotations

import pandas as pd
import pytest

from posttrain import cli
from posttrain.workflows import override
from posttrain.workflows.preference import PreferenceRunConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sampled_evaluation_and_a_budget_in_a_tiny_dpo_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = cli.load_recipe("dpo")
    tiny = {**module.TINY, "eval.samples": 3}
    cfg = override(module.Config(), {**tiny, "budget_s": 1e6, "out_dir": str(tmp_path / "a")})
    results = module.main(cfg)
    items = tiny["task.eval_size"]
    assert results["steps"] == tiny["optim.steps"]  # the budget is far away
    for stage in ("sft", "dpo"):
        table = pd.read_csv(tmp_path / "a" / f"eval_sampled_after_{stage}.csv")
        assert len(table) == items * 3 and table["item"].nunique() == items
        per_item = table.groupby("item")["correct"]
        assert results[f"sampled_after_{stage}"]["pass_at_1"] == pytest.approx(
            per_item.mean().mean()
        )
        assert results[f"sampled_after_{stage}"]["pass_at_k"] == pytest.approx(
            per_item.max().mean()
        )
    markdown = (tmp_path / "a" / "results.md").read_text()
    assert "| held-out (sampled, T=1, 3 answers each) | pass@1 | pass@3 |" in markdown
    assert "DPO minus SFT, sampled pass@1" in markdown

    # a budget that the pairs' sampling alone uses up: named, before any step
    spent = override(
        module.Config(),
        {**tiny, "model.init_from": str(tmp_path / "a" / "policy"), "budget_s": 1e-3,
         "out_dir": str(tmp_path / "b")},
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"budget_s=0.001 was spent before the first step"):
        module.main(spent)
    assert not (tmp_path / "b" / "results.json").exists()


@pytest.mark.parametrize(
    "overrides, allowed",
    [
        ({"budget_s": 0.0}, "budget_s"),
        ({"budget_s": float("inf")}, "budget_s"),
        ({"eval.samples": -1}, "eval.samples"),
        ({"budget_s": 10.0, "parallel.dp_shard": 2}, "None under a parallel plan"),
    ],
)
def test_bad_budget_and_samples_are_refused_by_name(overrides, allowed):
    with pytest.raises(ValueError, match=allowed):
        override(PreferenceRunConfig(), overrides)
