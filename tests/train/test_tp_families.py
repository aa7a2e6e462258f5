"""Tensor parallelism (tp=2, gloo) of the Qwen3 and Mistral families equals one process: loss,
every parameter's gradient, the gradient norm and the weights after an SGD step.

Qwen3's q/k norms act on the heads of one rank only; with torchtune's Llama TP plan alone their
scales stayed plain tensors and each rank kept its own heads' share of their gradient (seen: 0.06
off, ranks disagreeing). The plan now makes them replicated DTensors over the heads dimension, so
the gradient is summed over the tp ranks.

Tolerances: 1e-6 for gradients and weights (sharded sums rounded in another order; seen 5e-8),
loss equal to 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import tp_families_run as worker
from _ranks import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ATOL = 1e-6


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp_families")
    run_ranks(worker.__file__, 2, out, str(out), log_prefix="tp")
    return [torch.load(out / f"tp-rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("family", sorted(worker.SPECS))
def test_tp2_equals_one_process(ranks, family):
    single = worker.one_step(worker.SPECS[family])
    for rank, results in enumerate(ranks):
        tp = results[family]
        assert tp["loss"] == pytest.approx(single["loss"], abs=ATOL), rank
        assert tp["grad_norm"] == pytest.approx(single["grad_norm"], abs=ATOL), rank
        assert tp["grads"].keys() == single["grads"].keys()
        for name, grad in single["grads"].items():
            assert (tp["grads"][name] - grad).abs().max().item() <= ATOL, (rank, name)
        assert tp["weights"].keys() == single["weights"].keys()
        for name, weight in single["weights"].items():
            assert (tp["weights"][name] - weight).abs().max().item() <= ATOL, (rank, name)
    if family == "qwen3":  # the norms are there, and their gradients are not zero
        q_norm = single["grads"]["layers.0.attn.q_norm.scale"]
        assert q_norm.shape == (64,) and q_norm.abs().max().item() > 1e-3
