"""The converter registry (`posttrain.train.converters`): one place, a fixed order, refused
combinations, the plan axes a converted model may use, and checkpoints of a LoRA / QLoRA run
that hold only what trains and resume bitwise."""

import pytest
import torch
from _train_helpers import TINY, sft_dataset

from posttrain.data import SFTLoader
from posttrain.models import build_model, get_preset
from posttrain.models.lora import LoRAConfig, has_adapters
from posttrain.train import ParallelPlan, Trainer
from posttrain.train.converters import (
    CONVERTER_ORDER,
    applied_converters,
    check_plan_axes,
    checkpoint_state,
    convert_model,
    register_converter,
    registered_converters,
)
from posttrain.train.float8 import Float8Config


def _model(spec=TINY):
    return build_model(spec, seed=0)


def test_registry_holds_every_converter_in_its_order():
    assert registered_converters() == CONVERTER_ORDER == ("lora", "qlora", "float8", "qat")
    with pytest.raises(ValueError, match="registered already"):
        register_converter("lora", lambda model, config, spec=None: None)
    with pytest.raises(ValueError, match="allowed: lora, qlora, float8, qat"):
        register_converter("dora", lambda model, config, spec=None: None)


def test_converters_run_in_the_fixed_order_whatever_the_order_given():
    model = _model()
    reports = convert_model(model, [Float8Config(), LoRAConfig(rank=4)], spec=TINY)
    assert [r.name for r in reports] == ["lora", "float8"]
    assert applied_converters(model) == ("lora", "float8")
    # float8 saw the block linears that LoRA did not take (the MLP), not the adapters' linears
    assert all(".mlp." in name for name in reports[1].converted), reports[1].converted
    assert not any("lora" in name for name in reports[1].converted)


@pytest.mark.parametrize(
    "configs, message",
    [
        ([LoRAConfig(), LoRAConfig(quantize_base=True)], "one set of adapters"),
        ([LoRAConfig(quantize_base=True), Float8Config()], "NF4 already"),
        ([LoRAConfig(), LoRAConfig()], "given twice"),
        (["lora"], "not a converter config"),
    ],
)
def test_refused_combinations_name_the_reason(configs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        convert_model(_model(), configs, spec=TINY)


def test_a_converter_applies_once_per_model():
    model = _model()
    convert_model(model, [LoRAConfig(rank=2)], spec=TINY)
    with pytest.raises(ValueError, match="given twice .*applied to this model already"):
        convert_model(model, [LoRAConfig(rank=2)], spec=TINY)


def test_converted_models_refuse_plan_axes_they_do_not_support():
    model = _model()
    convert_model(model, [LoRAConfig(rank=2)], spec=TINY)
    check_plan_axes(_float8_model(), ParallelPlan(tp=2))  # float8 takes torchtune's TP plan
    for axis in ("tp", "sp", "pp", "ep"):
        with pytest.raises(
            ValueError,
            match=rf"{axis}=2 is not supported with lora; allowed "
            r"axes with lora: dp_replicate, dp_shard",
        ):
            check_plan_axes(model, ParallelPlan(**{axis: 2}))
    check_plan_axes(model, ParallelPlan(dp_shard=2))  # FSDP2 takes adapters
    check_plan_axes(_model(), ParallelPlan(tp=2))  # a plain model takes any axis


def _float8_model():
    model = _model()
    convert_model(model, [Float8Config()], spec=TINY)
    return model


def test_merging_adapters_forgets_the_converter():
    from posttrain.models.lora import merge_lora

    model = _model()
    convert_model(model, [LoRAConfig(rank=2)], spec=TINY)
    merge_lora(model)
    assert applied_converters(model) == () and not has_adapters(model)
    convert_model(model, [LoRAConfig(rank=2)], spec=TINY)  # adapted anew
    assert applied_converters(model) == ("lora",)


def _trainer(model, run_dir, **kw):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loader = SFTLoader(sft_dataset(16), batch_size=4, seed=0)
    return Trainer(model, opt, data=loader, run_dir=run_dir, progress=False, **kw)


@pytest.mark.parametrize("quantize_base", [False, True], ids=["lora", "qlora"])
def test_adapter_checkpoint_holds_what_trains_and_resumes_bitwise(quantize_base, tmp_path):
    """A LoRA / QLoRA run checkpointed after step 2 and resumed in a fresh process-like setting
    (model rebuilt and converted the same way) continues bitwise like the uninterrupted run.
    The checkpoint holds only the adapter weights (no NF4 tensor, which `weights_only` loading
    could not read)."""
    spec = get_preset("tiny-1m").replace(num_kv_heads=4)  # every numel divisible by 16,384
    config = LoRAConfig(rank=4, modules=("q_proj", "v_proj", "w1"), quantize_base=quantize_base)

    def converted():
        model = build_model(spec, seed=0)
        convert_model(model, [config], spec=spec)
        return model

    whole = _trainer(converted(), tmp_path / "whole")
    whole.fit(4)
    state = checkpoint_state(whole.model)
    assert state and all("lora" in name for name in state), sorted(state)[:4]

    first = _trainer(converted(), tmp_path / "cut", checkpoint_every=2)
    first.fit(2)
    again = _trainer(converted(), tmp_path / "cut", checkpoint_every=2, resume=True)
    assert again.step_count == 2 and has_adapters(again.model)
    again.fit(4)
    assert again.metrics["loss"].tolist() == whole.metrics["loss"].tolist()

    def plain(t):  # an NF4 base compares by its dequantised weight
        return t.get_original_weight() if hasattr(t, "get_original_weight") else t

    for (name, a), b in zip(whole.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(plain(a), plain(b)), name


def test_resume_with_other_converters_is_refused(tmp_path):
    model = _model()
    convert_model(model, [LoRAConfig(rank=2)], spec=TINY)
    _trainer(model, tmp_path / "run", checkpoint_every=1).fit(1)
    plain = _model()
    with pytest.raises(ValueError, match="converters"):
        _trainer(plain, tmp_path / "run", checkpoint_every=1, resume=True)
