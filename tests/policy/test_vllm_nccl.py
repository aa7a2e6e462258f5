"""NCCL weight sync for vLLM (posttrain.policy.vllm_nccl) where no GPU is: refused by name before
anything is sent, and its payloads checked against what they must carry. The tensors are checked
against the safetensors file the reload path writes; the two JSON payloads against the fields of
vLLM 0.32's own dataclasses, read from the vLLM venv's source (skipped without it). Nothing here
runs NCCL.
"""

import ast
import base64
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.models.hf import save_hf_checkpoint
from posttrain.models.specs import get_preset
from posttrain.policy import Policy
from posttrain.policy.vllm_nccl import (
    NCCL_SERVER_ARGS,
    NCCLUnavailable,
    NCCLWeightSync,
    hf_weights,
    init_info,
    update_info,
)
from posttrain.policy.vllm_process import VLLMUnavailable, vllm_unavailable_reason, vllm_venv

ON_CPU = not torch.cuda.is_available()


class _NoServer:
    """A server that fails the test if anything is sent to it."""

    alive = True

    def post(self, path, body):
        raise AssertionError(f"POST {path} was sent before the refusal")


@pytest.mark.skipif(not ON_CPU, reason="the refusal is for machines without CUDA GPUs")
def test_nccl_sync_is_refused_on_cpu_by_name_before_anything_is_sent():
    with pytest.raises(NCCLUnavailable, match="NCCL weight sync needs CUDA GPUs; on CPU the "):
        NCCLWeightSync.open(_NoServer())
    assert issubclass(NCCLUnavailable, VLLMUnavailable)
    assert NCCL_SERVER_ARGS[0] == "--weight-transfer-config"
    assert json.loads(NCCL_SERVER_ARGS[1]) == {"backend": "nccl"}


@pytest.mark.parametrize("tied", [True, False])
def test_the_broadcast_tensors_are_the_reload_paths_safetensors(tmp_path, tied):
    spec = dataclasses.replace(get_preset("tiny-1m"), tie_word_embeddings=tied)
    policy = Policy.from_spec(spec, seed=3)
    weights = hf_weights(policy)
    written = load_file(str(save_hf_checkpoint(policy.model, spec, tmp_path) / "model.safetensors"))
    if tied:  # the reload path adds the tied head too (vllm_server._add_tied_lm_head)
        assert "lm_head.weight" not in written
        written["lm_head.weight"] = written["model.embed_tokens.weight"]
    assert [name for name, _ in weights] == sorted(written)
    for name, tensor in weights:
        assert torch.equal(tensor, written[name]), name
    info = update_info(weights)
    assert info["names"] == sorted(written)
    assert info["shapes"] == [list(written[k].shape) for k in sorted(written)]
    assert {getattr(torch, d) for d in info["dtype_names"]} == {torch.float32}
    json.dumps(info)


def test_init_info_is_refused_for_a_bad_id_or_worker_count():
    with pytest.raises(ValueError, match="unique_id has 16 bytes"):
        init_info(bytes(16), workers=1)
    with pytest.raises(ValueError, match="workers=0"):
        init_info(bytes(128), workers=0)


VLLM_REASON = vllm_unavailable_reason()


def _dataclass_fields(source: Path, name: str) -> dict[str, bool]:
    """Field name -> whether it has a default, of dataclass `name` in `source` (read, not
    imported: importing vLLM takes ~40 s)."""
    tree = ast.parse(source.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return {
        n.target.id: n.value is not None
        for n in cls.body
        if isinstance(n, ast.AnnAssign)
        and isinstance(n.target, ast.Name)
        and "ClassVar" not in ast.unparse(n.annotation)
    }


@pytest.mark.skipif(VLLM_REASON is not None, reason=str(VLLM_REASON))
def test_the_payloads_carry_the_fields_of_vllms_own_dataclasses():
    (package,) = vllm_venv().glob("lib/python3*/site-packages/vllm/distributed/weight_transfer")
    init = init_info(bytes(range(128)), workers=2)
    fields = _dataclass_fields(package / "nccl_common.py", "NCCLWeightTransferInitInfo")
    assert set(init) <= set(fields), sorted(set(init) - set(fields))
    assert {k for k, has_default in fields.items() if not has_default} <= set(init)
    assert "master_address" not in init  # the unique-id rendezvous, not vLLM's TCPStore
    assert base64.b64decode(init["nccl_unique_id_b64"], validate=True) == bytes(range(128))
    assert (init["rank_offset"], init["world_size"]) == (1, 3)
    update = update_info(hf_weights(Policy.from_spec("tiny-1m")))
    fields = _dataclass_fields(package / "nccl_engine.py", "NCCLWeightTransferUpdateInfo")
    assert fields == dict.fromkeys(update, False)
