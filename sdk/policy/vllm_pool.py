"""Several vLLM servers behind one client (`VLLMPool`), which stands where one `VLLMServer` does:
`generate`, `sync_weights`, `close`, `weight_version`, a notebook table.

Sampling: one `generate` call becomes one request per sample (`vllm_sampling.call_requests`), and
each request goes to the live server with the fewest requests outstanding (ties to the lowest
index), at most `max_concurrency` per server. Sample j of prompt i carries its own seed,
`seed + i * n + j`, whichever server draws it, so the pool's answer equals one server's for the
same seed; the results come back prompt-major, as from one server.

Faults, per request:

- no answer (connection refused or cut, a timeout) or HTTP 5xx, and the server is gone (its
  process exited, or `GET /health` does not answer): the server leaves the pool (its process
  group is stopped) and the request is sent again to another server (`stats["retries"]`);
- the same, but `/health` answers (the server is up), or HTTP 4xx (a request the server
  refused, e.g. bad input): the call fails with `VLLMRequestError` naming the request (prompt,
  sample), the server and its answer; not retried, since another server would answer the same;
- every server gone: `VLLMServerError` naming each server, why it left and its log.

A retried request was not answered before, and each request's answer is kept once, at its own
place: nothing is lost or duplicated.

Weight sync (`sync_weights`) syncs every server still in the pool, at once (each its own
safetensors in /dev/shm, reload, prefix-cache reset: `VLLMServer.sync_weights`; LoRA adapters
merged once for all: `vllm_servable.served_policy`). A server whose
sync failed leaves the rotation until a later sync succeeds on it, so it is never sampled with
stale or partial weights; the pool's `weight_version` advances when every server left in the
rotation holds the new weights (at least one). If no server took them, the pool refuses to sample
until a sync succeeds.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.policy.vllm_process import VLLMRequestError, VLLMServerError
from posttrain.policy.vllm_sampling import ServedCompletion, call_completions, call_requests
from posttrain.policy.vllm_servable import served_policy
from posttrain.policy.vllm_server import SERVED_NAME, VLLMServer, WeightSync

if TYPE_CHECKING:
    from posttrain.models.specs import ModelSpec
    from posttrain.models.tokenizer import Tokenizer
    from posttrain.policy.policy import Policy

__all__ = ["VLLMPool", "PoolSync"]

HEALTH_TIMEOUT_S = 10.0
"""How long the pool waits for `GET /health` when it asks whether a failing server is gone."""


@dataclass(frozen=True)
class PoolSync:
    """What one `VLLMPool.sync_weights` did.

    Attributes:
        version: the pool's weight version now.
        syncs: server index -> its `WeightSync`, for the servers that took the new weights.
        failed: server index -> why its sync failed (it left the rotation).
        total_s: wall-clock seconds of the whole sync (the servers sync at once).
    """

    version: int
    syncs: dict[int, WeightSync]
    failed: dict[int, str]
    total_s: float


class VLLMPool:
    """Several `VLLMServer`s of one policy behind one client. Build it with `VLLMPool.start`, or
    from server handles (the pool then owns them: `close` closes them all, which stops a started
    server and leaves an attached one, `VLLMServer.attach`, running).

    Args:
        servers: started servers of the same architecture, dtype and weight version.

    Attributes:
        servers: the servers, in index order (a server that left the pool stays listed).
        weight_version: 0 for the weights the servers started with, +1 per successful sync.
        served: requests each server answered, by index.

    Raises:
        ValueError: no servers, or servers of different architectures, dtypes or versions.
    """

    def __init__(self, servers: Sequence[VLLMServer]) -> None:
        self.servers = list(servers)
        if not self.servers:
            raise ValueError("servers is empty; a VLLMPool needs at least one started VLLMServer")
        first = self.servers[0]
        for k, server in enumerate(self.servers[1:], start=1):
            if (server.spec, server.dtype, server.weight_version) != (
                first.spec,
                first.dtype,
                first.weight_version,
            ):
                raise ValueError(
                    f"servers[{k}] serves {server.spec.family}/{server.dtype} at weight version "
                    f"{server.weight_version}, servers[0] {first.spec.family}/{first.dtype} at "
                    f"{first.weight_version}; a pool's servers serve the same weights"
                )
        self.weight_version = 0
        self.served = [0] * len(self.servers)
        self._outstanding = [0] * len(self.servers)
        self._gone: dict[int, str] = {}  # index -> why it left the pool (dead)
        self._stale: dict[int, str] = {}  # index -> why its last sync failed (out of rotation)
        self._retries = 0
        self._sync_failures = 0
        self._closed = False
        self._lock = threading.Lock()  # one call (generate or sync_weights) at a time
        self._cond = threading.Condition()  # guards the counts and the two dicts above

    @classmethod
    def start(
        cls, policy: Policy, run_dir: str | os.PathLike, *, servers: int = 2, **server_options: Any
    ) -> VLLMPool:
        """Start `servers` vLLM servers for `policy` at once (`VLLMServer.start`; server k's
        model and log in `run_dir/server-k/vllm/`) and return them as a pool.

        Args:
            policy: the policy to serve.
            run_dir: the run folder.
            servers: how many servers (>= 1); each takes ~1-2 GiB of memory on CPU.
            server_options: `VLLMServer.start`'s keywords (venv, startup_timeout_s, ...), the
                same for every server; `port` is refused (each server picks a free one).

        Raises:
            ValueError: `servers` < 1, or a `port`.
            What `VLLMServer.start` raises for the first server that failed; the others are
            stopped first.
        """
        if not isinstance(servers, int) or isinstance(servers, bool) or servers < 1:
            raise ValueError(f"servers={servers!r}; must be an int >= 1")
        if server_options.get("port") is not None:
            raise ValueError("port: each server of a pool picks a free port; leave port unset")
        folder = Path(run_dir)
        with ThreadPoolExecutor(max_workers=servers) as threads:
            futures = [
                threads.submit(VLLMServer.start, policy, folder / f"server-{k}", **server_options)
                for k in range(servers)
            ]
        started = [f.result() for f in futures if f.exception() is None]
        for future in futures:
            if future.exception() is not None:
                for server in started:
                    server.close()
                future.result()
        return cls(started)

    # ------------------------------------------------------------------------------ lifecycle
    @property
    def spec(self) -> ModelSpec:
        return self.servers[0].spec

    @property
    def tokenizer(self) -> Tokenizer:
        return self.servers[0].tokenizer

    @property
    def url(self) -> str:
        """The servers' URLs, comma-separated."""
        return ", ".join(s.url for s in self.servers)

    @property
    def log_path(self) -> str:
        """The servers' logs, comma-separated."""
        return ", ".join(str(s.log_path) for s in self.servers)

    @property
    def alive(self) -> bool:
        """Whether any server is in the rotation (and the pool not closed)."""
        return not self._closed and bool(self._rotation())

    @property
    def stats(self) -> dict[str, int]:
        """Counts for a trainer's metrics: servers, live (in the rotation), dead (left the
        pool), out_of_rotation (last sync failed), retries (requests sent again after their
        server died), sync_failures (server syncs that failed), requests (answered)."""
        with self._cond:
            return {
                "servers": len(self.servers),
                "live": len(self._rotation()),
                "dead": len(self._gone),
                "out_of_rotation": len(self._stale),
                "retries": self._retries,
                "sync_failures": self._sync_failures,
                "requests": sum(self.served),
            }

    def close(self) -> None:
        """Close every server handle (`VLLMServer.close`, at once): a started server stops, an
        attached one keeps running. Idempotent."""
        self._closed = True
        with ThreadPoolExecutor(max_workers=len(self.servers)) as threads:
            list(threads.map(lambda s: s.close(), self.servers))

    def __enter__(self) -> VLLMPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _state(self, k: int) -> str:
        if k in self._gone:
            return f"dead: {self._gone[k]}"
        if k in self._stale:
            return f"out of rotation: {self._stale[k]}"
        return "closed" if self._closed else "live"

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"VLLMPool({s['servers']} servers: {s['live']} live, {s['dead']} dead, "
            f"{s['out_of_rotation']} out of rotation; weight_version={self.weight_version}, "
            f"retries={s['retries']})"
        )

    def _repr_html_(self) -> str:
        head = "<tr><th>server</th><th>state</th><th>url</th><th>answered</th><th>log</th></tr>"
        rows = "".join(
            f"<tr><td>{k}</td><td>{self._state(k)}</td><td>{s.url}</td><td>{self.served[k]}</td>"
            f"<td>{s.log_path if s.log_path is not None else 'where it was started'}</td></tr>"
            for k, s in enumerate(self.servers)
        )
        caption = (
            f"vLLM pool: weight version {self.weight_version}, "
            f"{self.stats['retries']} requests retried"
        )
        return f"<table><caption>{caption}</caption>{head}{rows}</table>"

    # ------------------------------------------------------------------------------- sampling
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        seed: int | None = None,
        **sampling: Any,
    ) -> list[ServedCompletion]:
        """Sample completions over the pool's servers, as `VLLMServer.generate` does from one.

        Args:
            prompts: str prompts (encoded with BOS by the policy's tokenizer) or token-id lists.
            seed: the call's seed (sample j of prompt i uses `seed + i * n + j` on whichever
                server draws it); None draws one from the global torch RNG.
            sampling: n, max_new_tokens, temperature, top_p, top_k, stop (see
                `posttrain.policy.vllm_sampling`).

        Returns:
            `len(prompts) * n` `ServedCompletion`s, prompt-major, stamped with the pool's
            `weight_version`.

        Raises:
            ValueError: a bad or unsupported setting, named; an unknown keyword.
            VLLMRequestError: a request failed on a server that is up (a 4xx, or no answer
                while `/health` answers): not retried, the request and the server named.
            VLLMServerError: the pool is closed, no server is left (each named, with why it
                left and its log), or none holds the current weights (the last sync failed).
        """
        prompt_ids, bodies = call_requests(
            prompts,
            tokenizer=self.tokenizer,
            spec=self.spec,
            model=SERVED_NAME,
            seed=seed,
            sampling=sampling,
        )
        n = len(bodies) // len(prompt_ids)
        with self._lock:
            if self._closed:
                raise VLLMServerError("this VLLMPool is closed; start a new one")
            version = self.weight_version
            answers = self._dispatch(bodies, n)
        return call_completions(
            answers, prompt_ids, tokenizer=self.tokenizer, weight_version=version
        )

    def _rotation(self) -> list[int]:
        return [k for k in range(len(self.servers)) if k not in self._gone and k not in self._stale]

    def _dispatch(self, bodies: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
        """Every body answered once, in order (see the module docstring for the faults)."""
        with self._cond:
            capacity = sum(self.servers[k].max_concurrency for k in self._rotation())
            if not capacity:
                raise self._nothing_left()
        answers: list[dict[str, Any] | None] = [None] * len(bodies)
        with ThreadPoolExecutor(max_workers=max(1, min(len(bodies), capacity))) as threads:
            futures = [threads.submit(self._send, k, b, n) for k, b in enumerate(bodies)]
            try:
                for k, future in enumerate(futures):
                    answers[k] = future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        assert all(a is not None for a in answers), "a request was left unanswered"
        return answers  # type: ignore[return-value]

    def _send(self, k: int, body: Mapping[str, Any], n: int) -> dict[str, Any]:
        """Send request `k` to the least busy server in the rotation until one answers."""
        while True:
            slot = self._acquire()
            server = self.servers[slot]
            try:
                answer = server.complete(body)
            except VLLMServerError as err:
                self._release(slot, answered=False)
                if not self._gone_after(slot, err):
                    status = err.status if isinstance(err, VLLMRequestError) else None
                    raise VLLMRequestError(
                        f"prompts[{k // n}] sample {k % n} failed on server {slot} "
                        f"({server.url}), which is up, so it was not retried: {err}",
                        status=status,
                    ) from None
                if isinstance(err, VLLMRequestError):  # it was sent: sending it again
                    with self._cond:
                        self._retries += 1
                continue
            except BaseException:  # e.g. an answer that is not JSON: the slot is freed all the same
                self._release(slot, answered=False)
                raise
            self._release(slot, answered=True)
            return answer

    def _acquire(self) -> int:
        with self._cond:
            while True:
                live = self._rotation()
                if not live:
                    raise self._nothing_left()
                free = [k for k in live if self._outstanding[k] < self.servers[k].max_concurrency]
                if free:
                    slot = min(free, key=lambda k: (self._outstanding[k], k))
                    self._outstanding[slot] += 1
                    return slot
                self._cond.wait()

    def _release(self, slot: int, *, answered: bool) -> None:
        with self._cond:
            self._outstanding[slot] -= 1
            self.served[slot] += answered
            self._cond.notify_all()

    def _gone_after(self, slot: int, err: VLLMServerError) -> bool:
        """Whether server `slot` is gone after `err`; if so it leaves the pool (stopped)."""
        server = self.servers[slot]
        status = err.status if isinstance(err, VLLMRequestError) else None
        if server.alive:
            if status is not None and status < 500:
                return False  # it answered: the request was refused
            if _healthy(server.url):
                return False
            reason = f"no answer to GET {server.url}/health after: {err}"
        else:
            reason = "its process exited or was stopped"
        with self._cond:
            self._gone.setdefault(slot, reason)
            self._cond.notify_all()
        server.close()
        return True

    def _nothing_left(self) -> VLLMServerError:
        parts = [
            f"server {k} ({s.url}) {self._state(k)}; {s._where_log()}"
            for k, s in enumerate(self.servers)
        ]
        if len(self._gone) == len(self.servers):
            head = f"all {len(self.servers)} vLLM servers of the pool died"
        else:
            head = "no vLLM server of the pool holds the current weights (call sync_weights)"
        return VLLMServerError(f"{head}: " + "; ".join(parts))

    # ---------------------------------------------------------------------------- weight sync
    def sync_weights(self, policy: Policy) -> PoolSync:
        """Load `policy`'s weights into every server still in the pool, at once.

        A server whose sync fails leaves the rotation (it comes back after a later successful
        sync; one that died leaves the pool); the pool's `weight_version` advances when at least
        one server took the new weights, and only those sample from then on.

        Raises:
            ValueError: `policy` has another architecture or dtype than the served one, or a
                converter applied other than LoRA / QLoRA (nothing changed on any server).
            VLLMServerError: no server is left, or every server's sync failed (each named);
                the pool then refuses to sample until a sync succeeds.
        """
        with self._lock:
            if self._closed:
                raise VLLMServerError("this VLLMPool is closed; start a new one")
            targets = [k for k in range(len(self.servers)) if k not in self._gone]
            if not targets:
                raise self._nothing_left()
            t0 = time.perf_counter()
            served = served_policy(policy)  # refused by name before any change; merged once
            with ThreadPoolExecutor(max_workers=len(targets)) as threads:
                futures = {k: threads.submit(self.servers[k].sync_weights, served) for k in targets}
            for future in futures.values():
                if isinstance(future.exception(), ValueError):
                    future.result()  # a bad policy: refused by every server before any change
            syncs, failed = {}, {}
            for k, future in futures.items():
                if future.exception() is None:
                    syncs[k] = future.result()
                else:
                    failed[k] = f"sync_weights failed: {future.exception()}"
            with self._cond:
                self._sync_failures += len(failed)
                for k in syncs:
                    self._stale.pop(k, None)
                for k, why in failed.items():
                    if self.servers[k].alive:
                        self._stale[k] = why
                    else:
                        self._gone.setdefault(k, why)
                        self._stale.pop(k, None)
                if syncs:
                    self.weight_version += 1
            for k in failed:
                if k in self._gone:
                    self.servers[k].close()
            if not syncs:
                raise VLLMServerError(
                    "sync_weights failed on every server, so none samples until a sync "
                    "succeeds: " + "; ".join(f"server {k}: {why}" for k, why in failed.items())
                )
            return PoolSync(self.weight_version, syncs, failed, time.perf_counter() - t0)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=HEALTH_TIMEOUT_S) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False
