"""`RLTrainer(loss_chunk_tokens=)`: every scoring of the rows (the policy's log-probs, entropy and
values in the update, the reference's log-probs, the policy's frozen log-probs of a low-bit
sampler's rows or under a rollout correction, the old values) runs the head and log-softmax in
chunks, and a step equals the unchunked step (the independent path: full [B, T, V] logits) to
fp32 rounding; bad values and sequence parallelism are refused by name before any work."""

import pytest
import torch
from _rl_helpers import toy_trainer

import posttrain.rl.update as update
from posttrain.policy import Policy
from posttrain.rl import RLAlgorithm
from posttrain.train import ParallelPlan
from posttrain.train.runtime import LocalRuntime

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_a_chunked_ppo_step_scores_every_pass_in_chunks_and_equals_the_unchunked_step(
    monkeypatch,
):
    """PPO with a value head, a KL term (a reference copy), an entropy bonus (its gradient goes
    through the chunks) and a rollout correction (the policy's old log-probs are recomputed):
    one step with 3 response tokens a chunk against one with full logits, SGD so that the
    weights move linearly in the gradients. Every metric within 1e-6, every weight within 1e-6
    (fp32 rounding of sums taken in another order: seen ~1e-8)."""
    calls = []
    score_rows = update.score_rows

    def spy(model, m, **kw):
        calls.append((model, kw["value_head"] is not None, kw["entropy"], kw["chunk_tokens"]))
        return score_rows(model, m, **kw)

    monkeypatch.setattr(update, "score_rows", spy)
    algo = RLAlgorithm.ppo(
        minibatch_size=4,
        ppo_epochs=1,
        kl_coef=0.05,
        entropy_coef=0.01,
        rollout_correction="token_tis",
    )
    options = dict(algo=algo, lr=0.5, optimizer=torch.optim.SGD)
    plain = toy_trainer(**options)
    row_plain = plain.step()
    assert {c[3] for c in calls} == {None}
    calls.clear()
    chunked = toy_trainer(**options, loss_chunk_tokens=3)
    row_chunked = chunked.step()

    model, reference = chunked.policy.model, chunked.reference
    assert reference is not None and reference is not model
    passes = {(m is model, m is reference, values, entropy) for m, values, entropy, _ in calls}
    assert passes == {
        (False, True, False, False),  # the reference's log-probs
        (True, False, False, False),  # the policy's frozen (old) log-probs
        (True, False, True, False),  # the old values
        (True, False, True, True),  # the update: log-probs, entropy, values
    }
    assert {c[3] for c in calls} == {3}
    assert row_plain["vf_loss"] > 0 and row_plain["grad_norm"] > 0
    numbers = [k for k in row_plain if not k.endswith("_s") and "per_s" not in k and k != "mfu"]
    assert row_chunked.keys() == row_plain.keys()
    for k in numbers:
        assert row_chunked[k] == pytest.approx(row_plain[k], abs=1e-6, nan_ok=True), k
    for (name, p), q in zip(model.named_parameters(), plain.policy.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    torch.testing.assert_close(
        chunked.value_head.proj.weight, plain.value_head.proj.weight, atol=1e-6, rtol=0
    )


@pytest.fixture(scope="module")
def policy():
    return Policy.from_spec("tiny-1m", seed=0)


@pytest.mark.parametrize("bad", [0, -4, True, 2.5, "512"])
def test_a_bad_loss_chunk_tokens_is_refused_by_name(policy, bad):
    with pytest.raises(ValueError, match=r"loss_chunk_tokens=.*None .* integer >= 1"):
        toy_trainer(policy, loss_chunk_tokens=bad)


def test_chunks_under_sequence_parallelism_are_refused_before_any_work(policy):
    """Under sp each rank's head would see a slice of every row: refused at construction (the
    runtime stands for one of an sp=2 plan; nothing runs before the refusal)."""
    runtime = LocalRuntime(policy.model, replicas=False)
    runtime.plan = ParallelPlan(sp=2)  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"loss_chunk_tokens=8 with .*sp=2.*sequence"):
        toy_trainer(policy, loss_chunk_tokens=8, runtime=runtime)


def test_chunks_with_a_float8_head_are_refused_before_any_work():
    """A float8 output projection would scale each chunk by its own amax
    (`posttrain.policy.chunked_ce.check_chunkable_head`): refused when the trainer is built."""
    import dataclasses

    from _train_helpers import TINY

    from posttrain.models import ByteTokenizer, build_model
    from posttrain.train.float8 import Float8Config, apply_float8

    spec = dataclasses.replace(TINY, tie_word_embeddings=False)
    model = build_model(spec, seed=0)
    apply_float8(model, Float8Config(skip_modules=()))
    with pytest.raises(ValueError, match=r"loss_chunk_tokens with a float8 output projection"):
        toy_trainer(Policy(model, ByteTokenizer(), spec), loss_chunk_tokens=8)
