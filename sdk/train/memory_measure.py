"""Measured memory of a region of code: the peak bytes of the tensors it allocates, for checking
`posttrain.train.memory_plan`'s terms against what really happens (on CPU, where torch has no
allocator statistics).

`TensorPeak` watches every aten operation run inside it (a `TorchDispatchMode`, forward and
backward alike) and counts each new storage an operation returns, until the storage is freed. A
result that shares a storage with one of the operation's inputs (a view, an in-place update)
is not new. Tensors that existed before the region (parameters, inputs) are not counted;
scratch memory inside a kernel (never a tensor) is not seen, nor are FSDP2's gathered
parameters: FSDP2 resizes their storages in place (no operation allocates them; only the
all-gather's flat output, freed at once, is counted). Under FSDP the measured peak is therefore
below RSS by the gathered groups, the root's above all (the memory plan's "FSDP gathered root"
row: a tied 151,936 x 896 embedding is 0.51 GiB).

Example:
    >>> import torch
    >>> x = torch.ones(1000)                      # allocated before: not counted
    >>> with TensorPeak() as peak:
    ...     y = x * 2                             # 4,000 bytes
    ...     z = (y + 1).view(10, 100)             # 4,000 more (the view is no allocation)
    ...     del y, z
    >>> peak.peak_bytes, peak.live_bytes
    (8000, 0)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["TensorPeak"]


class TensorPeak(TorchDispatchMode):
    """Context manager: `peak_bytes` (the most bytes of storages allocated inside the region
    alive at once) and `live_bytes` (those still alive now), in bytes.

    Counts storages, not tensors: two views of one storage count once. Single-threaded use;
    the autograd engine runs a CPU backward on the calling thread, so `loss.backward()` inside
    is measured too.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def _free(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            _storage_ptr(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = _storage_ptr(t)
            if key == 0 or key in inputs or key in self._live:
                continue
            self._live[key] = storage.nbytes()
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._free, key)
        return out


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of `t`'s storage; 0 for a storage freed in place (FSDP2 frees the gathered
    parameters' storages, resize_(0), while tensors still refer to them)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # "Attempted to access the data pointer on an invalid python storage"
        return 0
