"""Judge server under load: N concurrent clients, a fixed count of requests, 127.0.0.1 only.

The judge is a real tiny one: `RewardModelJudge` on the `tiny-1m` reward model (seed 0, byte
tokenizer). Each request is one GRPO group: G completions of one chain_sum-like question, all
different across requests, sent by `posttrain.rewards.judge_client.JudgeClient` with an explicit
request id (a deadline of 60 s and up to 100 retries, so a 429 is retried, never given up on).
`--clients` threads take request indices from a shared counter until `--requests` are done.

What is checked for every configuration (the columns "lost", "dup", "wrong" must be 0):
- lost: a request whose results are not all judged (outcome ok/wrong), for any reason;
- dup: judgements beyond one per request id (the server's `requests` counter minus the
  requests sent; a retry answered from the replay cache is not a judgement);
- wrong: a result that differs from the same judge run in this process on the same
  completions (> 1e-4: an answer delivered to the wrong request would show here).

Reported: requests/s and completions/s over the wall time of the whole burst, client-side
latency per request (p50, p99, max; retries and waits included), 429 answers, the server's
batch-size histogram (completions per judge call -> number of calls) and "judge busy", the
judge's working seconds over the wall time (near 100%: the judge is the bottleneck).

Server: `--server process` (default) runs it as a local job (`posttrain.launch.judge
.launch_judge`), so clients and server do not share an interpreter lock; `--server thread` runs
it in this process (`serve_judge`).

Limits (`--limits`): a 50 MB body and a request of 10,000 completions, each on a fresh
server, with the default limits and with them raised (the cases, and what each checks, are
described in `judge_load_limits.py`).

Usage:
    python benchmarks/judge_load.py                # the table into docs/benchmarks/judge_load.md
    python benchmarks/judge_load.py --limits       # writes the limits table there
    python benchmarks/judge_load.py --quick --json # small runs of both (the test), nothing written
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from judge_load_limits import ServedJudge, limits_table, run_limits

DOCS = Path(__file__).resolve().parents[1] / "docs"
BEGIN, END = "<!-- judge_load:begin -->", "<!-- judge_load:end -->"
LIMITS_BEGIN, LIMITS_END = "<!-- judge_limits:begin -->", "<!-- judge_limits:end -->"


@dataclass(frozen=True)
class Config:
    """One row: `clients` threads send `requests` requests of `group_size` completions to a
    server with these batching settings."""

    name: str
    clients: int
    requests: int
    group_size: int = 8
    max_batch_size: int = 64
    max_wait_s: float = 0.005
    max_queue: int = 256


@dataclass
class Result:
    config: Config
    wall_s: float
    requests_per_s: float
    completions_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    lost: int
    duplicated: int
    wrong: int
    rejected_429: int
    replayed: int
    batches: int
    judge_busy: float  # the judge's seconds / wall seconds
    batch_completions: dict = field(default_factory=dict)
    batch_requests: dict = field(default_factory=dict)

    @property
    def mean_batch(self) -> float:
        total = sum(int(k) * v for k, v in self.batch_completions.items())
        return total / self.batches if self.batches else 0.0


def make_judge():
    from posttrain.models import ByteTokenizer
    from posttrain.rewards import RewardModel, RewardModelJudge

    return RewardModelJudge(RewardModel.from_spec("tiny-1m", seed=0), ByteTokenizer())


def workload(requests: int, group_size: int) -> list[tuple[list[str], list[dict]]]:
    """Request i: G different completions of the question "a + b =" (a, b from i)."""
    out = []
    for i in range(requests):
        a, b = i % 97, (i // 97) % 89
        item = {"question": f"{a} + {b} =", "answer": str(a + b)}
        out.append(
            (
                [f"{a + b + j - group_size // 2} (request {i})" for j in range(group_size)],
                [item] * group_size,
            )
        )
    return out


def reference_scores(judge, work) -> list[list[float]]:
    """The same judge in this process, one call over everything (the independent path)."""
    flat = judge.judge([c for cs, _ in work for c in cs], [i for _, its in work for i in its])
    scores, k = [], 0
    for cs, _ in work:
        scores.append([r.score for r in flat[k : k + len(cs)]])
        k += len(cs)
    return scores


def run_load(url: str, config: Config, reference: list[list[float]], work) -> Result:
    """Send `config.requests` requests from `config.clients` threads; check and measure."""
    from posttrain.rewards.judge_client import JudgeClient

    stats_client = JudgeClient(url)
    before = stats_client.stats()
    counter, lock = itertools.count(), threading.Lock()
    latency = [0.0] * config.requests
    results: list[list | None] = [None] * config.requests

    def worker() -> None:
        client = JudgeClient(url, timeout_s=60.0, retries=100, backoff_s=0.01, max_backoff_s=0.2)
        while True:
            with lock:
                i = next(counter)
            if i >= config.requests:
                return
            completions, items = work[i]
            start = time.perf_counter()
            results[i] = client.judge(completions, items, request_id=f"load-{config.name}-{i}")
            latency[i] = time.perf_counter() - start

    threads = [threading.Thread(target=worker) for _ in range(config.clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = stats_client.stats()

    def delta(key: str) -> int:
        return after[key] - before[key]

    def hist(key: str) -> dict:
        keys = set(after[key]) | set(before[key])
        d = {k: after[key].get(k, 0) - before[key].get(k, 0) for k in keys}
        return {int(k): v for k, v in sorted(d.items(), key=lambda kv: int(kv[0])) if v}

    lost = sum(r is None or not all(x.outcome.value in ("ok", "wrong") for x in r) for r in results)
    wrong = sum(
        abs(x.score - want) > 1e-4
        for r, ref in zip(results, reference)
        if r is not None
        for x, want in zip(r, ref)
        if x.outcome.value in ("ok", "wrong")
    )
    ms = sorted(1000 * t for t in latency)
    # inclusive: within the latencies seen (the default extrapolates past the largest)
    p99 = statistics.quantiles(ms, n=100, method="inclusive")[98] if len(ms) >= 2 else ms[0]
    return Result(
        config,
        wall,
        config.requests / wall,
        config.requests * config.group_size / wall,
        statistics.median(ms),
        p99,
        ms[-1],
        lost=lost,
        duplicated=max(0, delta("requests") - config.requests),
        wrong=wrong,
        rejected_429=delta("rejected_full"),
        replayed=delta("replayed"),
        batches=delta("batches"),
        judge_busy=(after["judge_s"] - before["judge_s"]) / wall,
        batch_completions=hist("batch_completions"),
        batch_requests=hist("batch_requests"),
    )


CONFIGS = [
    Config("c1", clients=1, requests=200),
    Config("c8", clients=8, requests=400),
    Config("c32", clients=32, requests=800),
    Config("c64", clients=64, requests=800),
    Config("c32-nobatch", clients=32, requests=400, max_batch_size=8),
    Config("c64-queue8", clients=64, requests=800, max_queue=8),
]
QUICK = [Config("quick", clients=16, requests=48, group_size=4, max_queue=2, max_wait_s=0.01)]


def write_section(path: Path, begin: str, end: str, body: str, mode: str) -> None:
    import torch

    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
        f"average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, Python "
        f"{sys.version.split()[0]}, server: {mode}"
    )
    flag = " --limits" if begin == LIMITS_BEGIN else ""
    section = (
        f"{begin}\n_Measured {time.strftime('%Y-%m-%d')} by `python "
        f"benchmarks/judge_load.py{flag}` ({machine})._\n\n{body}{end}"
    )
    text = path.read_text()
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)
    print(f"wrote {path}")


def table(results: list[Result]) -> str:
    head = (
        "| run | clients | G | max batch | max wait | max queue | req/s | compl/s | p50 ms | "
        "p99 ms | max ms | 429s | lost | dup | wrong | judge calls | mean batch | "
        "judge busy |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        "---:|---:|\n"
    )
    rows = "".join(
        f"| {r.config.name} | {r.config.clients} | {r.config.group_size} | "
        f"{r.config.max_batch_size} | {r.config.max_wait_s * 1000:g} ms | {r.config.max_queue} | "
        f"{r.requests_per_s:.0f} | {r.completions_per_s:.0f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | "
        f"{r.max_ms:.0f} | {r.rejected_429} | {r.lost} | {r.duplicated} | {r.wrong} | "
        f"{r.batches} | {r.mean_batch:.1f} | {100 * r.judge_busy:.0f}% |\n"
        for r in results
    )
    hist = "".join(
        f"| {r.config.name} | "
        + ", ".join(f"{k}: {v}" for k, v in r.batch_completions.items())
        + " |\n"
        for r in results
    )
    return (
        head + rows + "\nBatch-size histogram (completions per judge call: number of "
        "calls):\n\n| run | histogram |\n|---|---|\n" + hist
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small runs of the load and the limits, nothing written",
    )
    parser.add_argument(
        "--limits",
        action="store_true",
        help="the body-size, completion-cap and deadline cases instead of load",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON lines")
    parser.add_argument(
        "--server",
        choices=("process", "thread"),
        default=None,
        help="where the server runs (default: process; thread with --quick)",
    )
    parser.add_argument("--out", type=Path, default=DOCS / "benchmarks" / "judge_load.md")
    args = parser.parse_args(argv)
    mode = args.server or ("thread" if args.quick else "process")
    judge = make_judge()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.limits or args.quick:
            rows = run_limits(judge, mode, Path(tmp), args.quick, workload)
            for row in rows:
                print(json.dumps({"limits": row}) if args.json else row, flush=True)
            if not args.quick:
                write_section(args.out, LIMITS_BEGIN, LIMITS_END, limits_table(rows), mode)
                return 0
        for config in QUICK if args.quick else CONFIGS:
            work = workload(config.requests, config.group_size)
            reference = reference_scores(judge, work)
            with ServedJudge(
                judge,
                mode,
                Path(tmp) / config.name,
                max_batch_size=config.max_batch_size,
                max_wait_s=config.max_wait_s,
                max_queue=config.max_queue,
            ) as server:
                result = run_load(server.url, config, reference, work)
            results.append(result)
            line = {**asdict(result), "mean_batch": result.mean_batch}
            summary = (
                f"{config.name}: {result.requests_per_s:.0f} req/s, p50 {result.p50_ms:.1f} ms, "
                f"p99 {result.p99_ms:.1f} ms, lost {result.lost}, dup {result.duplicated}, "
                f"wrong {result.wrong}, 429s {result.rejected_429}, mean batch "
                f"{result.mean_batch:.1f}"
            )
            print(json.dumps(line) if args.json else summary, flush=True)
    if not args.quick:
        write_section(args.out, BEGIN, END, table(results), mode)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
