"""The evaluation harness (`posttrain.workflows.evaluation`): each metric pinned independently of
the harness (by hand, or by calling the underlying evaluator / judge directly), the win-rate rule
on a scripted judge, save/load, the regression check on hand-built results, and every bad input
rejected before any generation."""

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from posttrain.models import ByteTokenizer
from posttrain.policy import Policy
from posttrain.rewards.evaluation import (
    evaluate_generations,
    paired_bootstrap_diff,
    wilson_interval,
)
from posttrain.rewards.pairwise import PairwiseOutcome, PairwiseResult, RewardModelPairwiseJudge
from posttrain.rewards.reward_model import RewardModel
from posttrain.verifiers.sandbox import sandbox_available
from posttrain.workflows import TaskConfig, evaluate, held_out_items
from posttrain.workflows.evaluation import (
    ExactMatchSet,
    HumanEvalSet,
    JudgeWinRateSet,
    RegressionError,
    SuiteResult,
    bootstrap_mean_interval,
    evaluate_suite,
    regression_check,
)

NO_SANDBOX = sandbox_available()


class _ScriptedPolicy:
    """Answers each prompt with `answer(question)`, for every sample (greedy or not); counts
    calls."""

    def __init__(self, answer=lambda q: q[-2:]):
        self.answer, self.calls = answer, 0
        self.tokenizer = SimpleNamespace(render_prompt=lambda messages: messages[0]["content"])
        self.model = SimpleNamespace(training=False, train=lambda mode: None)

    def generate(self, prompts, n=1, **kwargs):
        self.calls += 1
        return [
            SimpleNamespace(prompt_index=i, text=self.answer(p), finish_reason="eos")
            for i, p in enumerate(prompts)
            for _ in range(n)
        ]


class _NoGeneration(_ScriptedPolicy):
    def generate(self, prompts, **kwargs):
        raise AssertionError("generation started before the input was checked")


ITEMS = [{"question": f"q{i:02d}", "answer": f"{i:02d}" if i % 3 else "xx"} for i in range(10)]


def _exact(text, item):
    return float(text == item["answer"])


@pytest.fixture(scope="module")
def tiny():
    return Policy.from_spec("tiny-1m", seed=0)


def test_task_accuracy_equals_evaluate_called_directly(tiny):
    task = TaskConfig(eval_size=6, train_size=1)
    suite = evaluate_suite(
        tiny, [ExactMatchSet(name="chain", task=task, max_new_tokens=4)], progress=False
    )
    direct = evaluate(tiny, *held_out_items(task), max_new_tokens=4)
    [row] = suite.table.to_dict("records")
    per = suite.per_item["chain"]
    assert (row["set"], row["metric"], row["n"]) == ("chain", "accuracy", 6)
    assert row["value"] == pytest.approx(direct.accuracy)
    assert row["value"] == pytest.approx(per["correct"].mean())
    assert (row["ci_low"], row["ci_high"]) == pytest.approx(
        wilson_interval(int(direct.table["correct"].sum()), 6)
    )
    assert per["completion"].tolist() == direct.table["completion"].tolist()


def test_items_greedy_and_sampled_metrics_by_hand():
    """The scripted policy answers the last 2 characters of "qNN", so items 1, 2, 4, 5, 7, 8 are
    right and 0, 3, 6, 9 (answer "xx") wrong: accuracy 6/10; every sample is the same answer,
    so pass@1 = pass@3 = 0.6, per item 1 or 0."""
    s = ExactMatchSet(name="echo", items=ITEMS, score_fn=_exact, max_new_tokens=2, samples=3)
    suite = evaluate_suite(_ScriptedPolicy(), [s], progress=False)
    values = dict(zip(suite.table["metric"], suite.table["value"]))
    assert values == pytest.approx({"accuracy": 0.6, "pass@1": 0.6, "pass@3": 0.6})
    want = [float(i % 3 != 0) for i in range(10)]
    per = suite.per_item["echo"]
    assert per["correct"].astype(float).tolist() == want
    assert per["pass@1"].tolist() == want and per["pass@3"].tolist() == want
    acc = suite.table.set_index("metric").loc["accuracy"]
    assert (acc["ci_low"], acc["ci_high"]) == pytest.approx(wilson_interval(6, 10))
    boot = suite.table.set_index("metric").loc["pass@1"]
    assert boot["ci_low"] < 0.6 < boot["ci_high"] and "bootstrap" in boot["method"]
    assert "accuracy" in suite._repr_html_()


class _ScriptedJudge:
    """Returns `script[call][i]` for pair i of its call-th `compare` call."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def compare(self, a, b, items):
        outcomes = self.script[len(self.calls)]
        self.calls.append((list(a), list(b)))
        return [
            PairwiseResult(
                o,
                None if o in ("error", "inconsistent") else {"a": 1.0, "b": 0.0, "tie": 0.5}[o],
                "judge broke" * (o == "error"),
            )
            for o in outcomes
        ]


def test_win_rate_rule_on_a_scripted_judge():
    """First call: policy is A; second: policy is B.
    item 0: a, b -> wins both -> 1;  item 1: a, a -> orders disagree -> 0.5;
    item 2: b, a -> loses both -> 0; item 3: error in one order -> excluded (counted);
    item 4: tie, tie -> 0.5;         item 5: inconsistent, b -> 0.5.
    win rate = (1 + 0.5 + 0 + 0.5 + 0.5) / 5 = 0.5 over n = 5, excluded 1."""
    judge = _ScriptedJudge(
        [["a", "a", "b", "error", "tie", "inconsistent"], ["b", "a", "a", "b", "tie", "b"]]
    )
    items = [{"question": f"q{i}"} for i in range(6)]
    s = JudgeWinRateSet(
        name="judge",
        items=items,
        baseline_policy=_ScriptedPolicy(lambda q: "B"),
        judge=judge,
        max_new_tokens=2,
    )
    suite = evaluate_suite(_ScriptedPolicy(lambda q: "P"), [s], progress=False)
    [row] = suite.table.to_dict("records")
    assert (row["value"], row["n"], row["excluded"]) == (0.5, 5, 1)
    scores = suite.per_item["judge"]["score"].tolist()
    assert scores[:3] == [1.0, 0.5, 0.0] and np.isnan(scores[3]) and scores[4:] == [0.5, 0.5]
    assert "judge broke" in suite.per_item["judge"]["error"][3]
    assert judge.calls == [(["P"] * 6, ["B"] * 6), (["B"] * 6, ["P"] * 6)]  # both orders


def test_win_rate_with_a_reward_model_judge_recomputed_by_hand(tiny):
    items = [{"question": f"{a} + {b} ="} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    baseline = Policy.from_spec("tiny-1m", seed=1)
    judge = RewardModelPairwiseJudge(RewardModel.from_spec("tiny-1m", seed=0), ByteTokenizer())
    s = JudgeWinRateSet(
        name="rm", items=items, baseline_policy=baseline, judge=judge, max_new_tokens=6
    )
    suite = evaluate_suite(tiny, [s], progress=False)
    blank = lambda t, i: 0.0  # noqa: E731
    ours = evaluate_generations(tiny, items, score_fn=blank, max_new_tokens=6).table["completion"]
    theirs = evaluate_generations(baseline, items, score_fn=blank, max_new_tokens=6).table[
        "completion"
    ]
    first, second = (
        judge.compare(list(ours), list(theirs), items),
        judge.compare(list(theirs), list(ours), items),
    )
    by_hand = []
    for r1, r2 in zip(first, second):
        won = (r1.outcome == PairwiseOutcome.A, r2.outcome == PairwiseOutcome.B)
        lost = (r1.outcome == PairwiseOutcome.B, r2.outcome == PairwiseOutcome.A)
        by_hand.append(1.0 if all(won) else 0.0 if all(lost) else 0.5)
    assert suite.table["value"][0] == pytest.approx(np.mean(by_hand))
    assert suite.per_item["rm"]["score"].tolist() == by_hand
    assert suite.per_item["rm"]["completion"].tolist() == list(ours)


@pytest.mark.skipif(NO_SANDBOX is not None, reason=f"no sandbox here: {NO_SANDBOX}")
def test_humaneval_pass_at_k_by_hand():
    """A scripted policy answers problem 0 with its canonical solution and problem 1 with
    `return None`, in each of n = 2 samples: per problem pass@1 = pass@2 = 1, 0; mean 0.5."""
    from posttrain.verifiers.humaneval import humaneval_problems

    problems = humaneval_problems()[:2]
    canonical = {problems[0]["question"]: problems[0]["canonical_solution"]}
    policy = _ScriptedPolicy(lambda q: canonical.get(q, "    return None\n"))
    s = HumanEvalSet(name="he", n=2, k=(1, 2), max_new_tokens=8, limit=2)
    suite = evaluate_suite(policy, [s], progress=False)
    assert dict(zip(suite.table["metric"], suite.table["value"])) == {"pass@1": 0.5, "pass@2": 0.5}
    assert suite.per_item["he"]["pass@1"].tolist() == [1.0, 0.0]
    assert (suite.table["n"] == 2).all() and (suite.table["errors"] == 0).all()


def _result(correct, questions=None, name="s"):
    """A hand-built SuiteResult: one accuracy row with its Wilson interval."""
    questions = questions or [f"q{i}" for i in range(len(correct))]
    per = pd.DataFrame({"question": questions, "correct": correct})
    low, high = wilson_interval(sum(correct), len(correct))
    row = dict(
        set=name,
        metric="accuracy",
        value=float(np.mean(correct)),
        ci_low=low,
        ci_high=high,
        n=len(correct),
        method="Wilson",
        excluded=0,
        errors=0,
        per_item_column="correct",
    )
    return SuiteResult(pd.DataFrame([row]), {name: per})


def test_regression_check_flags_a_worse_result_and_passes_an_identical_one(tmp_path):
    earlier, worse = _result([True] * 10), _result([False] * 10)
    table = regression_check(worse, earlier)
    [row] = table.to_dict("records")
    assert row["worse"] and row["difference"] == -1.0 and "paired" in row["method"]
    assert "s/accuracy got worse" in row["reason"]
    with pytest.raises(RegressionError, match="s/accuracy"):
        regression_check(worse, earlier, raise_on_regression=True)
    same = regression_check(_result([True] * 10), earlier.save(tmp_path / "old"))
    assert not same["worse"][0] and same["difference"][0] == 0.0
    # the current run holds other items: the intervals decide (0/10 vs 10/10 do not overlap)
    other = regression_check(_result([False] * 10, [f"x{i}" for i in range(10)]), earlier)
    assert other["worse"][0] and "overlap" in other["method"][0]
    close = regression_check(_result([True] * 9 + [False], [f"x{i}" for i in range(10)]), earlier)
    assert not close["worse"][0]
    with pytest.raises(ValueError, match="no \\(set, metric\\) in common"):
        regression_check(_result([True], name="other"), earlier)


def test_save_and_load_round_trip(tmp_path):
    s = ExactMatchSet(name="echo set/1", items=ITEMS, score_fn=_exact, max_new_tokens=2)
    suite = evaluate_suite(_ScriptedPolicy(), [s], progress=False)
    loaded = SuiteResult.load(suite.save(tmp_path))
    assert (tmp_path / "eval_suite.json").is_file()
    pd.testing.assert_frame_equal(loaded.table, suite.table, check_dtype=False)
    assert (
        loaded.per_item["echo set/1"]["correct"].tolist()
        == suite.per_item["echo set/1"]["correct"].tolist()
    )
    assert not regression_check(suite, tmp_path)["worse"].any()
    with pytest.raises(FileNotFoundError):
        SuiteResult.load(tmp_path / "missing")


def _ok(name="a"):
    return ExactMatchSet(name=name, items=ITEMS, score_fn=_exact)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: [], "sets=.*non-empty list of eval sets"),
        (lambda: [_ok("a"), _ok("a")], "sets\\[1\\].name='a' is a duplicate"),
        (
            lambda: [_ok(), object()],
            "sets\\[1\\] is a object; the eval-set types are ExactMatchSet",
        ),
        (
            lambda: [ExactMatchSet(name="a", items=ITEMS, score_fn=_exact, samples=-1)],
            "samples=-1; must be an int >= 0",
        ),
        (
            lambda: [HumanEvalSet(name="h", n=2, k=(1, 3))],
            "k=\\(1, 3\\); must be .* in \\[1, n=2\\]",
        ),
        (lambda: [ExactMatchSet(name="a", items=ITEMS)], "score_fn=None; must be a callable"),
        (
            lambda: [ExactMatchSet(name="a", items=ITEMS, score_fn=_exact, task=TaskConfig())],
            "exactly one of task=",
        ),
        (lambda: [ExactMatchSet(name="a", task=TaskConfig(eval_size=0))], "task.eval_size=0"),
        (lambda: [ExactMatchSet(name="", items=ITEMS, score_fn=_exact)], "name=''"),
        (
            lambda: [
                JudgeWinRateSet(
                    name="j", items=ITEMS, baseline_policy=_ScriptedPolicy(), judge=None
                )
            ],
            "judge=None; must be a PairwiseJudge",
        ),
        # found by probing: these used to start generating, or fail deep inside it
        (
            lambda: [ExactMatchSet(name="a", items="abc", score_fn=_exact)],
            "items='abc'; must be a non-empty list",
        ),
        (
            lambda: [
                _ok(),
                ExactMatchSet(name="b", items=[{"question": "q"}, {"q": 1}], score_fn=_exact),
            ],
            r"ExactMatchSet\('b'\).items\[1\]=\{'q': 1\}; must be a mapping with string 'question'",
        ),
        (
            lambda: [
                JudgeWinRateSet(
                    name="j",
                    items=[{"x": 1}],
                    baseline_policy=_ScriptedPolicy(),
                    judge=_ScriptedJudge([]),
                )
            ],
            r"items\[0\]=.*string 'question'",
        ),
        (lambda: [HumanEvalSet(name="h", n=2, k=(1, 1))], r"k=\(1, 1\); must be .*distinct ints"),
        (
            lambda: [HumanEvalSet(name="h", items=[{"question": "def f():"}])],
            r"items\[0\]=.*must be a mapping with string 'question' and 'test'",
        ),
        (lambda: [HumanEvalSet(name="h", top_p=0)], r"top_p=0; must be a number in \(0, 1\]"),
        (
            lambda: [HumanEvalSet(name="h", temperature=-1)],
            "temperature=-1; must be a finite number",
        ),
        (
            lambda: [ExactMatchSet(name="a", items=ITEMS, score_fn=_exact, temperature=True)],
            "temperature=True; must be a finite number > 0",
        ),
        (
            lambda: [
                ExactMatchSet(name="a", items=ITEMS, score_fn=_exact, temperature=float("inf"))
            ],
            "temperature=inf; must be a finite number > 0",
        ),
        (
            lambda: [ExactMatchSet(name="a", items=ITEMS, score_fn=_exact, chat="no")],
            "chat='no'; must be True or False",
        ),
    ],
)
def test_bad_input_raises_before_any_generation(make, match):
    policy = _NoGeneration()
    with pytest.raises(ValueError, match=match):
        evaluate_suite(policy, make(), progress=False)


def test_a_field_changed_after_construction_is_caught_before_generation():
    s = _ok("b")
    s.samples = -2
    with pytest.raises(ValueError, match="samples=-2"):
        evaluate_suite(_NoGeneration(), [_ok("a"), s], progress=False)


def _dup_rows():
    r = _result([True])
    return SuiteResult(pd.concat([r.table, r.table]), r.per_item)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: evaluate_suite(_NoGeneration(), [_ok()], seed=-1, progress=False),
            "seed=-1; must be an int >= 0",
        ),
        (lambda: evaluate_suite(_NoGeneration(), [_ok()], seed=1.5, progress=False), "seed=1.5"),
        (
            lambda: regression_check(_result([True]), _result([True]), num_resamples=0),
            "num_resamples=0; must be an int >= 1",
        ),
        (
            lambda: regression_check(_result([True]), 5),
            "earlier=5; must be a SuiteResult or a saved",
        ),
        (lambda: regression_check("x", _result([True])), "current='x'; must be a SuiteResult"),
        (lambda: regression_check(_dup_rows(), _result([True])), "lists a \\(set, metric\\) twice"),
        (lambda: bootstrap_mean_interval([1.0, float("nan")]), "values_N holds NaN"),
    ],
)
def test_bad_arguments_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_loaded_numeric_looking_and_empty_questions_still_pair(tmp_path):
    """Questions that pandas would read as numbers, NaN or missing keep their text on load, so
    the check stays paired: 8 items, each 1 -> 0, difference -1 on every item."""
    questions = ["01", "1", "1.0", "nan", "NA", "", " 2", "True"]
    _result([True] * 8, questions).save(tmp_path / "old")
    assert SuiteResult.load(tmp_path / "old").per_item["s"]["question"].tolist() == questions
    [row] = regression_check(_result([False] * 8, questions), tmp_path / "old").to_dict("records")
    assert row["method"] == "paired bootstrap on 8 items" and row["worse"]
    assert (row["ci_low"], row["ci_high"]) == (-1.0, -1.0)


def test_duplicate_questions_pair_row_for_row_when_in_the_same_order():
    """Questions a, a, b, b: earlier right on rows 0 and 2, now on none: per-row differences
    -1, 0, -1, 0 (mean -0.5). In another order the rows cannot be matched: interval overlap."""
    qs = ["a", "a", "b", "b"]
    [row] = regression_check(
        _result([False] * 4, qs), _result([True, False, True, False], qs)
    ).to_dict("records")
    want = paired_bootstrap_diff([False] * 4, [True, False, True, False])
    assert row["method"] == "paired bootstrap on 4 items" and want["difference"] == -0.5
    assert (row["ci_low"], row["ci_high"]) == (want["ci_low"], want["ci_high"])
    other = regression_check(
        _result([False] * 4, ["b", "a", "b", "a"]), _result([True, False, True, False], qs)
    )
    assert other["method"][0] == "interval overlap (items differ)"


def _scores(name, scores):
    per = pd.DataFrame({"question": [f"q{i}" for i in range(len(scores))], "score": scores})
    value = float(np.nanmean(scores)) if not np.isnan(scores).all() else float("nan")
    row = dict(
        set=name,
        metric="win_rate",
        value=value,
        ci_low=0.0,
        ci_high=1.0,
        n=int((~np.isnan(scores)).sum()),
        method="m",
        excluded=int(np.isnan(scores).sum()),
        errors=0,
        per_item_column="score",
    )
    return SuiteResult(pd.DataFrame([row]), {name: per})


def test_no_value_now_is_worse_and_the_paired_reason_uses_the_paired_items(capsys):
    """A judge that errs on every item gives no win rate: that fails the check against an
    earlier 0.75 rather than passing as "nothing to compare"."""
    judge = _ScriptedJudge([["error", "error"], ["error", "error"]])
    s = JudgeWinRateSet(
        name="j",
        items=[{"question": "q0"}, {"question": "q1"}],
        baseline_policy=_ScriptedPolicy(lambda q: "B"),
        judge=judge,
    )
    broken = evaluate_suite(_ScriptedPolicy(), [s])
    assert "no item scored (2 excluded)" in capsys.readouterr().out
    with pytest.raises(RegressionError, match="j/win_rate got worse: no value now .n=0, 2 excl"):
        regression_check(broken, _scores("j", [0.5, 1.0]), raise_on_regression=True)
    # earlier without a value (None in a hand-built table): nothing to compare, not worse
    earlier = _scores("j", [0.5, 1.0])
    earlier.table["value"] = earlier.table["value"].astype(object)
    earlier.table.loc[0, "value"] = None
    [row] = regression_check(_scores("j", [0.5, 1.0]), earlier).to_dict("records")
    assert not row["worse"] and row["reason"] == "j/win_rate: no value to compare"
    # earlier 0, 1, 1, 1 (0.75); now item 0 unscored, 1, 1, 1 (1.0): on the 3 items scored in
    # both the paired difference is 0, though the values differ by +0.25
    [row] = regression_check(_scores("j", [np.nan, 1, 1, 1]), _scores("j", [0.0, 1, 1, 1])).to_dict(
        "records"
    )
    assert row["difference"] == 0.25 and row["method"] == "paired bootstrap on 3 items"
    assert "paired difference +0.000" in row["reason"]


# A sampled completion may hold any byte the tokenizer has; each of these once split a row or a
# quoted field when a table was written with "\n" line ends (a bare "\r" was left unquoted).
ODD_COMPLETIONS = ["a\rb", "x\r", "\r\n", "\r", "a\nb", '"q"', 'say "hi",\r\nok', "a,b", "\x00z"]


@pytest.mark.parametrize("completion", ODD_COMPLETIONS)
def test_every_table_writer_round_trips_a_completion_with_line_breaks_and_quotes(
    completion, tmp_path
):
    from posttrain.workflows.reports import write_table

    table = pd.DataFrame(
        {
            "question": ["q0", "q1", "q2"],
            "completion": ["ok", completion, "z"],
            "score": [1.0, 0.25, 0.0],
            "correct": [True, False, False],
        }
    )
    write_table(table, tmp_path / "t.csv")
    back = pd.read_csv(tmp_path / "t.csv", keep_default_na=False)
    assert len(back) == 3 and back["completion"].tolist() == ["ok", completion, "z"]
    assert back["correct"].tolist() == [True, False, False]

    suite = _result([True, False, False], ["q0", completion, "q2"])
    loaded = SuiteResult.load(suite.save(tmp_path / "suite"))
    assert loaded.per_item["s"]["question"].tolist() == ["q0", completion, "q2"]
    assert loaded.per_item["s"]["correct"].tolist() == [True, False, False]
