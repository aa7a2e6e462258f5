"""Stand-ins for the parts of a TRL trainer its loss code reads, so TRL's own `_compute_loss` runs
on given log-probs (tests/preference/test_preference.py, tests/preference/test_dpo_family.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class _Accelerator:
    """Single process: gathers are the identity; `gathered` keeps what TRL gathered, in order."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.gathered: list[torch.Tensor] = []

    def gather(self, x):
        self.gathered.append(x)
        return x

    def gather_for_metrics(self, x):
        return x


class _FixedLogps:
    """Stands in for the model of a TRL trainer. Rows whose first input id is 2 are KTO's
    mismatched (KL) rows. Returns per-token log-probs [rows, T-1] that sum to the given values."""

    training = True

    def __init__(self, logps, kl_logps=None) -> None:
        self.logps, self.kl_logps = logps, kl_logps

    def __call__(self, *, input_ids, **kwargs):
        values = self.kl_logps if int(input_ids[0, 0]) == 2 else self.logps
        per_token = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1)
        per_token[:, 0] = values
        zeros = torch.zeros_like(per_token)
        return SimpleNamespace(
            log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool()
        )


def _close(ours, theirs, tol=1e-6):
    """|ours - theirs| <= tol, relative to |theirs| where that exceeds 1 (IPO's squared losses
    reach ~25-400 here, where fp32 resolves ~2e-6 to 3e-5 absolute)."""
    ours, theirs = torch.as_tensor(ours).float(), torch.as_tensor(theirs).float()
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    if ours.numel():
        excess = (ours - theirs).abs() / theirs.abs().clamp(min=1.0)
        worst = float(excess.max())
        assert worst <= tol, f"largest (relative) difference {worst:.3g}"
