"""Rollout engines in the RL trainer (posttrain.policy.rollout_engine, posttrain.rl.engine_rollout),
without vLLM: the builtin engine samples exactly what `Policy.generate` samples, engines are
chosen by name (an unknown one refused naming the allowed ones), every trajectory carries the
weight version that drew it, a sample older than the staleness bound is refused by name and its
step rolled back, and an engine apart from the policy has the old log-probs recomputed and the
mismatch metrics logged. tests/rl/test_vllm_rollout.py runs the same with a real vLLM server.

The engines apart from the policy here are small test classes that satisfy `RolloutEngine`
(`CopyEngine`: its own deep copy of the weights; `LaggingEngine`: a sync that does not move the
version), so the trainer's rules are checked in a second on the tiny-1m policy.
"""

import copy

import pytest
import torch
from _rl_helpers import ToyTask, toy_trainer

from posttrain.policy import Policy
from posttrain.policy.rollout_engine import (
    ROLLOUT_ENGINES,
    BuiltinEngine,
    RolloutEngine,
    build_rollout_engine,
)
from posttrain.rl.engine_rollout import ManagedEngine, StaleRolloutError
from posttrain.rl.lowbit_rollout import SAMPLER_METRICS
from posttrain.rl.rollout import collect_groups

pytestmark = pytest.mark.usefixtures("one_thread")


class LaggingEngine(BuiltinEngine):
    """Takes the new weights but keeps its version: its samples say they are old."""

    name = "lagging"

    def sync(self, policy, *, version=None):
        self.policy = policy
        return self.version


class CopyEngine(BuiltinEngine):
    """Samples with a deep copy of the weights it was last synced with (apart from the policy);
    with `frozen`, a sync moves the version but keeps the first weights (a sync that lies)."""

    name = "copy"
    apart_from_policy = True

    def __init__(self, policy, *, frozen=False):
        super().__init__(copy.deepcopy(policy))
        self.frozen, self.syncs = frozen, 0

    def sync(self, policy, *, version=None):
        self.syncs += 1
        if not self.frozen:
            self.policy = copy.deepcopy(policy)
        self.version = self.version + 1 if version is None else version
        return self.version


def test_the_registry_names_the_engines_and_refuses_others():
    assert ROLLOUT_ENGINES == ("builtin", "vllm")
    policy = Policy.from_spec("tiny-1m", seed=0)
    with pytest.raises(ValueError, match="unknown rollout engine 'vlm'.*builtin, vllm"):
        build_rollout_engine("vlm", policy)
    with pytest.raises(ValueError, match=r"rollout_engine='vlm'; allowed: builtin, vllm"):
        toy_trainer(policy, rollout_engine="vlm")
    with pytest.raises(TypeError, match="rollout_engine=3"):
        toy_trainer(policy, rollout_engine=3)
    with pytest.raises(ValueError, match="'vllm' needs run_dir"):
        build_rollout_engine("vllm", policy)
    engine = BuiltinEngine(policy, version=4)
    assert isinstance(engine, RolloutEngine) and isinstance(CopyEngine(policy), RolloutEngine)
    assert "version=4" in repr(engine) and "weight version</th><td>4" in engine._repr_html_()


@pytest.mark.parametrize(
    "options, field",
    [
        ({"rollout_quantization": "int8"}, "rollout_quantization='int8'"),
        ({"top_p": 0.9}, "top_p=0.9"),
        ({"max_staleness": -1}, "max_staleness=-1"),
    ],
)
def test_an_engine_apart_from_the_policy_refuses_what_it_cannot_score(options, field):
    with pytest.raises(ValueError, match=field):
        ManagedEngine("vllm", **options)
    if "max_staleness" not in options:  # the builtin engine takes each of them
        assert not ManagedEngine("builtin", **options).apart_from_policy


def test_the_builtin_engine_samples_what_policy_generate_samples():
    """The trainer's step-0 groups equal `collect_groups` on the policy itself (no engine) with
    the step's seed: same tokens, same log-probs (bitwise), every version 0; step 1's are 1."""
    trainer = toy_trainer()
    before = copy.deepcopy(trainer.policy)
    trainer.step()
    reference = collect_groups(
        before, ToyTask().builders(0, 4), group_size=4, max_new_tokens=3, seed=0
    )
    got = [t for g in trainer.last_groups for t in g]
    want = [t for g in reference for t in g]
    assert [t.completion_ids for t in got] == [t.completion_ids for t in want]
    assert [t.logprobs for t in got] == [t.logprobs for t in want]
    assert {t.policy_version for t in got} == {0}
    row = trainer.step()
    assert {t.policy_version for g in trainer.last_groups for t in g} == {1}
    assert not set(SAMPLER_METRICS) & set(row)  # the policy samples itself: nothing recomputed


def test_a_sample_older_than_the_staleness_bound_is_refused_and_its_step_rolled_back():
    policy = Policy.from_spec("tiny-1m", seed=0)
    trainer = toy_trainer(policy, rollout_engine=LaggingEngine(policy))
    trainer.step()  # version 0 at step 0
    rng = torch.get_rng_state()
    with pytest.raises(StaleRolloutError, match=r"16 of 16 .*version 0 .*at version 1 .*>= 1"):
        trainer.step()
    assert trainer.step_count == 1 and len(trainer.metrics) == 1  # nothing of step 2 applied
    assert torch.equal(torch.get_rng_state(), rng)
    # one version behind is within max_staleness=1; two are not
    lagging = toy_trainer(policy, rollout_engine=LaggingEngine(policy), max_staleness=1)
    lagging.fit(2)
    with pytest.raises(StaleRolloutError, match=r"version 0 .*at version 2 .*max_staleness=1"):
        lagging.step()


def test_an_engine_apart_from_the_policy_is_rescored_and_its_mismatch_logged():
    """The same weights in the engine: log-prob deltas at float rounding (the KV-cache sampler
    against the teacher-forced scorer, < 1e-4), k3 KL <= delta^2 / 2 (< 5e-9); the versions are
    the steps. A sync that keeps the first weights (lr 0.05: the policy moves) shows in the same
    columns, orders of magnitude larger."""
    policy = Policy.from_spec("tiny-1m", seed=0)
    engine = CopyEngine(policy)
    trainer = toy_trainer(policy, rollout_engine=engine, lr=0.05)
    versions = []
    trainer.callbacks.append(
        lambda t, row: versions.append({x.policy_version for g in t.last_groups for x in g})
    )
    metrics = trainer.fit(3)
    assert versions == [{0}, {1}, {2}] and engine.syncs == 3 and not engine.closed
    assert set(SAMPLER_METRICS) <= set(metrics.columns)
    assert (metrics["rollout_logprob_delta_max"] < 1e-4).all()
    assert (metrics["rollout_kl_mean"] < 5e-9).all()
    assert metrics["loss"].notna().all()

    policy = Policy.from_spec("tiny-1m", seed=0)
    stale = toy_trainer(policy, rollout_engine=CopyEngine(policy, frozen=True), lr=0.05)
    rows = stale.fit(3)
    assert rows["rollout_logprob_delta_max"].iloc[-1] > 100 * 1e-4
    assert rows["rollout_kl_mean"].iloc[-1] > 1e-3


def test_an_engine_built_by_name_is_closed_when_fit_ends_and_a_given_one_is_not():
    trainer = toy_trainer()
    trainer.fit(1)
    assert trainer.rollout.engine is None  # closed and dropped; the next rollout builds one
    built = []
    trainer.callbacks.append(lambda t, row: built.append(t.rollout.engine))
    trainer.fit(2)
    assert built[0].closed and built[0].version == 1
