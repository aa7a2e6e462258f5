"""Where a step's time goes, how many model FLOPs it did, and the model FLOPs utilisation (MFU).

Notation: N = non-embedding parameters (`non_embedding_params`), D = tokens.

Three pieces, shared by the trainers:

    PhaseTimer          wall seconds per named phase of one step (time.perf_counter); on CUDA it
                        calls torch.cuda.synchronize at each phase boundary, on CPU nothing
    model_flops         the standard approximation: 6 N D for training (forward + backward),
                        2 N D forward-only (sampling, reference / old log-probs); Kaplan et al.
                        2020, "Scaling Laws for Neural Language Models", sec. 2.1, eq. 2.2 and
                        Table 1 (no attention term)
    attention_flops     the attention term (the score and value matmuls) at one sequence length
                        T: 12 L T d_attn per trained token, 4 L T d_attn per forward token
                        (PaLM, Chowdhery et al. 2022, appendix B; the causal mask not halved)
    step_flops          the two together over sequences of mixed lengths, the convention every
                        MFU here follows (the trainers' `mfu` columns and the benchmarks,
                        docs/benchmarks/README.md "Conventions"): 6 N D + 12 L d_attn S for
                        training, S = the step's `attention_span`; `attention_dims` reads L and
                        d_attn off a model
    matmul_peak_flops   the measured peak: the best of `repeats` timed fp32 matmuls of two
                        n x n matrices (2 n^3 FLOPs each; n = 1024 on CPU, 8192 on CUDA) after one
                        warm-up, measured once per process and device and cached; the
                        `POSTTRAIN_PEAK_FLOPS` environment variable (FLOP/s) or
                        `set_peak_flops` override it (e.g. a datasheet figure); `dtype`
                        bfloat16 times a bf16 matmul (GPU training in bf16)
    datasheet_peak_flops
                        a GPU's dense bf16 peak from `DATASHEET_PEAK_FLOPS` by device name
                        (torch.cuda.get_device_name), or None with the reason for another GPU

MFU = model FLOPs of the step / (step seconds x peak FLOP/s x devices), at most 1. The peak is
measured, not a datasheet number, so MFU says how close the step comes to what a plain fp32
matmul reaches on this very machine (fp32: the dtype the trainers run in on CPU; for bf16
training on a GPU set the bf16 peak with `set_peak_flops`).

A peak must not depend on how busy the machine was when it was measured: on a shared CPU a
process that waits for a core sees its wall-clock matmul slow down several times, and a peak
measured so would make every later step's MFU too high (above 1). On CPU the matmul therefore
runs on one intra-op thread and is timed in that thread's CPU seconds (`time.thread_time`: the
time it ran, not the time it waited), and the peak is that one-thread rate x the intra-op
threads (perfect scaling, an upper bound of what the threads reach together). A step is timed
in wall seconds, so waiting lowers its MFU, as it should. When a step's model FLOP/s still
exceed the peak (a peak set too low, or a FLOP count above the work done: every MoE expert
counted), `mfu` reports 1.0 and warns once per process, naming both rates.

Example (a hand count: N = 1,000 parameters, 10 trained tokens):
    >>> model_flops(1_000, 10, kind="train"), model_flops(1_000, 10, kind="forward")
    (60000, 20000)
    >>> # + attention, L = 2, d_attn = 4: the 10 tokens in one sequence of 10 (span 10 x 10)
    >>> step_flops(1_000, 10, span=100, num_layers=2, attn_dim=4, kind="train")
    69600
    >>> set_peak_flops(1e9)
    >>> mfu(6e8, seconds=1.0)
    0.6
    >>> mfu(6e9, seconds=1.0)   # 6 GFLOP/s of model FLOPs over a 1 GFLOP/s peak (warns)
    1.0
    >>> set_peak_flops(None)    # back to measuring
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = [
    "PhaseTimer",
    "model_flops",
    "attention_flops",
    "attention_dims",
    "attention_span",
    "step_flops",
    "datasheet_peak_flops",
    "DATASHEET_PEAK_FLOPS",
    "non_embedding_params",
    "matmul_peak_flops",
    "set_peak_flops",
    "mfu",
    "on_cuda",
    "PEAK_FLOPS_ENV",
    "PEAK_MATMUL_SIZE",
]

PEAK_FLOPS_ENV = "POSTTRAIN_PEAK_FLOPS"
"""Environment variable: a peak in FLOP/s (e.g. "1.5e11") used instead of measuring."""

PEAK_MATMUL_SIZE = {"cpu": 1024, "cuda": 8192}
"""n of the n x n fp32 matmul timed by `matmul_peak_flops`, per device type (others: 2048)."""

DATASHEET_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),  # SXM4 and PCIe
)
"""Dense bf16 tensor-core peaks in FLOP/s from NVIDIA's datasheets (the sparse figures are twice
these), as (substring of the device name, peak): the first entry whose substring is in the name
wins, so the more specific names come first."""

log = logging.getLogger(__name__)

_FLOPS_PER_PARAM_TOKEN = {"train": 6, "forward": 2}
_peak_cache: dict[tuple[str, int, int, int, str], float] = {}
_peak_override: float | None = None
_warned_above_peak = False


class PhaseTimer:
    """Accumulates wall seconds per phase of one step.

    Args:
        cuda: call `torch.cuda.synchronize()` when a phase starts and ends, so that queued GPU
            work is charged to the phase that launched it. Pass `on_cuda(model)`; False (the
            default) adds no synchronisation (CPU work is synchronous already).

    Attributes:
        seconds: phase name -> seconds accumulated (a phase may be entered several times).

    Example:
        >>> timer = PhaseTimer()
        >>> with timer.phase("update"):
        ...     pass
        >>> list(timer.seconds), timer.seconds["update"] >= 0
        (['update'], True)
    """

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the wall time of the `with` block to `name` (also when the block raises)."""
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Add `seconds` to phase `name`. Raises ValueError for negative seconds."""
        if seconds < 0:
            raise ValueError(f"seconds={seconds!r} for phase {name!r}; must be >= 0")
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def row(self, total_s: float, phases: tuple[str, ...]) -> dict[str, float]:
        """`time_<phase>_s` for each of `phases` (0.0 if never entered) and `time_other_s` =
        `total_s` minus their sum (whatever ran outside them, clipped at 0 against clock
        rounding when the phases cover everything). The columns sum to `total_s` whenever the
        phases lie inside the measured interval."""
        out = {f"time_{p}_s": self.seconds.get(p, 0.0) for p in phases}
        out["time_other_s"] = max(total_s - sum(out.values()), 0.0)
        return out


def on_cuda(model: nn.Module) -> bool:
    """True if `model`'s first parameter lives on a CUDA device (False for no parameters)."""
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cuda"


def non_embedding_params(model: nn.Module) -> int:
    """N of the FLOP count: every parameter of `model` except the token-embedding table
    (a lookup, no multiply-adds). The output projection is a matmul and counts; when it is tied
    to the embedding (torchtune `TiedLinear`, no parameter of its own) the table's size is
    counted once for it. Frozen parameters (a LoRA base, a reference copy) count too: they do
    forward FLOPs. For a mixture-of-experts model every expert is counted (an upper bound of
    the active parameters)."""
    embedding = getattr(model, "tok_embeddings", None)
    skip = {id(p) for p in embedding.parameters()} if isinstance(embedding, nn.Module) else set()
    n = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    output = getattr(model, "output", None)
    if (
        skip
        and output is not None
        and not any(True for _ in getattr(output, "parameters", lambda: iter(()))())
    ):
        assert isinstance(embedding, nn.Module)  # skip is empty otherwise
        n += sum(p.numel() for p in embedding.parameters())
    return n


def model_flops(n_params: int, tokens: int, *, kind: str) -> int:
    """Model FLOPs of `tokens` tokens through a model with `n_params` non-embedding parameters:
    6 N D for kind "train" (forward 2 N D + backward 4 N D), 2 N D for "forward" (Kaplan et al.
    2020, eq. 2.2; the attention term is `attention_flops`, both together `step_flops`).

    Raises:
        ValueError: for an unknown kind (allowed: "train", "forward") or negative counts.
    """
    if kind not in _FLOPS_PER_PARAM_TOKEN:
        raise ValueError(f"kind={kind!r}; must be one of {sorted(_FLOPS_PER_PARAM_TOKEN)}")
    if n_params < 0 or tokens < 0:
        raise ValueError(f"n_params={n_params!r}, tokens={tokens!r}; both must be >= 0")
    return _FLOPS_PER_PARAM_TOKEN[kind] * int(n_params) * int(tokens)


def attention_flops(num_layers: int, seq_len: int, attn_dim: int, tokens: int, *, kind: str) -> int:
    """Attention FLOPs (the score and value matmuls, which 6 N D leaves out) of `tokens` tokens in
    sequences of `seq_len` positions: 12 L T d_attn per token for kind "train" and 4 L T d_attn
    for "forward" (PaLM, Chowdhery et al. 2022, appendix B; the causal mask is not halved, as
    there). d_attn = num_heads x head_dim (the query width, not the model width when they differ).

    Example: L = 2, T = 8, d_attn = 4, 10 tokens, train: 12 x 2 x 8 x 4 x 10 = 7,680.

    Raises:
        ValueError: for an unknown kind (allowed: "train", "forward") or a negative count.
    """
    if kind not in _FLOPS_PER_PARAM_TOKEN:
        raise ValueError(f"kind={kind!r}; must be one of {sorted(_FLOPS_PER_PARAM_TOKEN)}")
    counts = {"num_layers": num_layers, "seq_len": seq_len, "attn_dim": attn_dim, "tokens": tokens}
    bad = {k: v for k, v in counts.items() if v < 0}
    if bad:
        raise ValueError(f"{bad}; every count must be >= 0")
    per_token = 2 * _FLOPS_PER_PARAM_TOKEN[kind] * int(num_layers) * int(seq_len) * int(attn_dim)
    return per_token * int(tokens)


def attention_span(position_ids_BT: torch.Tensor, counted_BT: torch.Tensor) -> torch.Tensor:
    """S of `step_flops`: the sum, over the counted positions, of the length of the sequence
    each one sits in (the keys its attention spans, the causal mask not halved).

    A sequence starts at column 0 and at every position id 0, and runs to the next start or
    the row's end: packed rows (position ids restarting at 0 per document) give each token its
    own document's length, the padding tail being one more sequence; unpacked right-padded rows
    (ids 0..T-1) give every token the row length T, padding included (the attention kernel runs
    over it). With one sequence length T throughout, S = T x the counted tokens.

    Args:
        position_ids_BT: [B, T] int64 position ids.
        counted_BT: [B, T] bool (or 0/1), the positions counted (the trained tokens).

    Returns:
        An int64 scalar on the inputs' device (no host sync).

    Example (a row packing documents of 3 and 2 tokens, then 1 of padding; counted: the
    first two tokens of each document): 3 + 3 + 2 + 2 = 10.
        >>> pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
        >>> int(attention_span(pos, torch.tensor([[1, 1, 0, 1, 1, 0]]).bool()))
        10

    Raises:
        ValueError: if the two are not [B, T] of one shape.
    """
    if position_ids_BT.dim() != 2 or counted_BT.shape != position_ids_BT.shape:
        raise ValueError(
            f"position_ids {tuple(position_ids_BT.shape)} and counted "
            f"{tuple(counted_BT.shape)} must both be [B, T]"
        )
    B, T = position_ids_BT.shape
    starts_BT = position_ids_BT == 0
    starts_BT[:, 0] = True
    offsets_B1 = torch.arange(B, device=starts_BT.device)[:, None] * T
    sequence_BT = starts_BT.cumsum(-1) - 1 + offsets_B1  # a distinct id per sequence
    lengths = torch.bincount(sequence_BT.flatten(), minlength=B * T)
    return (lengths[sequence_BT] * counted_BT.to(torch.int64)).sum()


def attention_dims(model: nn.Module) -> tuple[int, int]:
    """(L, d_attn) of `model` for `step_flops`: L = its attention modules, found as the
    modules with a `q_proj` submodule (torchtune's `MultiHeadAttention`, transformers' attention
    classes; LoRA or FP8 versions of q_proj too), d_attn = q_proj's output width (heads x head
    width; a tensor-parallel DTensor weight has its global shape, so this is the whole layer's
    width, as `non_embedding_params` counts every shard). (0, 0) for a model with no such
    module (no attention FLOPs to count); a pipeline stage counts its own layers.

    Raises:
        ValueError: if the attention modules have different widths (their FLOPs would need
            one term per width), naming the widths found.
    """
    widths = []
    for module in model.modules():
        q_proj = getattr(module, "q_proj", None)
        if isinstance(q_proj, nn.Module):
            out = getattr(q_proj, "out_features", getattr(q_proj, "out_dim", None))
            weight = getattr(q_proj, "weight", None)
            if out is None and isinstance(weight, torch.Tensor):
                out = weight.shape[0]
            if out is None:
                raise ValueError(
                    f"{type(q_proj).__name__} q_proj has neither out_features, out_dim nor a "
                    "weight; its attention width is unknown"
                )
            widths.append(int(out))
    if not widths:
        return 0, 0
    if len(set(widths)) > 1:
        raise ValueError(
            f"attention modules of widths {sorted(set(widths))} (q_proj output features); "
            "step_flops takes one d_attn"
        )
    return len(widths), widths[0]


def step_flops(
    n_params: int, tokens: int, *, span: int, num_layers: int, attn_dim: int, kind: str
) -> int:
    """Model FLOPs by the convention every MFU here uses: `model_flops(n_params, tokens)` + the
    attention term 2k L d_attn S (k = 6 for kind "train", 2 for "forward"; PaLM appendix B),
    S = `span` = the sum over the `tokens` of the length of the sequence each sits in
    (`attention_span`; T x tokens when every sequence has T positions, and then the attention
    term is `attention_flops(num_layers, T, attn_dim, tokens)`).

    Example: N = 1,000, 10 tokens in sequences of 4 and 6 tokens (S = 4 x 4 + 6 x 6 = 52),
    L = 2, d_attn = 4, train: 60,000 + 12 x 2 x 4 x 52 = 64,992.

    Raises:
        ValueError: for an unknown kind (allowed: "train", "forward") or a negative count.
    """
    attention = attention_flops(num_layers, span, attn_dim, 1, kind=kind)
    return model_flops(n_params, tokens, kind=kind) + attention


def datasheet_peak_flops(device_name: str) -> tuple[float | None, str]:
    """The dense bf16 peak (FLOP/s) of the GPU named `device_name` (`torch.cuda.get_device_name`)
    from `DATASHEET_PEAK_FLOPS`, and where it came from; (None, the reason) for a device the
    table does not list (report "n/a", never a guess).

    Example:
        >>> datasheet_peak_flops("NVIDIA H100 80GB HBM3")
        (989000000000000.0, 'datasheet dense bf16 of H100')
        >>> datasheet_peak_flops("NVIDIA L4")[0] is None
        True
    """
    for key, peak in DATASHEET_PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return peak, f"datasheet dense bf16 of {key}"
    known = ", ".join(key for key, _ in DATASHEET_PEAK_FLOPS)
    return None, f"no datasheet peak for {device_name!r} (the table lists {known})"


def set_peak_flops(flops_per_s: float | None) -> None:
    """Use `flops_per_s` as the peak for every later `matmul_peak_flops` call in this process
    (None: measure again, cached). Raises ValueError for a value that is not > 0."""
    global _peak_override
    if flops_per_s is not None and not (isinstance(flops_per_s, (int, float)) and flops_per_s > 0):
        raise ValueError(f"flops_per_s={flops_per_s!r}; must be a number > 0 or None")
    _peak_override = None if flops_per_s is None else float(flops_per_s)


def matmul_peak_flops(
    device: torch.device | str = "cpu",
    *,
    size: int | None = None,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Peak FLOP/s of `device`: `set_peak_flops`'s value, else `$POSTTRAIN_PEAK_FLOPS`, else
    measured: one warm-up, then the best of `repeats` fp32 (n x n) @ (n x n) products, each 2 n^3
    FLOPs, n = `size` or `PEAK_MATMUL_SIZE[device type]`. On CPU each product runs on one intra-op
    thread (torch's thread setting is 1 while it measures, then restored) and is timed in that
    thread's CPU seconds (`time.thread_time`), so a machine busy with other processes does not lower
    the peak; the result is that rate x `torch.get_num_threads()`. Elsewhere the products run as
    configured and are timed in wall seconds (time.perf_counter, synchronised on CUDA). Measured
    once per (device, n, repeats, torch intra-op threads) in a process; later calls return the
    cached value. Costs ~0.1-0.5 s on a 2-core CPU (n = 1024). `dtype` is the matrices' dtype
    (float32 by default; bfloat16 for the peak a bf16 GPU step is measured against).

    Raises:
        ValueError: for size or repeats < 1, or a `$POSTTRAIN_PEAK_FLOPS` that is not a
            number > 0.
    """
    if _peak_override is not None:
        return _peak_override
    env = os.environ.get(PEAK_FLOPS_ENV)
    if env:
        try:
            value = float(env)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"{PEAK_FLOPS_ENV}={env!r}; must be a number of FLOP/s > 0")
        return value
    device = torch.device(device)
    n = PEAK_MATMUL_SIZE.get(device.type, 2048) if size is None else size
    if n < 1 or repeats < 1:
        raise ValueError(f"size={size!r}, repeats={repeats!r}; both must be >= 1")
    key = (str(device), n, repeats, torch.get_num_threads(), str(dtype))
    if key not in _peak_cache:
        _peak_cache[key] = _measure(device, n, repeats, dtype)
    return _peak_cache[key]


def _measure(device: torch.device, n: int, repeats: int, dtype: torch.dtype) -> float:
    """FLOP/s of the fastest of `repeats` (n x n) `dtype` products on `device` after a warm-up:
    on CPU one thread's rate in its CPU seconds x the intra-op threads, else wall seconds."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(device, dtype)
    b = torch.randn(n, n, generator=generator).to(device, dtype)
    if device.type == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return threads * _best_rate(a, b, time.thread_time, lambda: None, repeats)
        finally:
            torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return _best_rate(a, b, time.perf_counter, sync, repeats)


def _best_rate(a: torch.Tensor, b: torch.Tensor, clock, sync, repeats: int) -> float:
    """2 n^3 / the fewest `clock` seconds one `a @ b` took over `repeats` tries (one warm-up)."""
    torch.mm(a, b)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        torch.mm(a, b)
        sync()
        best = min(best, clock() - start)
    return 2.0 * a.shape[0] ** 3 / max(best, 1e-9)


def mfu(
    flops: float, seconds: float, *, peak_flops_per_s: float | None = None, devices: int = 1
) -> float:
    """Model FLOPs utilisation, a fraction in [0, 1]: `flops` / (`seconds` x peak x `devices`);
    the peak is `matmul_peak_flops()` (CPU) unless given. NaN when seconds is 0. A step whose
    FLOP/s exceed peak x devices reports 1.0 (it cannot use more than the peak: the peak or the
    FLOP count is off) and logs a warning, once per process, naming both rates and how to set
    the peak.

    Raises:
        ValueError: for negative flops or seconds, devices < 1, or a peak that is not > 0.
    """
    global _warned_above_peak
    if flops < 0 or seconds < 0 or devices < 1:
        raise ValueError(
            f"flops={flops!r}, seconds={seconds!r}, devices={devices!r}; flops "
            "and seconds must be >= 0 and devices >= 1"
        )
    if seconds == 0:
        return float("nan")
    peak = matmul_peak_flops() if peak_flops_per_s is None else peak_flops_per_s
    if not peak > 0:
        raise ValueError(f"peak_flops_per_s={peak!r}; must be > 0 FLOP/s")
    utilisation = float(flops) / (seconds * peak * devices)
    if utilisation > 1.0:
        if not _warned_above_peak:
            _warned_above_peak = True
            log.warning(
                "a step ran %.3g model FLOP/s over a peak of %.3g FLOP/s x %d devices: "
                "MFU reported as 1.0 (the peak is too low or the FLOP count too high; "
                "set the peak with set_peak_flops or $%s)",
                flops / seconds,
                peak,
                devices,
                PEAK_FLOPS_ENV,
            )
        return 1.0
    return utilisation
