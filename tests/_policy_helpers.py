"""A tiny policy whose every parameter is drawn by the test (tests/policy/): greedy outputs vary
by prompt and logits stay small, whatever `build_model`'s own initialisation is."""

from __future__ import annotations

import torch

from posttrain.policy import Policy


def drawn_policy(seed: int = 0, std: float = 0.1) -> Policy:
    """tiny-1m with RMSNorm scales at 1 and every other parameter ~ N(0, std^2), drawn from a
    generator seeded with `seed` in sorted parameter-name order."""
    policy = Policy.from_spec("tiny-1m", seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in sorted(policy.model.named_parameters()):
            w.copy_(
                torch.ones_like(w)
                if name.endswith("scale")  # RMSNorm
                else torch.randn(w.shape, generator=g) * std
            )
    return policy
