"""posttrain.train.memory_plan's terms beside the block activations: the tied embedding's
gradients (measured with TensorPeak on a tiny tied model), the FSDP gathered root and the root's
reduce-scatter, the reference model only where one is built, and the rollout copy under a plan.

Hand values use WIDE_V: qwen2, V=4096, D=32, L=1, H=2, K=1, d=16, F=64, so the root (V x D =
131072 parameters, 512 KiB in fp32) outweighs the block (9,344 parameters) and the tokens. One
V x D matrix in fp32 is VD = 4096 * 32 * 4 = 524288 bytes.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.models import ModelSpec, build_model
from posttrain.train import ParallelPlan
from posttrain.train.memory_measure import TensorPeak
from posttrain.train.memory_plan import MemoryBatch, plan_memory

WIDE_V = ModelSpec(
    family="qwen2",
    vocab_size=4096,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    embed_dim=32,
    intermediate_dim=64,
    max_seq_len=64,
    rope_base=1e6,
    norm_eps=1e-6,
    tie_word_embeddings=True,
)
VD = 4096 * 32 * 4
BATCH = MemoryBatch(micro_batch_size=1, seq_len=4)


def _term(df, name: str) -> int:
    return int(df.set_index("term").loc[name, "bytes"])


def _step_tensor_peak(spec: ModelSpec) -> int:
    """TensorPeak of one forward + cross-entropy + backward of `spec` (B=1, T=4), one thread."""
    model = build_model(spec, seed=0)
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, 256, (1, 4), generator=g) for _ in range(2))
    with TensorPeak() as peak:
        logits = model(ids, input_pos=torch.arange(4).expand(1, 4))
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
        del logits
    return peak.peak_bytes


@pytest.mark.parametrize("tied", [True, False])
def test_the_plan_counts_the_tied_embeddings_second_gradient_and_their_sum(one_thread, tied):
    """A tied embedding's backward makes its own V x D gradient while the head's waits in the
    engine's buffer, then their sum: three V x D at once, where the plan had one (its training
    moments without the term peak at about 1.14 VD; TensorPeak measured 3.16 VD). Untied, each
    matrix keeps its one gradient (2.04 VD planned for the update, 2.16 measured)."""
    spec = WIDE_V.replace(tie_word_embeddings=tied)
    df = plan_memory(spec, None, BATCH, optimizer="sgd", device_type="cpu")
    assert _term(df, "tied embedding gradients") == (2 * VD if tied else 0)
    planned_step = df.attrs["peak_bytes"] - _term(df, "parameters")
    measured = _step_tensor_peak(spec)
    assert 3 * VD < measured < 3.3 * VD if tied else 2 * VD < measured < 2.3 * VD
    assert abs(planned_step - measured) <= 0.06 * measured, (planned_step / VD, measured / VD)
    assert df.attrs["moment"] == ("training (embedding backward)" if tied else "training (update)")


def test_the_fsdp_root_is_its_own_term_and_its_reduce_scatter_a_moment():
    """Under dp_shard=2 the root group stays gathered (V x D, tied) and apart from the 3 blocks
    of the "FSDP buffers" row. Untied, the root's gradients (2 VD + the final norm's) are copied
    into the reduce-scatter input while the gathered root (2 VD) is held: 6 VD at the end of
    backward, which RSS showed on 2 gloo ranks (6.08 VD) where the plan had 4.02 VD."""
    D, block = 32, 2 * 32 * 32 + 2 * 32 * 16 + 32 + 2 * 16 + 3 * 32 * 64 + 2 * 32  # 9,344
    plan = ParallelPlan(dp_shard=2)
    tied = plan_memory(WIDE_V, plan, BATCH, optimizer="sgd", device_type="cpu")
    assert _term(tied, "FSDP gathered root") == VD + 4 * D
    assert _term(tied, "FSDP buffers") == 3 * block * 4
    untied = plan_memory(
        WIDE_V.replace(tie_word_embeddings=False), plan, BATCH, optimizer="sgd", device_type="cpu"
    )
    root = 2 * VD + 4 * D
    assert _term(untied, "FSDP gathered root") == root
    assert untied.attrs["moment"] == "training (root reduce-scatter)"
    reduce_scatter = block * 4 // 2 + 2 * root + root  # one block's local gradients
    assert untied.attrs["peak_bytes"] == _term(untied, "parameters") + reduce_scatter


def test_a_reference_is_counted_only_where_the_trainer_builds_one():
    """RLTrainer holds a reference only with kl_coef > 0 and no LoRA adapters
    (`uses_reference`; an adapter is a module with `adapter_params`, as torchtune's
    LoRALinear); plan_memory(reference=False) leaves it out."""
    from posttrain.rl import RLAlgorithm
    from posttrain.rl.parallel import uses_reference

    batch = MemoryBatch(micro_batch_size=2, seq_len=8)
    held = plan_memory(WIDE_V, None, batch, phase="grpo")
    without = plan_memory(WIDE_V, None, batch, phase="grpo", reference=False)
    assert _term(held, "reference model") == _term(held, "parameters")
    assert "reference model" not in set(without["term"])
    assert held.attrs["peak_bytes"] - without.attrs["peak_bytes"] == _term(held, "parameters")
    model = build_model(WIDE_V, seed=0)
    assert uses_reference(RLAlgorithm.grpo(kl_coef=0.04), model)
    assert not uses_reference(RLAlgorithm.grpo(kl_coef=0.0), model)

    class Adapter(torch.nn.Module):  # what torchtune's LoRALinear offers has_adapters
        def adapter_params(self) -> list[str]:
            return []

    model.layers[0].attn.q_proj = Adapter()
    assert not uses_reference(RLAlgorithm.grpo(kl_coef=0.04), model)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"phase": "sft", "reference": True}, r"reference=True with phase='sft'.*dpo, grpo, ppo"),
        ({"phase": "grpo", "reference": "no"}, r"reference='no'; must be None, True or False"),
    ],
)
def test_a_bad_reference_names_the_field_and_the_allowed_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_memory(WIDE_V, None, BATCH, **kwargs)


def test_the_rollout_copy_is_held_under_a_plan_and_refreshed_from_the_gathered_weights():
    """Under a plan RLTrainer samples from a plain, unsharded copy of the policy and loads the
    gathered full state dict into it every step (as many bytes again); without a plan the policy
    samples itself, and SFT has no copy. Here 8 blocks outweigh a 256-token vocabulary, so the
    refresh (the whole model twice beside the rank's half) is the peak: 83,008 parameters."""
    spec = WIDE_V.replace(vocab_size=256, num_layers=8)
    whole = (8 * 9344 + 256 * 32 + 32) * 4  # blocks + root (tied embedding, final norm)
    assert sum(p.numel() for p in build_model(spec, seed=0).parameters()) * 4 == whole
    plan, batch = ParallelPlan(dp_shard=2), MemoryBatch(micro_batch_size=1, seq_len=2)
    grpo = plan_memory(spec, plan, batch, phase="grpo", reference=False, optimizer="sgd")
    assert _term(grpo, "rollout copy") == whole
    assert grpo.attrs["moment"] == "rollout refresh"
    assert grpo.attrs["peak_bytes"] == whole // 2 + 2 * whole
    for phase, p in (("grpo", None), ("sft", plan), ("rollout", plan)):
        assert "rollout copy" not in set(plan_memory(spec, p, batch, phase=phase)["term"])


def test_the_model_builds_broadcast_copies_are_planned(one_thread, monkeypatch):
    """plan.parallelize broadcasts rank 0's weights through `flat_collective`, whose flat copy of
    a bucket is still referenced while the next one is made: two buckets, but a tensor larger
    than a bucket goes alone, as its own copy (Qwen2.5-0.5B's 0.51 GiB embedding against 64 MiB
    buckets; here 512 KiB against 64 KiB buckets, the bucket size the plan reads patched).
    TensorPeak around the same copy-in and copy-out (the collective allocates nothing on CPU):
    the embedding's copy and the next bucket, 512 + 57 KiB, where the plan had 2 x 64 KiB."""
    from posttrain.core import distributed

    monkeypatch.setattr(distributed, "_BUCKET_BYTES", 64 * 1024)
    spec = WIDE_V.replace(num_layers=4)
    model = build_model(spec, seed=0)
    with TensorPeak() as peak:
        distributed.flat_collective(list(model.parameters()), lambda flat: None)
    df = plan_memory(spec, ParallelPlan(dp_shard=2), BATCH, optimizer="sgd", device_type="cpu")
    whole = sum(p.numel() * 4 for p in model.parameters())
    planned = _term(df, "model build") - whole
    assert planned == VD + 64 * 1024
    assert VD + 48 * 1024 < peak.peak_bytes <= planned
