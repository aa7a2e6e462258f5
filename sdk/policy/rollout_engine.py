"""Rollout engines: what samples an RL step's completions, behind one small interface.

A `RolloutEngine` samples like `Policy.generate` (same arguments, same `Completion`s, each with
the `weight_version` of the weights that drew it), takes new weights with `sync(policy)` after an
optimizer step, and is closed when the run ends (a context manager). Engines are chosen by name
through one registry (`ROLLOUT_ENGINES`, built with `build_rollout_engine`):

| name | samples with | sync | apart |
|---|---|---|---|
| "builtin" | `Policy.generate` (the KV-cache loop) | free (a reference) | no |
| "vllm" | a managed vLLM server (`VLLMServer`) | /dev/shm, reload, cache reset | yes |

An engine apart from the policy (`apart_from_policy`: its samples come from another copy of the
weights, with its own kernels and rounding) has its own numerics: a trainer recomputes the old
log-probs with the trained policy and can weigh the mismatch (`posttrain.rl.lowbit_rollout`). A
researcher's class with the same attributes satisfies `RolloutEngine` without importing anything
from here.

Weight versions: an engine starts at `version` (the trainer's step when it is built) and each
`sync(policy)` sets the next one (`version + 1`, or the version passed).

Example:
    >>> from posttrain.policy import Policy
    >>> with build_rollout_engine("builtin", Policy.from_spec("tiny-1m", seed=0)) as engine:
    ...     samples = engine.generate(["1+1="], n=2, max_new_tokens=3, seed=0)
    ...     _ = engine.sync(engine.policy)
    ...     [c.weight_version for c in samples], engine.version
    ([0, 0], 1)
    >>> build_rollout_engine("vlm", None)
    Traceback (most recent call last):
    ...
    ValueError: unknown rollout engine 'vlm'; registered rollout engines: builtin, vllm
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from posttrain.core.registry import Registry
from posttrain.policy.vllm_sampling import ServedCompletion

if TYPE_CHECKING:
    from posttrain.models.specs import ModelSpec
    from posttrain.models.tokenizer import Tokenizer
    from posttrain.policy.policy import Policy
    from posttrain.policy.vllm_server import VLLMServer, WeightSync

__all__ = [
    "ROLLOUT_ENGINES",
    "RolloutEngine",
    "BuiltinEngine",
    "VLLMEngine",
    "build_rollout_engine",
    "rollout_engines",
]

rollout_engines: Registry = Registry("rollout engine")
"""The rollout engines by name: `build(name, policy=..., **options)`."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What samples rollouts (see the module docstring).

    Attributes:
        name: the registry name ("builtin", "vllm", or a researcher's own).
        version: the weight version the next samples are drawn with.
        apart_from_policy: whether the samples come from another copy of the weights than the
            trained policy's (its own kernels and rounding): a trainer then recomputes the old
            log-probs with the policy.
        tokenizer, spec: the sampled policy's (prompts are rendered and checked with them).
    """

    name: str
    version: int
    apart_from_policy: bool
    tokenizer: Tokenizer
    spec: ModelSpec

    def generate(
        self, prompts: Sequence[str | Sequence[int]], *, seed: int | None = None, **sampling: Any
    ) -> Sequence[ServedCompletion]:
        """`Policy.generate`'s arguments (n, max_new_tokens, temperature, top_p, ...); returns
        `len(prompts) * n` completions, prompt-major, each with its `weight_version`."""
        ...

    def sync(self, policy: Policy, *, version: int | None = None) -> int:
        """Sample from `policy`'s current weights from now on; returns the new version (`version`
        when given, else the old one + 1)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> RolloutEngine: ...

    def __exit__(self, *exc: object) -> None: ...


class BuiltinEngine:
    """The policy's own generator (`Policy.generate`): sync is free (the engine keeps a
    reference to the policy it is given), so the samples are exactly `policy.generate`'s.

    Args:
        policy: the `Policy` to sample from.
        version: the starting weight version (a trainer's step).
    """

    name = "builtin"
    apart_from_policy = False

    def __init__(self, policy: Policy, *, version: int = 0) -> None:
        self.policy, self.version, self.closed = policy, version, False

    @property
    def tokenizer(self) -> Tokenizer:
        return self.policy.tokenizer

    @property
    def spec(self) -> ModelSpec:
        return self.policy.spec

    def generate(
        self, prompts: Sequence[str | Sequence[int]], *, seed: int | None = None, **sampling: Any
    ) -> list[ServedCompletion]:
        """`policy.generate(prompts, seed=seed, **sampling)`, each completion stamped with
        `version`. Raises what `Policy.generate` raises, and ValueError once closed."""
        if self.closed:
            raise ValueError("this BuiltinEngine is closed; build a new one")
        return [
            ServedCompletion(
                **{f.name: getattr(c, f.name) for f in dataclasses.fields(c)},
                weight_version=self.version,
            )
            for c in self.policy.generate(prompts, seed=seed, **sampling)
        ]

    def sync(self, policy: Policy, *, version: int | None = None) -> int:
        self.policy = policy
        self.version = self.version + 1 if version is None else version
        return self.version

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> BuiltinEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"BuiltinEngine({state}, family={self.spec.family}, version={self.version})"

    def _repr_html_(self) -> str:
        return _table("builtin rollout engine", {"sampler": "Policy.generate", **_rows(self)})


class VLLMEngine:
    """A managed vLLM server as a rollout engine (`VLLMServer`: its own process group, closed
    with the engine, at interpreter exit, or by its watchdog when the starting process dies).

    Build it with `VLLMEngine.start`, or wrap a running `server` (the engine then closes it).

    Args:
        server: a started `VLLMServer`.
        version: the weight version of the weights the server holds now.

    Attributes:
        last_sync: the `WeightSync` of the last `sync` (its seconds), or None.
    """

    name = "vllm"
    apart_from_policy = True

    def __init__(self, server: VLLMServer, *, version: int = 0) -> None:
        self.server = server
        # the server's weight version -> this engine's, per sync: a sample is stamped by the
        # version that drew it, however late the mapping is read (a sync may run in between)
        self._versions = {server.weight_version: version}
        self._latest = (server.weight_version, version)
        self.last_sync: WeightSync | None = None

    @classmethod
    def start(
        cls,
        policy: Policy,
        run_dir: str | os.PathLike,
        *,
        version: int = 0,
        startup_timeout_s: float = 900.0,
        kv_cache_gib: int = 1,
        url: str | None = None,
        **server_options: Any,
    ) -> VLLMEngine:
        """Start a server for `policy` (`VLLMServer.start`: the model and `server.log` in
        `run_dir/vllm/`) and return it as an engine at `version`. With `url`, attach to the
        server running there instead (`VLLMServer.attach` with `server_options`: it loads the
        policy's weights; `startup_timeout_s` and `kv_cache_gib` are a start's); the engine's
        `close` then leaves that server running.

        Raises:
            what `VLLMServer.start` raises: `VLLMUnavailable` without the vLLM venv (run
            scripts/vllm-up.sh), ValueError for a policy it cannot serve (named), and
            `VLLMServerError` when the server does not come up within `startup_timeout_s`;
            with `url`, what `VLLMServer.attach` raises (`AttachRefused`, named).
        """
        from posttrain.policy.vllm_server import VLLMServer

        if url is not None:
            return cls(VLLMServer.attach(url, policy, **server_options), version=version)
        server = VLLMServer.start(
            policy,
            run_dir,
            startup_timeout_s=startup_timeout_s,
            kv_cache_gib=kv_cache_gib,
            **server_options,
        )
        return cls(server, version=version)

    @property
    def version(self) -> int:
        return self._engine_version(self.server.weight_version)

    def _engine_version(self, served: int) -> int:
        """This engine's version of the server's `served` one (a version synced past this
        engine counts on from the latest it synced)."""
        known = self._versions.get(served)
        if known is not None:
            return known
        latest_served, latest = self._latest
        return latest + served - latest_served

    @property
    def tokenizer(self) -> Tokenizer:
        return self.server.tokenizer

    @property
    def spec(self) -> ModelSpec:
        return self.server.spec

    def generate(
        self, prompts: Sequence[str | Sequence[int]], *, seed: int | None = None, **sampling: Any
    ) -> list[ServedCompletion]:
        """`VLLMServer.generate` (see `posttrain.policy.vllm_sampling` for how each setting maps
        and what is refused by name), each completion's `weight_version` on this engine's scale."""
        return [
            dataclasses.replace(c, weight_version=self._engine_version(c.weight_version))
            for c in self.server.generate(prompts, seed=seed, **sampling)
        ]

    def sync(self, policy: Policy, *, version: int | None = None) -> int:
        """`VLLMServer.sync_weights(policy)` (safetensors in /dev/shm, reload, prefix-cache
        reset); after a failure the server refuses to sample until a sync succeeds.

        Raises:
            what `VLLMServer.sync_weights` raises (ValueError for another architecture or
            dtype, `VLLMServerError` when the server refused the reload or the reset).
        """
        self.last_sync = self.server.sync_weights(policy)
        served = self.last_sync.version  # the server's, read under its lock
        mine = self._engine_version(served) if version is None else version
        self._versions[served], self._latest = mine, (served, mine)
        return mine

    def close(self) -> None:
        """Stop the server's whole process group (idempotent)."""
        self.server.close()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VLLMEngine(version={self.version}, server={self.server!r})"

    def _repr_html_(self) -> str:
        state = "running" if self.server.alive else "stopped"
        rows = {"sampler": f"vLLM server, {state}", **_rows(self), "url": self.server.url}
        rows["log"] = str(self.server.log_path)
        return _table("vllm rollout engine", rows)


def _rows(engine: Any) -> dict[str, str]:
    return {"model": f"{engine.spec.family}, {engine.spec.num_layers} layers",
            "weight version": str(engine.version)}  # fmt: skip


def _table(caption: str, rows: dict[str, str]) -> str:
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows.items())
    return f"<table><caption>{caption}</caption>{body}</table>"


@rollout_engines.register("builtin")
def _builtin(*, policy: Policy, version: int = 0, **_server_options: Any) -> BuiltinEngine:
    return BuiltinEngine(policy, version=version)


@rollout_engines.register("vllm")
def _vllm(
    *, policy: Policy, run_dir: str | os.PathLike, version: int = 0, **server_options: Any
) -> VLLMEngine:
    return VLLMEngine.start(policy, run_dir, version=version, **server_options)


ROLLOUT_ENGINES = rollout_engines.names()
"""The registered engine names: ("builtin", "vllm")."""


def build_rollout_engine(
    name: str,
    policy: Policy,
    *,
    run_dir: str | os.PathLike | None = None,
    version: int = 0,
    **server_options: Any,
) -> RolloutEngine:
    """The engine `name` for `policy`, at weight version `version`.

    Args:
        name: one of `ROLLOUT_ENGINES` (or a name registered in `rollout_engines`).
        policy: the `Policy` whose weights it samples (the vllm engine exports them once).
        run_dir: the run folder; the vllm engine writes its model and log in `run_dir/vllm/`
            (needed for "vllm").
        version: the starting weight version.
        server_options: the vllm engine's `VLLMEngine.start` options (`startup_timeout_s`,
            `kv_cache_gib`, ...); the builtin engine ignores them.

    Raises:
        ValueError: an unknown name (the registered ones listed); "vllm" without a run_dir.
        What the engine's start raises (`VLLMEngine.start`).
    """
    if name not in rollout_engines.names():
        rollout_engines.build(name)  # the registry's error, naming the registered engines
    if name == "vllm" and run_dir is None:
        raise ValueError(
            "rollout engine 'vllm' needs run_dir (its model and log go to run_dir/vllm)"
        )
    options = {"run_dir": run_dir} if run_dir is not None else {}
    return rollout_engines.build(name, policy=policy, version=version, **options, **server_options)
