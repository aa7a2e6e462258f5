"""AsyncRLTrainer with a rollout engine apart from the policy: threads of the driver sample from a
vLLM server (no Ray, no policy copies), the server is synced every `sync_every` updates, and
every sample carries the version of the weights that drew it.

Checked independently of the stamps: with the stand-in server (`_vllm_fake`: the first token of
every sample is a function of the weights it holds), each trajectory's first token equals what
the server answers after a sync of the weights of its stamped version, taken from the trainer
after each update; with the real server (the shared `vllm_server`), each trajectory's sampled
log-probs equal `Policy.logprobs` under the weights of its stamped version (fp32, 1e-4) and
not under the next version's. The staleness bound: sync_every above max_staleness + 1 refused
by name, and a sync that does not take refused at the step it would train on a sample too old.
"""

import threading
from dataclasses import dataclass

import pytest
import torch
from _rl_helpers import toy_trainer
from _vllm_fake import fake_venv
from _vllm_helpers import SharedServerEngine

from posttrain.models import ByteTokenizer
from posttrain.policy import Policy
from posttrain.policy.rollout_engine import VLLMEngine
from posttrain.policy.vllm_sampling import ServedCompletion
from posttrain.policy.vllm_server import VLLMServer
from posttrain.rewards import VerifierResult
from posttrain.rl import StepResult
from posttrain.rl.async_engine import EngineWorkers
from posttrain.rl.async_rl import AsyncRLTrainer, rollout_schedule
from posttrain.rl.engine_rollout import ManagedEngine, StaleRolloutError
from posttrain.rl.lowbit_rollout import SAMPLER_METRICS

pytestmark = pytest.mark.usefixtures("one_thread")

WAIT_S = 60.0  # a generous bound on each wait for a thread of the test


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _recording_trainer(engine, snapshots, **kw):
    """`toy_trainer` on `engine`, keeping the policy's weights of every version in `snapshots`."""
    policy = Policy.from_spec("tiny-1m", seed=0)
    snapshots[0] = _snapshot(policy.model)

    def keep(trainer, row):
        snapshots[trainer.step_count] = _snapshot(trainer.policy.model)

    return toy_trainer(policy, lr=1e-2, rollout_engine=engine, callbacks=[keep], **kw)


def _stand_in_server(tmp_path) -> VLLMServer:
    """The stand-in server (4 requests at a time: its listen queue is Python's default 5)."""
    venv = fake_venv(tmp_path / "venv")
    return VLLMServer.start(
        Policy.from_spec("tiny-1m", seed=0), tmp_path / "run", venv=venv, max_concurrency=4
    )


def _with_weights(state) -> Policy:
    policy = Policy.from_spec("tiny-1m", seed=0)
    policy.model.load_state_dict(state)
    return policy


def test_bad_options_are_refused_by_name():
    """Threads need neither Ray nor its options; K - 1 > s would leave a step unsampleable."""
    with pytest.raises(ValueError, match=r"sync_every=3 with max_staleness=1: .* allowed: "):
        rollout_schedule(4, max_staleness=1, sync_every=3)
    trainer = toy_trainer(rollout_engine="vllm")  # by name: nothing starts before a rollout
    with pytest.raises(ValueError, match=r"sync_every=2 with max_staleness=0"):
        AsyncRLTrainer(trainer, max_staleness=0, sync_every=2)
    with pytest.raises(
        ValueError, match=r"num_threads=1 with rollout engine 'vllm'.*allowed: None"
    ):
        AsyncRLTrainer(trainer, num_threads=1)
    with pytest.raises(ValueError, match=r"worker_num_cpus=2"):
        AsyncRLTrainer(trainer, worker_num_cpus=2)


def test_schedule_by_hand_with_sync_every():
    """K = 2, s = 1: syncs at versions 2, 4; rollouts 2k, 2k+1 sample version 2k. From a
    resumed version 3 (not a multiple of K): 3, 3 (held), then 4 and 6 (the first sync >= j - s)."""
    versions = [v for _, v, _ in rollout_schedule(6, max_staleness=1, sync_every=2)]
    assert versions == [0, 0, 2, 2, 4, 4]
    assert [v for _, v, _ in rollout_schedule(4, max_staleness=1, sync_every=2, start=3)] == [
        3,
        3,
        4,
        6,
    ]
    assert [v for _, v, _ in rollout_schedule(4, max_staleness=2, sync_every=3)] == [0, 0, 0, 3]


def test_stand_in_server_samples_each_rollout_with_the_weights_of_its_version(tmp_path):
    """Two worker threads, s = 1, K = 2, four steps on the stand-in server: the stamps follow the
    schedule (syncs after updates 2 and 4 only), and the first token of every sample is the one
    the server gives for the weights of its stamped version (probed after the run, one sync
    per version)."""
    server = _stand_in_server(tmp_path)
    with server:
        snapshots: dict[int, dict] = {}
        trainer = _recording_trainer(VLLMEngine(server), snapshots)
        firsts = []
        with AsyncRLTrainer(trainer, max_staleness=1, sync_every=2, num_workers=2) as runner:
            rows = []
            for _ in range(4):
                rows.append(runner.step())
                trajectories = [t for g in trainer.last_groups for t in g]
                firsts.append({(t.policy_version, t.completion_ids[0]) for t in trajectories})
        expected = [v for _, v, _ in rollout_schedule(4, max_staleness=1, sync_every=2)]
        assert [r["policy_version"] for r in rows] == expected == [0, 0, 2, 2]
        assert [r["staleness"] for r in rows] == [0, 1, 0, 1]
        assert [r["weight_sync_s"] > 0 for r in rows] == [False, True, False, True]
        assert [c["lag"] for c in runner.consumed] == [lag for lag in (0, 1, 0, 1) for _ in "abcd"]
        assert all(set(SAMPLER_METRICS) <= r.keys() for r in rows)  # the policy rescored
        probe = VLLMEngine(server)
        token_of = {}
        for version in sorted(set(expected)):
            probe.sync(_with_weights(snapshots[version]))
            [answer] = probe.generate([[1, 2, 3]], max_new_tokens=1, temperature=0.0)
            token_of[version] = answer.token_ids[0]
        assert len(set(token_of.values())) == len(token_of)  # the versions are told apart
        assert firsts == [{(v, token_of[v])} for v in expected]


class _StubEngine:
    """A rollout engine apart from the policy, in-process: every answer is "ab" stamped with
    its version; `log` records each generate and sync with the version at that moment."""

    name, apart_from_policy = "stub", True

    def __init__(self):
        self.version, self.log = 0, []
        self.tokenizer, self.spec = ByteTokenizer(), Policy.from_spec("tiny-1m").spec

    def generate(self, prompts, *, seed=None, n=1, **sampling):
        self.log.append(("generate", self.version))
        ids = self.tokenizer.encode("ab")
        return [
            ServedCompletion(
                prompt_index=i,
                sample_index=j,
                prompt_ids=list(p),
                token_ids=ids,
                text="ab",
                logprobs=[-0.5] * len(ids),
                finish_reason="length",
                weight_version=self.version,
            )
            for i, p in enumerate(prompts)
            for j in range(n)
        ]

    def sync(self, policy, *, version=None):
        self.version = self.version + 1 if version is None else version
        self.log.append(("sync", self.version))
        return self.version

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _GatedTwoTurnEnv:
    """Turn 1 waits at `gate` (after setting `reached`) before its tool-like observation; turn
    2 ends the episode."""

    def __init__(self, reached, gate):
        self.reached, self.gate, self.turns = reached, gate, 0

    def initial_messages(self):
        return [{"role": "user", "content": "q"}]

    def step(self, text):
        self.turns += 1
        if self.turns == 1:
            self.reached.set()
            assert self.gate.wait(WAIT_S), f"the test did not open the gate in {WAIT_S} s"
            return StepResult(done=False, observation=[{"role": "tool", "content": "out"}])
        return StepResult(done=True, reward=1.0, verifier_result=VerifierResult.from_score(1.0))


@dataclass(frozen=True)
class _GatedBuilder:
    reached: threading.Event
    gate: threading.Event

    def make_envs(self, group_size):
        return [_GatedTwoTurnEnv(self.reached, self.gate) for _ in range(group_size)]


def test_a_sync_waits_for_the_rollout_in_flight_between_its_turns():
    """A two-turn rollout is between its turns (held at a gate) when the trainer syncs: the sync
    waits for the rollout, whose two turns are both drawn with version 0; only then version 1
    is loaded. (Without the wait the second turn would be drawn with the new weights under the
    first turn's stamp. The test's 0.5 s join is the time such a sync would have to run first.)"""
    engine, reached, gate = _StubEngine(), threading.Event(), threading.Event()
    workers = EngineWorkers(
        ManagedEngine(engine), Policy.from_spec("tiny-1m"), version=0, num_workers=1
    )
    options = dict(group_size=1, max_new_tokens=2, temperature=1.0, top_p=1.0)
    future = workers.submit(0, [_GatedBuilder(reached, gate)], 0, options)
    assert reached.wait(WAIT_S), f"the rollout did not reach its first step in {WAIT_S} s"
    syncing = threading.Thread(target=workers.sync, args=(Policy.from_spec("tiny-1m"), 1))
    syncing.start()
    syncing.join(0.5)
    gate.set()
    syncing.join(WAIT_S)
    assert not syncing.is_alive(), f"the sync did not end within {WAIT_S} s"
    groups, version, _ = future.result()
    workers.close()
    assert engine.log == [("sync", 0), ("generate", 0), ("generate", 0), ("sync", 1)]
    assert version == 0 and groups[0].trajectories[0].completion_mask.count(False) > 0


def test_a_sync_that_does_not_take_is_refused_at_the_step_it_would_train_stale(tmp_path):
    """An engine whose sync leaves its weights (and version) as they were: with s = 1 the
    rollout of step 2 is still drawn with version 0, two versions behind; the step refuses it
    by name and nothing of it is applied."""

    class NoSync(VLLMEngine):
        def sync(self, policy, *, version=None):
            return self.version

    server = _stand_in_server(tmp_path)
    with server:
        trainer = toy_trainer(rollout_engine=NoSync(server), lr=1e-2)
        with AsyncRLTrainer(trainer, max_staleness=1) as runner:
            runner.fit(2)
            before = _snapshot(trainer.policy.model)
            with pytest.raises(StaleRolloutError, match=r"drawn with weight version 0 .*version 2"):
                runner.step()
        assert trainer.step_count == 2
        assert all(torch.equal(before[k], v) for k, v in trainer.policy.model.state_dict().items())


def test_vllm_server_samples_each_rollout_with_the_weights_of_its_version(vllm_server):
    """The real server (shared; synced with the trainer's weights before the first rollout),
    s = 1, K = 2, three steps: each trajectory's vLLM log-probs equal the policy's recomputation
    under the weights of its stamped version (fp32, 1e-4), and differ from those under the
    weights one update later (the stamp is not off by one); the lagging steps log the
    engine/trainer mismatch."""
    snapshots: dict[int, dict] = {}
    trainer = _recording_trainer(SharedServerEngine(vllm_server), snapshots)
    groups = []
    with AsyncRLTrainer(trainer, max_staleness=1, sync_every=2) as runner:
        rows = []
        for _ in range(3):
            rows.append(runner.step())
            groups.append([t for g in trainer.last_groups for t in g])
    assert [r["policy_version"] for r in rows] == [0, 0, 2]
    assert [r["staleness"] for r in rows] == [0, 1, 0]
    for step, trajectories in enumerate(groups):
        version = rows[step]["policy_version"]
        assert {t.policy_version for t in trajectories} == {version}
        prompts = [t.prompt_ids for t in trajectories]
        sampled = [t.completion_ids for t in trajectories]
        served = torch.cat([torch.tensor(t.logprobs) for t in trajectories])
        drew = torch.cat(_with_weights(snapshots[version]).logprobs(prompts, sampled))
        later = torch.cat(_with_weights(snapshots[version + 1]).logprobs(prompts, sampled))
        assert (served - drew).abs().max() < 1e-4, step
        assert (served - later).abs().max() > 1e-3, step
    deltas = [r["rollout_logprob_delta_max"] for r in rows]  # trainer at j, sample at j - lag
    assert deltas[0] < 1e-4 and deltas[2] < 1e-4 and deltas[1] > 1e-3
