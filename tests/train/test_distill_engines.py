"""Distillation samples through a rollout engine: `teacher_generate(engine, ...)` and
`OnPolicyData(..., engine=...)`. The builtin engine gives the same rows and batches as the policy
bit for bit; the vllm engine (the suite's shared server, `vllm_server` in tests/conftest.py) is
synced with the student's weights by the data itself (the server may hold any weights when the
test begins) and gives the student's own greedy completions. References: `Policy.generate` and
`on_policy_batch(student, ...)` without an engine, computed without the server."""

import pytest
import torch
from _policy_helpers import drawn_policy
from _vllm_helpers import SharedServerEngine

from posttrain.data import SFTDataset, SFTLoader
from posttrain.policy.rollout_engine import BuiltinEngine
from posttrain.train.distill import OnPolicyData, on_policy_batch, teacher_generate

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["1+1=", "2+3=", "Say hi.", "Count to three."]


def loader(policy):
    rows = [{"prompt": p, "completion": "x"} for p in PROMPTS]
    dataset = SFTDataset(rows, policy.tokenizer, max_seq_len=64)
    return SFTLoader(dataset, batch_size=len(PROMPTS), shuffle=False)


def test_the_builtin_engine_gives_the_teachers_rows_and_the_students_batches():
    teacher, student = drawn_policy(2), drawn_policy(1)
    rows = teacher_generate(teacher, PROMPTS, n=2, max_new_tokens=6, seed=4)
    assert teacher_generate(BuiltinEngine(teacher), PROMPTS, n=2, max_new_tokens=6, seed=4) == rows
    assert len(rows) > len(PROMPTS)
    batches = []
    for engine in ("builtin", BuiltinEngine(student)):
        torch.manual_seed(7)  # the samples' seed comes from the global RNG, as in a Trainer
        with OnPolicyData(
            loader(student), student, lmbda=1.0, max_new_tokens=6, engine=engine
        ) as d:
            batches.append(d.next_batch())
    assert torch.equal(batches[0].input_ids, batches[1].input_ids)
    assert torch.equal(batches[0].labels, batches[1].labels)


def test_an_unknown_engine_is_refused_by_name():
    student = drawn_policy(1)
    with pytest.raises(ValueError, match=r"rollout_engine='vlm'; allowed: builtin, vllm"):
        OnPolicyData(loader(student), student, engine="vlm")


@pytest.mark.slow
def test_the_vllm_engine_samples_the_students_current_weights(vllm_server):
    student = drawn_policy(1)
    expected = on_policy_batch(
        student, loader(student).next_batch(), temperature=0.0, max_new_tokens=10
    )
    engine = SharedServerEngine(vllm_server)
    with OnPolicyData(
        loader(student), student, lmbda=1.0, temperature=0.0, max_new_tokens=10, engine=engine
    ) as data:
        batch = data.next_batch()
    assert torch.equal(batch.input_ids, expected.input_ids)
    assert torch.equal(batch.labels, expected.labels)
    assert engine.version == 1 and engine.closed is False  # synced once; the caller's to close
