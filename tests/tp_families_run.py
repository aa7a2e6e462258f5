"""One rank of tests/train/test_tp_families.py; run as a subprocess.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT python tests/tp_families_run.py RANK 2 OUT_DIR

Each family of `SPECS` under `ParallelPlan(tp=2)`: one forward/backward of a fixed batch, then one
SGD step; the results go to OUT_DIR/tp-rank{RANK}.pt. `one_step(spec)` without a plan is the
single-process reference the test runs itself.
"""

from __future__ import annotations

import torch
from _ranks import gloo_rank

from posttrain.models import build_model, get_preset
from posttrain.models.specs import ModelSpec
from posttrain.train import ParallelPlan

SPECS = {  # two blocks of each: Qwen3's per-head q/k norms (head_dim 64 = 2 x 128 / 4), Mistral
    "qwen3": get_preset("tiny-qwen3-1m").replace(num_layers=2),
    "mistral": get_preset("tiny-mistral-1m").replace(num_layers=2),
}


def one_step(spec: ModelSpec, plan: ParallelPlan | None = None) -> dict:
    """{loss, grad_norm, grads: name -> full gradient, weights: full state dict after one SGD
    step} of a model whose every parameter is drawn here (norm scales 1 + N(0, 0.3^2), so the
    q/k norm gradients matter; the rest N(0, 0.1^2))."""
    model = build_model(spec, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if name.endswith("scale") else 0.1 * noise)
    runtime = plan.parallelize(model, spec=spec) if plan is not None else None
    tokens_BT = torch.randint(
        0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2)
    )
    logits_BTV = model(tokens_BT)
    loss = torch.nn.functional.cross_entropy(
        logits_BTV.flatten(0, 1).float(), tokens_BT.roll(-1, 1).flatten()
    )
    loss.backward()
    params = list(model.parameters())
    if runtime is None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        norm = runtime.grad_norm(params)
    grads = {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        for name, p in model.named_parameters()
    }
    torch.optim.SGD(params, lr=0.5).step()
    weights = (
        {k: v.detach().clone() for k, v in model.state_dict().items()}
        if runtime is None
        else runtime.full_state_dict()
    )
    return dict(loss=loss.item(), grad_norm=float(norm), grads=grads, weights=weights)


if __name__ == "__main__":
    with gloo_rank() as args:
        results = {name: one_step(spec, ParallelPlan(tp=2)) for name, spec in SPECS.items()}
        torch.save(results, args.out / f"tp-rank{args.rank}.pt")
