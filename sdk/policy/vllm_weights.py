"""The files a vLLM weight sync writes for the server's reload, and what one sync did
(`WeightSync`). `posttrain.policy.vllm_server.VLLMServer.sync_weights` writes them to a folder of
its own (in /dev/shm by default) and has the server's workers reload from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from posttrain.models.specs import ModelSpec

__all__ = ["WeightSync", "write_reload_files"]


@dataclass(frozen=True)
class WeightSync:
    """What one `VLLMServer.sync_weights` did.

    Attributes:
        version: the weight version now served.
        nbytes: bytes of the safetensors file written to /dev/shm.
        save_s, reload_s, reset_s: wall-clock seconds to write it, to reload it in the server,
            and to reset the server's prefix cache.
    """

    version: int
    nbytes: int
    save_s: float
    reload_s: float
    reset_s: float

    @property
    def total_s(self) -> float:
        return self.save_s + self.reload_s + self.reset_s


def write_reload_files(model: nn.Module, spec: ModelSpec, folder: Path) -> int:
    """Save `model`'s weights (HF names, `spec`'s family) as safetensors in `folder` for vLLM's
    `reload_weights(weights_path=folder)`; return the bytes written."""
    from posttrain.models.hf import save_hf_checkpoint

    save_hf_checkpoint(model, spec, folder)
    if spec.tie_word_embeddings:
        _add_tied_lm_head(folder)
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _add_tied_lm_head(folder: Path) -> None:
    """Write `lm_head.weight` (the embedding) into a tied model's safetensors. vLLM's in-place
    reload fills each layer from the file and puts a layer's old tensors back when the file has
    nothing for it: without this key the output head keeps the old embedding (the tie broken)."""
    from safetensors.torch import load_file, save_file

    for path in folder.glob("*.safetensors"):
        tensors = load_file(str(path))
        if "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
            save_file(tensors, str(path), metadata={"format": "pt"})
