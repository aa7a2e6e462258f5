"""The runtime a trainer holds (`posttrain.train.runtime`): applying a plan stores nothing on the
model; a process without a plan (`LocalRuntime`) and a plan of one rank (`PlanRuntime` on a
1-rank gloo group, with and without FSDP2) take the same steps; every trainer updates through
the engine's one `update`; the earlier `plan.apply` / `plan=` / `plan_state` spelling still works
with a DeprecationWarning; misused runtimes are refused by name.

The process group of the 1-rank cases lives in this process for one test and is destroyed after it
(a file store in tmp_path, no port).
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _train_helpers import TINY, assert_bitwise_equal, params_of, sft_dataset

from posttrain.data import SFTLoader
from posttrain.models import build_model
from posttrain.train import LocalRuntime, ParallelPlan, PlanRuntime, Runtime, Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SDK = Path(__file__).resolve().parents[2] / "sdk"


@pytest.fixture
def one_rank_group(tmp_path):
    """An initialised gloo process group of one rank (this process), destroyed afterwards."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _plan_attributes(model: torch.nn.Module) -> list[str]:
    """Attributes of `model` or a submodule that name posttrain or a plan, or hold a runtime."""
    found = []
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if "posttrain" in name or "plan" in name.lower() or isinstance(value, Runtime):
                found.append(f"{prefix}.{name}" if prefix else name)
    return found


def _train(model: torch.nn.Module, runtime: Runtime | None, steps: int = 3) -> dict:
    """SGD with momentum, batch 4 x accumulation 2, clipping at 0.5 (active: the norms are
    ~1-2), on 9 rows (the last step's second micro-batch has one row)."""
    loader = SFTLoader(sft_dataset(9), batch_size=4, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(
        model,
        opt,
        data=loader,
        grad_accum_steps=2,
        max_grad_norm=0.5,
        progress=False,
        runtime=runtime,
    )
    metrics = trainer.fit(steps)
    assert max(metrics["grad_norm"]) > 0.5  # the clipping acted
    full = (runtime or trainer.runtime).full_state_dict()
    return {
        "losses": metrics["loss"].tolist(),
        "grad_norms": metrics["grad_norm"].tolist(),
        "params": full,
        "runtime": trainer.runtime,
    }


# ---------------------------------------------------------------------- nothing on the model
def test_a_one_rank_plan_without_a_process_group_leaves_nothing_on_the_model():
    model = build_model(TINY, seed=0)
    before = set(vars(model))
    runtime = ParallelPlan(activation_checkpointing=True).parallelize(model, spec=TINY)
    assert isinstance(runtime, PlanRuntime) and runtime.model is model
    assert (runtime.data_rank, runtime.data_size, runtime.mesh) == (0, 1, None)
    assert set(vars(model)) == before
    assert _plan_attributes(model) == []


def test_fsdp2_on_a_one_rank_group_leaves_nothing_on_the_model(one_rank_group):
    model = build_model(TINY, seed=0)
    runtime = ParallelPlan(param_dtype="float32").parallelize(model, spec=TINY)  # FSDP2
    assert runtime.fsdp and runtime.mesh is not None and runtime.spec == TINY
    assert _plan_attributes(model) == []


# ---------------------------------------------------------------------- local == one-rank plan
def test_local_runtime_and_one_rank_plan_runtimes_take_the_same_steps(one_rank_group):
    """No plan vs ParallelPlan() on a 1-rank group (mesh of size-1 axes; the plan's norm,
    clipping and sums) vs FSDP2 on that one rank (param_dtype float32: DTensor parameters and
    gradients). The first two are bitwise equal; FSDP2's gradients go through a reduce-scatter
    of one rank and DTensor norms (seen equal here; bound 1e-6)."""
    local = _train(build_model(TINY, seed=0), None)
    assert isinstance(local["runtime"], LocalRuntime)
    plain = build_model(TINY, seed=0)
    planned = _train(plain, ParallelPlan().parallelize(plain, spec=TINY))
    assert planned["losses"] == local["losses"]
    assert planned["grad_norms"] == local["grad_norms"]
    assert_bitwise_equal(planned["params"], local["params"])
    sharded = build_model(TINY, seed=0)
    fsdp = _train(sharded, ParallelPlan(param_dtype="float32").parallelize(sharded, spec=TINY))
    assert max(abs(a - b) for a, b in zip(fsdp["losses"], local["losses"])) <= 1e-6
    assert (
        max(float((fsdp["params"][k] - local["params"][k]).abs().max()) for k in local["params"])
        <= 1e-6
    )


def test_runtimes_answer_the_data_rank_questions_alike():
    """LocalRuntime of one process: rank 0 of 1, sums return the value itself, rows and
    objects come back as given."""
    runtime = LocalRuntime(build_model(TINY, seed=0))
    value = torch.tensor(3.0)
    assert runtime.sum_over_data_ranks(value) is value
    rows = {"x_B": torch.arange(3)}
    assert runtime.gather_rows(rows, [3]) is rows
    assert runtime.gather_objects("a") == ["a"]
    assert runtime.reduce_metrics(rows) is rows
    assert not runtime.sharded and runtime.describe() == ""


# ---------------------------------------------------------------------- one update method
def test_every_optimizer_step_in_the_sdk_is_the_engines_update():
    """clip -> optimizer.step -> schedule -> zero_grad is written once (`Engine.update`), and the
    schedule is stepped in one place (`Engine._step_schedule`, which RL calls once per RL step
    after its minibatch updates): no other function of the SDK calls an optimizer's step() or
    steps a scheduler."""
    calls = []
    for path in SDK.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for call in ast.walk(node):
                    if (
                        isinstance(call, ast.Call)
                        and isinstance(call.func, ast.Attribute)
                        and call.func.attr == "step"
                        and ast.unparse(call.func.value).endswith(("optimizer", "lr_scheduler"))
                    ):
                        calls.append(f"{path.relative_to(SDK)}:{node.name}")
    assert sorted(set(calls)) == ["train/engine.py:_step_schedule", "train/engine.py:update"]


def test_a_non_finite_update_applies_nothing_and_rolls_the_step_back():
    from posttrain.train.losses import NonFiniteLossError

    model = build_model(TINY, seed=0)
    loader = SFTLoader(sft_dataset(8), batch_size=4, seed=0)
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data=loader, progress=False
    )
    with torch.no_grad():
        model.norm.scale.fill_(float("nan"))  # every logit NaN: the loss and the norm too
    before, position = params_of(model), loader.state_dict()
    with pytest.raises(NonFiniteLossError, match="step 1"):
        trainer.step()
    assert trainer.step_count == 0 and trainer._rolled_back
    assert loader.state_dict() == position
    assert all(p.grad is None for p in model.parameters())
    after = params_of(model)  # SGD did not step: every weight as it was (NaN where it was)
    assert all(torch.equal(after[k].nan_to_num(), before[k].nan_to_num()) for k in before)


# ---------------------------------------------------------------------- misuse
def test_a_runtime_of_another_model_or_not_a_runtime_is_refused():
    model, other = build_model(TINY, seed=0), build_model(TINY, seed=0)
    loader = SFTLoader(sft_dataset(8), batch_size=4, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="runtime.model is not the model"):
        Trainer(model, opt, data=loader, progress=False, runtime=LocalRuntime(other))
    with pytest.raises(TypeError, match="runtime must be a posttrain.train.Runtime"):
        Trainer(model, opt, data=loader, progress=False, runtime="dp_shard=2")


def test_a_split_model_without_its_runtime_is_refused_by_name():
    from posttrain.train import full_state_dict

    runtime = ParallelPlan(activation_checkpointing=True).parallelize(
        build_model(TINY, seed=0), spec=TINY
    )
    model = runtime.model
    with pytest.raises(ValueError, match=r"\(activation checkpointing\) but no runtime"):
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            data=SFTLoader(sft_dataset(8), batch_size=4),
            progress=False,
        )
    with pytest.raises(ValueError, match="pass the PlanRuntime"):
        full_state_dict(model)
    with pytest.raises(ValueError, match="already has a ParallelPlan applied"):
        ParallelPlan().parallelize(model, spec=TINY)
    assert full_state_dict(runtime).keys() == build_model(TINY, seed=0).state_dict().keys()


# ---------------------------------------------------------------------- the earlier spelling
def test_the_earlier_spelling_works_with_a_deprecation_warning():
    from posttrain.train import apply_plan, full_state_dict, plan_state

    plan = ParallelPlan(activation_checkpointing=True)
    model = build_model(TINY, seed=0)
    with pytest.warns(DeprecationWarning, match="plan.parallelize") as caught:
        assert plan.apply(model, spec=TINY) is model
    assert caught[0].filename == __file__  # attributed to the caller, shown in notebooks
    with pytest.warns(DeprecationWarning):
        state = plan_state(model)
    assert isinstance(state, PlanRuntime) and state.model is model and state.plan == plan
    assert state.data_rank == 0 and state.spec == TINY
    assert _plan_attributes(model) == []  # kept by the compatibility shim, not on the model
    loader = SFTLoader(sft_dataset(8), batch_size=4, seed=0)
    with pytest.warns(DeprecationWarning, match="plan= argument") as caught:
        trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            data=loader,
            progress=False,
            plan=plan,
        )
    assert trainer.runtime is state
    assert [w.filename for w in caught if w.category is DeprecationWarning] == [__file__]
    with pytest.warns(DeprecationWarning, match="a model split by plan.apply"):
        other = Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data=loader, progress=False
        )  # recognised without plan=, as before
    assert other.runtime is state
    with pytest.warns(DeprecationWarning, match="trainer.runtime"):
        assert trainer.plan_state is state
    assert full_state_dict(model).keys() == build_model(TINY, seed=0).state_dict().keys()
    with pytest.raises(ValueError, match="already has a ParallelPlan"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        apply_plan(plan, model, spec=TINY)
    with pytest.raises(ValueError, match="not by the given"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            data=loader,
            progress=False,
            plan=ParallelPlan(),
        )


def test_the_earlier_reward_model_spelling_works_with_a_deprecation_warning():
    from posttrain.preference import (
        apply_plan_to_reward_model,
        gathered_reward_model,
        parallelize_reward_model,
    )
    from posttrain.rewards.reward_model import RewardModel
    from posttrain.train import plan_state

    model = RewardModel.from_spec(TINY, seed=0)
    with pytest.warns(DeprecationWarning, match="parallelize_reward_model"):
        assert apply_plan_to_reward_model(ParallelPlan(), model) is model
    with pytest.warns(DeprecationWarning):
        assert plan_state(model).model is model
    runtime = parallelize_reward_model(ParallelPlan(), RewardModel.from_spec(TINY, seed=0))
    assert isinstance(runtime, PlanRuntime) and isinstance(runtime.model, RewardModel)
    plain = gathered_reward_model(runtime)
    assert_bitwise_equal(params_of(plain), params_of(runtime.model))


def test_reference_logps_under_a_one_rank_plan_without_a_process_group_equal_the_plain_models():
    """A runtime without a mesh runs no collective: the reference log-probs of a one-rank plan
    (activation checkpointing only, no process group) are those of the plain model, bitwise."""
    from posttrain.data import PreferenceDataset
    from posttrain.models import ByteTokenizer
    from posttrain.preference import compute_reference_logps

    rows = [
        {"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(5)
    ]
    values = []
    for plan in (None, ParallelPlan(activation_checkpointing=True)):
        model = build_model(TINY, seed=0)
        runtime = LocalRuntime(model) if plan is None else plan.parallelize(model, spec=TINY)
        dataset = PreferenceDataset(rows, ByteTokenizer(), max_seq_len=32)
        values.append(compute_reference_logps(runtime, dataset, batch_size=2).values)
    assert values[0].keys() == values[1].keys()
    assert all(torch.equal(values[0][k], values[1][k]) for k in values[0])
