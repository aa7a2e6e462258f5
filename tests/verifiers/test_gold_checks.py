"""Gold checks when a task is built: an upstream reasoning-gym item whose answer contradicts the
task's own scorer or metadata is dropped and counted, from training and held-out items alike;
consistent items are all kept; the check runs once per build; builders stay deterministic.
(Each registered check on its own, and the checks against the docs: test_gold_check_rules.py.)

Expected counts are recomputed here independently of `posttrain.verifiers.reasoning_gym_gold`:
expressions with sympy (exact rationals), corrupted items by construction."""

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import reasoning_gym
import sympy
from reasoning_gym.arithmetic.chain_sum import ChainSumConfig, ChainSumDataset
from reasoning_gym.factory import DATASETS, register_dataset

from posttrain.envs import CHAIN_SUM_CONFIG, ReasoningGymTask, calculator_task
from posttrain.rewards import run_verifier
from posttrain.verifiers import MathAnswerVerifier
from posttrain.verifiers.reasoning_gym_gold import (
    GOLD_CHECKS,
    GoldReport,
    check_gold,
    gold_problem,
    register_gold_check,
)

BAD = "chain_sum_bad_gold_for_tests"


# --------------------------------------------------------------------------------------------
# A real chain_sum dataset with chosen items corrupted (registered with reasoning-gym itself)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BadGoldConfig(ChainSumConfig):
    """chain_sum options plus the items (by `seed + index`, the item's own random seed) whose
    answer is off by one, or whose question and metadata ask `... + 1` while the gold stays."""

    wrong_answer: tuple = ()
    wrong_question: tuple = ()


class BadGoldChainSum(ChainSumDataset):
    score_calls = 0  # every score_answer call in this process, for the once-per-build test

    def __getitem__(self, idx: int) -> dict:
        item = super().__getitem__(idx)
        if self.seed + idx in self.config.wrong_answer:
            item["answer"] = str(int(item["answer"]) + 1)
        if self.seed + idx in self.config.wrong_question:
            item["metadata"]["expression"] += " + 1"
            item["question"] = item["question"].replace(" =", " + 1 =")
        return item

    def score_answer(self, answer, entry):
        type(self).score_calls += 1
        return super().score_answer(answer, entry)


def _chain_sum_check(item):
    return GOLD_CHECKS.build("chain_sum", item=item)


if BAD not in DATASETS:
    register_dataset(BAD, BadGoldChainSum, BadGoldConfig)
    register_gold_check(BAD)(_chain_sum_check)


def bad_task(**options) -> ReasoningGymTask:
    arguments = dict(
        size=200,
        seed=0,
        held_out_size=20,
        held_out_seed=1000,
        config={**CHAIN_SUM_CONFIG, "wrong_answer": (7, 1003), "wrong_question": (11,)},
    )
    arguments.update(options)
    return ReasoningGymTask(name=BAD, **arguments)


def _first_distinct(items, n):
    out, seen = [], set()
    for item in items:
        if item["question"] not in seen and len(out) < n:
            seen.add(item["question"])
            out.append(item)
    return out


def test_items_with_a_corrupted_gold_are_dropped_and_counted():
    """Corrupted: training items 7 (answer) and 11 (question + metadata), held-out candidate 3
    of seed 1000 (answer). The expected sets are built from the uncorrupted chain_sum items."""
    task = bad_task()
    assert "items not generated yet" in repr(task)
    train, held = task.train_items, task.held_out()
    clean_train = list(
        reasoning_gym.create_dataset("chain_sum", size=200, seed=0, **CHAIN_SUM_CONFIG)
    )
    clean_held = list(
        reasoning_gym.create_dataset("chain_sum", size=200, seed=1000, **CHAIN_SUM_CONFIG)
    )
    expected_held = _first_distinct(
        [it for it in clean_held if it["metadata"]["source_index"] != 3], 20
    )
    assert held == expected_held
    assert task.gold_held_out.dropped == {"metadata": 1}
    read = 1 + clean_held.index(expected_held[-1])  # candidates up to the 20th kept
    assert task.gold_held_out.checked == read
    held_questions = {it["question"] for it in expected_held}
    assert task.gold_train.checked == 200
    assert task.gold_train.dropped == {"metadata": 2} and task.gold_train.num_dropped == 2
    assert train == [
        it
        for it in clean_train
        if it["metadata"]["source_index"] not in (7, 11) and it["question"] not in held_questions
    ]
    assert len(train) == 200 - 2 - task.num_dropped
    assert "source index 7" in task.gold_train.examples[0]
    assert "the gold says '" in task.gold_train.examples[0]
    assert "does not contain the expression" not in task.gold_train.examples[1]
    assert "+ 1' is" in task.gold_train.examples[1]
    assert task.num_bad_gold == 3
    text = repr(task)
    assert "2 of 200 dropped (metadata 2)" in text
    assert f"20 held out (gold check 1 of {read} dropped (metadata 1))" in text
    stats = task.stats()
    assert stats["gold_train"]["dropped"] == 2 and stats["gold_held_out"]["dropped"] == 1
    assert stats["train_items"] == len(train) and stats["held_out_items"] == 20
    json.dumps(stats)  # plain values for results.json


def test_a_task_whose_every_item_fails_says_so():
    task = bad_task(
        size=2, seed=7, held_out_size=0, config={**CHAIN_SUM_CONFIG, "wrong_answer": (7, 8)}
    )
    with pytest.raises(ValueError, match=r"no training item .* gold check 2 of 2 dropped"):
        task.train_items
    with pytest.raises(ValueError, match=r"trusted gold answer .*dropped"):
        bad_task(
            held_out_size=3,
            held_out_seed=1000,
            config={**CHAIN_SUM_CONFIG, "wrong_answer": tuple(range(1000, 1100))},
        ).held_out()


def test_the_check_runs_once_per_build():
    """Building checks size + (held-out candidates read) items, each scored once; the steps'
    builders afterwards score nothing (the verifier scores only completions)."""
    task = bad_task(size=2000, held_out_size=50)
    calls = BadGoldChainSum.score_calls
    task.builders(0, 4)
    read = task.gold_train.checked + task.gold_held_out.checked
    assert task.gold_train.checked == 2000 and task.gold_held_out.checked >= 51
    assert BadGoldChainSum.score_calls - calls == read
    for step in range(50):
        task.builders(step, 16)
    task.held_out(10)
    assert BadGoldChainSum.score_calls - calls == read
    assert (task.gold_train.checked, task.gold_held_out.checked) == (2000, read - 2000)
    # its cost is recorded (~20-80 ms per 1000 items on a shared 2-core machine), not asserted:
    # a wall-clock bound would fail on a loaded machine
    assert task.gold_train.seconds > 0 and task.gold_train.ms_per_1000 > 0, task.gold_train


# --------------------------------------------------------------------------------------------
# A real upstream inconsistency: basic_arithmetic floor-divides ('/' means '//' in its gold)
# --------------------------------------------------------------------------------------------


def _sympy_disagrees(items) -> list[int]:
    """Source indices whose gold differs from sympy's exact value of the expression."""
    return [
        it["metadata"]["source_index"]
        for it in items
        if sympy.sympify(it["metadata"]["expression"]) != sympy.Rational(it["answer"])
    ]


def test_consistent_items_are_all_kept_and_the_inconsistent_count_matches_sympy():
    items = list(reasoning_gym.create_dataset("basic_arithmetic", size=600, seed=0))
    disagree = _sympy_disagrees(items)
    assert len(disagree) >= 3  # sympy finds 116, 153, 234, ... among the first 600
    task = ReasoningGymTask(name="basic_arithmetic", size=600, seed=0, held_out_size=0)
    assert task.gold_train.checked == 0  # filled when the items are generated
    task.train_items
    assert task.gold_train.dropped == {"metadata": len(disagree)}
    assert [it["metadata"]["source_index"] for it in task.train_items] == [
        it["metadata"]["source_index"]
        for it in items
        if it["metadata"]["source_index"] not in disagree
    ]
    # chain_sum as the recipes use it: sympy agrees with every gold, so every item is kept
    chain = list(reasoning_gym.create_dataset("chain_sum", size=500, seed=3, **CHAIN_SUM_CONFIG))
    assert _sympy_disagrees(chain) == []
    report = GoldReport("chain_sum")
    assert (
        len(
            list(
                check_gold(
                    "chain_sum", ChainSumDataset(ChainSumConfig(**CHAIN_SUM_CONFIG)), chain, report
                )
            )
        )
        == 500
    )
    assert report.checked == 500 and report.dropped == {}


def test_the_held_out_set_excludes_items_with_a_bad_gold():
    """The held-out set is the first 150 distinct questions among the candidates sympy agrees
    with; the report counts the disagreeing candidates read before the 150th."""
    task = ReasoningGymTask(
        name="basic_arithmetic", size=50, seed=0, held_out_size=150, held_out_seed=777
    )
    candidates = list(reasoning_gym.create_dataset("basic_arithmetic", size=4 * 150 + 64, seed=777))
    disagree = set(_sympy_disagrees(candidates))
    expected, seen, read = [], set(), 0
    for item in candidates:
        read += 1
        if item["metadata"]["source_index"] in disagree or item["question"] in seen:
            continue
        seen.add(item["question"])
        expected.append(item)
        if len(expected) == 150:
            break
    held = task.held_out()
    assert held == expected
    assert task.gold_held_out.checked == read
    dropped = sum(1 for i in range(read) if candidates[i]["metadata"]["source_index"] in disagree)
    assert dropped >= 1 and task.gold_held_out.dropped == {"metadata": dropped}
    dataset = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=0)
    assert all(gold_problem("basic_arithmetic", dataset, it) is None for it in held)


def test_the_recipes_sft_stage_holds_out_the_same_checked_items_as_the_rl_task():
    """The RL workflow refuses to run when the two held-out sets differ; with basic_arithmetic
    both must skip the same bad golds."""
    from posttrain.workflows.config import TaskConfig
    from posttrain.workflows.sft import held_out_items

    config = TaskConfig(name="basic_arithmetic", options={}, eval_size=150, eval_seed=777)
    items, _ = held_out_items(config)
    task = ReasoningGymTask(name="basic_arithmetic", size=10, held_out_size=150, held_out_seed=777)
    assert items == task.held_out() and task.gold_held_out.num_dropped >= 1


def test_the_sft_stage_trains_on_no_item_whose_gold_sympy_rejects():
    """SFT rows come from the same checked items: among 600 basic_arithmetic items sympy finds
    >= 3 wrong golds; none of their questions is a training row, every other one is."""
    from posttrain.models import ByteTokenizer
    from posttrain.workflows.config import TaskConfig
    from posttrain.workflows.sft import SFTConfig, build_dataset

    items = list(reasoning_gym.create_dataset("basic_arithmetic", size=600, seed=0))
    bad = set(_sympy_disagrees(items))
    assert len(bad) >= 3
    cfg = SFTConfig(
        task=TaskConfig(name="basic_arithmetic", options={}, train_size=600, eval_size=0), seed=0
    )
    report = GoldReport("basic_arithmetic")
    dataset, dropped = build_dataset(cfg, ByteTokenizer(), set(), report)
    assert dropped == 0 and len(dataset) == 600 - len(bad)
    assert report.checked == 600 and report.dropped == {"metadata": len(bad)}


def test_builders_are_the_same_in_another_process():
    code = (
        "import json; from posttrain.envs import ReasoningGymTask\n"
        "t = ReasoningGymTask(name='basic_arithmetic', size=400, seed=0, held_out_size=30)\n"
        "print(json.dumps([[b.item for b in t.builders(5, 7)], t.held_out(),"
        " t.gold_train.dropped, t.gold_held_out.dropped]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    there = json.loads(run.stdout.strip().splitlines()[-1])
    task = ReasoningGymTask(name="basic_arithmetic", size=400, seed=0, held_out_size=30)
    here = [
        [b.item for b in task.builders(5, 7)],
        task.held_out(),
        task.gold_train.dropped,
        task.gold_held_out.dropped,
    ]
    assert json.loads(json.dumps(here)) == there
    assert task.gold_train.num_dropped > 0


# --------------------------------------------------------------------------------------------
# Reports: items without a gold, checks by the scorer only, the calculator task, timing
# --------------------------------------------------------------------------------------------


def test_items_without_a_gold_are_kept_and_counted():
    dataset = reasoning_gym.create_dataset("propositional_logic", size=20, seed=0)
    report = GoldReport("propositional_logic")
    kept = list(check_gold("propositional_logic", dataset, dataset, report))
    assert len(kept) == 20 and report.no_gold == 20 and report.num_dropped == 0


def test_a_task_checked_by_its_scorer_only_says_so():
    """A task with no recomputation is marked in its report, its text and repr(task); a task
    with one is not."""
    task = ReasoningGymTask(name="propositional_logic", size=20, held_out_size=2)
    assert len(task.train_items) >= 1
    assert task.gold_train.recomputed is False and task.gold_held_out.recomputed is False
    assert task.stats()["gold_train"]["recomputed"] is False
    assert str(task.gold_train) == "0 of 20 dropped (scorer only: no recomputed answer)"
    assert "scorer only" in repr(task)
    checked = ReasoningGymTask(name="chain_sum", size=20, held_out_size=2)
    checked.train_items
    assert checked.gold_train.recomputed is True and "scorer only" not in repr(checked)
    assert GoldReport("x").recomputed is None  # unknown until check_gold runs


def test_calculator_items_are_gold_checked_and_their_gold_passes_its_verifier():
    """The calculator task plays chain_sum items (the same ReasoningGymTask), so they are checked
    when built; its verifier (math_answer on the <answer> content) accepts every kept gold."""
    task = calculator_task(size=300, held_out_size=20)
    items = task.train_items + task.held_out()
    assert task.gold_train.checked == 300 and task.num_bad_gold == 0
    verifier = MathAnswerVerifier()
    assert all(run_verifier(verifier, it["answer"], it).ok for it in items)


def test_report_timing_is_recorded():
    report = GoldReport("chain_sum")
    dataset = ChainSumDataset(ChainSumConfig(**CHAIN_SUM_CONFIG, size=200, seed=0))
    start = time.perf_counter()
    assert len(list(check_gold("chain_sum", dataset, dataset, report))) == 200
    assert 0 < report.seconds <= time.perf_counter() - start
    assert report.ms_per_1000 == pytest.approx(1e6 * report.seconds / 200)
