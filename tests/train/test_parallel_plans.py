"""Parallel plans (FSDP2, HSDP, TP, Ulysses SP, pipeline stages with GPipe and 1F1B, expert
parallelism, and the compositions dp_shard x tp, dp_shard x sp, pp x dp, ep x dp) on 2 and 4
gloo processes equal one process on the same global batch; sharded checkpoints resume bitwise under
the same plan after SIGKILL and reshard under another plan (or none); bad plans fail before any
process group.

The multi-process runs happen once per module (tests/parallel_plan_run.py: 4 ranks, then 2
ranks twice, forked from the session's preloaded server, then 2 fresh ranks for one sp step);
each test compares them with the single-process run done here.

Tolerances, from the float rounding of sharded sums (reductions in another order):
  * per-step losses and gradient norms: 2e-6 absolute (seen: at most 4.8e-7 and 7.2e-7);
  * weights after 3 SGD-with-momentum steps: 1e-6 (seen: at most 1.5e-8; SGD moves weights
    linearly in the gradients, so rounding stays at its own size);
  * weights after 3 AdamW steps: 1e-4 (seen: 3.1e-6; Adam's first steps divide by |g|, which
    turns the rounding of near-zero gradient entries into larger weight differences);
  * trained-token counts (the step normaliser): exactly equal;
  * FSDP2 mixed precision (bf16 compute, fp32 reduction): losses 1e-2, weights 2e-3 (bf16 keeps
    8 significant bits, a relative rounding of 2^-9 = 2e-3 per operand; seen: 7.3e-4 and 2.6e-4).
"""

from __future__ import annotations

import os
from pathlib import Path

import parallel_plan_run as worker
import pytest
import torch
from _ranks import run_ranks
from _train_helpers import TINY

from posttrain.models import build_model, get_preset
from posttrain.train import ParallelPlan

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LOSS_ATOL, SGD_WEIGHT_ATOL, ADAMW_WEIGHT_ATOL = 2e-6, 1e-6, 1e-4
BF16_LOSS_ATOL, BF16_WEIGHT_ATOL = 1e-2, 2e-3


def _launch(
    out: Path, world_size: int, phase: str, expect_killed: bool = False, fresh: bool = False
) -> None:
    run_ranks(
        worker.__file__,
        world_size,
        out,
        str(out),
        phase,
        log_prefix=phase,
        expect_returncode=-9 if expect_killed else 0,
        fresh=fresh,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    out = tmp_path_factory.mktemp("plans")
    _launch(out, 4, "four")
    _launch(out, 2, "kill", expect_killed=True)
    _launch(out, 2, "two")
    _launch(out, 2, "sp_fresh", fresh=True)
    load = lambda phase, n: [
        torch.load(out / f"{phase}-rank{r}.pt", weights_only=False) for r in range(n)
    ]
    return out, {"four": load("four", 4), "two": load("two", 2), "sp_fresh": load("sp_fresh", 2)}


_REFERENCES: dict = {}


def _single(spec=TINY, steps=worker.STEPS, optimizer="sgd", packed=False) -> dict:
    key = (spec, steps, optimizer, packed)
    if key not in _REFERENCES:
        _REFERENCES[key] = worker.run_plan(
            None, spec, steps=steps, optimizer=optimizer, packed=packed
        )
    return _REFERENCES[key]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _close(xs, ys, atol):
    assert len(xs) == len(ys)
    worst = max(abs(x - y) for x, y in zip(xs, ys))
    assert worst <= atol, f"largest difference {worst:.3g} > {atol}"


ALL_PLANS = {
    **{name: ("four", p, s) for name, (p, s) in worker.PLANS_4.items()},
    **{name: ("two", p, s) for name, (p, s) in worker.PLANS_2.items()},
}


@pytest.mark.parametrize("name", sorted(ALL_PLANS))
def test_plan_equals_one_process_on_the_global_batch(runs, name):
    """Batch 8 x accumulation 2 with active clipping (17 rows: the second step's last
    micro-batch is one row, so some data ranks train only padding)."""
    phase, plan, spec = ALL_PLANS[name]
    ranks = runs[1][phase]
    single = _single(spec, packed=name.endswith("packed"))
    loss_atol, weight_atol = (
        (BF16_LOSS_ATOL, BF16_WEIGHT_ATOL)
        if plan.param_dtype == "bfloat16"
        else (LOSS_ATOL, SGD_WEIGHT_ATOL)
    )
    for result in ranks:
        assert result[name]["trained_tokens"] == single["trained_tokens"]
        _close(result[name]["losses"], single["losses"], loss_atol)
        _close(result[name]["grad_norms"], single["grad_norms"], loss_atol)
        assert _max_diff(result[name]["params"], single["params"]) <= weight_atol
    # every rank ends with the same full weights and logs the same losses
    assert all(r[name]["losses"] == ranks[0][name]["losses"] for r in ranks)
    assert _max_diff(ranks[-1][name]["params"], ranks[0][name]["params"]) == 0.0


@pytest.mark.parametrize("name", sorted(worker.LOOKED_2))
def test_a_no_grad_forward_before_the_optimizer_trains_every_parameter(runs, name):
    """The notebook habit: plan.parallelize, look at logits under torch.no_grad(), then build the
    optimizer over model.parameters(). FSDP2 leaves its root (embedding, final norm) gathered
    after a forward; an optimizer built over those copies never updated them, and the logged
    gradient norm missed theirs. Every parameter must train as in one process."""
    single = _single()
    initial = build_model(TINY, seed=0).state_dict()
    moved = {k: float((single["params"][k] - initial[k]).abs().max()) for k in initial}
    # every parameter moves by over 10x the tolerance (least: a k_proj bias, ~2e-5; the
    # embedding ~9e-2, the final norm ~7e-3), so one left unchanged fails the comparison below
    assert min(moved.values()) > 10 * SGD_WEIGHT_ATOL, moved
    for result in runs[1]["two"]:
        _close(result[name]["losses"], single["losses"], LOSS_ATOL)
        _close(result[name]["grad_norms"], single["grad_norms"], LOSS_ATOL)
        assert _max_diff(result[name]["params"], single["params"]) <= SGD_WEIGHT_ATOL


@pytest.mark.parametrize(
    ("name", "spec"), [("dp_shard2_chunked", TINY), ("tp2_untied_chunked", worker.UNTIED)]
)
def test_the_chunked_loss_under_a_plan_trains_as_one_process(runs, name, spec):
    """`SFTCrossEntropy(loss_chunk_tokens=5)` under dp_shard=2, and under tp=2 with the untied
    head column-parallel, equals the unchunked run of one process (chunking changes only the
    order of float sums). Under dp_shard=2 it failed with "aten.mm got mixed torch.Tensor and
    DTensor": the forward without the head returned a tensor that did not require grad, so
    FSDP2 resharded the root and the tied head met its sharded weight."""
    single = _single(spec)
    for result in runs[1]["two"]:
        chunked = result[name]
        _close(chunked["losses"], single["losses"], LOSS_ATOL)
        _close(chunked["grad_norms"], single["grad_norms"], LOSS_ATOL)
        assert _max_diff(chunked["params"], single["params"]) <= SGD_WEIGHT_ATOL


def test_tensor_peak_measures_a_step_under_fsdp(runs):
    """TensorPeak around a dp_shard=2 run (model build included) sees at least the rank's half
    of the fp32 parameters; it raised "invalid python storage" on the storages FSDP2 frees."""
    half = 4 * sum(p.numel() for p in build_model(TINY, seed=0).parameters()) // 2
    for result in runs[1]["two"]:
        assert result["dp_shard2_chunked"]["tensor_peak"] >= half


def test_the_plans_model_is_sharded_again_after_a_no_grad_forward(runs):
    """After the forward, `model.parameters()` are the sharded DTensors, not FSDP2's gathered
    copies (checked on the ranks: `looked_types`)."""
    for result in runs[1]["two"]:
        assert result["looked_types"] == {
            "tok_embeddings.weight": "DTensor",
            "norm.scale": "DTensor",
        }


def test_the_deprecated_spelling_trains_exactly_as_the_runtime(runs):
    """`model = plan.apply(model)`, `plan_state(model).data_rank` and `Trainer(..., plan=plan)`
    still work for one release: the same run, bitwise, as `plan.parallelize` + `runtime=`."""
    for result in runs[1]["two"]:
        new, old = result["dp_shard2"], result["dp_shard2_deprecated"]
        assert old["losses"] == new["losses"] and old["grad_norms"] == new["grad_norms"]
        assert _max_diff(old["params"], new["params"]) == 0.0


def test_adamw_under_dp_shard_x_tp_stays_within_its_tolerance(runs):
    result, single = runs[1]["four"][0]["adamw_dp_shard2_tp2"], _single(optimizer="adamw")
    _close(result["losses"], single["losses"], LOSS_ATOL)
    assert _max_diff(result["params"], single["params"]) <= ADAMW_WEIGHT_ATOL


def test_same_plan_resumes_bitwise_after_sigkill(runs):
    for rank in runs[1]["two"]:
        same = rank["same_plan"]
        assert same["found"] == ["step_000002"]  # killed after step 3, saved after step 2
        assert same["restored_rows"] == list(range(1, worker.RESUME_STEPS + 1))
        assert same["resumed"]["losses"] == same["uninterrupted"]["losses"]
        assert _max_diff(same["resumed"]["params"], same["uninterrupted"]["params"]) == 0.0


def test_every_rank_of_a_sharded_save_gets_the_checkpoints_folder(runs):
    """Ranks > 0 were given the staging folder's name, which no longer exists after the save."""
    out = runs[0]
    for rank in runs[1]["two"]:
        assert rank["saved"] == {
            "path": str(out / "saved" / "checkpoints" / "step_000001"),
            "is_dir": True,
        }


@pytest.mark.parametrize("name", ["reshard_dp_shard2", "reshard_tp2"])
def test_checkpoint_saved_with_dp_shard4_resumes_under_another_plan(runs, name):
    """Saved after 3 steps under dp_shard=4; resumed to 5 steps under dp_shard=2 or tp=2: the
    run continues as the uninterrupted single-process run."""
    single = _single(steps=worker.RESUME_STEPS)
    for rank in runs[1]["two"]:
        _close(rank[name]["losses"], single["losses"], LOSS_ATOL)
        assert _max_diff(rank[name]["params"], single["params"]) <= SGD_WEIGHT_ATOL


def test_sharded_checkpoint_resumes_in_one_process_without_a_plan(runs, tmp_path):
    import shutil

    out, _ = runs
    shutil.copytree(out / "ckpt4", tmp_path / "run")
    resumed = worker.run_plan(
        None, steps=worker.RESUME_STEPS, run_dir=tmp_path / "run", resume=True
    )
    single = _single(steps=worker.RESUME_STEPS)
    _close(resumed["losses"], single["losses"], LOSS_ATOL)
    assert _max_diff(resumed["params"], single["params"]) <= SGD_WEIGHT_ATOL


def test_sharded_checkpoint_lists_and_verifies_every_shard(runs):
    import json

    from posttrain.core import CheckpointCorruptError, verify_checkpoint

    out, _ = runs
    ckpt = out / "ckpt4" / "checkpoints" / "step_000003"
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    shards = sorted(p.relative_to(ckpt).as_posix() for p in (ckpt / "sharded").iterdir())
    assert shards and set(shards) <= set(manifest)
    assert json.loads((ckpt / "meta.json").read_text())["plan"]["dp_shard"] == 4
    copy = out / "corrupt"
    import shutil

    shutil.copytree(ckpt, copy)
    shard = next(p for p in (copy / "sharded").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=shard.name):
        verify_checkpoint(copy)


def test_tampered_dcp_metadata_is_refused_without_unpickling(tmp_path):
    import pickle

    from posttrain.core.checkpoint_files import UnsafeCheckpointError, check_dcp_metadata

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UnsafeCheckpointError, match="system"):
        check_dcp_metadata(path)


def test_hf_export_of_a_sharded_run_has_logits_parity(runs):
    transformers = pytest.importorskip("transformers")
    from posttrain.models import build_model

    out, results = runs
    plain = build_model(TINY, seed=1)
    plain.load_state_dict(results["four"][0]["dp_shard2_tp2"]["params"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    tokens = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = plain.eval()(tokens), hf(tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-5), float((ours - theirs).abs().max())


def test_misused_plans_are_refused_with_what_to_do(runs):
    errors = runs[1]["two"][0]["errors"]
    assert "built before ParallelPlan(tp=2) was applied" in errors["optimizer_before_apply"]
    assert (
        "holds 20 parameter(s) the model no longer has: layers.0.attn.q_proj.weight"
        in errors["optimizer_before_apply"]
    )
    assert errors["gathered_copies"].startswith(
        "optimizer: holds FSDP2's gathered (unsharded) copies of tok_embeddings.weight, "
        "norm.scale, registered on the model by a forward that no backward followed"
    )
    assert "build the optimizer over [p for p in model.parameters()" in errors["gathered_copies"]
    assert "was not applied to the model" in errors["not_applied"]
    assert "no runtime was given: pass runtime=" in errors["without_runtime"]
    assert "runtime.model is not the model given to the trainer" in errors["other_model"]
    assert (
        "rank 0 of world_size=2 among the data-parallel ranks of ParallelPlan(dp_shard=2)"
        in errors["data_sharding"]
    )


def test_sequence_parallel_ranks_do_not_import_the_verl_package(runs):
    """An sp=2 step in ranks started as fresh interpreters runs verl's Ulysses helpers without
    `import verl`, whose package imports ray, tensordict and transformers (~5 s of CPU in every
    rank). (The sp plans above, sp2, dp_shard2_sp2 and their packed and looked variants, equal one
    process; their ranks fork from a server that has imported verl, tests/_fork_preload.py.)"""
    fresh = runs[1]["sp_fresh"]
    assert [r["verl_imported"] for r in fresh] == [False, False]
    assert all(len(r["sp2"]["losses"]) == 1 for r in fresh)
    assert [r["verl_imported"] for r in runs[1]["two"]] == [True, True]  # forked: preloaded


def test_ulysses_helpers_are_verls_own_file_loaded_or_not():
    """Without verl loaded, `_ulysses()` runs verl's `utils/ulysses.py` as a private module and
    leaves `verl` unimported; with verl loaded (as here), it is the package's module."""
    import subprocess
    import sys

    import verl.utils.ulysses

    from posttrain.train.sequence_parallel import _ulysses

    assert _ulysses() is verl.utils.ulysses
    probe = (
        "import sys; from posttrain.train.sequence_parallel import _ulysses; m = _ulysses(); "
        "print(m.__name__, m.__file__, 'verl' in sys.modules, _ulysses() is m, "
        "callable(m.gather_outputs_and_unpad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    ).stdout.split()
    assert out == [
        "posttrain.train._verl_ulysses",
        verl.utils.ulysses.__file__,
        "False",
        "True",
        "True",
    ]


# ---------------------------------------------------------------------- validation, no processes
@pytest.mark.parametrize(
    "kwargs, world, field, allowed",
    [
        (dict(dp_shard=2, tp=2), 8, "must multiply to 8", None),
        (dict(tp=3), 3, "ParallelPlan.tp=3", "allowed tp: 1, 2"),
        (dict(sp=3), 3, "ParallelPlan.sp=3", "allowed sp: 1, 2, 4"),
        (dict(tp=2, sp=4), 8, "ParallelPlan.sp=4", "allowed sp: 1, 2"),
        (dict(pp=5), 5, "ParallelPlan.pp=5", "allowed pp: 1..4"),
        (dict(ep=2), 2, "ParallelPlan.ep=2", "allowed ep: 1"),
        (dict(ep=3), 3, "ParallelPlan.ep=3", "allowed ep: 1, 2, 4"),
        (dict(tp=2), 2, "ParallelPlan.tp=2 with an MoE model", "allowed tp for MoE models: 1"),
        (dict(pp=2), 2, "ParallelPlan.pp=2 with an MoE model", "allowed pp for MoE models: 1"),
    ],
)
def test_bad_plans_fail_naming_the_field_and_allowed_values(kwargs, world, field, allowed):
    spec = get_preset("tiny-moe" if "MoE" in field or "ep=3" in field else "tiny-1m")
    with pytest.raises(ValueError) as info:
        ParallelPlan(**kwargs).validate(world_size=world, spec=spec)
    assert field in str(info.value)
    if allowed:
        assert allowed in str(info.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(param_dtype=["bfloat16"]), "param_dtype"),
        (dict(tp=0), "tp"),
        (dict(dp_shard=1.5), "dp_shard"),
        (dict(pp_schedule="zb"), "pp_schedule"),
        (dict(param_dtype="fp8"), "param_dtype"),
        (dict(n_microbatches=4), "n_microbatches"),
        (dict(cpu_offload="yes"), "cpu_offload"),
    ],
)
def test_bad_plan_fields_fail_on_construction(kwargs, field):
    with pytest.raises(ValueError, match=f"ParallelPlan.{field}"):
        ParallelPlan(**kwargs)


def test_cpu_offload_of_a_model_on_the_cpu_is_refused():
    from posttrain.models import build_model

    with pytest.raises(ValueError, match="allowed cpu_offload on CPU: False"):
        ParallelPlan(cpu_offload=True).parallelize(build_model(TINY, seed=0), spec=TINY)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=0), "world_size=0; must be a positive integer"),
        (dict(world_size="4"), "world_size='4'; must be a positive integer"),
        (dict(spec=42), "spec=42; must be a posttrain.models.ModelSpec"),
    ],
)
def test_validate_checks_its_own_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelPlan().validate(**kwargs)


def test_a_preset_name_is_a_spec_and_numpy_integers_are_sizes():
    import numpy as np

    plan = ParallelPlan(tp=np.int64(2))
    assert plan.tp == 2 and type(plan.tp) is int
    with pytest.raises(ValueError, match="allowed tp: 1, 2"):
        ParallelPlan(tp=4).validate(spec="tiny-1m")


def test_a_one_rank_plan_applies_activation_checkpointing_without_a_process_group():
    """Activation checkpointing alone needs no other rank: the same losses and gradients as
    the plain model (it only recomputes the forward in backward)."""
    from _train_helpers import sft_dataset

    from posttrain.data import SFTLoader
    from posttrain.models import build_model
    from posttrain.train import Trainer

    losses = []
    for plan in (None, ParallelPlan(activation_checkpointing=True)):
        model = build_model(TINY, seed=0)
        runtime = None if plan is None else plan.parallelize(model, spec=TINY)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = SFTLoader(sft_dataset(8), batch_size=4, seed=0)
        losses.append(
            Trainer(model, opt, data=loader, progress=False, runtime=runtime)
            .fit(2)["loss"]
            .tolist()
        )
    assert losses[0] == losses[1]


def test_trainer_memory_check_refuses_a_plan_that_does_not_fit_before_any_step():
    """The check the Trainer runs under a plan (spec from plan.parallelize, batch from the
    loader): a 0.5B model at 64 rows x 500 tokens needs far more than 8 GiB per rank."""
    from _train_helpers import sft_dataset

    from posttrain.data import SFTLoader
    from posttrain.train import LocalRuntime, PlanRuntime
    from posttrain.train.memory_check import check_memory

    model = torch.nn.Linear(2, 2)
    runtime = PlanRuntime(
        model=model,
        plan=ParallelPlan(),
        mesh=None,
        data_rank=0,
        data_group=None,
        fsdp=False,
        spec=get_preset("qwen2.5-0.5b"),
    )
    loader = SFTLoader(sft_dataset(8, max_seq_len=500), batch_size=64)
    with pytest.raises(ValueError, match="GiB per rank") as info:
        check_memory(runtime, loader, device_bytes=8 * 2**30)
    assert "raise" in str(info.value) or "lower" in str(info.value)  # names the fixing axis
    check_memory(runtime, loader, device_bytes=2**50)  # fits a large enough device
    check_memory(LocalRuntime(model), loader, device_bytes=1)  # no plan: nothing to check


def test_plan_sizes_and_mesh_need_a_process_group():
    plan = ParallelPlan(dp_replicate=2, dp_shard=2, tp=2)
    assert (plan.world_size, plan.data_parallel_size) == (8, 4)
    assert str(plan) == "ParallelPlan(dp_replicate=2, dp_shard=2, tp=2)"
    with pytest.raises(RuntimeError, match="process group"):
        plan.build_mesh()


def test_the_recipes_parallel_section_is_the_plan_and_its_defaults_are_no_plan():
    """A recipe's `parallel` section is a ParallelPlan (no copy of its fields to drift);
    `ParallelConfig`, the former copy, is a deprecated alias of it."""
    from posttrain.workflows import SFTConfig, plan_of

    assert type(SFTConfig().parallel) is ParallelPlan
    assert plan_of(SFTConfig()) is None
    plan = ParallelPlan(dp_shard=2, tp=2)
    assert plan_of(SFTConfig(parallel=plan)) is plan
    with pytest.deprecated_call(match="ParallelConfig is deprecated"):
        from posttrain.workflows import ParallelConfig
    assert ParallelConfig is ParallelPlan


def test_ranks_that_read_different_free_memory_refuse_together(runs):
    """Each rank reads its free memory at its own moment; the memory check takes the smallest
    over the ranks, so both refuse (rank 0 read 1 TiB, rank 1 1 KiB). A rank that refused alone
    left the other waiting in its first collective."""
    verdicts = [rank["memory_agreement"] for rank in runs[1]["two"]]
    assert len(verdicts) == 2
    for verdict in verdicts:
        assert "needs about" in verdict and "but the device has 0.0 GiB" in verdict, verdict
