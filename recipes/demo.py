"""Demo job: build a tiny policy, generate from it, save it as a HF folder and reload it.

Run: `posttrain run demo [model.name=tiny-1m] [sampling.max_new_tokens=32] ...` or, in a
notebook, `main(Config(model=ModelConfig(name="tiny-2m")))`. An untrained model generates noise;
the demo shows the parts (policy, sampler with per-token log-probs, HF export) working end to
end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from posttrain.policy import Policy
from posttrain.workflows import ModelConfig, SamplingConfig, validate
from posttrain.workflows.config import fail, folder_path, seeds
from posttrain.workflows.task_data import check_seq_len


@dataclass(kw_only=True)
class Config:
    """The demo's policy, prompts and sampling. It samples with the policy itself
    (`Policy.generate`, before and after a save and reload), so it has no `rollout` section: the
    engine is what the other recipes choose. Raises ValueError in `__post_init__` naming the
    dotted field."""

    model: ModelConfig = field(default_factory=ModelConfig)
    prompts: tuple[str, ...] = field(default=("What is 2 + 3?", "Say hello.", "1, 2, 3,"))
    sampling: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(temperature=0.8, max_new_tokens=24)
    )
    seed: int = 0
    out_dir: str = "runs/demo"

    def __post_init__(self) -> None:
        validate(self)

    def check(self, at: str) -> None:
        seeds(self, at, ("seed",))
        folder_path(self, at, "out_dir", "where the policy is saved")
        if (
            isinstance(self.prompts, str)
            or not isinstance(self.prompts, (list, tuple))
            or not self.prompts
            or not all(isinstance(p, str) and p for p in self.prompts)
        ):
            raise fail(f"{at}.prompts", self.prompts, "a non-empty list of non-empty strings")
        check_seq_len(self, at)
        limit = self.model.max_seq_len()
        longest = max(len(self.model.tokenizer().encode(p, add_bos=True)) for p in self.prompts)
        if limit is not None and longest + self.sampling.max_new_tokens > limit:
            raise fail(
                f"{at}.sampling.max_new_tokens",
                self.sampling.max_new_tokens,
                f"at most {limit - longest}: the longest prompt has {longest} tokens and "
                f"the model holds {limit}",
            )


def main(cfg: Config) -> pd.DataFrame:
    """Generate, save, reload, generate again; returns the table of sampled completions."""
    torch.manual_seed(cfg.seed)
    policy = (
        Policy.from_pretrained(cfg.model.init_from)
        if cfg.model.init_from
        else Policy.from_spec(cfg.model.name, seed=cfg.seed)
    )
    print(policy)
    prompts, s = list(cfg.prompts), cfg.sampling
    sampled = policy.generate(
        prompts,
        n=2,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=cfg.seed,
    )
    greedy = policy.generate(prompts, max_new_tokens=s.max_new_tokens, temperature=0.0)
    table = pd.DataFrame(
        {
            "prompt": [prompts[c.prompt_index] for c in sampled],
            "sample": [c.sample_index for c in sampled],
            # an untrained model emits arbitrary bytes: show control characters as U+FFFD
            "completion": [
                "".join(ch if ch.isprintable() else "\ufffd" for ch in c.text) for c in sampled
            ],
            "tokens": [len(c.token_ids) for c in sampled],
            "mean_logprob": [float(torch.as_tensor(c.logprobs).mean()) for c in sampled],
            "finish": [c.finish_reason for c in sampled],
        }
    )
    with pd.option_context("display.max_colwidth", 40, "display.width", 160):
        print(table.to_string(index=False))

    folder = Path(cfg.out_dir) / "policy"
    policy.save(folder)
    reloaded = Policy.from_pretrained(folder)
    again = reloaded.generate(prompts, max_new_tokens=s.max_new_tokens, temperature=0.0)
    same = [a.token_ids for a in again] == [g.token_ids for g in greedy]
    print(f"saved HF folder {folder}; reloaded greedy output identical: {same}")
    if not same:
        raise RuntimeError("reloaded policy generates differently from the saved one")
    return table


if __name__ == "__main__":
    main(Config())
