"""The vllm rollout engine of an `RLTrainer` under a `ParallelPlan` of several ranks: one server
for the job, started and synced by rank 0, sampled by every data rank (`SharedSlot`,
`SharedEngine`).

Notation: none (lists of completions; versions are integers; "rank" is the global rank).

One rollout, on every rank (the collectives are marked *):

    rollout copy <- runtime.full_state_dict()*    the trainer's gather of the full weights
                                                  (`posttrain.rl.parallel`); rank 0's copy
                                                  is what reaches the server
    first rollout: rank 0 starts the server from its copy (`VLLMEngine.start`: the model and
                   `server.log` in `run_dir/vllm/`), or with `url` in the options attaches to
                   the one running there and loads its copy (`VLLMServer.attach`); the outcome
                   (its URL, or rank 0's error) is broadcast*, and the other ranks sample
                   through a client of that URL
    later ones:    rank 0 syncs (`VLLMEngine.sync`: safetensors in /dev/shm, reload,
                   prefix-cache reset); the outcome (the new version, or rank 0's error) is
                   broadcast*: no rank samples before the sync it needs has finished, and a
                   failed sync raises on every rank (`SharedEngineError` naming rank 0's
                   error; rank 0 raises its own), never stale sampling
    samples        each data rank its share of the prompts (`posttrain.rl.parallel.data_shares`,
                   its own seed), from the server, stamped with the agreed version; the ranks
                   of one data rank (tp, sp) need the same groups, so the first of them asks
                   and the others receive its answer (broadcast* over their group): two
                   identical seeded requests batched differently by the server need not give
                   the same tokens; a failed request raises on all of them
    close          when `fit` returns or raises: rank 0 stops the server (its process group;
                   an attached server keeps running);
                   the other ranks drop their client (no collective: a rank that failed alone
                   still closes)

Why one server for the job, not one per data rank or per node: on CPU each server takes ~1-2
minutes to start and 1-2 GiB, and the server batches every rank's requests together
(continuous batching), so one is the cheapest; it also keeps one sync per step (one copy of the
weights written to /dev/shm). A server per node behind a `posttrain.policy.vllm_pool.VLLMPool`
is the way to scale sampling on GPUs; it is not built here. For ranks on several nodes, start
the server on an address they reach (`rollout_options={"host": "0.0.0.0"}`: the URL broadcast
then names rank 0's host name). A server started before the job (`rollout_options={"url": ...}`:
on rank 0's machine, with the dev-mode routes, docs/runbooks/vllm.md) costs the ranks no start.

Timeouts: the other ranks wait in a broadcast while rank 0 starts the server, so the process
group's timeout (`init_process_group(timeout=...)`) must exceed the start
(`startup_timeout_s`, 900 s by default; ~1-2 minutes for a tiny model on a loaded 2-core
machine).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from posttrain.policy.rollout_engine import RolloutEngine, VLLMEngine
from posttrain.policy.vllm_process import VLLMRequestError, VLLMServerError
from posttrain.policy.vllm_sampling import ServedCompletion, call_completions, call_requests

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from posttrain.models.specs import ModelSpec
    from posttrain.models.tokenizer import Tokenizer
    from posttrain.policy.policy import Policy
    from posttrain.policy.vllm_server import WeightSync
    from posttrain.train.runtime import Runtime

__all__ = ["SharedEngine", "SharedEngineError", "SharedSlot", "shared_engine_wanted"]


class SharedEngineError(VLLMServerError):
    """Rank 0 could not start or sync the job's vLLM server, or the rank that asks the server
    for a data rank's samples failed: raised on the other ranks (the failing rank raises its own
    error), so that no rank samples with weights it did not get or waits for samples that will
    not come."""


def shared_engine_wanted(name: str, runtime: Runtime | None) -> bool:
    """Whether the engine named `name` of a trainer with `runtime` is shared by the ranks of its
    job: a vllm engine under a `ParallelPlan` whose default process group has several ranks.
    (Without a plan each process that builds a trainer has an engine of its own: such a
    trainer needs no other rank, and a collective could wait for ranks that never come.)"""
    return (
        name == "vllm"
        and runtime is not None
        and runtime.plan is not None
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


def _from_rank_0(value: Any) -> Any:
    """Rank 0's `value` on every rank (a collective over the default group)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _peer_group(data_rank: int) -> tuple[ProcessGroup | None, int]:
    """The group of the ranks that share this rank's data rank (None when it has one rank) and
    the first of them (the one that asks the server). Collective: every rank creates every
    group, in the same order."""
    data_ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(data_ranks, data_rank)
    members: dict[int, list[int]] = {}
    for rank, d in enumerate(data_ranks):
        members.setdefault(d, []).append(rank)
    mine: ProcessGroup | None = None
    for d in sorted(members):
        group = dist.new_group(members[d]) if len(members[d]) > 1 else None
        if d == data_rank:
            mine = group
    return mine, members[data_rank][0]


def _reachable(url: str) -> str:
    """`url` with a wildcard host (0.0.0.0, ::) replaced by this machine's host name."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname in ("0.0.0.0", "::"):
        return parts._replace(netloc=f"{socket.getfqdn()}:{parts.port}").geturl()
    return url


class SharedEngine:
    """The job's vLLM server as a rollout engine on one rank (see the module docstring). Build it
    on every rank with `SharedEngine.start` (a collective).

    Attributes:
        url: the server's address (the same on every rank).
        version: the weight version the next samples are drawn with (the same on every rank).
        owner: rank 0's `VLLMEngine` (it started the server and syncs it); None elsewhere.
        peers: (the group of the ranks of this data rank, or None when it has one; the first of
            them, which asks the server for their samples).
        last_sync: rank 0's `WeightSync` of the last sync (on every rank), or None.
    """

    name = "vllm"
    apart_from_policy = True

    def __init__(
        self,
        *,
        url: str,
        version: int,
        policy: Policy,
        owner: VLLMEngine | None,
        peers: ProcessGroup | None,
        asker: int,
        max_concurrency: int,
        request_timeout_s: float,
        log: str,
        served_name: str,
    ) -> None:
        self.url, self.version, self.owner = url, version, owner
        self.peers = (peers, asker)
        self.last_sync: WeightSync | None = None
        self.tokenizer: Tokenizer = policy.tokenizer
        self.spec: ModelSpec = policy.spec
        self._peers, self._asker = peers, asker
        self._concurrency, self._timeout_s, self._log = max_concurrency, request_timeout_s, log
        self._served_name = served_name
        self.closed = False

    @classmethod
    def start(
        cls,
        policy: Policy,
        run_dir: str | os.PathLike | None,
        *,
        version: int,
        data_rank: int,
        peers: tuple[ProcessGroup | None, int] | None = None,
        **server_options: Any,
    ) -> SharedEngine:
        """Start the job's server on rank 0 from `policy` (`VLLMEngine.start` with
        `server_options`; a temporary folder without a run_dir) and return every rank's engine.
        Collective: every rank calls it, with its own data rank (`runtime.data_rank`).
        `peers`: the (group, first rank) of this data rank's ranks from an earlier start (`peers`
        of that engine); made here when None (every rank makes every group).

        Raises:
            on rank 0 what `VLLMEngine.start` raises; on the others `SharedEngineError` naming
            it. Every rank raises when rank 0 failed.
        """
        group, asker = peers or _peer_group(data_rank)
        owner: VLLMEngine | None = None
        error: BaseException | None = None
        outcome: dict[str, Any] | None = None
        if dist.get_rank() == 0:
            try:
                run_dir = run_dir or tempfile.mkdtemp(prefix="posttrain-rollout-")
                owner = VLLMEngine.start(policy, run_dir, version=version, **server_options)
                server = owner.server
                outcome = {
                    "url": _reachable(server.url),
                    "max_concurrency": server.max_concurrency,
                    "request_timeout_s": server.request_timeout_s,
                    "log": str(server.log_path or f"where the server at {server.url} started"),
                    "served_name": server.served_name,
                }
            except BaseException as err:  # noqa: BLE001 - told to every rank, then raised
                error, outcome = err, {"error": f"{type(err).__name__}: {err}"}
        outcome = _from_rank_0(outcome)
        if "error" in outcome:
            if error is not None:
                raise error
            raise SharedEngineError(
                f"rank 0 could not start the vLLM server this run's ranks share: {outcome['error']}"
            )
        return cls(version=version, policy=policy, owner=owner, peers=group, asker=asker, **outcome)

    def generate(
        self, prompts: Sequence[str | Sequence[int]], *, seed: int | None = None, **sampling: Any
    ) -> list[ServedCompletion]:
        """`VLLMServer.generate`'s arguments and answer, each completion stamped with `version`.
        A collective over the ranks of this data rank when it has several (module docstring).

        Raises:
            ValueError: closed, or a setting `posttrain.policy.vllm_sampling` refuses (named).
            VLLMServerError: the server refused or did not answer (`VLLMRequestError`), is dead,
                or (rank 0) its last sync failed.
        """
        if self.closed:
            raise ValueError("this SharedEngine is closed; the next rollout starts a new server")
        if self._peers is None:
            return self._ask(prompts, seed=seed, **sampling)
        answer: Any = None
        error: BaseException | None = None
        if dist.get_rank() == self._asker:
            try:
                answer = self._ask(prompts, seed=seed, **sampling)
            except BaseException as err:  # noqa: BLE001 - told to the peers, then raised
                error, answer = err, f"{type(err).__name__}: {err}"
        box = [answer]
        dist.broadcast_object_list(box, src=self._asker, group=self._peers)
        if error is not None:
            raise error
        if isinstance(box[0], str):
            raise SharedEngineError(
                f"rank {self._asker} asked the vLLM server for this data rank's samples and "
                f"failed: {box[0]}"
            )
        return box[0]

    def _ask(
        self, prompts: Sequence[str | Sequence[int]], *, seed: int | None, **sampling: Any
    ) -> list[ServedCompletion]:
        if self.owner is not None:
            return self.owner.generate(prompts, seed=seed, **sampling)
        prompt_ids, bodies = call_requests(
            prompts,
            tokenizer=self.tokenizer,
            spec=self.spec,
            model=self._served_name,
            seed=seed,
            sampling=sampling,
        )
        workers = max(1, min(len(bodies), self._concurrency))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            answers = list(pool.map(self._complete, bodies))
        return call_completions(
            answers, prompt_ids, tokenizer=self.tokenizer, weight_version=self.version
        )

    def _complete(self, body: Mapping[str, Any]) -> Any:
        """One `POST /v1/completions` to rank 0's server; its JSON answer."""
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as answer:
                return json.loads(answer.read().decode())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            raise VLLMRequestError(
                f"POST {self.url}/v1/completions -> HTTP {err.code}: {detail}", status=err.code
            ) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            raise VLLMRequestError(
                f"POST {self.url}/v1/completions failed ({err}); the server runs on rank 0, "
                f"its log is {self._log}",
                status=None,
            ) from None

    def sync(self, policy: Policy, *, version: int | None = None) -> int:
        """Rank 0 loads `policy`'s weights into the server (`VLLMEngine.sync`); every rank then
        takes the new version (`version`, or the old one + 1). Collective: every rank calls it,
        and returns only after rank 0's sync has finished.

        Raises:
            on rank 0 what `VLLMEngine.sync` raises; on the others `SharedEngineError` naming
            it (every rank raises; the server then refuses to sample until a sync succeeds).
        """
        error: BaseException | None = None
        outcome: dict[str, Any] | None = None
        if self.owner is not None:
            try:
                self.owner.sync(policy, version=version)
                outcome = {"version": self.owner.version, "last_sync": self.owner.last_sync}
            except BaseException as err:  # noqa: BLE001 - told to every rank, then raised
                error, outcome = err, {"error": f"{type(err).__name__}: {err}"}
        outcome = _from_rank_0(outcome)
        if "error" in outcome:
            if error is not None:
                raise error
            raise SharedEngineError(
                f"rank 0's weight sync of the vLLM server failed, so no rank samples (the "
                f"server may hold stale or partial weights): {outcome['error']}"
            )
        self.version, self.last_sync = outcome["version"], outcome["last_sync"]
        return self.version

    def close(self) -> None:
        """Rank 0 stops the server (an attached one keeps running); every rank stops sampling.
        Not a collective. Idempotent."""
        self.closed = True
        if self.owner is not None:
            self.owner.close()

    def __enter__(self) -> SharedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.owner is not None else "client"
        state = "closed" if self.closed else "open"
        return f"SharedEngine({state}, {role}, url={self.url}, version={self.version})"


class SharedSlot:
    """`posttrain.policy.engine_slot.EngineSlot`'s part for a vllm engine shared by the ranks of
    a process group: `sampler` starts it (a collective, at the first rollout) or syncs it when
    the version asked for differs from the one it holds (a collective: every rank asks for the
    same version, so every rank takes the same branch); `close` stops it.

    Args:
        name: "vllm" (see `shared_engine_wanted`).
        data_rank: this rank's data rank (`runtime.data_rank`).
        run_dir, options: as `EngineSlot`'s.
    """

    apart_from_policy = True

    def __init__(
        self,
        name: str,
        *,
        data_rank: int,
        run_dir: str | os.PathLike | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.name, self.data_rank = name, data_rank
        self.engine: SharedEngine | None = None
        self._run_dir, self._options = run_dir, dict(options or {})
        self._peers: tuple[ProcessGroup | None, int] | None = None  # made once, at the first start

    def sampler(self, policy: Policy, version: int | None = None) -> RolloutEngine:
        """The shared engine holding `policy`'s weights at `version` (see the class docstring)."""
        if self.engine is None:
            self.engine = SharedEngine.start(
                policy,
                self._run_dir,
                version=version or 0,
                data_rank=self.data_rank,
                peers=self._peers,
                **self._options,
            )
            self._peers = self.engine.peers
        elif version is None or self.engine.version != version:
            self.engine.sync(policy, version=version)
        return self.engine

    def close(self) -> None:
        """Stop the engine (rank 0 stops the server); the next `sampler` starts a new one."""
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()

    def __repr__(self) -> str:
        return f"SharedSlot({self.name!r}, data_rank={self.data_rank}, engine={self.engine!r})"
