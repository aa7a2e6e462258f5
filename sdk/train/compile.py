"""`torch.compile` of a decoder's transformer blocks, opt-in (`ParallelPlan(compile=True)`, or
`parallel.compile=true` from the command line; `compile_blocks(model)` in a notebook).

As torchtitan's `apply_compile`: each transformer block (torchtune's
`TransformerSelfAttentionLayer`, or the activation-checkpoint wrapper around it) is compiled on
its own, with `fullgraph=True` (a graph break inside a block is an error, not a silent slow path).
The blocks share one code object and identical structure, so dynamo traces the block once and
every other block reuses that graph; the embedding, the final norm and the output projection stay
eager. Order inside `posttrain.train.sharding.parallelize` (torchtitan's): TP, then activation
checkpointing, then compile (of the checkpoint wrapper: the compiler sees the recomputation), then
FSDP2 (its hooks all-gather outside the compiled forward).

What is compiled is the block's `forward`, bound to the block (`types.MethodType`): the module
keeps its class, its hooks run eagerly (FSDP2's all-gathers and reshards), its state-dict keys are
unchanged (no `_orig_mod.` prefix: checkpoints, HF export and weight syncs see the same names),
and `copy.deepcopy(model)` binds the copy's blocks to the copy's own weights.

Dynamic shapes: none are marked. A training batch of a new sequence length recompiles once, after
which dynamo marks the changed dimension dynamic by itself (`automatic_dynamic_shapes`); padded
batches of a fixed length (the loaders' default) compile once. Not composable, refused by name in
`posttrain.train.plan_value.PlanFields`: sp (Ulysses all-to-alls inside the attention call), ep
(the experts' all-to-alls inside the block) and pp (pipeline stages: not verified) with compile.

Backends: "inductor" (the default: C++ kernels on CPU, which needs a C++ compiler such as
Debian's g++; Triton on GPUs) and "aot_eager" (dynamo and AOTAutograd without code generation:
the same graphs, fast to build; for tests and to find graph breaks).

Example:
    >>> from posttrain.models import build_model, get_preset
    >>> model = build_model(get_preset("tiny-1m"), seed=0)
    >>> compile_blocks(model, backend="aot_eager"), compiled_blocks(model)  # tiny-1m: 4 blocks
    (4, 4)
    >>> compile_blocks(model)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: compile_blocks: the blocks of this model are compiled already ...
"""

from __future__ import annotations

import types

import torch
from torch import nn

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "compile_blocks", "compiled_blocks"]

BACKENDS = ("inductor", "aot_eager")
"""The `torch.compile` backends `compile_blocks` takes."""

DEFAULT_BACKEND = "inductor"
"""The backend of `compile_blocks(model)` and of `ParallelPlan(compile=True)`."""


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        raise TypeError(
            "compile_blocks compiles the transformer blocks of a torchtune TransformerDecoder "
            f"(a model with .layers); got {type(model).__name__}"
        )
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def _is_compiled(block: nn.Module) -> bool:
    forward = block.__dict__.get("forward")
    return forward is not None and hasattr(
        getattr(forward, "__func__", forward), "_torchdynamo_orig_callable"
    )


def compiled_blocks(model: nn.Module) -> int:
    """How many transformer blocks of `model` have a compiled forward (0: none).

    Raises:
        TypeError: for a model without `.layers` (not a torchtune decoder).
    """
    return sum(_is_compiled(block) for block in _blocks(model))


def compile_blocks(model: nn.Module, *, backend: str | None = None, fullgraph: bool = True) -> int:
    """Compile the forward of every transformer block of `model` in place (module docstring);
    returns the number of blocks compiled. Compilation itself happens at the first forward of
    each shape (tens of seconds on a CPU for the inductor backend).

    Args:
        model: a torchtune `TransformerDecoder` (after converters, TP and activation
            checkpointing; before FSDP2: `ParallelPlan(compile=True).parallelize` keeps that
            order).
        backend: one of `BACKENDS` (None: `DEFAULT_BACKEND`).
        fullgraph: refuse graph breaks inside a block (torchtitan's choice).

    Raises:
        TypeError: for a model without `.layers`.
        ValueError: for an unknown backend, or blocks compiled already.
        RuntimeError: for backend "inductor" on a CPU model without a C++ compiler.
    """
    backend = DEFAULT_BACKEND if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"compile_blocks backend={backend!r}; allowed: {', '.join(BACKENDS)}")
    blocks = _blocks(model)
    if any(_is_compiled(block) for block in blocks):
        raise ValueError(
            "compile_blocks: the blocks of this model are compiled already "
            "(compile a model once; build a fresh one to compile it differently)"
        )
    param = next(model.parameters(), None)
    if backend == "inductor" and (param is None or param.device.type == "cpu"):
        _check_cpp_compiler()
    for block in blocks:
        compiled = torch.compile(type(block).forward, backend=backend, fullgraph=fullgraph)
        block.forward = types.MethodType(compiled, block)
    return len(blocks)


def _check_cpp_compiler() -> None:
    import shutil

    from torch._inductor import config

    cxx = config.cpp.cxx[-1] if isinstance(config.cpp.cxx, tuple) else config.cpp.cxx
    if not any(shutil.which(c) for c in (cxx, "g++", "c++", "clang++") if c):
        raise RuntimeError(
            "torch.compile's inductor backend builds C++ kernels on the CPU and finds no C++ "
            "compiler (g++): install it (Debian: apt-get install g++), or use "
            "backend='aot_eager'"
        )
