"""torch.compile, opt-in: compiled transformer blocks train as eager ones, the compiled decoding
step samples as the eager one, and the plan refuses by name the axes compile does not compose with.

Compiling costs tens of seconds on a loaded 2-core CPU (inductor: ~70 s for tiny-1m's first
training step at load ~13; the decoding step's dynamic-shape graph 40-370 s even with aot_eager),
so the suite runs the "aot_eager" backend (dynamo and AOTAutograd, the same graphs without code
generation) on the training path, and counts the decoding step's graphs with dynamo's
`CompileCounter` backend on a one-block model; the inductor training test and the aot_eager
decoding test run with POSTTRAIN_COMPILE_TESTS=1 (and a C++ compiler for inductor).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil

import pytest
import torch

from posttrain.models import build_model, get_preset
from posttrain.train import ParallelPlan
from posttrain.train import compile as compile_mod
from posttrain.train.compile import compile_blocks, compiled_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = get_preset("tiny-1m")
FULL = pytest.mark.skipif(
    not os.environ.get("POSTTRAIN_COMPILE_TESTS"),
    reason="compiling costs minutes on a loaded CPU: set POSTTRAIN_COMPILE_TESTS=1",
)
NEEDS_CXX = pytest.mark.skipif(
    shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler (g++)"
)


def _two_steps(model: torch.nn.Module) -> list[tuple[float, list[torch.Tensor]]]:
    """Loss and gradients of two AdamW steps of next-token CE on fixed random tokens."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        x = torch.randint(0, TINY.vocab_size, (2, 16), generator=gen)
        logits = model(x)[:, :-1].flatten(0, 1)
        loss = torch.nn.functional.cross_entropy(logits, x[:, 1:].flatten())
        loss.backward()
        out.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return out


def _assert_close(got, want, tol: float) -> None:
    for (loss_got, grads_got), (loss_want, grads_want) in zip(got, want):
        assert abs(loss_got - loss_want) <= tol
        for g, w in zip(grads_got, grads_want):
            torch.testing.assert_close(g, w, rtol=0, atol=tol)


def test_a_plan_with_compile_and_checkpointing_trains_as_eager(monkeypatch):
    """Through `ParallelPlan(compile=True, activation_checkpointing=True).parallelize` (one rank,
    no process group): every block compiled around its checkpoint wrapper, two steps' losses and
    gradients equal to eager within 1e-5 (fp32; aot_eager computes the same ops: 0.0 seen),
    state-dict keys unchanged, and a deep copy runs on its own weights."""
    monkeypatch.setattr(compile_mod, "DEFAULT_BACKEND", "aot_eager")
    want = _two_steps(build_model(TINY, seed=0))
    model = build_model(TINY, seed=0)
    keys = list(model.state_dict())
    plan = ParallelPlan(compile=True, activation_checkpointing=True)
    runtime = plan.parallelize(model, spec=TINY)
    assert compiled_blocks(runtime.model) == TINY.num_layers
    _assert_close(_two_steps(runtime.model), want, 1e-5)
    twin = copy.deepcopy(runtime.model)
    assert twin.layers[0].forward.__self__ is twin.layers[0]
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
        x = torch.zeros(1, 4, dtype=torch.long)
        assert not torch.equal(twin(x), runtime.model(x))  # the copy's weights, not the model's
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    assert isinstance(runtime.model.layers[0], CheckpointWrapper)
    plain = {k.replace("._checkpoint_wrapped_module", "") for k in runtime.model.state_dict()}
    assert plain == set(keys)


def test_compile_refuses_what_it_does_not_compose_with():
    for axis in ("sp", "ep", "pp"):
        with pytest.raises(ValueError, match=f"ParallelPlan.compile=True with {axis}=2"):
            ParallelPlan(compile=True, **{axis: 2})
    with pytest.raises(ValueError, match="ParallelPlan.compile='yes'; must be a bool"):
        ParallelPlan(compile="yes")  # type: ignore[arg-type]
    assert ParallelPlan(compile=True, dp_shard=2, tp=2).world_size == 4
    assert not ParallelPlan(compile=True).is_default
    model = build_model(TINY, seed=0)
    with pytest.raises(ValueError, match="backend='tvm'; allowed: inductor, aot_eager"):
        compile_blocks(model, backend="tvm")
    with pytest.raises(TypeError, match="a model with .layers"):
        compile_blocks(torch.nn.Linear(2, 2))
    assert compile_blocks(model, backend="aot_eager") == TINY.num_layers
    with pytest.raises(ValueError, match="compiled already"):
        compile_blocks(model, backend="aot_eager")


@FULL
@NEEDS_CXX
def test_inductor_blocks_train_as_eager():
    """inductor's C++ kernels reorder fp32 sums: within 1e-5 (8.5e-7 seen on gradients)."""
    want = _two_steps(build_model(TINY, seed=0))
    model = build_model(TINY, seed=0)
    compile_blocks(model, backend="inductor")
    _assert_close(_two_steps(model), want, 1e-5)


@FULL
def test_the_compiled_decoding_step_samples_as_eager(monkeypatch):
    """Greedy tokens identical and log-probs within 1e-5 (fp32), for prompts of different
    lengths (left padding) and a second call with another batch size on the same compiled step."""
    from posttrain.policy import generation

    monkeypatch.setattr(generation, "COMPILE_BACKEND", "aot_eager")
    model = build_model(TINY, seed=0).eval()
    kw = dict(
        max_new_tokens=12,
        max_seq_len=TINY.max_seq_len,
        temperature=0.0,
        top_k=None,
        top_p=1.0,
        stop_ids=[],
        stops=[],
        decode=None,
        pad_id=0,
        seed=0,
    )
    for rows in ([[1, 5, 6, 7, 8], [1, 9, 10], [1, 3, 4, 5, 6, 7, 8, 9]], [[1, 9, 10, 4]] * 2):
        want = generation._generate_tokens(model, rows, **kw)
        got = generation._generate_tokens(model, rows, compile=True, **kw)
        assert got[0] == want[0] and got[2] == want[2]
        for a, b in zip(got[1], want[1]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def test_decoding_batches_shrink_to_powers_of_two_under_compile():
    """Six sequences finishing one at a time (by hand): eager keeps finished rows until they are
    a quarter of the batch (6, 4, 3, 2, 1 rows); compiled runs 8, 4, 2, 1 rows, the buckets."""
    from posttrain.policy.generation import _bucket, _rows_to_keep

    assert [_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    for buckets, want in ((False, [6, 4, 3, 2, 1]), (True, [8, 4, 2, 1])):
        rows = _bucket(6) if buckets else 6
        seen = [rows]
        for running in range(5, 0, -1):
            rows = _rows_to_keep(running, rows, buckets=buckets)
            seen += [rows] if rows != seen[-1] else []
        assert seen == want


def test_the_compiled_decoding_step_compiles_once_per_bucket(monkeypatch):
    """Four rows whose length budgets (prompt + new tokens <= 10) end them after 1, 2, 3 and 3
    tokens run the compiled step on 4 rows, then 2: two graphs (without buckets 4, 3 and 2
    rows: three). Greedy tokens and finish reasons equal eager's, log-probs within 1e-5. A
    second call of three of the prompts (padded to 4 rows, then 2; the same 16-position cache)
    compiles nothing new. dynamo's graphs are counted by a `CompileCounter` backend (it runs
    them as captured, without code generation), on a one-block tiny-1m: a capture costs ~2 s."""
    from torch._dynamo.testing import CompileCounter

    from posttrain.policy import generation

    counter = CompileCounter()
    monkeypatch.setattr(generation, "COMPILE_BACKEND", counter)
    model = build_model(dataclasses.replace(TINY, num_layers=1), seed=0).eval()
    kw = dict(
        max_new_tokens=3,
        max_seq_len=10,
        temperature=0.0,
        top_k=None,
        top_p=1.0,
        stop_ids=[],
        stops=[],
        decode=None,
        pad_id=0,
        seed=0,
    )
    rows = [list(range(1, 10)), list(range(1, 9)), list(range(1, 8)), list(range(2, 9))]
    for prompts in (rows, [rows[0], rows[2], rows[3]]):
        want = generation._generate_tokens(model, prompts, **kw)
        got = generation._generate_tokens(model, prompts, compile=True, **kw)
        assert got[0] == want[0] and got[2] == want[2]
        for a, b in zip(got[1], want[1]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
        assert counter.frame_count == 2
    assert [len(t) for t in want[0]] == [1, 3, 3]
    assert want[2] == ["length"] * 3
