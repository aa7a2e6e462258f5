"""Preference pairs sampled through a rollout engine (`make_preference_pairs(engine, ...)`):
the builtin engine gives the policy's own pairs bit for bit; the vllm engine (the suite's shared
server, `vllm_server` in tests/conftest.py, synced first) gives the same pairs at temperature 0.

The reference of the vllm test is the builtin engine's pairs, computed without the server. The
task's answer joins the candidates (`reference_answer`), so every prompt gives a pair (the
answer, scored 1, against a greedy sample, scored 0) and the comparison covers the sampled text.
"""

import pytest
from _policy_helpers import drawn_policy
from _vllm_helpers import SharedServerEngine

from posttrain.policy.rollout_engine import BuiltinEngine
from posttrain.preference import make_preference_pairs

pytestmark = pytest.mark.usefixtures("one_thread")

ITEMS = [{"question": f"{a} + {b} =", "answer": str(a + b)} for a in range(3) for b in range(3)]


def exact(text, item):
    return float(text.strip() == item["answer"])


def pairs(sampler, **settings):
    return make_preference_pairs(
        sampler,
        ITEMS,
        rank=exact,
        n=2,
        max_new_tokens=10,
        prompts_per_batch=4,
        reference_answer=lambda item: item["answer"],
        timeout_s=None,  # the ranker is exact string equality: run inline, no worker processes
        **settings,
    )


@pytest.fixture(scope="module")
def policy():
    return drawn_policy(0)


def test_the_builtin_engine_gives_the_policys_pairs(policy):
    rows, stats = pairs(policy, temperature=1.0, seed=5)
    with BuiltinEngine(policy) as engine:
        assert pairs(engine, temperature=1.0, seed=5) == (rows, stats)
    assert stats.pairs == len(ITEMS) and stats.reference_chosen == len(ITEMS)


@pytest.mark.slow
def test_the_vllm_engine_gives_the_same_pairs_at_temperature_0(vllm_server, policy):
    rows, stats = pairs(policy, temperature=0.0)
    vllm_server.sync_weights(policy)
    with SharedServerEngine(vllm_server) as engine:
        served_rows, served_stats = pairs(engine, temperature=0.0)
    assert served_rows == rows
    assert served_stats == stats
    assert stats.pairs == len(ITEMS)  # each prompt compared: the answer against its sample
    assert len({r["rejected"] for r in rows}) > 1  # the greedy samples differ by prompt
