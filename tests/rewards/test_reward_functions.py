"""Reward functions as Python callables (posttrain.rewards.functions, posttrain.envs.prompt_task):
TRL's convention run unchanged, the per-sample form, import paths, and every way a function can
fail becoming a typed outcome that names it."""

from __future__ import annotations

import math
import pickle
from types import SimpleNamespace

import pytest

from posttrain.envs import PromptGroupBuilder, PromptTask
from posttrain.rewards.functions import RewardFunctions, load_reward, per_sample
from posttrain.rl.environment import Trajectory, group_rewards

# --- reward functions written for TRL's GRPOTrainer, used unchanged ---------------------------


def accuracy(completions, answer, **kwargs):
    """1.0 when the completion is the answer; None (not applicable) for a row without one."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [None if a is None else float(t.strip() == a) for t, a in zip(texts, answer)]


def brevity(prompts, completions, completion_ids, log_metric, **kwargs):
    """0.5 for a completion of at most 2 tokens, else 0.0; logs a metric as TRL allows."""
    log_metric("brevity/calls", 1.0)
    return [0.5 if len(ids) <= 2 else 0.0 for ids in completion_ids]


def _trl_rewards(funcs, weights, rows, completions, completion_ids):
    """TRL 1.16's own reward computation: `GRPOTrainer._calculate_rewards` on a stand-in trainer,
    then its weighted sum (`(rewards_per_func * reward_weights).nansum(dim=1)`, NaN where every
    function returned None)."""
    import torch
    from accelerate import PartialState
    from trl.trainer.grpo_trainer import GRPOTrainer

    PartialState()  # single process; TRL's gather and logger need the state
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        args=SimpleNamespace(report_to=[]),
        state=SimpleNamespace(global_step=0),
        reward_funcs=funcs,
        reward_processing_classes=[None] * len(funcs),
        reward_func_names=[f.__name__ for f in funcs],
        _log_completion_extra=lambda *a, **k: None,
        _log_metric=lambda *a, **k: None,
        environments=None,
    )
    prompts = [row["prompt"] for row in rows]
    per_func = GRPOTrainer._calculate_rewards(trainer, rows, prompts, completions, completion_ids)
    total = (per_func * torch.tensor(weights)).nansum(dim=1)
    total[torch.isnan(per_func).all(dim=1)] = torch.nan
    return total.tolist()


@pytest.mark.parametrize("conversational", [False, True])
def test_a_trl_reward_function_gives_trls_rewards_unchanged(conversational):
    """Weights 2 and 1. By hand, answer "3" for rows 0-2, None for row 3:
    "3" (1 token): 2*1 + 0.5 = 2.5;  "4" (1 token): 0 + 0.5 = 0.5;  " 3 " (3 tokens): 2*1 + 0 = 2;
    row 3 "7" (3 tokens): accuracy None -> left out, brevity 0.0 -> 0.0."""
    prompt = [{"role": "user", "content": "1+2="}] if conversational else "1+2="
    texts = ["3", "4", " 3 ", "7"]
    answers = ["3", "3", "3", None]
    ids = [[51], [52], [32, 51, 32], [55, 1, 1]]
    rows = [{"prompt": prompt, "answer": a, "level": 1} for a in answers]
    completions = (
        [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    )
    trl = _trl_rewards([accuracy, brevity], [2.0, 1.0], rows, completions, ids)
    ours = RewardFunctions([accuracy, brevity], [2.0, 1.0]).score(
        [prompt] * 4, completions, {"answer": answers, "level": [1] * 4}, completion_ids=ids
    )
    assert trl == [2.5, 0.5, 2.0, 0.0]
    assert [r.score for r in ours] == trl
    assert [r.outcome.value for r in ours] == ["ok", "wrong", "ok", "wrong"]
    # the same records through the task's group scoring (one group per record)
    builder = PromptGroupBuilder(rows[0], RewardFunctions([accuracy, brevity], [2.0, 1.0]))
    trajs = [_trajectory(t, i) for t, i in zip(texts[:3], ids[:3])]
    assert group_rewards(builder, trajs) == trl[:3]


def test_every_function_returning_none_is_unscorable_in_both():
    """TRL marks such a completion NaN (left out of its group's baseline); here it is an error
    outcome that names the functions, which the trainer counts and excludes."""
    rows = [{"prompt": "q", "answer": None}]
    assert math.isnan(_trl_rewards([accuracy], [1.0], rows, ["x"], [[1]])[0])
    [ours] = RewardFunctions([accuracy]).score(["q"], ["x"], {"answer": [None]})
    assert ours.outcome.value == "error" and "every reward function (accuracy)" in ours.reason


def _trajectory(text, ids=(1,), outcome="ok"):
    return Trajectory(
        group_id=0,
        prompt_ids=[1],
        completion_ids=list(ids),
        logprobs=[0.0] * len(ids),
        reward=0.0,
        outcome=outcome,
        finish_reason="stop",
        text=text,
    )


def test_per_sample_form_equals_the_batch_form():
    def exact(prompt, completion, answer, **row):
        return float(completion == answer) + row["bonus"]

    columns = {"answer": ["3", "3", "5"], "bonus": [0.0, 0.25, 0.5]}
    [a, b] = [
        [r.score for r in RewardFunctions([fn]).score(["q"] * 3, ["3", "4", "5"], columns)]
        for fn in (
            per_sample(exact),
            lambda completions, answer, bonus, **kw: [
                float(c == a) + x for c, a, x in zip(completions, answer, bonus)
            ],
        )
    ]
    assert a == b == [1.0, 0.25, 1.5]
    with pytest.raises(TypeError, match="per_sample needs a callable"):
        per_sample("exact")


def _raises(completions, **kwargs):
    raise KeyError("answer_column")


@pytest.mark.parametrize(
    "fn, reason",
    [
        (_raises, "reward function _raises raised KeyError: 'answer_column'"),
        (lambda completions, **kw: [1.0], "returned 1 rewards; expected a list of 2"),
        (lambda completions, **kw: 1.0, "returned a float; expected a list of 2"),
        (lambda completions, **kw: "10", "returned a str; expected a list of 2"),
        (lambda completions, **kw: [float("nan"), 1.0], "must be a finite number"),
        (lambda completions, **kw: [1e39, 1.0], "within float32 range"),
        (lambda completions, **kw: ["1", 1.0], "must be a real number, got str"),
    ],
)
def test_a_failing_function_is_a_typed_outcome_naming_it(fn, reason):
    """Never a silent 0.0: the failing completion's outcome is error with the reason; the
    second completion keeps its reward when only the first value was bad."""
    results = RewardFunctions([fn]).score(["q", "q"], ["a", "b"], {})
    assert results[0].outcome.value == "error" and reason in results[0].reason
    assert "reward function" in results[0].reason
    per_value = "finite" in reason or "real number" in reason or "float32" in reason
    assert (results[1].outcome.value, results[1].score) == (
        ("ok", 1.0) if per_value else ("error", 0.0)
    )


def test_weights_and_entries_are_checked_by_name():
    with pytest.raises(ValueError, match=r"2 entries for 1 reward functions \(accuracy\)"):
        RewardFunctions([accuracy], [1.0, 2.0])
    with pytest.raises(ValueError, match="reward weight 0 must be a finite number"):
        RewardFunctions([accuracy], [float("nan")])
    with pytest.raises(TypeError, match="reward function 1 must be a callable"):
        RewardFunctions([accuracy, 3])
    with pytest.raises(ValueError, match="at least one"):
        RewardFunctions([])


def test_load_reward_resolves_import_paths_and_names_what_is_wrong():
    assert load_reward(f"{__name__}:accuracy") is accuracy
    assert RewardFunctions([f"{__name__}:accuracy"]).names == ["accuracy"]
    for path, error, match in [
        ("accuracy", ValueError, "must be 'package.module:function'"),
        ("no_such_pkg.rewards:fn", ValueError, "module 'no_such_pkg.rewards' does not import"),
        (f"{__name__}:missing", ValueError, "has no attribute 'missing'"),
        ("posttrain.rewards.outcome:FLOAT32_MAX", TypeError, "is a float, not a callable"),
    ]:
        with pytest.raises(error, match=match):
            load_reward(path)


def test_prompt_task_rows_split_pickle_and_refuse_bad_records():
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    task = PromptTask(rows, rewards=[f"{__name__}:accuracy"], held_out_size=2)
    assert len(task) == 3 and [r["answer"] for r in task.held_out()] == ["4", "5"]
    assert [b.row["answer"] for b in task.builders(1, 2)] == ["3", "1"]  # rows 2, 3 mod 3
    again = pickle.loads(pickle.dumps(task))
    assert [b.row for b in again.builders(0, 3)] == rows[:3]
    assert task.score_fn()("2", rows[1]) == 1.0
    with pytest.raises(ValueError, match=r"prompt row 1: column 'prompt' must be a non-empty"):
        PromptTask([rows[0], {"question": "x"}], rewards=[accuracy])
    with pytest.raises(ValueError, match=r"held_out_size must be an int in 0 \.\. 4"):
        PromptTask(rows, rewards=[accuracy], held_out_size=5)


def test_a_failed_episode_keeps_its_outcome_and_is_not_scored():
    calls = []

    def count(completions, **kwargs):
        calls.append(len(completions))
        return [1.0] * len(completions)

    builder = PromptGroupBuilder({"prompt": "q"}, RewardFunctions([count]))
    trajs = [_trajectory("a"), _trajectory("", outcome="timeout")]
    assert group_rewards(builder, trajs) == [1.0, 0.0]
    assert [t.outcome for t in trajs] == ["ok", "timeout"] and calls == [1]


def test_prompt_task_reads_a_prompts_file(tmp_path):
    """A JSONL file of prompt/answer rows becomes the task's records, answers reaching the
    reward functions; a missing file is refused."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    task = PromptTask(str(path), rewards=[accuracy], held_out_size=1)
    assert task.train_items == [{"prompt": "1+1=", "answer": "2"}]
    assert task.score_fn()("4", task.held_out()[0]) == 1.0
    with pytest.raises(FileNotFoundError):
        PromptTask(str(tmp_path / "missing.jsonl"), rewards=[accuracy])


def test_a_raising_function_in_a_rollout_is_an_error_outcome_on_its_group(tiny_policy):
    """Sampled by a real policy: the group whose function raised is outcome error with the
    reason on each trajectory (what RLTrainer counts and excludes), not a crash or 0.0 rewards
    that look scored."""
    from posttrain.rl import collect_groups

    task = PromptTask([{"prompt": "1+2=", "answer": "3"}], rewards=[_raises])
    [group] = collect_groups(
        tiny_policy, task.builders(0, 1), group_size=2, max_new_tokens=2, seed=0
    )
    assert group.outcomes == ["error", "error"]
    assert all("_raises raised KeyError" in t.info["verifier_reason"] for t in group)


def test_prompt_task_held_out_rows_go_to_evaluate_generations_and_a_failure_is_not_a_score():
    """`evaluate_generations(policy, task.held_out(), score_fn=task.score_fn())` as the docs say:
    the held-out rows hold their prompt as "question" (they were refused: no string 'question'),
    and a reward function that raises on a held-out completion stops the scoring with its outcome
    instead of scoring 0.0."""
    from posttrain.policy import Policy
    from posttrain.rewards.evaluation import evaluate_generations

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)]
    task = PromptTask(rows, rewards=[accuracy], held_out_size=2)
    held_out = task.held_out()
    assert [r["question"] for r in held_out] == ["2+1=", "3+1="]
    assert [r["prompt"] for r in task.held_out()] == ["2+1=", "3+1="]  # rows are copies
    policy = Policy.from_spec("tiny-1m", seed=0)
    result = evaluate_generations(policy, held_out, score_fn=task.score_fn(), max_new_tokens=2)
    expected = [
        float(c.strip() == r["answer"]) for c, r in zip(result.table["completion"], rows[2:])
    ]
    assert result.num_items == 2 and list(result.table["score"]) == expected

    def broken(completions, **kwargs):
        raise RuntimeError("no")

    failing = PromptTask(rows, rewards=[broken], held_out_size=2)
    with pytest.raises(ValueError, match="outcome 'error'.*a failure is not a score"):
        failing.score_fn()("3", failing.held_out()[0])
