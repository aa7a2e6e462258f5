"""Coding environments: MBPP rows, the deterministic held-out split, HumanEval and MBPP as tasks
(registered, batched, pickled), and single-turn code episodes scored in the sandbox (scripted
and with a tiny policy). The multi-turn Python-tool environment: test_python_tool_env.py."""

import doctest
import importlib
import json
import os
import pickle
import random
import subprocess
import sys

import cloudpickle
import pytest
from _env_helpers import ScriptedTurnsPolicy
from _waits import WAIT_S

from posttrain.envs import get_task, registered_tasks
from posttrain.envs.code_env import CodeGroupBuilder, CodeTask, mbpp_item, split_held_out
from posttrain.envs.python_tool_env import PythonToolGroupBuilder, python_tool_task
from posttrain.policy import Policy
from posttrain.rl import collect_groups, run_text_episode
from posttrain.verifiers.sandbox import SandboxLimits, sandbox_available

NO_SANDBOX = sandbox_available()
needs_sandbox = pytest.mark.skipif(NO_SANDBOX is not None, reason=f"no sandbox here: {NO_SANDBOX}")
PICKLERS = [(pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)]
ROWS = [
    {
        "task_id": i,
        "text": f"Write add{i}(x) returning x + {i}.",
        "test_list": [f"assert add{i}(1) == {1 + i}", f"assert add{i}(-{i}) == 0"],
        "code": f"def add{i}(x):\n    return x + {i}\n",
    }
    for i in range(20)
]


def _never(completion, item):  # a verifier for tests that only look at the task's items
    raise AssertionError("not called")


# --------------------------------------------------------------------------------------------
# Items and the split (no sandbox)
# --------------------------------------------------------------------------------------------


def test_mbpp_item():
    item = mbpp_item({**ROWS[3], "test_setup_code": "import math"})
    assert item["question"] == (
        "Write add3(x) returning x + 3.\nYour code should pass this test:\nassert add3(1) == 4"
    )
    assert item["test"] == "import math\nassert add3(1) == 4\nassert add3(-3) == 0\n"
    assert item["entry_point"] is None and item["prompt"] == "" and item["task_id"] == 3
    with pytest.raises(ValueError, match="test_list"):
        mbpp_item({"text": "x", "test_list": []})
    with pytest.raises(ValueError, match="'text'"):
        mbpp_item({"test_list": ["assert 1"]})


def test_split_is_order_free_sized_and_seeded():
    ids = [f"T/{i}" for i in range(50)]
    held = split_held_out(ids, 0.2)
    assert len(held) == 10 and held <= set(ids)
    shuffled = list(ids)
    random.Random(1).shuffle(shuffled)
    assert split_held_out(shuffled, 0.2) == held
    assert split_held_out(ids, 0.2, seed=1) != held
    assert split_held_out(ids, 0.0) == set() and len(split_held_out(ids, 0.3)) == 15
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        split_held_out(ids, 1.0)
    with pytest.raises(ValueError, match="unique"):
        split_held_out(["a", "a"], 0.5)


def test_split_is_the_same_in_another_process_with_another_hash_seed():
    ids = [f"HumanEval/{i}" for i in range(164)]
    here = sorted(split_held_out(ids, 0.25, seed=7))
    code = (
        "import json; from posttrain.envs.code_env import split_held_out; "
        f"print(json.dumps(sorted(split_held_out({ids!r}, 0.25, seed=7))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        timeout=WAIT_S,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here and len(here) == 41


def test_code_task_batches_held_out_and_pickling():
    task = CodeTask(items=[mbpp_item(r) for r in ROWS], held_out_fraction=0.25, verifier=_never)
    train_ids = [i["task_id"] for i in task.train_items]
    held_ids = [i["task_id"] for i in task.held_out()]
    assert len(train_ids) == 15 and len(held_ids) == 5 and not set(train_ids) & set(held_ids)
    assert train_ids == sorted(train_ids)  # training keeps the items' order
    batch = [b.item["task_id"] for b in task.builders(3, 4)]  # items 12..15 mod 15
    assert batch == [train_ids[12], train_ids[13], train_ids[14], train_ids[0]]
    copy = task.held_out(2)
    copy[0]["question"] = "changed"
    assert task.held_out(2)[0]["question"] != "changed"
    for dumps, loads in PICKLERS:
        again = loads(dumps(task))
        assert [b.item for b in again.builders(1, 3)] == [b.item for b in task.builders(1, 3)]
    with pytest.raises(ValueError, match="no 'test'"):
        CodeTask(items=[{"question": "q"}], verifier=_never)
    with pytest.raises(ValueError, match="leaves no training item"):
        CodeTask(items=[mbpp_item(ROWS[0])], held_out_fraction=0.9, verifier=_never)
    with pytest.raises(ValueError, match="held_out"):
        task.held_out(6)
    with pytest.raises(ValueError, match="batch_size"):
        task.builders(0, 0)


def test_tasks_are_registered():
    assert {"humaneval", "code", "python_tool"} <= set(registered_tasks())
    task = get_task("humaneval", held_out_fraction=0.25, verifier=_never)
    assert len(task) == 123 and len(task.held_out()) == 41
    assert task.builders(0, 1)[0].item["task_id"] == task.train_items[0]["task_id"]
    with pytest.raises(ValueError, match="items"):
        get_task("humaneval", items=[])
    tool = python_tool_task(size=20, held_out_size=4, max_turns=2, max_output_chars=50)
    builder = tool.builders(0, 1)[0]
    assert isinstance(builder, PythonToolGroupBuilder) and builder.max_output_chars == 50
    for dumps, loads in PICKLERS:
        assert loads(dumps(builder)) == builder


def test_held_out_scan_stops_when_the_task_runs_out_of_questions():
    """1-digit 2-term chain_sum has a few hundred questions: 40,000 held out stops early
    (`found + 1000` candidates without a new question), not after 160,064 candidates (the
    candidates read are counted in the message)."""
    from posttrain.envs.reasoning_gym_env import chain_sum_task

    task = chain_sum_task(size=20, held_out_size=40_000, max_digits=1)
    with pytest.raises(
        ValueError,
        match="gave only .* distinct questions .* in [0-9]{3,4} of 160064 candidates read",
    ):
        task.held_out()


# --------------------------------------------------------------------------------------------
# Single-turn code episodes (sandbox)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def code_verifier():
    if NO_SANDBOX is not None:
        pytest.skip(f"no sandbox here: {NO_SANDBOX}")
    from posttrain.verifiers.code_exec import CodeTestsVerifier

    return CodeTestsVerifier(limits=SandboxLimits(cpu_s=2.0, wall_s=60.0))


@needs_sandbox
def test_code_episodes_are_scored_by_the_tests(code_verifier):
    item = mbpp_item(ROWS[2])
    envs = CodeGroupBuilder(item, verifier=code_verifier).make_envs(3)
    answers = [f"```python\n{ROWS[2]['code']}```", "def add2(x):\n    return x\n", "```python\n```"]
    results = [env.step(text) for env, text in zip(envs, answers)]
    assert [(r.reward, r.outcome) for r in results] == [
        (1.0, "ok"),
        (0.0, "wrong"),
        (0.0, "format_error"),
    ]
    assert results[0].info == {"task_id": 2}
    with pytest.raises(RuntimeError, match="single-use"):
        envs[0].step("x")
    (nul,) = CodeGroupBuilder(item, verifier=code_verifier).make_envs(1)  # the policy's fault
    assert (nul.step(ROWS[2]["code"] + "\x00print('x')\n").outcome,) == ("wrong",)
    episode = run_text_episode(
        CodeGroupBuilder(item, verifier=code_verifier).make_envs(1)[0],
        lambda messages: ROWS[2]["code"],
    )
    assert episode.messages[0] == {"role": "user", "content": item["question"]}
    assert (episode.reward, episode.outcome, episode.num_turns) == (1.0, "ok", 1)


@needs_sandbox
def test_humaneval_task_episode_and_builder_pickling():
    task = get_task("humaneval", held_out_fraction=0.25)
    builder = task.builders(0, 1)[0]
    for dumps, loads in PICKLERS:
        (env,) = loads(dumps(builder)).make_envs(1)
        assert env.step(builder.item["canonical_solution"]).outcome == "ok"


@needs_sandbox
def test_code_rollouts_scripted_and_with_a_tiny_policy(code_verifier):
    builders = [CodeGroupBuilder(mbpp_item(r), verifier=code_verifier) for r in ROWS[:2]]
    right = ScriptedTurnsPolicy(["def add0(x):\n    return x\n"])  # right for add0 only
    groups = collect_groups(right, builders, group_size=2, max_new_tokens=32)
    assert [g.rewards for g in groups] == [[1.0, 1.0], [0.0, 0.0]]
    assert [g.outcomes for g in groups] == [["ok", "ok"], ["wrong", "wrong"]]
    policy = Policy.from_spec("tiny-1m", seed=0)
    groups = collect_groups(policy, builders, group_size=2, max_new_tokens=8, seed=0)
    rows = [t for g in groups for t in g]
    assert len(rows) == 4 and all(t.completion_mask is None for t in rows)
    assert all(t.outcome in ("wrong", "format_error") and t.reward == 0.0 for t in rows)


# --------------------------------------------------------------------------------------------
# Doctests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module",
    [
        "posttrain.envs.code_env",
        pytest.param("posttrain.envs.python_tool_env", marks=needs_sandbox),
    ],
)
def test_doctests(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
