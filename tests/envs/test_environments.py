"""Environments: protocols, single-turn reasoning-gym episodes, picklable builders, tasks with
disjoint held-out items, the multi-turn calculator env (scripted policies, no model), the
trajectory records and the task registry."""

import doctest
import functools
import importlib
import pickle

import cloudpickle
import pytest

from posttrain.envs import (
    CalculatorEnv,
    CalculatorGroupBuilder,
    ReasoningGymEnv,
    ReasoningGymGroupBuilder,
    ReasoningGymTask,
    calculator_result,
    calculator_task,
    chain_sum_task,
    evaluate_arithmetic,
    get_task,
    register_task,
    registered_tasks,
)
from posttrain.rewards import Outcome
from posttrain.rl.environment import (
    EnvDataset,
    EnvGroupBuilder,
    Environment,
    Group,
    StepResult,
    Trajectory,
    group_rewards,
    run_text_episode,
)
from posttrain.verifiers import MathAnswerVerifier

ITEM = {
    "question": "State the final answer to the following arithmetic problem: 4 - 1 =",
    "answer": "3",
    "metadata": {"source_dataset": "chain_sum"},
}
PICKLERS = [(pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)]


@pytest.fixture(scope="module")
def small_task():
    return chain_sum_task(size=300, seed=5, held_out_size=40)


# --------------------------------------------------------------------------------------------
# Single-turn reasoning-gym environments
# --------------------------------------------------------------------------------------------


def test_single_turn_episode_is_done_on_the_first_step_with_the_verified_reward():
    (env,) = ReasoningGymGroupBuilder(ITEM, "chain_sum").make_envs(1)
    assert isinstance(env, Environment)
    assert env.initial_messages() == [{"role": "user", "content": ITEM["question"]}]
    result = env.step(" 3 ")
    assert result.done and result.reward == 1.0 and result.observation is None
    assert result.verifier_result.outcome is Outcome.OK and result.outcome == "ok"
    with pytest.raises(RuntimeError, match="single-use"):
        env.step("3")


def test_wrong_and_empty_answers_are_scored():
    envs = ReasoningGymGroupBuilder(ITEM, "chain_sum", system_prompt="Be brief.").make_envs(3)
    assert len({id(e) for e in envs}) == 3
    assert envs[0].initial_messages()[0] == {"role": "system", "content": "Be brief."}
    assert [e.step(text).reward for e, text in zip(envs, ["3", "4", ""])] == [1.0, 0.0, 0.0]


def test_a_hanging_verifier_gives_a_timeout_outcome():
    import time

    def hangs(completion, item):
        time.sleep(600)  # cut at its 0.1 s budget

    (env,) = ReasoningGymGroupBuilder(ITEM, "chain_sum", verifier=hangs, timeout_s=0.1).make_envs(1)
    result = env.step("3")
    assert result.done and result.reward == 0.0 and result.outcome == "timeout"


def test_group_size_is_validated():
    with pytest.raises(ValueError, match="group_size"):
        ReasoningGymGroupBuilder(ITEM, "chain_sum").make_envs(0)


@pytest.mark.parametrize("dumps, loads", PICKLERS)
def test_builders_pickle(dumps, loads, small_task):
    builders = small_task.builders(0, 3) + [CalculatorGroupBuilder(ITEM, max_turns=2)]
    for builder in builders:
        assert isinstance(builder, EnvGroupBuilder)
        copy = loads(dumps(builder))
        assert copy.item == builder.item
        env = copy.make_envs(2)[0]
        answer = builder.item["answer"]
        text = f"<answer>{answer}</answer>" if isinstance(copy, CalculatorGroupBuilder) else answer
        assert env.step(text).reward == 1.0


# --------------------------------------------------------------------------------------------
# Tasks: deterministic batches, disjoint held-out items
# --------------------------------------------------------------------------------------------


def test_task_is_an_env_dataset_with_deterministic_batches(small_task):
    assert isinstance(small_task, EnvDataset)
    again = chain_sum_task(size=300, seed=5, held_out_size=40)
    first = [b.item for b in small_task.builders(3, 8)]
    assert first == [b.item for b in again.builders(3, 8)]
    assert first != [b.item for b in small_task.builders(4, 8)]
    n = len(small_task)
    assert [b.item for b in small_task.builders(0, n + 2)][-2:] == small_task.train_items[:2]
    with pytest.raises(ValueError, match="batch_size"):
        small_task.builders(0, 0)
    with pytest.raises(ValueError, match="batch_index"):
        small_task.builders(-1, 4)


def test_held_out_questions_never_occur_in_training():
    """2-term 1-2-digit chain_sum has ~8k distinct questions: 10k training items repeat many
    and overlap any held-out set, so the overlapping training items must be dropped."""
    task = chain_sum_task()  # the preset: 10,000 items, 200 held out
    held = task.held_out(200)
    questions = [item["question"] for item in held]
    assert len(set(questions)) == 200
    assert set(questions).isdisjoint(item["question"] for item in task.train_items)
    assert task.num_dropped > 0 and task.gold_train.checked == 10_000
    assert len(task) == 10_000 - task.num_dropped - task.gold_train.num_dropped
    assert task.held_out(5) == held[:5]
    with pytest.raises(ValueError, match="held_out_size=200"):
        task.held_out(201)


def test_held_out_items_are_copies(small_task):
    items = small_task.held_out(2)
    items[0]["answer"] = "tampered"
    assert small_task.held_out(2)[0]["answer"] != "tampered"


@pytest.mark.parametrize("dumps, loads", PICKLERS)
def test_a_task_pickles_without_its_items_and_regenerates_them(dumps, loads, small_task):
    small_task.builders(0, 1)  # items generated
    blob = dumps(small_task)
    assert len(blob) < 5_000
    copy = loads(blob)
    assert [b.item for b in copy.builders(2, 5)] == [b.item for b in small_task.builders(2, 5)]
    assert copy.held_out(40) == small_task.held_out(40)


def test_task_arguments_are_validated():
    with pytest.raises(ValueError, match="unknown reasoning-gym task"):
        ReasoningGymTask(name="chain_summ", size=10)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['max_digit'\].*max_digits"):
        chain_sum_task(max_digit=3)
    with pytest.raises(ValueError, match="invalid options"):
        chain_sum_task(min_terms=3, max_terms=2)
    with pytest.raises(ValueError, match="not in config"):
        ReasoningGymTask(name="chain_sum", size=10, config={"seed": 1})
    with pytest.raises(ValueError, match="size"):
        ReasoningGymTask(name="chain_sum", size=0)
    with pytest.raises(ValueError, match="distinct questions"):
        chain_sum_task(size=10, min_digits=1, max_digits=1, held_out_size=500).held_out(1)


def test_any_reasoning_gym_task_by_name_and_its_score_fn():
    task = ReasoningGymTask(name="basic_arithmetic", size=20, held_out_size=3)
    builder = task.builders(0, 1)[0]
    env = builder.make_envs(1)[0]
    assert env.step(builder.item["answer"]).reward == 1.0
    score = task.score_fn()
    item = task.held_out(1)[0]
    assert score(item["answer"], item) == 1.0 and score("nonsense", item) == 0.0


# --------------------------------------------------------------------------------------------
# Calculator: multi-turn tool use with scripted policies
# --------------------------------------------------------------------------------------------


def scripted(*turns):
    """A 'policy' that returns fixed texts, one per turn."""
    replies = iter(turns)
    return lambda messages: next(replies)


def test_calculator_multi_turn_episode():
    env = CalculatorEnv({"question": "What is 12 * 7 - 5?", "answer": "79"})
    episode = run_text_episode(
        env,
        scripted(
            "First <calc>12*7</calc>.",
            "Then <calc>84 - 5</calc> and <calc>(84-5)/2</calc>",
            "<answer>79</answer>",
        ),
    )
    assert [m["role"] for m in episode.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert episode.messages[3]["content"] == "<result>84</result>"
    assert episode.messages[5]["content"] == "<result>79</result>\n<result>79/2</result>"
    assert (episode.reward, episode.outcome, episode.num_turns) == (1.0, "ok", 3)
    assert episode.final.info == {"turn": 3, "calls": 3, "tool_errors": 0}
    with pytest.raises(RuntimeError, match="single-use"):
        env.step("<answer>79</answer>")


def test_calculator_answers_are_checked_by_value():
    item = {"question": "7/2?", "answer": "3.5"}
    assert run_text_episode(CalculatorEnv(item), scripted("<answer>7/2</answer>")).reward == 1.0
    wrong = run_text_episode(CalculatorEnv(item), scripted("<answer>3</answer>"))
    assert (wrong.reward, wrong.outcome) == (0.0, "wrong")
    empty = run_text_episode(CalculatorEnv(item), scripted("<answer></answer>"))
    assert empty.outcome == "format_error"


def test_calculator_without_an_answer_ends_as_a_format_error_after_max_turns():
    env = CalculatorEnv({"question": "1+1?", "answer": "2"}, max_turns=3, system_prompt=None)
    episode = run_text_episode(env, scripted("hmm", "<calc>1+1</calc>", "still thinking"))
    assert (episode.reward, episode.outcome, episode.num_turns) == (0.0, "format_error", 3)
    assert "no <answer> after 3 turns" in episode.final.verifier_result.reason
    nudge = episode.messages[2]
    assert nudge["role"] == "tool" and "<calc>expression</calc>" in nudge["content"]


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os')",
        "__import__('os').system('echo pwned')",
        "open('/tmp/x', 'w')",
        "(1).__class__",
        "2**10",
        "1.5 + 1",
        "a + 1",
        "[1, 2]",
        "lambda: 1",
        "'a' * 3",
        "1 // 2",
        "7 % 3",
        "1 if 1 else 2",
        "1 < 2",
        "1/0",
        "9" * 40,
        "1 +" * 100 + "1",
        "",
        "1 +",
    ],
)
def test_unsafe_or_invalid_expressions_are_rejected(expression):
    with pytest.raises(ValueError):
        evaluate_arithmetic(expression)
    assert calculator_result(expression).startswith("<result>error: ")


def test_rejected_expressions_are_never_executed(tmp_path):
    target = tmp_path / "pwned"
    env = CalculatorEnv({"question": "?", "answer": "1"})
    result = env.step(f"<calc>open('{target}', 'w')</calc> <calc>__import__('os')</calc>")
    assert not result.done and not target.exists()
    assert result.observation[0]["content"] == (
        "<result>error: Call is not allowed: only integers, + - * / and parentheses</result>\n"
        "<result>error: Call is not allowed: only integers, + - * / and parentheses</result>"
    )
    assert result.info["tool_errors"] == 2


def test_safe_arithmetic_values():
    assert evaluate_arithmetic("12*7") == 84
    assert evaluate_arithmetic(" -(3 - 10) * +2 ") == 14
    assert str(evaluate_arithmetic("1/3 + 1/6")) == "1/2"
    assert evaluate_arithmetic("((2))") == 2


def test_calculator_task_from_the_registry_pickles(tmp_path):
    task = get_task("calculator", size=30, held_out_size=4, max_turns=2)
    copy = cloudpickle.loads(cloudpickle.dumps(task))
    builder = copy.builders(1, 2)[0]
    assert isinstance(builder, CalculatorGroupBuilder) and builder.max_turns == 2
    env = pickle.loads(pickle.dumps(builder)).make_envs(1)[0]
    assert env.step(f"<answer>{builder.item['answer']}</answer>").reward == 1.0


# --------------------------------------------------------------------------------------------
# StepResult, Trajectory, Group, group rewards, run_text_episode
# --------------------------------------------------------------------------------------------


def test_step_result_validation():
    with pytest.raises(ValueError, match="needs the episode's reward"):
        StepResult(done=True)
    with pytest.raises(ValueError, match="finite"):
        StepResult(done=True, reward=float("nan"))
    with pytest.raises(ValueError, match="observation"):
        StepResult(done=False)
    assert StepResult(done=False, observation=[]).reward is None
    assert StepResult(done=True, reward=1).reward == 1.0


def _trajectory(**overrides):
    fields = dict(
        group_id=7,
        prompt_ids=[1, 2],
        completion_ids=[3, 4, 5],
        logprobs=[-0.1, -0.2, -0.3],
        reward=1.0,
        outcome="ok",
        finish_reason="stop",
        text="345",
    )
    fields.update(overrides)
    return Trajectory(**fields)


def test_trajectory_validation():
    t = _trajectory(outcome=Outcome.WRONG)
    assert t.outcome == "wrong" and t.policy_version == 0 and t.info == {}
    assert t.num_completion_tokens == 3 and t.completion_mask is None
    with pytest.raises(ValueError, match="logprobs"):
        _trajectory(logprobs=[0.0])
    with pytest.raises(ValueError, match="completion_mask"):
        _trajectory(completion_mask=[True])
    with pytest.raises(ValueError, match="finite"):
        _trajectory(reward=float("inf"))
    with pytest.raises(ValueError, match="outcome"):
        _trajectory(outcome="correct")
    with pytest.raises(ValueError, match="finish_reason"):
        _trajectory(finish_reason="eos")
    with pytest.raises(TypeError):
        Trajectory(7, [1], [2], [0.0], 1.0, "ok", "stop", "x")  # keyword-only


def test_trajectories_pickle():
    t = _trajectory(completion_mask=[True, False, True], info={"turn": 2})
    assert pickle.loads(pickle.dumps(t)) == t


def test_group_and_group_rewards():
    group = Group([_trajectory(reward=1.0), _trajectory(reward=0.0, outcome="wrong")])
    assert group.group_id == 7 and group.rewards == [1.0, 0.0] and len(group) == 2
    assert group.outcomes == ["ok", "wrong"] and [t.reward for t in group] == [1.0, 0.0]
    with pytest.raises(ValueError, match="share one group_id"):
        Group([_trajectory(), _trajectory(group_id=8)])
    with pytest.raises(ValueError, match="at least one"):
        Group([])

    plain = ReasoningGymGroupBuilder(ITEM, "chain_sum")
    assert group_rewards(plain, group.trajectories) == [1.0, 0.0]

    class RankBuilder:  # a group-level reward: the shortest text wins
        def make_envs(self, group_size):
            return []

        def group_rewards(self, trajectories):
            best = min(len(t.text) for t in trajectories)
            return [float(len(t.text) == best) for t in trajectories]

    texts = [_trajectory(text="long text"), _trajectory(text="short")]
    assert group_rewards(RankBuilder(), texts) == [0.0, 1.0]

    class BadBuilder(RankBuilder):
        def group_rewards(self, trajectories):
            return [1.0]

    with pytest.raises(ValueError, match="returned 1 rewards for 2"):
        group_rewards(BadBuilder(), texts)


def test_run_text_episode_stops_an_endless_environment():
    class Endless:  # a notebook env without a turn limit
        def initial_messages(self):
            return [{"role": "user", "content": "talk"}]

        def step(self, text):
            return StepResult(done=False, observation=[{"role": "user", "content": "more"}])

    assert isinstance(Endless(), Environment)
    with pytest.raises(RuntimeError, match="not done after 5 turns"):
        run_text_episode(Endless(), lambda m: "ok", max_turns=5)


# --------------------------------------------------------------------------------------------
# Registry, doctests
# --------------------------------------------------------------------------------------------


def test_task_registry():
    assert {"reasoning_gym", "chain_sum", "calculator"} <= set(registered_tasks())
    with pytest.raises(ValueError, match="unknown task 'chainsum'.*chain_sum"):
        get_task("chainsum")
    with pytest.raises(ValueError, match="already registered"):
        register_task("chain_sum")(calculator_task)
    task = get_task("reasoning_gym", name="chain_sum", size=10, held_out_size=2)
    assert isinstance(task, ReasoningGymTask) and len(task.builders(0, 2)) == 2


def test_reasoning_gym_env_with_another_verifier():
    env = ReasoningGymEnv(ITEM, MathAnswerVerifier())
    assert env.step("so it is \\boxed{3}").reward == 1.0
    builder = ReasoningGymGroupBuilder(ITEM, "chain_sum", verifier=MathAnswerVerifier())
    assert pickle.loads(pickle.dumps(builder)).make_envs(1)[0].step("3.0").reward == 1.0
    partial = functools.partial(CalculatorGroupBuilder, max_turns=1)
    assert pickle.loads(pickle.dumps(partial))(ITEM).max_turns == 1


@pytest.mark.parametrize(
    "module",
    [
        "posttrain.rl.environment",
        "posttrain.envs",
        "posttrain.envs.reasoning_gym_env",
        "posttrain.envs.calculator_env",
    ],
)
def test_doctests(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_calculator_task_checks_its_options_when_built_and_passes_them_on():
    from posttrain.envs import calculator_task

    task = calculator_task(size=8, held_out_size=2, max_turns=2, timeout_s=7.0, system_prompt=None)
    (env,) = task.builders(0, 1)[0].make_envs(1)
    assert (env.max_turns, env.timeout_s, env.system_prompt) == (2, 7.0, None)
    assert env.initial_messages()[0]["role"] == "user"
    for bad, match in (
        ({"max_turns": 0}, "max_turns"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"builder": None}, "builder="),
        ({"extract": "boxed"}, "extract="),
    ):
        with pytest.raises(ValueError, match=match):
            calculator_task(size=8, held_out_size=2, **bad)
    with pytest.raises(TypeError, match="system_prompt"):
        calculator_task(size=8, held_out_size=2, system_prompt=3)
