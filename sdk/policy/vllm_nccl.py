"""Weight sync over NCCL for vLLM servers on CUDA GPUs: the trainer broadcasts its weights from
GPU memory straight into the server's workers, without the safetensors round trip through
/dev/shm that `VLLMServer.sync_weights` makes (the only way on CPU).

Written against vLLM 0.32's weight-transfer API (`vllm.distributed.weight_transfer`: its NCCL
engine, and the RL routes a server started with `VLLM_SERVER_DEV_MODE=1` exposes), the way its
trainer-side `NCCLTrainerWeightTransferEngine` drives it:

1. the server starts with `NCCL_SERVER_ARGS` (`--weight-transfer-config {"backend": "nccl"}`);
2. `NCCLWeightSync.open`: the trainer mints an NCCL unique id and sends it to the server
   (`POST /init_weight_transfer_engine`, `init_info`: the id in standard base64, the workers at
   ranks 1.. of a group of `1 + workers`), and at the same time joins that group as rank 0 and
   answers the one-element all-reduce vLLM's communicator issues right after joining;
3. `NCCLWeightSync.send(policy)`: `POST /start_weight_update`, then `POST /update_weights` (the
   names, dtypes and shapes, `update_info`) while it broadcasts each tensor from rank 0 in that
   order, then `POST /finish_weight_update` and the prefix-cache reset (as after a reload).

The trainer side uses torch alone (`torch.cuda.nccl`): posttrain's venv cannot import vLLM (its
transformers pin conflicts), so it joins through the unique-id rendezvous vLLM offers to
trainers that do not run vLLM's own TCPStore group. The tensors are the HF-named ones
`save_hf_checkpoint` writes, plus `lm_head.weight` for a tied model, as the safetensors path
sends (vLLM's layerwise reload keeps a layer's old tensors when nothing is sent for it).

On a machine without CUDA GPUs `NCCLWeightSync.open` refuses by name (`NCCLUnavailable`) before
it sends anything. This module has not been run on GPUs: on CPU its tests check the refusal,
the tensors, and the payloads against the fields of vLLM's own dataclasses
(tests/policy/test_vllm_nccl.py); the first GPU run should check outputs after `send` against the
builtin generator, as the server tests do after a reload.
"""

from __future__ import annotations

import base64
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from posttrain.policy.vllm_process import VLLMUnavailable

if TYPE_CHECKING:
    from posttrain.policy.policy import Policy
    from posttrain.policy.vllm_server import VLLMServer, WeightSync

__all__ = [
    "NCCL_SERVER_ARGS",
    "NCCLUnavailable",
    "NCCLWeightSync",
    "nccl_unavailable_reason",
    "hf_weights",
    "init_info",
    "update_info",
]

NCCL_SERVER_ARGS = ("--weight-transfer-config", json.dumps({"backend": "nccl"}))
"""`VLLMServer.start(extra_args=...)` for a server that takes weights over NCCL."""

NCCL_UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)


class NCCLUnavailable(VLLMUnavailable):
    """NCCL weight sync needs CUDA GPUs (and torch built with NCCL)."""


def nccl_unavailable_reason() -> str | None:
    """Why NCCL weight sync cannot run here (a sentence), or None when it can."""
    if not torch.cuda.is_available():
        return (
            "NCCL weight sync needs CUDA GPUs; on CPU the safetensors reload is used "
            "(VLLMServer.sync_weights)"
        )
    if not hasattr(torch._C, "_nccl_unique_id"):
        return "NCCL weight sync needs torch built with NCCL; this torch has no torch.cuda.nccl"
    return None


def hf_weights(policy: Policy) -> list[tuple[str, torch.Tensor]]:
    """The policy's weights under HF names, on its device, in the order they are sent: the
    tensors `save_hf_checkpoint` writes, plus `lm_head.weight` (the embedding) for a tied model;
    LoRA / QLoRA adapters merged as the reload path merges them (`vllm_servable.served_policy`).

    Raises:
        ValueError: the model's parameters do not match its spec, or one is not a plain tensor;
            a converter the server does not take (`vllm_servable.check_servable`).
    """
    from posttrain.models.hf import hf_state_dict
    from posttrain.policy.vllm_servable import served_policy

    hf = hf_state_dict(served_policy(policy).model, policy.spec)
    if policy.spec.tie_word_embeddings and "lm_head.weight" not in hf:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    return sorted(hf.items())


def update_info(weights: list[tuple[str, torch.Tensor]]) -> dict[str, list[Any]]:
    """The `update_info` of `POST /update_weights` (vLLM's `NCCLWeightTransferUpdateInfo`):
    names, dtype names (`torch.<name>`, e.g. "float32") and shapes, in broadcast order."""
    return {
        "names": [name for name, _ in weights],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
        "shapes": [list(t.shape) for _, t in weights],
    }


def init_info(unique_id: bytes, *, workers: int) -> dict[str, Any]:
    """The `init_info` of `POST /init_weight_transfer_engine` (vLLM's
    `NCCLWeightTransferInitInfo`): the trainer at rank 0, the server's `workers` at 1..workers.

    Raises:
        ValueError: `unique_id` is not 128 bytes, or `workers` < 1.
    """
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"unique_id has {len(unique_id)} bytes; an NCCL unique id has 128")
    if workers < 1:
        raise ValueError(f"workers={workers}; the server's workers (tp x pp x dp) are >= 1")
    return {
        "nccl_unique_id_b64": base64.b64encode(unique_id).decode(),  # standard, not URL-safe
        "rank_offset": 1,
        "world_size": 1 + workers,
        "packed": False,
    }


class NCCLWeightSync:
    """An NCCL group between this process (rank 0) and one vLLM server's workers. Build it with
    `NCCLWeightSync.open`; `send(policy)` broadcasts the weights; `close()` releases the group.

    Attributes:
        server: the `VLLMServer` (started with `NCCL_SERVER_ARGS`).
        workers: its worker processes (tensor x pipeline x data parallel).
    """

    def __init__(self, server: VLLMServer, comm: Any, workers: int, device: torch.device) -> None:
        self.server, self.workers, self.device = server, workers, device
        self._comm = comm

    @classmethod
    def open(
        cls, server: VLLMServer, *, workers: int = 1, device: torch.device | None = None
    ) -> NCCLWeightSync:
        """Join an NCCL group with `server`'s workers (see the module docstring).

        Raises:
            NCCLUnavailable: no CUDA GPUs or no NCCL in torch (nothing is sent to the server).
            VLLMServerError: the server refused the init (e.g. it was started without
                `NCCL_SERVER_ARGS`).
        """
        reason = nccl_unavailable_reason()
        if reason is not None:
            raise NCCLUnavailable(reason)
        device = device or torch.device("cuda", torch.cuda.current_device())
        unique_id = torch.cuda.nccl.unique_id()
        body = {"init_info": init_info(unique_id, workers=workers)}
        with ThreadPoolExecutor(max_workers=1) as thread:
            answer = thread.submit(server.post, "/init_weight_transfer_engine", body)
            with torch.cuda.device(device):
                comm = torch.cuda.nccl.init_rank(1 + workers, unique_id, 0)
                warm_up = [torch.zeros(1, device=device)]  # vLLM's communicator issues this
                torch.cuda.nccl.all_reduce(warm_up, comms=[comm])
                torch.cuda.current_stream().synchronize()
            answer.result()
        return cls(server, comm, workers, device)

    def send(self, policy: Policy) -> WeightSync:
        """Broadcast `policy`'s weights into the server's workers, reset its prefix cache and
        bump its `weight_version`.

        Raises:
            ValueError: the weights are not on this group's CUDA device.
            VLLMServerError: the server refused a step; the group is then unusable (a worker
                may wait in a broadcast): close the server.
        """
        from posttrain.policy.vllm_server import WeightSync

        weights = hf_weights(policy)
        off = sorted({str(t.device) for _, t in weights if t.device != self.device})
        if off:
            raise ValueError(f"the policy's weights are on {off}; move them to {self.device}")
        t0 = time.perf_counter()
        self.server.post("/start_weight_update", None)
        with ThreadPoolExecutor(max_workers=1) as thread:
            answer = thread.submit(
                self.server.post, "/update_weights", {"update_info": update_info(weights)}
            )
            with torch.cuda.device(self.device):
                for _, tensor in weights:
                    torch.cuda.nccl.broadcast([tensor.contiguous()], root=0, comms=[self._comm])
                torch.cuda.current_stream().synchronize()
            answer.result()
        self.server.post("/finish_weight_update", None)
        t1 = time.perf_counter()
        self.server.reset_prefix_cache()
        t2 = time.perf_counter()
        self.server.weight_version += 1
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        return WeightSync(self.server.weight_version, nbytes, 0.0, t1 - t0, t2 - t1)

    def close(self) -> None:
        """Ask the server to release the group (`POST /shutdown_weight_transfer_engine`)."""
        if self.server.alive:
            self.server.post("/shutdown_weight_transfer_engine", None)
