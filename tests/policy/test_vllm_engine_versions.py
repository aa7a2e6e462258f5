"""`VLLMEngine` stamps a sample with the engine version of the weights that drew it, even when a
sync (from another thread) lands between the server's answer and the engine's mapping of the
server's version to its own: the mapping is recorded per sync, not read as one offset at the
end. A stand-in server object in-process (no HTTP)."""

from dataclasses import dataclass

from posttrain.models import ByteTokenizer
from posttrain.policy import Policy
from posttrain.policy.rollout_engine import VLLMEngine
from posttrain.policy.vllm_sampling import ServedCompletion


@dataclass
class _Sync:
    version: int


class _Server:
    """Answers one "ab" per prompt stamped with its weight version at the draw; `during` runs
    after the draw and before the answer returns (where a sync from another thread may land)."""

    def __init__(self):
        self.weight_version, self.during = 0, None
        self.tokenizer, self.spec = ByteTokenizer(), Policy.from_spec("tiny-1m").spec

    def generate(self, prompts, *, seed=None, **sampling):
        drawn = self.weight_version
        answers = [
            ServedCompletion(
                prompt_index=i,
                sample_index=0,
                prompt_ids=list(p),
                token_ids=[97, 98],
                text="ab",
                logprobs=[-0.5, -0.5],
                finish_reason="length",
                weight_version=drawn,
            )
            for i, p in enumerate(prompts)
        ]
        if self.during is not None:
            self.during()
        return answers

    def sync_weights(self, policy):
        self.weight_version += 1
        return _Sync(self.weight_version)


def test_a_sync_between_the_draw_and_the_stamp_does_not_change_the_stamp():
    server, policy = _Server(), Policy.from_spec("tiny-1m")
    engine = VLLMEngine(server, version=0)
    assert engine.sync(policy, version=2) == 2  # server 1 = engine 2 (a sync every 2 updates)
    server.during = lambda: engine.sync(policy, version=4)  # server 2 = engine 4
    [sample] = engine.generate([[1, 2]], max_new_tokens=2)
    assert sample.weight_version == 2  # drawn by server version 1 (an offset read late: 3)
    server.during = None
    assert engine.version == 4 and engine.generate([[1]])[0].weight_version == 4


def test_versions_count_on_from_the_latest_sync():
    """A sync without a version is the next one; a server synced behind the engine's back
    counts on from the latest version the engine mapped."""
    server, policy = _Server(), Policy.from_spec("tiny-1m")
    server.weight_version = 5  # a shared server that others synced before
    engine = VLLMEngine(server, version=10)
    assert engine.version == 10 and engine.sync(policy) == 11
    server.sync_weights(policy)  # not through the engine
    assert engine.version == 12 and engine.generate([[1]])[0].weight_version == 12
