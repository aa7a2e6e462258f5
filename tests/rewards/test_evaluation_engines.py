"""The evaluation harness samples through a rollout engine as through a policy
(`evaluate_generations(policy_or_engine, ...)`, via `posttrain.policy.generate_for_items`), and
so does a policy-backed judge (`LLMJudge(engine, ...)`).

References: the builtin engine must answer exactly as `Policy.generate` (the same table, bit for
bit, no vLLM needed); the vllm engine (the suite's shared server, `vllm_server` in
tests/conftest.py, synced to the policy first) must give the same greedy answers and accuracy as
the builtin one, which is computed without the server.
"""

import pytest
from _policy_helpers import drawn_policy
from _vllm_helpers import SharedServerEngine

from posttrain.policy import generate_for_items
from posttrain.policy.rollout_engine import BuiltinEngine
from posttrain.rewards.evaluation import evaluate_generations, evaluate_sampled

pytestmark = pytest.mark.usefixtures("one_thread")

ITEMS = [{"question": f"{a} + {b} =", "answer": str(a + b)} for a in range(3) for b in range(4)]


def even_length(text, item):
    """A score that splits the drawn policy's answers (its sums are never right)."""
    return float(len(text) % 2 == 0)


@pytest.fixture(scope="module")
def policy():
    return drawn_policy(0)


@pytest.mark.parametrize("chat", [True, False])
def test_the_builtin_engine_evaluates_as_the_policy(policy, chat):
    direct = evaluate_generations(policy, ITEMS, score_fn=even_length, max_new_tokens=8, chat=chat)
    with BuiltinEngine(policy) as engine:
        through = evaluate_generations(
            engine, ITEMS, score_fn=even_length, max_new_tokens=8, chat=chat
        )
    assert through.table.equals(direct.table)
    assert through.accuracy == direct.accuracy
    assert 0 < direct.accuracy < 1  # the score splits the answers: the comparison can fail
    sampled = evaluate_sampled(BuiltinEngine(policy), ITEMS[:4], score_fn=even_length, samples=2)
    assert sampled.table.equals(
        evaluate_sampled(policy, ITEMS[:4], score_fn=even_length, samples=2).table
    )


def test_an_object_that_cannot_sample_is_refused_by_name():
    with pytest.raises(TypeError, match=r"policy_or_engine is a dict; must be a Policy or a "):
        next(generate_for_items({}, ITEMS, batch_size=2))


@pytest.mark.slow
@pytest.mark.parametrize("chat", [True, False])
def test_the_vllm_engine_gives_the_same_greedy_answers_and_accuracy(vllm_server, policy, chat):
    builtin = evaluate_generations(
        policy, ITEMS, score_fn=even_length, max_new_tokens=12, chat=chat, batch_size=5
    )
    vllm_server.sync_weights(policy)
    with SharedServerEngine(vllm_server) as engine:
        served = evaluate_generations(
            engine, ITEMS, score_fn=even_length, max_new_tokens=12, chat=chat, batch_size=5
        )
    assert served.table["completion"].tolist() == builtin.table["completion"].tolist()
    assert served.table["finish_reason"].tolist() == builtin.table["finish_reason"].tolist()
    assert (served.accuracy, served.ci_low, served.ci_high) == (
        builtin.accuracy,
        builtin.ci_low,
        builtin.ci_high,
    )
    assert len(set(builtin.table["completion"])) > len(ITEMS) // 2  # answers vary


def _judge(sampler):
    from posttrain.rewards.judges import LLMJudge

    return LLMJudge(sampler, "Is it correct?", score_range=(0, 10), max_new_tokens=12)


def test_a_policy_backed_judge_samples_through_the_builtin_engine_as_the_policy(policy):
    completions = [f"{a + b}" for a in range(3) for b in range(4)]
    direct = _judge(policy).judge(completions, ITEMS)
    with BuiltinEngine(policy) as engine:
        assert _judge(engine).judge(completions, ITEMS) == direct
    assert len({r.raw for r in direct}) > len(ITEMS) // 2  # the verdict texts vary


@pytest.mark.slow
def test_a_policy_backed_judge_on_the_vllm_engine_gives_the_same_verdicts(vllm_server, policy):
    completions = [f"{a + b}" for a in range(3) for b in range(4)]
    direct = _judge(policy).judge(completions, ITEMS)
    vllm_server.sync_weights(policy)
    with SharedServerEngine(vllm_server) as engine:
        served = _judge(engine).judge(completions, ITEMS)
    assert [(r.outcome, r.raw, r.reason) for r in served] == [
        (r.outcome, r.raw, r.reason) for r in direct
    ]
