"""Every packed path hands the model the mask `use_block_mask` decides on: the SFT/CPT loss (plain
and chunked), distillation (student and teacher), the pipeline stages, shared-prefix scoring and
sequence parallelism's padding. On CPU (no GPU here) each keeps the dense mask as it was; with the
decision of a capable CUDA device (patched in, the masks built on CPU) each builds a FlexAttention
`BlockMask` whose pairs, as the kernel reads them (its full blocks whole, its partial blocks
through `mask_mod`, evaluated over every (q, kv) pair), are the dense mask's, and whose forward
(eager FlexAttention, forward only on CPU) gives the dense mask's loss."""

import pytest
import torch
from _flex_helpers import flex
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from posttrain.data.loader import IGNORE_INDEX, Sample, pack_samples, stack_rows
from posttrain.models import attention_masks
from posttrain.models.attention_masks import (
    FLEX_CAPABILITY,
    block_segment_mask,
    dense_segment_mask,
    device_mask,
    documents_from_mask,
    pad_block_mask,
    use_block_mask,
)
from posttrain.policy import Policy, shared_prefix
from posttrain.policy.shared_prefix import SharedPrefixPack
from posttrain.train import pipeline
from posttrain.train.distill_loss import GKDLoss
from posttrain.train.losses import SFTCrossEntropy
from posttrain.train.sequence_parallel import _pad_mask

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = ([37, 130, 100], [260, 25])  # documents of two packed rows of 300: 33 and 15 padding


def kernel_pairs(block: BlockMask) -> torch.Tensor:
    """bool [N, S, S]: the (q, kv) pairs FlexAttention attends under `block`: every pair of a full
    block, and the pairs of a partial block where `mask_mod` is True."""
    N, S = block.shape[0], block.seq_lengths[0]
    partial = BlockMask.from_kv_blocks(
        block.kv_num_blocks,
        block.kv_indices,
        BLOCK_SIZE=block.BLOCK_SIZE,
        mask_mod=block.mask_mod,
        seq_lengths=block.seq_lengths,
    ).to_dense()[:, 0]
    full = block.to_dense()[:, 0].bool() & ~partial.bool()

    def pairs(blocks: torch.Tensor) -> torch.Tensor:
        rows = blocks.bool().repeat_interleave(block.BLOCK_SIZE[0], 1)
        return rows.repeat_interleave(block.BLOCK_SIZE[1], 2)[:, :S, :S]

    b, q, kv = torch.arange(N)[:, None, None], torch.arange(S)[:, None], torch.arange(S)
    mod = block.mask_mod(b, torch.zeros(1, dtype=torch.long), q, kv).expand(N, S, S)
    return pairs(full) | (pairs(partial) & mod)


def _packed_batch(vocab: int = 250):
    """Two packed rows of 300 tokens (several documents, a padding tail), trained labels."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for lengths in LENGTHS:
        samples = [
            Sample(ids, torch.roll(ids, -1))
            for n in lengths
            for ids in [torch.randint(3, vocab, (n,), generator=g)]
        ]
        rows += pack_samples(samples, seq_len=300, pad_id=0)
    return stack_rows(rows)


class _Recorder:
    """Makes `model`'s attention record each mask it gets and run a `BlockMask` through eager
    FlexAttention (a dense mask through torchtune's SDPA call), as torchtune does on CUDA."""

    def __init__(self, model: nn.Module) -> None:
        self.masks: list = []
        for module in model.modules():
            if hasattr(module, "_attention_call"):
                module._attention_call = self._wrap(module._attention_call)

    def _wrap(self, sdpa):
        def call(q, k, v, mask, dropout_p, is_causal):
            self.masks.append(mask)
            if isinstance(mask, BlockMask):
                return flex(q, k, v, mask)
            return sdpa(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)

        return call


@pytest.fixture
def capable_gpu(monkeypatch):
    """The decision of a CUDA device of compute capability 8.0, wherever a path imports it."""

    def decide(device, *, capability=None):
        return use_block_mask("cuda", capability=(8, 0))

    for module in (attention_masks, pipeline, shared_prefix):
        monkeypatch.setattr(module, "use_block_mask", decide)


@pytest.fixture(scope="module")
def batch():
    return _packed_batch()


def test_the_decision_by_device_and_capability():
    assert FLEX_CAPABILITY == (7, 5)
    cases = {
        ("cuda", (7, 5)): True,
        ("cuda:1", (9, 0)): True,
        ("cuda", (8, 6)): True,
        ("cuda", (7, 0)): False,
        ("cuda", (6, 1)): False,
        ("cpu", (9, 0)): False,
        ("meta", None): False,
    }
    for (device, capability), want in cases.items():
        assert use_block_mask(device, capability=capability) is want, (device, capability)
    assert use_block_mask("cpu") is False
    # without a capability: what torchtune's attention acts on (no GPU here: False)
    from torchtune.utils._import_guard import _SUPPORTS_FLEX_ATTENTION

    assert use_block_mask("cuda") is bool(_SUPPORTS_FLEX_ATTENTION)


def test_the_block_masks_of_every_path_are_the_dense_masks(batch, capable_gpu):
    """Packed rows (loss, distillation: `device_mask`; pipeline: the documents each stage
    builds from), shared-prefix groups, and both grown by sequence parallelism's padding."""
    block = device_mask(batch.attention_mask, "cpu")
    assert isinstance(block, BlockMask) and block.shape == (2, 1, 300, 300)
    assert torch.equal(kernel_pairs(block), batch.attention_mask)
    # row 1's first document fills query block 1 x key block 0: a full block, no mask_mod
    assert block.full_kv_num_blocks[1, 0].tolist() == [0, 1, 0]
    assert device_mask(None, "cpu") is None
    (documents,) = pipeline._stage_mask(batch.attention_mask, torch.device("cpu")).values()
    assert documents[1].tolist() == [0] * 260 + [1] * 25 + [2] * 15  # by hand
    assert torch.equal(kernel_pairs(block_segment_mask(documents)), batch.attention_mask)
    # two groups: a prompt of 20 with answers 150, 90, 40; a prompt of 5 with 200, 80 (+15)
    ids = torch.randint(3, 200, (5, 300), generator=torch.Generator().manual_seed(1))
    valid, response = torch.zeros(5, 300, dtype=torch.bool), torch.zeros(5, 300, dtype=torch.bool)
    for b, (prompt, answer) in enumerate([(20, 150), (20, 90), (20, 40), (5, 200), (5, 80)]):
        ids[b, :prompt] = ids[0 if prompt == 20 else 3, :prompt]
        valid[b, : prompt + answer], response[b, prompt : prompt + answer] = True, True
    packs = [
        SharedPrefixPack.build(ids, valid, response, embed_dim=8, block_mask=b)
        for b in (None, False)
    ]
    assert packs[0] is not None and packs[1] is not None
    assert isinstance(packs[0].mask, BlockMask)
    assert torch.equal(kernel_pairs(packs[0].mask), packs[1].mask)
    for blocked, dense in ((packs[0].mask, packs[1].mask), (block, batch.attention_mask)):
        assert torch.equal(kernel_pairs(pad_block_mask(blocked, 3)), _pad_mask(dense, 3))
    assert pad_block_mask(block, 0) is block
    with pytest.raises(ValueError, match="pad=-1; must be an int >= 0"):
        pad_block_mask(block, -1)


def test_cpu_keeps_the_dense_mask_on_every_path(batch):
    assert device_mask(batch.attention_mask, "cpu") is batch.attention_mask  # not even a copy
    assert pipeline._stage_mask(batch.attention_mask, torch.device("cpu")) == {
        "mask": batch.attention_mask
    }
    assert pipeline._stage_mask(None, torch.device("cpu")) == {}


@pytest.fixture(scope="module")
def policies():
    return Policy.from_spec("tiny-1m", seed=0), Policy.from_spec("tiny-1m", seed=1)


def _losses(policies, batch):
    """(SFT CE, chunked SFT CE, GKD, chunked GKD) on `batch`, and the masks each model got."""
    student, teacher = policies
    seen = _Recorder(student.model), _Recorder(teacher.model)
    units = (batch.labels != IGNORE_INDEX).sum()
    losses = [
        SFTCrossEntropy(),
        SFTCrossEntropy(loss_chunk_tokens=64),
        GKDLoss(teacher=teacher, student=student),
        GKDLoss(teacher=teacher, student=student, loss_chunk_tokens=64),
    ]
    with torch.no_grad():
        values = [float(loss(student.model, batch, units)) for loss in losses]
    return values, seen[0].masks + seen[1].masks


def test_the_losses_hand_the_model_the_decided_mask(policies, batch, monkeypatch):
    """CPU: every attention call gets the batch's own dense mask. A capable GPU's decision:
    every call gets a `BlockMask` of the batch's pairs, and the four losses are the dense
    mask's within 1e-5 (FlexAttention sums in another order)."""
    want, masks = _losses(policies, batch)
    layers = policies[0].spec.num_layers
    assert len(masks) == layers * 6  # student: 4 forwards; teacher: 2
    assert all(m is batch.attention_mask for m in masks)
    monkeypatch.setattr(attention_masks, "use_block_mask", lambda device, **_: True)
    got, masks = _losses(policies, batch)
    assert len(masks) == layers * 6 and all(isinstance(m, BlockMask) for m in masks)
    assert torch.equal(kernel_pairs(masks[0]), batch.attention_mask)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_pipeline_stage_builds_the_block_mask_of_its_rows(policies, batch):
    """One stage holding the whole model (pp=1's split): fed the documents of one pipeline
    micro-batch's rows, its logits are the dense mask's within 1e-5."""
    model = Policy.from_spec("tiny-1m", seed=0).model.eval()
    seen = _Recorder(model)
    want = model(batch.input_ids, mask=batch.attention_mask, input_pos=batch.position_ids)
    model.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(model.layers)})
    stage = pipeline._StageForward(model, first=True, last=True)
    documents = documents_from_mask(batch.attention_mask)
    for rows in (slice(0, 1), slice(1, 2)):  # each micro-batch of one row
        got = stage(
            batch.input_ids[rows], input_pos=batch.position_ids[rows], documents=documents[rows]
        )
        assert isinstance(seen.masks[-1], BlockMask)
        assert torch.equal(kernel_pairs(seen.masks[-1]), batch.attention_mask[rows])
        torch.testing.assert_close(got, want[rows], rtol=1e-5, atol=1e-5)
    assert torch.equal(dense_segment_mask(documents), batch.attention_mask)
