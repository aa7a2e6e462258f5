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

Limits (`--limits`, each case on a fresh server process, whose peak memory is read from
/proc/PID/status VmHWM before and after):
- a 50 MB body of short completions: with the default limits (413 before parsing), and with
  `max_body_bytes` and `max_request_completions` raised out of the way, as before they existed;
- 10,000 completions in one request: with the default cap (422); with the cap raised, the same
  request from a client that gives up after `BIG_DEADLINE_S` while another client sends a small
  request during it and a third one after it (their latencies, and how many of the 10,000 the
  judge did and did not judge); and alone with a generous deadline (the judge's time for all of
  them: what the judge used to spend after its client had gone).
Every judged completion of the big request is accounted for: judged + expired = 10,000 when the
client gave up (the column "accounted").

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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs"
BEGIN, END = "<!-- judge_load:begin -->", "<!-- judge_load:end -->"
LIMITS_BEGIN, LIMITS_END = "<!-- judge_limits:begin -->", "<!-- judge_limits:end -->"
BIG_DEADLINE_S = 3.0


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
    judge_busy: float          # the judge's seconds / wall seconds
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
        out.append(([f"{a + b + j - group_size // 2} (request {i})" for j in range(group_size)],
                    [item] * group_size))
    return out


def reference_scores(judge, work) -> list[list[float]]:
    """The same judge in this process, one call over everything (the independent path)."""
    flat = judge.judge([c for cs, _ in work for c in cs], [i for _, its in work for i in its])
    scores, k = [], 0
    for cs, _ in work:
        scores.append([r.score for r in flat[k:k + len(cs)]])
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
        client = JudgeClient(url, timeout_s=60.0, retries=100, backoff_s=0.01,
                             max_backoff_s=0.2)
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

    lost = sum(r is None or not all(x.outcome.value in ("ok", "wrong") for x in r)
               for r in results)
    wrong = sum(abs(x.score - want) > 1e-4 for r, ref in zip(results, reference) if r is not None
                for x, want in zip(r, ref) if x.outcome.value in ("ok", "wrong"))
    ms = sorted(1000 * t for t in latency)
    p99 = statistics.quantiles(ms, n=100)[98] if len(ms) >= 2 else ms[0]
    return Result(config, wall, config.requests / wall,
                  config.requests * config.group_size / wall, statistics.median(ms), p99, ms[-1],
                  lost=lost, duplicated=max(0, delta("requests") - config.requests),
                  wrong=wrong, rejected_429=delta("rejected_full"), replayed=delta("replayed"),
                  batches=delta("batches"),
                  judge_busy=(after["judge_s"] - before["judge_s"]) / wall,
                  batch_completions=hist("batch_completions"),
                  batch_requests=hist("batch_requests"))


def serve(judge, config: Config, mode: str, folder: Path):
    """(url, stop) for a server with `config`'s batching settings."""
    settings: dict[str, Any] = dict(max_batch_size=config.max_batch_size,
                                    max_wait_s=config.max_wait_s, max_queue=config.max_queue)
    if mode == "thread":
        from posttrain.rewards.judge_server import serve_judge

        server = serve_judge(judge, **settings)
        return server.url, server.stop
    from posttrain.launch.judge import launch_judge

    job = launch_judge(judge, folder=folder / config.name, timeout_min=30, **settings)
    return job.url, job.stop


CONFIGS = [
    Config("c1", clients=1, requests=200),
    Config("c8", clients=8, requests=400),
    Config("c32", clients=32, requests=800),
    Config("c64", clients=64, requests=800),
    Config("c32-nobatch", clients=32, requests=400, max_batch_size=8),
    Config("c64-queue8", clients=64, requests=800, max_queue=8),
]
QUICK = [Config("quick", clients=16, requests=48, group_size=4, max_queue=2, max_wait_s=0.01)]


# ------------------------------------------------------------------------------------- limits


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def huge_body(n_bytes: int) -> bytes:
    """A valid judge request of about `n_bytes`: as many short completions as fit."""
    one = '{"question": "5 + 7 ="}'
    n = n_bytes // (len('"12",') + len(one) + 1)
    return ('{"request_id": "huge", "completions": [' + ",".join(['"12"'] * n) + '], "items": ['
            + ",".join([one] * n) + "]}").encode()


class LimitServer:
    """A judge server with `settings` (a local job, or a thread with --server thread)."""

    def __init__(self, judge, mode: str, folder: Path, **settings) -> None:
        self.stop: Callable[..., Any]
        if mode == "thread":
            from posttrain.rewards.judge_server import serve_judge

            server = serve_judge(judge, **settings)
            self.url, self.pid, self.stop = server.url, os.getpid(), server.stop
        else:
            from posttrain.launch.judge import launch_judge

            job = launch_judge(judge, folder=folder, timeout_min=30, **settings)
            self.url, self.stop = job.url, job.stop
            self.pid = json.loads(job.url_file.read_text())["pid"]


def post_timed(url: str, body: bytes, timeout_s: float = 300.0) -> tuple[int, float, str]:
    """(status, seconds, detail) of one POST /v1/judge."""
    import httpx

    from posttrain.rewards.judge_client import JUDGE_PATH

    start = time.perf_counter()
    response = httpx.post(url + JUDGE_PATH, content=body, timeout=timeout_s,
                          headers={"content-type": "application/json"})
    seconds = time.perf_counter() - start
    detail = "" if response.status_code == 200 else response.json().get("detail")
    if isinstance(detail, list):     # a 422's errors
        detail = "; ".join(e["msg"] for e in detail)
    return response.status_code, seconds, detail[:160]


def run_limits(judge, mode: str, folder: Path, quick: bool) -> list[dict]:
    """The cases of the module docstring; one dict per case."""
    from posttrain.rewards.judge_client import JudgeClient

    body_mb, n_big, deadline = (1.2, 2_000, 0.5) if quick else (50, 10_000, BIG_DEADLINE_S)
    raised: dict[str, Any] = dict(max_body_bytes=int(body_mb + 8) * 2**20,
                                  max_request_completions=10**7)
    default: dict[str, Any] = {}
    if quick:     # a 1 MiB limit, and a 504 after 1 s rather than 30 s
        default, raised = dict(max_body_bytes=2**20), {**raised, "request_timeout_s": 1.0}
    rows: list[dict] = []
    body = huge_body(int(body_mb * 10**6))
    for label, settings in (("default limits", default), ("limits raised", raised)):
        server = LimitServer(judge, mode, folder / f"body-{len(rows)}", **settings)
        before = peak_rss_mb(server.pid)
        status, seconds, detail = post_timed(server.url, body)
        rows.append({"case": f"{body_mb} MB body, {label}", "status": status,
                     "answer_s": seconds, "peak_rss_mb": peak_rss_mb(server.pid) - before,
                     "detail": detail})
        server.stop()
    work = workload(n_big // 8, 8)
    big = [c for cs, _ in work for c in cs], [i for _, its in work for i in its]
    small = workload(1, 8)[0]
    big_body = json.dumps({"request_id": "big", "completions": big[0], "items": big[1]})
    server = LimitServer(judge, mode, folder / "cap")
    status, seconds, detail = post_timed(server.url, big_body.encode())
    rows.append({"case": f"{n_big:,} completions, default cap", "status": status,
                 "answer_s": seconds, "detail": detail})
    server.stop()

    server = LimitServer(judge, mode, folder / "gone", max_request_completions=n_big)
    done: dict = {}

    def big_client() -> None:     # one try; the server knows when its client gives up
        with_deadline = big_body[:-1] + f', "timeout_s": {deadline}}}'
        status, seconds, _ = post_timed(server.url, with_deadline.encode())
        done["big"] = (f"{status}", seconds)

    def small_client(name: str) -> None:
        start = time.perf_counter()
        results = JudgeClient(server.url, timeout_s=120.0).judge(*small,
                                                                  request_id=f"small-{name}")
        done[name] = ([r.outcome.value for r in results], time.perf_counter() - start)

    stats_before = JudgeClient(server.url).stats()
    thread = threading.Thread(target=big_client)
    thread.start()
    time.sleep(deadline / 3)        # the big request is being judged
    small_client("during")
    thread.join()
    small_client("after")
    stats = JudgeClient(server.url).stats()
    server.stop()
    judged = stats["completions"] - stats_before["completions"] - 2 * len(small[0])
    for name in ("during", "after"):
        outcomes, seconds = done[name]
        judged_ok = all(o in ("ok", "wrong") for o in outcomes)
        rows.append({"case": f"small request (8) {name} the big one", "answer_s": seconds,
                     "outcome": "judged" if judged_ok else "/".join(sorted(set(outcomes)))})
    rows.insert(-2, {"case": f"{n_big:,} completions, cap raised, deadline {deadline:g} s",
                     "status": int(done["big"][0]), "answer_s": done["big"][1],
                     "judged": judged, "expired_completions": stats["expired_completions"],
                     "accounted": judged + stats["expired_completions"] == n_big})
    if quick:
        return rows
    server = LimitServer(judge, mode, folder / "whole", max_request_completions=n_big,
                         request_timeout_s=600.0)
    start = time.perf_counter()
    results = JudgeClient(server.url, timeout_s=600.0).judge(*big)
    rows.append({"case": f"{n_big:,} completions judged whole (generous deadline)",
                 "outcome": "ok" if all(r.outcome.value in ("ok", "wrong") for r in results)
                 else "failed", "answer_s": time.perf_counter() - start})
    server.stop()
    return rows


def limits_table(rows: list[dict]) -> str:
    out = ["| case | answer | seconds | server peak memory | judged / dropped |",
           "|---|---|---:|---:|---|"]
    for r in rows:
        answer = (f"{r['status']}" if "status" in r else r["outcome"]) + (
            f": {r['detail']}" if r.get("detail") else "")
        memory = f"+{r['peak_rss_mb']:.0f} MiB" if "peak_rss_mb" in r else ""
        split = (f"{r['judged']:,} judged, {r['expired_completions']:,} dropped"
                 if "judged" in r else "")
        out.append(f"| {r['case']} | {answer} | {r['answer_s']:.2f} | {memory} | {split} |")
    return "\n".join(out) + "\n"


def write_section(path: Path, begin: str, end: str, body: str, mode: str) -> None:
    import torch

    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
               f"average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, Python "
               f"{sys.version.split()[0]}, server: {mode}")
    flag = " --limits" if begin == LIMITS_BEGIN else ""
    section = (f"{begin}\n_Measured {time.strftime('%Y-%m-%d')} by `python "
               f"benchmarks/judge_load.py{flag}` ({machine})._\n\n{body}{end}")
    text = path.read_text()
    if begin in text and end in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)
    print(f"wrote {path}")


def table(results: list[Result]) -> str:
    head = ("| run | clients | G | max batch | max wait | max queue | req/s | compl/s | p50 ms | "
            "p99 ms | max ms | 429s | lost | dup | wrong | judge calls | mean batch | "
            "judge busy |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            "---:|---:|\n")
    rows = "".join(
        f"| {r.config.name} | {r.config.clients} | {r.config.group_size} | "
        f"{r.config.max_batch_size} | {r.config.max_wait_s * 1000:g} ms | {r.config.max_queue} | "
        f"{r.requests_per_s:.0f} | {r.completions_per_s:.0f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | "
        f"{r.max_ms:.0f} | {r.rejected_429} | {r.lost} | {r.duplicated} | {r.wrong} | "
        f"{r.batches} | {r.mean_batch:.1f} | {100 * r.judge_busy:.0f}% |\n" for r in results)
    hist = "".join(f"| {r.config.name} | " + ", ".join(f"{k}: {v}" for k, v in
                                                        r.batch_completions.items()) + " |\n"
                   for r in results)
    return (head + rows + "\nBatch-size histogram (completions per judge call: number of "
            "calls):\n\n| run | histogram |\n|---|---|\n" + hist)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small runs of the load and the limits, nothing written")
    parser.add_argument("--limits", action="store_true",
                        help="the body-size, completion-cap and deadline cases instead of load")
    parser.add_argument("--json", action="store_true", help="print the results as JSON lines")
    parser.add_argument("--server", choices=("process", "thread"), default=None,
                        help="where the server runs (default: process; thread with --quick)")
    parser.add_argument("--out", type=Path, default=DOCS / "benchmarks" / "judge_load.md")
    args = parser.parse_args(argv)
    mode = args.server or ("thread" if args.quick else "process")
    judge = make_judge()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.limits or args.quick:
            rows = run_limits(judge, mode, Path(tmp), args.quick)
            for row in rows:
                print(json.dumps({"limits": row}) if args.json else row, flush=True)
            if not args.quick:
                write_section(args.out, LIMITS_BEGIN, LIMITS_END, limits_table(rows), mode)
                return 0
        for config in QUICK if args.quick else CONFIGS:
            work = workload(config.requests, config.group_size)
            reference = reference_scores(judge, work)
            url, stop = serve(judge, config, mode, Path(tmp))
            try:
                result = run_load(url, config, reference, work)
            finally:
                stop()
            results.append(result)
            line = {**asdict(result), "mean_batch": result.mean_batch}
            print(json.dumps(line) if args.json else
                  f"{config.name}: {result.requests_per_s:.0f} req/s, p50 {result.p50_ms:.1f} ms, "
                  f"p99 {result.p99_ms:.1f} ms, lost {result.lost}, dup {result.duplicated}, "
                  f"wrong {result.wrong}, 429s {result.rejected_429}, mean batch "
                  f"{result.mean_batch:.1f}", flush=True)
    if not args.quick:
        write_section(args.out, BEGIN, END, table(results), mode)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
