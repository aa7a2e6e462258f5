"""The weight sync columns of RL metrics rows (posttrain.rl.engine_rollout.ManagedEngine.
sync_metrics), without vLLM: `weight_sync_s` is 0.0 with the builtin engine (nothing moves), and
with an engine apart from the policy it is the seconds of the sync before each rollout, a part
of `time_scoring_s`, with the engine's own split (`last_sync`: save / reload / reset) summed per
step. tests/rl/test_vllm_rollout.py checks the same columns with a real vLLM server.
"""

import copy
import json

import pytest
from _rl_helpers import toy_trainer

from posttrain.policy import Policy
from posttrain.policy.rollout_engine import BuiltinEngine
from posttrain.policy.vllm_server import WeightSync

pytestmark = pytest.mark.usefixtures("one_thread")

SPLIT = {"save_s": 0.25, "reload_s": 0.5, "reset_s": 0.125}  # what the engine reports


class SplitEngine(BuiltinEngine):
    """Samples with its own deep copy of the weights (apart from the policy) and reports each
    sync's split as `VLLMEngine` does (`last_sync`, a new `WeightSync` per sync)."""

    name = "split"
    apart_from_policy = True

    def __init__(self, policy):
        super().__init__(copy.deepcopy(policy))
        self.last_sync = None

    def sync(self, policy, *, version=None):
        self.policy = copy.deepcopy(policy)
        self.version = self.version + 1 if version is None else version
        self.last_sync = WeightSync(version=self.version, nbytes=1, **SPLIT)
        return self.version


def test_the_builtin_engine_logs_no_sync_time():
    metrics = toy_trainer().fit(2)
    assert metrics["weight_sync_s"].tolist() == [0.0, 0.0]
    assert not [c for c in metrics.columns if c.startswith("weight_sync_") and c != "weight_sync_s"]


def test_an_engine_apart_from_the_policy_logs_each_sync_and_its_split(tmp_path):
    """A given engine is synced before every rollout, the first included; the columns reach the
    run's metrics file."""
    policy = Policy.from_spec("tiny-1m", seed=0)
    trainer = toy_trainer(policy, rollout_engine=SplitEngine(policy), run_dir=tmp_path)
    metrics = trainer.fit(3)
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_sync_s"] for r in written] == metrics["weight_sync_s"].tolist()
    assert [r["weight_sync_reload_s"] for r in written] == [SPLIT["reload_s"]] * 3
    assert (metrics["weight_sync_s"] > 0).all()
    assert (metrics["weight_sync_s"] <= metrics["time_scoring_s"]).all()  # a part of it
    for part, seconds in SPLIT.items():
        assert metrics[f"weight_sync_{part}"].tolist() == [seconds] * 3
