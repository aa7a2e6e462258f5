"""The `--limits` cases of `benchmarks/judge_load.py`: requests too big to judge, sent to a
`RewardModelJudge` served on 127.0.0.1, and what the server answers, how long it takes and what
it costs in memory. The load itself (many clients, small requests) is in `judge_load.py`; both
start their servers through `ServedJudge`.

The cases (each on a fresh server process, whose peak memory is read from /proc/PID/status
VmHWM before and after):
- a 50 MB body of short completions: with the default limits (413 before parsing), and with
  `max_body_bytes` and `max_request_completions` raised out of the way, as before they existed;
- 10,000 completions in one request: with the default cap (422); with the cap raised, the same
  request from a client that gives up after `BIG_DEADLINE_S` while another client sends a small
  request during it and a third one after it (their latencies, and how many of the 10,000 the
  judge did and did not judge); and alone with a generous deadline (the judge's time for all of
  them: what the judge used to spend after its client had gone).
Every judged completion of the big request is accounted for: judged + expired = 10,000 when the
client gave up (the column "accounted").
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BIG_DEADLINE_S = 3.0
"""Seconds the client of the 10,000-completion request waits before it gives up."""

Requests = list[tuple[list[str], list[dict]]]
"""Judge requests: per request, its G completions and their G items."""


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
    return (
        '{"request_id": "huge", "completions": ['
        + ",".join(['"12"'] * n)
        + '], "items": ['
        + ",".join([one] * n)
        + "]}"
    ).encode()


class ServedJudge:
    """`judge` served with `settings` (`serve_judge`'s batching and limits): as a local job in
    `folder` (`launch_judge`, mode "process"), or in a thread of this process (mode "thread").
    A context manager: the server stops when the block ends, also on an error.

    Attributes:
        url: the server's base URL (127.0.0.1).
        pid: the serving process's id (this process with mode "thread").
    """

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

    def __enter__(self) -> ServedJudge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def post_timed(url: str, body: bytes, timeout_s: float = 300.0) -> tuple[int, float, str]:
    """(status, seconds, detail) of one POST /v1/judge."""
    import httpx

    from posttrain.rewards.judge_client import JUDGE_PATH

    start = time.perf_counter()
    response = httpx.post(
        url + JUDGE_PATH,
        content=body,
        timeout=timeout_s,
        headers={"content-type": "application/json"},
    )
    seconds = time.perf_counter() - start
    detail = "" if response.status_code == 200 else response.json().get("detail")
    if isinstance(detail, list):  # a 422's errors
        detail = "; ".join(e["msg"] for e in detail)
    return response.status_code, seconds, detail[:160]


def run_limits(
    judge, mode: str, folder: Path, quick: bool, workload: Callable[[int, int], Requests]
) -> list[dict]:
    """The cases of the module docstring; one dict per case. `workload(n, G)` makes n requests of G
    different completions (the big request is all of them in one; the small one is one of
    them); `quick` runs smaller cases (a 1.2 MB body, 2,000 completions) with shorter limits."""
    from posttrain.rewards.judge_client import JudgeClient

    body_mb, n_big, deadline = (1.2, 2_000, 0.5) if quick else (50, 10_000, BIG_DEADLINE_S)
    raised: dict[str, Any] = dict(
        max_body_bytes=int(body_mb + 8) * 2**20, max_request_completions=10**7
    )
    default: dict[str, Any] = {}
    if quick:  # a 1 MiB limit, and a 504 after 1 s rather than 30 s
        default, raised = dict(max_body_bytes=2**20), {**raised, "request_timeout_s": 1.0}
    rows: list[dict] = []
    body = huge_body(int(body_mb * 10**6))
    for label, settings in (("default limits", default), ("limits raised", raised)):
        with ServedJudge(judge, mode, folder / f"body-{len(rows)}", **settings) as server:
            before = peak_rss_mb(server.pid)
            status, seconds, detail = post_timed(server.url, body)
            grown = peak_rss_mb(server.pid) - before
        rows.append(
            {
                "case": f"{body_mb} MB body, {label}",
                "status": status,
                "answer_s": seconds,
                "peak_rss_mb": grown,
                "detail": detail,
            }
        )
    work = workload(n_big // 8, 8)
    big = [c for cs, _ in work for c in cs], [i for _, its in work for i in its]
    small = workload(1, 8)[0]
    big_body = json.dumps({"request_id": "big", "completions": big[0], "items": big[1]})
    with ServedJudge(judge, mode, folder / "cap") as server:
        status, seconds, detail = post_timed(server.url, big_body.encode())
    rows.append(
        {
            "case": f"{n_big:,} completions, default cap",
            "status": status,
            "answer_s": seconds,
            "detail": detail,
        }
    )

    done: dict = {}
    server = ServedJudge(judge, mode, folder / "gone", max_request_completions=n_big)

    def big_client() -> None:  # one try; the server knows when its client gives up
        with_deadline = big_body[:-1] + f', "timeout_s": {deadline}}}'
        status, seconds, _ = post_timed(server.url, with_deadline.encode())
        done["big"] = (f"{status}", seconds)

    def small_client(name: str) -> None:
        start = time.perf_counter()
        results = JudgeClient(server.url, timeout_s=120.0).judge(*small, request_id=f"small-{name}")
        done[name] = ([r.outcome.value for r in results], time.perf_counter() - start)

    with server:
        stats_before = JudgeClient(server.url).stats()
        thread = threading.Thread(target=big_client)
        thread.start()
        time.sleep(deadline / 3)  # the big request is being judged
        small_client("during")
        thread.join()
        small_client("after")
        stats = JudgeClient(server.url).stats()
    judged = stats["completions"] - stats_before["completions"] - 2 * len(small[0])
    for name in ("during", "after"):
        outcomes, seconds = done[name]
        judged_ok = all(o in ("ok", "wrong") for o in outcomes)
        rows.append(
            {
                "case": f"small request (8) {name} the big one",
                "answer_s": seconds,
                "outcome": "judged" if judged_ok else "/".join(sorted(set(outcomes))),
            }
        )
    rows.insert(
        -2,
        {
            "case": f"{n_big:,} completions, cap raised, deadline {deadline:g} s",
            "status": int(done["big"][0]),
            "answer_s": done["big"][1],
            "judged": judged,
            "expired_completions": stats["expired_completions"],
            "accounted": judged + stats["expired_completions"] == n_big,
        },
    )
    if quick:
        return rows
    start = time.perf_counter()
    with ServedJudge(
        judge, mode, folder / "whole", max_request_completions=n_big, request_timeout_s=600.0
    ) as server:
        results = JudgeClient(server.url, timeout_s=600.0).judge(*big)
    rows.append(
        {
            "case": f"{n_big:,} completions judged whole (generous deadline)",
            "outcome": "ok"
            if all(r.outcome.value in ("ok", "wrong") for r in results)
            else "failed",
            "answer_s": time.perf_counter() - start,
        }
    )
    return rows


def limits_table(rows: list[dict]) -> str:
    out = [
        "| case | answer | seconds | server peak memory | judged / dropped |",
        "|---|---|---:|---:|---|",
    ]
    for r in rows:
        answer = (f"{r['status']}" if "status" in r else r["outcome"]) + (
            f": {r['detail']}" if r.get("detail") else ""
        )
        memory = f"+{r['peak_rss_mb']:.0f} MiB" if "peak_rss_mb" in r else ""
        split = (
            f"{r['judged']:,} judged, {r['expired_completions']:,} dropped" if "judged" in r else ""
        )
        out.append(f"| {r['case']} | {answer} | {r['answer_s']:.2f} | {memory} | {split} |")
    return "\n".join(out) + "\n"
