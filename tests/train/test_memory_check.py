"""The trainer's memory check plans with the optimizer it was given: an SGD run of the
Qwen2.5-0.5B shape was refused for 1.8 GiB of AdamW moments per rank that SGD does not keep."""

from __future__ import annotations

import pytest
import torch
from _train_helpers import sft_dataset

from posttrain.data import SFTLoader
from posttrain.models import get_preset
from posttrain.train import ParallelPlan, PlanRuntime
from posttrain.train.memory_check import check_memory, optimizer_states_of
from posttrain.train.memory_plan import plan_memory

QWEN_05B_PARAMETERS = 494_032_768  # Qwen2.5-0.5B's model card (tied embeddings)


def _param() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize(
    ("make", "states"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), 0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
        (lambda p: torch.optim.Adam(p), 2),
        (lambda p: torch.optim.AdamW(p), 2),
        (lambda p: torch.optim.AdamW(p, amsgrad=True), 3),  # max_exp_avg_sq too
        (lambda p: torch.optim.Adagrad(p), "adamw"),  # unknown: the large common case
    ],
)
def test_optimizer_states_of_counts_what_torch_keeps(make, states):
    assert optimizer_states_of(make(_param())) == states


def test_optimizer_states_match_the_state_torch_allocates():
    """Independent count: the tensors torch holds per parameter after one step."""
    for opt in (torch.optim.SGD, torch.optim.AdamW):
        params = [torch.nn.Parameter(torch.ones(8))]
        kw = {"lr": 0.1, "momentum": 0.9} if opt is torch.optim.SGD else {"amsgrad": True}
        o = opt(params, **kw)
        params[0].grad = torch.ones(8)
        o.step()
        held = [t for t in o.state[params[0]].values() if torch.is_tensor(t) and t.numel() == 8]
        assert optimizer_states_of(o) == len(held)


def test_check_memory_plans_with_the_trainers_optimizer():
    """On a device that holds the SGD run but not AdamW's moments (8 bytes per parameter, one
    rank), the SGD optimizer passes and AdamW is refused naming the optimizer state."""
    spec = get_preset("qwen2.5-0.5b")
    runtime = PlanRuntime(
        model=torch.nn.Linear(2, 2),
        plan=ParallelPlan(),
        mesh=None,
        data_rank=0,
        data_group=None,
        fsdp=False,
        spec=spec,
    )
    loader = SFTLoader(sft_dataset(8, max_seq_len=64), batch_size=2)
    batch = {"micro_batch_size": 2, "seq_len": max(loader._lengths)}
    sgd_peak = plan_memory(spec, None, batch, optimizer="sgd", device_type="cpu").attrs[
        "peak_bytes"
    ]
    adamw_peak = plan_memory(spec, None, batch, device_type="cpu").attrs["peak_bytes"]
    assert adamw_peak - sgd_peak >= 8 * QWEN_05B_PARAMETERS  # the moments, at least
    device = sgd_peak + 2**20
    params = _param()
    check_memory(runtime, loader, device_bytes=device, optimizer=torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="optimizer state"):
        check_memory(runtime, loader, device_bytes=device, optimizer=torch.optim.AdamW(params))
