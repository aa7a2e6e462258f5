"""Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses") on a torchtune decoder,
with verl's all-to-all helpers (`verl.utils.ulysses`).

The `sp` ranks of a group share one batch. Each embeds and runs the layers on its own slice of
the sequence; attention alone needs the whole sequence, and gets it by trading heads for
sequence:

    tokens [B, T] -> pad T to a multiple of sp -> this rank's slice [B, T'/sp]
    per layer:  q, k, v [B, H, T'/sp, D] --all-to-all--> [B, H/sp, T', D]
                    (gather_seq_scatter_heads)
                attention over the whole sequence (causal, or the batch's [B, T', T'] mask)
                out [B, H/sp, T', D] --all-to-all--> [B, H, T'/sp, D]
                    (gather_heads_scatter_seq)
    logits [B, T'/sp, V] --all-gather--> [B, T, V]   (verl's gather_outputs_and_unpad)

so the model's output, and every loss computed from it, is that of the unsharded model. The
backward of the all-gather passes each rank the gradient of its own slice, unscaled
(`grad_scaler=False`): each sp rank computes the same full loss, so the slices' contributions
add up (over the FSDP2 reduction, which includes the sp ranks) to the single-process gradient.
Padding positions attend only to themselves and are cut before the output.

Memory: activations inside the layers fall 1/sp; the gathered logits [B, T, V] do not (a
chunked loss would be the next step at large vocabularies).

Import cost: `verl.utils.ulysses` needs only torch, but importing it through the package runs
verl's `__init__`, which imports ray, tensordict and transformers (~5 s of CPU per process, paid
by every sp rank). `_ulysses()` therefore runs verl's own file as a private module when the
verl package is not loaded yet, and uses the package's module when it is.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from posttrain.models.attention_masks import pad_block_mask

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torchtune.modules import TransformerDecoder

__all__ = ["apply_ulysses"]


_VERL_ULYSSES = "verl.utils.ulysses"
_PRIVATE_ULYSSES = "posttrain.train._verl_ulysses"


def _ulysses() -> ModuleType:
    """verl's `verl.utils.ulysses` module (the all-to-all helpers; they hold no state: every
    call here passes its process group).

    When the verl package is already imported, its module; otherwise verl's file
    `verl/utils/ulysses.py` executed once as the private module `posttrain.train._verl_ulysses`
    (its module-level imports are torch only), so a process that trains under sp without any
    other verl function does not import verl's package (see the module docstring).

    Raises:
        ModuleNotFoundError: if verl is not installed.
    """
    if _VERL_ULYSSES in sys.modules or "verl" in sys.modules:
        return importlib.import_module(_VERL_ULYSSES)
    if _PRIVATE_ULYSSES not in sys.modules:
        spec = importlib.util.find_spec("verl")  # locates the package; does not import it
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError("sequence parallelism (sp > 1) needs verl", name="verl")
        path = Path(next(iter(spec.submodule_search_locations))) / "utils" / "ulysses.py"
        file_spec = importlib.util.spec_from_file_location(_PRIVATE_ULYSSES, path)
        assert file_spec is not None and file_spec.loader is not None, path
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[_PRIVATE_ULYSSES] = module
        try:
            file_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_PRIVATE_ULYSSES]
            raise
    return sys.modules[_PRIVATE_ULYSSES]


class _UlyssesAttention:
    """Wraps a torchtune attention call (q, k, v [B, H, S_local, D]) with the two all-to-alls."""

    def __init__(self, inner: Callable[..., Tensor], group: ProcessGroup) -> None:
        self.inner, self.group = inner, group

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = True,
    ) -> Tensor:
        ulysses = _ulysses()
        q, k, v = (
            ulysses.gather_seq_scatter_heads(t, seq_dim=2, head_dim=1, group=self.group)
            for t in (q, k, v)
        )
        out = self.inner(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        return ulysses.gather_heads_scatter_seq(out, head_dim=1, seq_dim=2, group=self.group)


def _pad_mask(mask: torch.Tensor, pad: int) -> torch.Tensor:
    """[B, T, T] bool -> [B, T+pad, T+pad]: real rows see no padding, padding sees itself."""
    b, t, _ = mask.shape
    out = torch.zeros(b, t + pad, t + pad, dtype=mask.dtype, device=mask.device)
    out[:, :t, :t] = mask
    idx = torch.arange(t, t + pad, device=mask.device)
    out[:, idx, idx] = True
    return out


def apply_ulysses(model: TransformerDecoder, mesh: DeviceMesh) -> None:
    """Make `model` (a torchtune decoder) sequence parallel over mesh["sp"], in place.

    After this the model is called as before (`model(tokens [B, T], mask=None | [B, T, T] bool |
    BlockMask, input_pos=None | [B, T])`) on every sp rank with the same inputs, and returns the
    full logits [B, T, V]. Incompatible with a KV cache (generation runs on a gathered copy).

    Raises:
        ValueError: at call time, for a mask that is not a [B, T, T] boolean tensor or a
            `BlockMask`.
    """
    sp_mesh = mesh["sp"]
    group, rank, size = sp_mesh.get_group(), sp_mesh.get_local_rank(), sp_mesh.size()
    for layer in model.layers:
        layer.attn._attention_call = _UlyssesAttention(layer.attn._attention_call, group)
    pads: list[int] = []

    def slice_inputs(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        tokens = args[0] if args else kwargs.pop("tokens")
        b, t = tokens.shape
        pad = -t % size
        input_pos = kwargs.get("input_pos")
        if input_pos is None:
            input_pos = torch.arange(t, device=tokens.device).expand(b, t)
        mask = kwargs.get("mask")
        block = isinstance(mask, BlockMask)  # packed rows on CUDA (attention_masks.device_mask)
        if mask is not None and not block and (mask.dim() != 3 or mask.dtype != torch.bool):
            raise ValueError(
                f"sequence parallelism needs a [B, T, T] boolean mask, a BlockMask or None; got "
                f"{tuple(mask.shape)} {mask.dtype}"
            )
        if pad:
            tokens = F.pad(tokens, (0, pad))
            input_pos = F.pad(input_pos, (0, pad))  # position 0: any valid index (cut later)
            if mask is not None:
                mask = pad_block_mask(mask, pad) if block else _pad_mask(mask, pad)
        chunk = (t + pad) // size
        piece = slice(rank * chunk, (rank + 1) * chunk)
        pads.append(pad)
        kwargs = {**kwargs, "mask": mask, "input_pos": input_pos[:, piece]}
        return (tokens[:, piece], *args[1:]), kwargs

    def gather_output(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Tensor
    ) -> Tensor:
        pad = pads.pop()
        return _ulysses().gather_outputs_and_unpad(
            output, gather_dim=1, unpad_dim=1, padding_size=pad, grad_scaler=False, group=group
        )

    model.register_forward_pre_hook(slice_inputs, with_kwargs=True)
    model.register_forward_hook(gather_output, with_kwargs=True)
