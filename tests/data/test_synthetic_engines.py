"""Synthetic candidates sampled through a rollout engine (`generate_candidates(engine, ...)`):
the builtin engine gives the policy's own rows bit for bit; the vllm engine (the suite's shared
server, `vllm_server` in tests/conftest.py, synced first) gives the same rows at temperature 0.
The reference of the vllm test is the builtin engine's rows, computed without the server."""

import pytest
from _policy_helpers import drawn_policy
from _vllm_helpers import SharedServerEngine

from posttrain.data.synthetic import generate_candidates
from posttrain.policy.rollout_engine import BuiltinEngine

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["Hello", "1 + 1 =", {"question": "Name a colour.", "answer": "red"}, "Why?", "a b c"]


@pytest.fixture(scope="module")
def policy():
    return drawn_policy(0)


@pytest.mark.parametrize("chat", [True, False])
def test_the_builtin_engine_gives_the_policys_candidates(policy, chat):
    rows = generate_candidates(policy, PROMPTS, n=2, max_new_tokens=8, seed=3, chat=chat)
    with BuiltinEngine(policy) as engine:
        again = generate_candidates(engine, PROMPTS, n=2, max_new_tokens=8, seed=3, chat=chat)
    assert again == rows
    assert len(rows) == 2 * len(PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("chat", [True, False])
def test_the_vllm_engine_gives_the_same_candidates_at_temperature_0(vllm_server, policy, chat):
    settings = {"n": 2, "max_new_tokens": 12, "temperature": 0.0, "chat": chat}
    rows = generate_candidates(policy, PROMPTS, prompts_per_batch=2, **settings)
    vllm_server.sync_weights(policy)
    with SharedServerEngine(vllm_server) as engine:
        served = generate_candidates(engine, PROMPTS, prompts_per_batch=2, **settings)
    assert served == rows
    assert len({r["completion"] for r in rows}) > len(PROMPTS) // 2  # the answers vary
