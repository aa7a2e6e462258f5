"""Launching the ranks of a memory benchmark and what a rank reads about its own memory, shared by
benchmarks/parallel_memory.py and benchmarks/real_size_run.py: each rank is a fresh process
(`SCRIPT --worker RANK WORLD SPEC OUT`, gloo on 127.0.0.1, one intra-op thread) that writes its
result as JSON to OUT.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def status_bytes(key: str) -> int:
    """A size field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def local_bytes(tensors) -> int:
    """Bytes of this rank's local parts of `tensors` (a DTensor's shard), each storage once."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0  # FSDP2's sharded gradients are views of one flat buffer per group
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        key = (local.data_ptr(), local.numel())
        if key in seen or local.dim() == 0:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(
    script: str,
    name: str,
    world: int,
    spec: str,
    folder: Path,
    *,
    timeout: float,
    fixed_malloc: bool,
) -> list[dict]:
    """Run `script --worker RANK WORLD SPEC OUT` as `world` fresh processes (gloo on 127.0.0.1,
    one intra-op thread each; with `fixed_malloc` MALLOC_MMAP_THRESHOLD_=65536, else glibc's
    default) and return the JSON each wrote to OUT, in rank order.

    Raises:
        RuntimeError: naming `name` and the deadline, with the failing ranks' log tails, when a
            rank exits non-zero (the others are killed) or `timeout` seconds pass.
    """
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if fixed_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    outs = [folder / f"{name}-rank{r}.json" for r in range(world)]
    logs = [folder / f"{name}-rank{r}.log" for r in range(world)]
    with contextlib.ExitStack() as files:
        procs = [
            subprocess.Popen(
                [sys.executable, script, "--worker", str(r), str(world), spec, str(outs[r])],
                env=env,
                cwd=ROOT,
                stderr=subprocess.STDOUT,
                stdout=files.enter_context(open(logs[r], "w")),
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + timeout
        try:
            while (
                any(p.poll() is None for p in procs)
                and time.monotonic() < deadline
                and not any(p.poll() not in (None, 0) for p in procs)
            ):
                time.sleep(0.2)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
    failed = [
        f"{log.name} (exit {p.returncode}):\n{log.read_text()[-3000:]}"
        for p, log in zip(procs, logs)
        if p.returncode != 0
    ]
    if failed:
        raise RuntimeError(f"{name} failed (deadline {timeout:.0f} s):\n" + "\n".join(failed))
    return [json.loads(out.read_text()) for out in outs]
