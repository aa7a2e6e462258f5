"""The toy RL task the RL tests share: a prompt per environment, reward 1 when the completion
starts with an ASCII character, an environment that raises every k-th prompt, and `toy_trainer`,
an `RLTrainer` on the tiny-1m policy with GRPO at group size 4."""

from dataclasses import dataclass

import torch

from posttrain.policy import Policy
from posttrain.rewards import VerifierResult
from posttrain.rl import RLAlgorithm, RLTrainer, StepResult, ValueHead


def _ascii_first(text: str) -> float:
    """The toy reward: 1 when the completion starts with an ASCII character, else 0."""
    return 1.0 if text and ord(text[0]) < 128 else 0.0


class ToyEnv:
    def __init__(self, prompt: str, raises: bool = False):
        self.prompt, self.raises = prompt, raises

    def initial_messages(self):
        return [{"role": "user", "content": self.prompt}]

    def step(self, text):
        if self.raises:
            raise RuntimeError("broken environment")
        score = _ascii_first(text)
        return StepResult(done=True, reward=score, verifier_result=VerifierResult.from_score(score))


@dataclass(frozen=True)
class ToyBuilder:
    prompt: str
    raises: bool = False

    def make_envs(self, group_size):
        return [ToyEnv(self.prompt, self.raises) for _ in range(group_size)]


@dataclass
class ToyTask:
    broken_every: int = 0  # every k-th prompt's environment raises (0: never)

    def builders(self, batch_index, batch_size):
        ids = [batch_index * batch_size + j for j in range(batch_size)]
        return [
            ToyBuilder(f"q{i}", bool(self.broken_every) and i % self.broken_every == 0) for i in ids
        ]

    def held_out(self, n):
        return []


def toy_trainer(policy=None, *, algo=None, lr=1e-3, task=None, optimizer=torch.optim.AdamW, **kw):
    policy = policy or Policy.from_spec("tiny-1m", seed=0)
    algo = algo or RLAlgorithm.grpo(group_size=4, kl_coef=0.0)
    head = ValueHead(policy.spec.embed_dim) if algo.use_value_head else None
    params = list(policy.model.parameters()) + (list(head.parameters()) if head else [])
    return RLTrainer(
        policy,
        optimizer(params, lr=lr),
        task=task or ToyTask(),
        algo=algo,
        prompts_per_step=4,
        max_new_tokens=3,
        value_head=head,
        progress=False,
        **kw,
    )


def is_int8(weight) -> bool:
    """Whether `weight` is a torchao int8 tensor (the int8 rollout copy's linears)."""
    from torchao.quantization import Int8Tensor

    return isinstance(weight, Int8Tensor) and weight.qdata.dtype == torch.int8
