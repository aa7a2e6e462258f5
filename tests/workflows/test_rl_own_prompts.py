"""The RL recipes run from a prompts file alone (`posttrain.workflows.rl_data`): `posttrain run
grpo data.train=prompts.jsonl rewards.funcs=[...]` in one try, the warm start on the rows'
answers (skipped without answers), the held-out rows scored by mean reward and exact match, and
each reward function's mean per step (`reward/<name>`, `posttrain.rl.rollout`)."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from posttrain import cli
from posttrain.envs.prompt_task import PromptGroupBuilder
from posttrain.rewards.functions import RewardFunctions
from posttrain.rl.environment import Trajectory, group_rewards
from posttrain.rl.rollout import rollout_metrics
from posttrain.workflows import override
from posttrain.workflows.rl_config import RL_TINY


def starts_with_digit(completions, answer, **kwargs):
    """1.0 when the completion starts with the answer's first character, else 0.0."""
    return [float(c[:1] == str(a)[:1]) for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    """1 / (1 + number of characters): 1.0 for an empty completion."""
    return [1.0 / (1 + len(c)) for c in completions]


def only_with_answer(completions, **kwargs):
    """Exact match against the "answer" column, None for a row without one (TRL's 'does not
    apply'); raises for a completion of "boom"."""
    answers = kwargs.get("answer") or [None] * len(completions)
    if "boom" in completions:
        raise RuntimeError("boom")
    return [None if a is None else float(c == a) for c, a in zip(completions, answers)]


def _traj(text: str) -> Trajectory:
    return Trajectory(
        group_id=0,
        prompt_ids=[1],
        completion_ids=[2],
        logprobs=[0.0],
        reward=0.0,
        outcome="ok",
        finish_reason="stop",
        text=text,
    )


def test_each_reward_function_mean_and_failures_are_step_metrics():
    """Three groups scored by `short` and `only_with_answer` (weights 1 and 2); by hand:

    group 1, answer "3", texts "3", "33":  short 1/2, 1/3; only_with_answer 1, 0
    group 2, no answer, texts "", "x":     short 1, 1/2;   only_with_answer None, None
    group 3, answer "7", texts "boom", "7": short 1/5, 1/2; only_with_answer raises (2 failures)

    reward/short = (1/2 + 1/3 + 1 + 1/2 + 1/5 + 1/2) / 6 = 3.0333... / 6 = 0.505555...
    reward/only_with_answer = (1 + 0) / 2 = 0.5 (None and failures left out), 2 failures
    reward_mean over the judged samples (group 3 is an error): (1/2 + 2*1, 1/3 + 0, 1, 1/2)
    = (2.5 + 0.3333 + 1 + 0.5) / 4 = 1.083333...
    """
    rewards = RewardFunctions([short, only_with_answer], [1.0, 2.0])
    groups = []
    for row, texts in (
        ({"prompt": "1+2=", "answer": "3"}, ["3", "33"]),
        ({"prompt": "hi"}, ["", "x"]),
        ({"prompt": "3+4=", "answer": "7"}, ["boom", "7"]),
    ):
        builder = PromptGroupBuilder(row, rewards=rewards)
        trajs = [_traj(t) for t in texts]
        for t, r in zip(trajs, group_rewards(builder, trajs)):
            t.reward = r
        groups.append(trajs)
    m = rollout_metrics(groups)
    assert m["reward/short"] == pytest.approx((1 / 2 + 1 / 3 + 1 + 1 / 2 + 1 / 5 + 1 / 2) / 6)
    assert m["reward/only_with_answer"] == 0.5
    assert (m["reward/short/failures"], m["reward/only_with_answer/failures"]) == (0, 2)
    assert m["outcome_error"] == 2
    assert m["reward_mean"] == pytest.approx((2.5 + 1 / 3 + 1 + 1 / 2) / 4)


def test_the_dashboard_shows_each_reward_function_mean():
    """`plot_metrics` of RL rows with per-function columns draws one panel per function mean
    (after the defaults, before held-out columns) and none for the failure counts."""
    from posttrain.notebook import plot_metrics

    rows = pd.DataFrame(
        {
            "step": [1, 2],
            "reward_mean": [0.5, 1.0],
            "reward/short": [0.25, 0.5],
            "reward/short/failures": [0, 1],
            "reward/exact": [0.0, 1.0],
            "reward/exact/failures": [0, 0],
        }
    )
    titles = [ax.get_title() for ax in plot_metrics(rows).axes if ax.get_visible()]
    assert titles == ["reward (mean)", "reward short (mean)", "reward exact (mean)"]


def _rows(n: int, *, answers: bool) -> list[dict]:
    rows = [{"prompt": f"{i % 10} + 1 ="} for i in range(n)]
    if answers:
        for i, r in enumerate(rows):
            r["answer"] = str(i % 10 + 1)
    return rows


def _tiny_args(**changes) -> list[str]:
    tiny = {k: v for k, v in RL_TINY.items() if not k.startswith("task.")}
    return [f"{k}={v}" for k, v in {**tiny, **changes}.items()]


def test_grpo_runs_from_a_prompts_file_with_reward_functions(tmp_path):
    """`posttrain run grpo data.train=FILE rewards.funcs=[a, b]` runs in one try: a warm start
    on the rows' answers, GRPO scored by both functions, the held-out rows (`data.eval_fraction`
    0.25 of 16: 4 rows) scored before, every step (`eval.every`) and after, then the more-SFT
    baseline; each step's `reward/<name>` is that function's mean and reward_mean their
    weighted sum plus the recipe's overlong punishment (no None, no failure); the held-out exact
    match and mean reward are recomputed here from the answers table."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(16, answers=True)))
    funcs = f"[{__name__}:starts_with_digit,{__name__}:short]"
    args = _tiny_args(
        out_dir=tmp_path / "run",
        **{"data.train": path, "data.eval_fraction": 0.25, "rewards.funcs": funcs},
        **{"rewards.weights": "[1.0,0.5]", "baseline.steps": 1, "eval.every": 1},
    )
    cli.main(["run", "grpo", *args])
    run = tmp_path / "run"
    results = json.loads((run / "results.json").read_text())
    assert results["data"]["train_rows"] == 12 and results["data"]["held_out_rows"] == 4
    assert results["data"]["demonstrations"] == 12 and (run / "sft" / "policy").is_dir()
    assert results["sft"]["validation"]["rows"] == 4
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward_mean" in m]
    assert len(steps) == RL_TINY["optim.steps"]
    for m in steps:
        assert m["reward/starts_with_digit/failures"] == m["reward/short/failures"] == 0
        weighted = m["reward/starts_with_digit"] + 0.5 * m["reward/short"]
        # plus the grpo recipe's overlong punishment (1-token buffer): -1 for every sample of
        # max_new_tokens tokens, so at least for every sample cut at the limit
        assert m["overlong_penalty"] <= -m["finish_length_frac"] + 1e-9
        assert m["reward_mean"] == pytest.approx(weighted + m["overlong_penalty"])
    table = pd.read_csv(run / "eval_after_grpo.csv", keep_default_na=False)
    texts, answers = table["completion"].astype(str), table["answer"].astype(str)
    exact = sum(t.strip() == a for t, a in zip(texts, answers)) / len(table)
    by_hand = [float(t[:1] == a[:1]) + 0.5 / (1 + len(t)) for t, a in zip(texts, answers)]
    assert results["after_grpo"]["exact_match"] == pytest.approx(exact)
    assert results["after_grpo"]["reward_mean"] == pytest.approx(sum(by_hand) / len(by_hand))
    assert set(results["difference"]) == {"reward_mean", "exact_match"}
    curve = results["eval_curve"]  # step 0: the warm-started policy, as before_rl
    assert [p["step"] for p in curve] == [0, 1, 2] and (run / "eval_curve.png").is_file()
    assert curve[0]["reward_mean"] == pytest.approx(results["before_rl"]["reward_mean"])
    assert curve[-1]["exact_match"] == pytest.approx(exact)
    assert results["more_sft"]["steps"] == 1 and "rl_minus_more_sft" in results
    assert "mean reward" in (run / "results.md").read_text()


def test_ppo_runs_from_prompts_without_answers_and_skips_the_warm_start(tmp_path):
    """Rows without answers (a .parquet file): no SFT stage, PPO from the fresh model, the
    held-out rows scored by mean reward only, and the more-SFT baseline not run, saying why."""
    path = tmp_path / "prompts.parquet"
    pd.DataFrame(_rows(8, answers=False)).to_parquet(path)
    ppo = cli.load_recipe("ppo")
    args = _tiny_args(
        out_dir=tmp_path / "run",
        **{k: v for k, v in ppo.TINY.items() if k.startswith("rl.")},
        **{"data.train": path, "rewards.funcs": f"[{__name__}:short]", "baseline.steps": 1},
    )
    cli.main(["run", "ppo", *args])
    run = tmp_path / "run"
    results = json.loads((run / "results.json").read_text())
    assert results["sft"] is None and results["sft_steps"] == 0 and not (run / "sft").exists()
    assert "exact_match" not in results["after_ppo"]
    assert not math.isnan(results["after_ppo"]["reward_mean"])
    assert results["more_sft_skipped"] == "no training row has an answer to imitate"


def test_own_prompts_without_reward_functions_are_refused_by_name(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "1 + 1 ="}) + "\n")
    with pytest.raises(SystemExit) as refused:
        cli.main(["run", "grpo", *_tiny_args(out_dir=tmp_path / "run", **{"data.train": path})])
    assert refused.value.code == 2
    assert "Config.rewards.funcs=[]; must be at least one" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    cfg = cli.load_recipe("grpo").Config()
    with pytest.raises(ValueError, match=r"Config\.data\.train='rows\.xlsx'"):
        override(cfg, {"data.train": "rows.xlsx"})


def test_a_prompt_longer_than_the_model_holds_is_refused_before_the_run(tmp_path, capsys):
    """A training prompt of 5000 bytes leaves tiny-1m no room for sampling.max_new_tokens: the
    field is named, with the prompt's length, and no run folder is made."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "x" * 5000, "answer": "1"}) + "\n")
    args = _tiny_args(
        out_dir=tmp_path / "run",
        **{"data.train": path, "rewards.funcs": f"[{__name__}:short]", "data.eval_fraction": 0.0},
    )
    with pytest.raises(SystemExit) as refused:
        cli.main(["run", "grpo", *args])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "Config.sampling.max_new_tokens=4; must be at most" in err
    assert "the longest training prompt has" in err and not (tmp_path / "run").exists()
