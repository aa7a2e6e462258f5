"""The main job's held-out curve during RL and its honest baseline (more SFT on the same
demonstrations), from `posttrain.workflows.rl`, at tiny size."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
import torch

from posttrain import cli
from posttrain.policy import Policy
from posttrain.rewards.evaluation import evaluate_generations, evaluate_sampled, wilson_interval
from posttrain.workflows import override
from posttrain.workflows.rl import HeldOutCurve
from posttrain.workflows.sft import held_out_items

_TIMING = ("time", "_per_s", "mfu", "_s")


def _run(tmp_path, name, **changes):
    module = cli.load_recipe("grpo")
    cfg = override(
        module.Config(),
        {
            **module.TINY,
            "sft.steps": 6,
            "optim.steps": 4,
            "eval.every": 2,
            "baseline.steps": 3,
            "sft.demonstrations": 40,
            "out_dir": str(tmp_path / name),
            **changes,
        },
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cfg, module.main(cfg)
    finally:
        torch.set_num_threads(threads)


def _behaviour(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not any(w in k for w in _TIMING)} for row in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("main_job")
    with_curve = _run(tmp, "curve")
    without = _run(tmp, "plain", **{"eval.every": 0, "baseline.steps": 0})
    return tmp, with_curve, without


def test_the_curve_and_the_baseline_do_not_change_the_rl_run(runs):
    tmp, (_, curved), (_, plain) = runs
    assert _behaviour(tmp / "curve") == _behaviour(tmp / "plain")
    assert curved["after_grpo"] == plain["after_grpo"]
    assert "eval_curve" not in plain and "more_sft" not in plain
    assert not (tmp / "plain" / "more_sft").exists()


def test_the_curve_starts_at_the_sft_policy_and_ends_at_the_final_evaluation(runs):
    tmp, (cfg, results), _ = runs
    curve = pd.read_csv(tmp / "curve" / "eval_curve.csv")
    assert curve["step"].tolist() == [0, 2, 4]
    assert results["eval_curve"] == curve.to_dict("records")
    final = pd.read_csv(tmp / "curve" / "eval_after_rl.csv")["correct"]
    assert curve["accuracy"].iloc[-1] == final.mean()
    after_sft = pd.read_csv(tmp / "curve" / "sft" / "eval_after.csv")["correct"]
    assert curve["accuracy"].iloc[0] == after_sft.mean()
    assert (curve["num_items"] == cfg.task.eval_size).all()
    assert (tmp / "curve" / "eval_curve.png").stat().st_size > 0
    assert "Held-out greedy accuracy during GRPO" in (tmp / "curve" / "results.md").read_text()


def test_the_baseline_continues_the_sft_policy_and_is_compared_paired(runs):
    tmp, (cfg, results), _ = runs
    run = tmp / "curve"
    saved = json.loads((run / "more_sft" / "config.json").read_text())
    assert saved["model"]["init_from"] == str(run / "sft" / "policy")
    assert (saved["optim"]["steps"], saved["optim"]["lr"]) == (3, cfg.baseline.lr)
    # the same demonstrations as the warm start: its first 40 items, not the RL pool of 64
    assert saved["task"] == json.loads((run / "sft" / "config.json").read_text())["task"]
    assert (saved["task"]["train_size"], cfg.task.train_size) == (40, 64)

    # scored again here, from the saved policy: the same greedy answers and sampled pass@1
    items, ds = held_out_items(cfg.task)
    score = lambda text, item: ds.score_answer(text.strip(), item)
    policy = Policy.from_pretrained(run / "more_sft" / "policy")
    greedy = evaluate_generations(
        policy, items, score_fn=score, max_new_tokens=cfg.eval.max_new_tokens
    )
    assert results["more_sft"]["accuracy"] == greedy.accuracy
    sampled = evaluate_sampled(
        policy,
        items,
        score_fn=score,
        samples=cfg.eval.samples,
        seed=cfg.seed + 1,
        max_new_tokens=cfg.eval.max_new_tokens,
    )
    assert results["sampled_after_more_sft"]["pass_at_1"] == sampled.pass_at_1

    rl = pd.read_csv(run / "eval_after_rl.csv")["correct"].to_numpy()
    assert results["rl_minus_more_sft"]["difference"] == pytest.approx(
        rl.mean() - greedy.table["correct"].to_numpy().mean()
    )
    rl_sampled = pd.read_csv(run / "eval_sampled_after_grpo.csv")
    rl_pass1 = rl_sampled.groupby("item")["correct"].mean().mean()
    assert results["rl_minus_more_sft_sampled"]["difference"] == pytest.approx(
        rl_pass1 - sampled.pass_at_1
    )
    steps = [
        json.loads(line) for line in (run / "more_sft" / "metrics.jsonl").read_text().splitlines()
    ]
    assert results["more_sft"]["train_s"] == pytest.approx(sum(r["step_time_s"] for r in steps))
    rl_steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert results["rl_train_s"] == pytest.approx(sum(r["step_time_s"] for r in rl_steps))
    assert "more SFT steps instead" in (run / "results.md").read_text()


def test_a_baseline_that_fails_leaves_the_rl_results_written(tmp_path):
    """The more-SFT stage runs after the RL results are on disk: a diverging baseline raises,
    and the RL run's results (its policy, evaluations and tables) are there to read."""
    from posttrain.train.losses import NonFiniteLossError

    with pytest.raises(NonFiniteLossError):
        _run(tmp_path, "diverges", **{"baseline.lr": 1e9, "eval.every": 0})
    results = json.loads((tmp_path / "diverges" / "results.json").read_text())
    final = pd.read_csv(tmp_path / "diverges" / "eval_after_rl.csv")["correct"]
    assert results["after_grpo"]["accuracy"] == final.mean()
    assert "more_sft" not in results and (tmp_path / "diverges" / "policy").is_dir()


class _FirstLetterScorer:
    """Full credit when the answer starts with one of `letters`: a score a tiny untrained policy
    gets on some items and not others, so the curve's values are not all 0."""

    def __init__(self, letters: str) -> None:
        self.letters = letters

    def score_answer(self, text, item) -> float:
        return float(bool(text) and text[0] in self.letters)


def test_a_curve_point_is_the_greedy_accuracy_of_the_policy_at_that_step(tmp_path):
    policy = Policy.from_spec("tiny-1m", seed=0)
    items = [{"question": f"say {w}", "answer": w} for w in ("ab", "cd", "ef", "gh", "ij", "kl")]
    direct = evaluate_generations(policy, items, max_new_tokens=3, score_fn=lambda t, it: 1.0)
    letters = "".join(sorted({c[0] for c in direct.table["completion"].str.strip() if c}))[:3]
    scorer = _FirstLetterScorer(letters)
    expected = evaluate_generations(
        policy, items, max_new_tokens=3, score_fn=lambda t, it: scorer.score_answer(t.strip(), it)
    )
    curve = HeldOutCurve(
        policy, items, scorer, every=5, max_new_tokens=3, path=tmp_path / "curve.csv"
    )
    curve.start(0, {"accuracy": 0.5, "ci_low": 0.1, "ci_high": 0.9, "num_items": 6})
    trainer = type("T", (), {"step_count": 3, "target_steps": 10})()
    alone = HeldOutCurve(
        policy, items, scorer, every=3, max_new_tokens=3, path=tmp_path / "alone.csv"
    )
    alone(trainer, {})  # without start(): the file gets its header first
    assert [r["step"] for r in alone.rows()] == [3]
    curve(trainer, {})  # not a multiple of 5, not the last step: nothing
    trainer.step_count = 5
    curve(trainer, {})
    rows = curve.rows()
    assert [r["step"] for r in rows] == [0, 5]
    k = int(expected.table["correct"].sum())
    assert 0 < k < len(items)
    assert rows[1]["accuracy"] == k / len(items)
    assert (rows[1]["ci_low"], rows[1]["ci_high"]) == pytest.approx(wilson_interval(k, len(items)))

    # a resumed run from step 0 drops the points it will take again, keeps step 0's
    curve.start(0, {"accuracy": 0.5, "ci_low": 0.1, "ci_high": 0.9, "num_items": 6})
    assert [r["step"] for r in curve.rows()] == [0]


def test_a_curve_needs_a_positive_interval(tmp_path):
    policy = Policy.from_spec("tiny-1m", seed=0)
    for every in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="every"):
            HeldOutCurve(policy, [], None, every=every, max_new_tokens=2, path=tmp_path / "c.csv")


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"baseline.steps": -1}, "baseline.steps"),
        ({"baseline.lr": 0.0}, "baseline.lr"),
        ({"eval.every": -2}, "eval.every"),
        ({"parallel.dp_shard": 2, "eval.every": 5, "baseline.steps": 0}, "eval.every"),
        ({"parallel.dp_shard": 2, "eval.every": 0, "baseline.steps": 10}, "baseline.steps"),
    ],
)
def test_bad_curve_and_baseline_settings_are_refused_by_name(changes, field):
    module = cli.load_recipe("grpo")
    with pytest.raises(ValueError, match=re.escape(f"Config.{field}=")):
        override(module.Config(), changes)
