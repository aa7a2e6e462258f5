"""A vLLM server that samples from a posttrain policy: started, health-checked, fed new weights
and stopped by posttrain, as one handle (`VLLMServer`).

vLLM pins transformers, tokenizers and fastapi against posttrain's own pins, so it runs from a
venv of its own (built by `scripts/vllm-up.sh`, found at `$POSTTRAIN_VLLM_VENV` or
/var/tmp/posttrain-vllm/venv) as its own process: `python -m vllm.entrypoints.openai.api_server`
on 127.0.0.1, with `VLLM_SERVER_DEV_MODE=1` for the weight-reload endpoints. The runbook is
docs/runbooks/vllm.md.

Lifecycle:
- `VLLMServer.start(policy, run_dir)` checks everything it can before starting anything (venv,
  architecture, dtype, port), exports the policy as an HF folder (`Policy.save`) under
  `run_dir/vllm/model`, starts the server with its log in `run_dir/vllm/server.log`, and waits for
  `GET /health` within `startup_timeout_s` (~2 minutes on a loaded 2-core machine, mostly imports).
- The server runs in a process group of its own under a small watchdog launcher. `close()` (also
  the context manager's exit, and a finalizer that runs at interpreter exit or when the handle is
  collected) kills the whole group; the watchdog kills it when the Python process that started
  it dies (a notebook kernel killed, `kill -9`), within a second.
- `VLLMServer.attach(url, policy)` takes a server started elsewhere (another process or node,
  `scripts/`, a pytest session) once it has checked that it serves the policy's model and takes
  weight reloads (`posttrain.policy.vllm_attach`), and loads the policy's weights into it. Its
  `close()` closes the handle only: the process it did not start keeps running.
- Prompts are token ids: the server runs with `--skip-tokenizer-init`, and posttrain encodes and
  decodes with the policy's own tokenizer (so byte-tokenizer models are served too).

Weight sync (`sync_weights`): the policy's weights are saved as safetensors in /dev/shm,
`reload_weights(weights_path=...)` runs in the server's workers (`POST /collective_rpc`), then
`POST /reset_prefix_cache`: reload alone keeps prompts cached before the update, and the server
would answer them with the old weights' KV. Every sample carries the weight version it was drawn
with; after a failed sync the handle refuses to sample until a sync succeeds.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain.policy.vllm_process import (
    DEFAULT_VENV,
    VLLMRequestError,
    VLLMServerError,
    VLLMUnavailable,
    check_port,
    log_tail,
    server_env,
    shm_root,
    start_group,
    stop_group,
    vllm_unavailable_reason,
    vllm_venv,
)
from posttrain.policy.vllm_sampling import (
    ServedCompletion,
    call_completions,
    call_requests,
)
from posttrain.policy.vllm_servable import (
    SUPPORTED_ARCHITECTURES,
    VLLM_DTYPES,
    cpu_batching,
    served_policy,
)
from posttrain.policy.vllm_weights import WeightSync, write_reload_files

if TYPE_CHECKING:
    from posttrain.models.specs import ModelSpec
    from posttrain.models.tokenizer import Tokenizer
    from posttrain.policy.policy import Policy

__all__ = [
    "VLLMServer",
    "VLLMServerError",
    "VLLMUnavailable",
    "WeightSync",
    "vllm_unavailable_reason",
    "DEFAULT_VENV",
    "SUPPORTED_ARCHITECTURES",
]

SERVED_NAME = "posttrain-policy"


class VLLMServer:
    """A running vLLM server for one policy architecture. Build it with `VLLMServer.start`.

    Attributes:
        url: http://host:port of the server.
        log_path: the server's log (stdout and stderr) in the run folder; None when attached.
        model_dir: the HF folder it was started from; None when attached.
        weight_version: 0 for the weights it started with, +1 per successful `sync_weights`.
        pgid: the process group of the server (watchdog, API server, engine); None when attached.
        attached: True for a server started elsewhere (`attach`): `close` leaves it running.
        served_name: the model name requests ask for (`--served-model-name`).
    """

    def __init__(
        self,
        *,
        proc: subprocess.Popen | None,
        url: str,
        log_path: Path | None,
        model_dir: Path | None,
        spec: ModelSpec,
        tokenizer: Tokenizer,
        dtype: torch.dtype,
        request_timeout_s: float,
        max_concurrency: int,
        served_name: str = SERVED_NAME,
        weights_dir: str | None = None,
    ) -> None:
        self._proc = proc
        self.url = url
        self.log_path = log_path
        self.model_dir = model_dir
        self.spec = spec
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.pgid = proc.pid if proc is not None else None
        self.attached, self.served_name = proc is None, served_name
        self.weight_version = 0
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self._stale = False
        self._closed = False
        self._lock = threading.Lock()
        self._shm_dir = tempfile.mkdtemp(prefix="posttrain-vllm-", dir=weights_dir or shm_root())
        self._finalizer = (
            weakref.finalize(self, stop_group, proc, self._shm_dir)
            if proc is not None  # a server started elsewhere keeps running: its files go
            else weakref.finalize(self, shutil.rmtree, self._shm_dir, True)
        )

    # ------------------------------------------------------------------------------ lifecycle
    @classmethod
    def start(
        cls,
        policy: Policy,
        run_dir: str | os.PathLike,
        *,
        venv: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = 900.0,
        request_timeout_s: float = 600.0,
        enforce_eager: bool = True,
        kv_cache_gib: int = 1,
        max_concurrency: int = 32,
        extra_args: Sequence[str] = (),
    ) -> VLLMServer:
        """Export `policy` and start a vLLM server for it; return once `GET /health` answers.

        Args:
            policy: the policy to serve (its weights, dtype and tokenizer).
            run_dir: the run folder; the model goes to `run_dir/vllm/model`, the log to
                `run_dir/vllm/server.log`.
            venv: the vLLM venv (default `$POSTTRAIN_VLLM_VENV` or /var/tmp/posttrain-vllm/venv).
            host, port: where to listen; `port=None` picks a free port.
            startup_timeout_s: deadline for `/health` (seconds).
            request_timeout_s: deadline of one HTTP request to the server (seconds).
            enforce_eager: no torch.compile / graphs (starts in seconds instead of ~1 minute).
            kv_cache_gib: KV cache memory on CPU (`VLLM_CPU_KVCACHE_SPACE`, GiB).
            max_concurrency: most requests in flight from one `generate` call.
            extra_args: more `api_server` arguments, passed as they are.

        Raises:
            VLLMUnavailable: the venv is missing or incomplete (run scripts/vllm-up.sh).
            ValueError: an architecture the server does not take (the allowed ones named), a
                dtype other than float32/bfloat16/float16, on CPU a head dimension without a
                kernel (`CPU_HEAD_DIMS`), or a converter applied other than LoRA / QLoRA
                (whose adapters are merged: `vllm_servable.served_policy`).
            VLLMServerError: the port is taken, the server exited before it was healthy (exit
                code and the log's tail in the message), or `/health` did not answer in time.
        """
        served = served_policy(policy)  # checked; LoRA / QLoRA adapters merged
        reason = vllm_unavailable_reason(venv)
        if reason is not None:
            raise VLLMUnavailable(reason)
        chosen_port = check_port(host, port)
        folder = Path(run_dir) / "vllm"
        folder.mkdir(parents=True, exist_ok=True)
        model_dir, log_path = folder / "model", folder / "server.log"
        served.save(model_dir)
        python = vllm_venv(venv) / "bin" / "python"
        argv = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", SERVED_NAME,
            "--host", host, "--port", str(chosen_port),
            "--dtype", VLLM_DTYPES[policy.dtype], "--max-model-len", str(policy.spec.max_seq_len),
            "--skip-tokenizer-init", "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm", "--seed", "0",
            *(["--enforce-eager"] if enforce_eager else []),
            *cpu_batching(policy.spec.max_seq_len, max_concurrency, extra_args),
            *extra_args,
        ]  # fmt: skip
        with open(log_path, "a") as log:
            log.write(f"$ {' '.join(argv)}\n")
        proc = start_group(argv, env=server_env(python, kv_cache_gib), log_path=log_path)
        server = cls(
            proc=proc, url=f"http://{host}:{chosen_port}", log_path=log_path,
            model_dir=model_dir, spec=policy.spec, tokenizer=policy.tokenizer, dtype=policy.dtype,
            request_timeout_s=request_timeout_s, max_concurrency=max_concurrency,
        )  # fmt: skip
        try:
            server._wait_healthy(startup_timeout_s)
        except BaseException:
            server.close()
            raise
        return server

    @classmethod
    def attach(
        cls,
        url: str,
        policy: Policy,
        *,
        served_name: str = SERVED_NAME,
        weights_dir: str | None = None,
        request_timeout_s: float = 600.0,
        max_concurrency: int = 32,
        check_timeout_s: float = 30.0,
    ) -> VLLMServer:
        """A handle to the vLLM server running at `url`, started elsewhere, serving `policy`'s
        weights (loaded at once: a sync) at `weight_version` 0, as `start` returns one.

        The server must serve `served_name` with `--max-model-len` the policy's
        `spec.max_seq_len`, run with `VLLM_SERVER_DEV_MODE=1`, and read the weight files this
        process writes (/dev/shm: on this machine, or `weights_dir` both read); prompts are
        token ids, so start it with `--skip-tokenizer-init` (`posttrain.policy.vllm_attach`).
        `close()` closes the handle and leaves the server running.

        Raises:
            ValueError: `url` is not http://host:port; the policy is not servable (as `start`).
            AttachRefused (a VLLMServerError): no answer, another model or max_model_len, a
                server on another machine without `weights_dir`, no weight-reload routes (named).
            VLLMServerError: the first sync failed (the server's answer quoted).
        """
        from posttrain.policy.vllm_attach import attach_handle

        return attach_handle(
            cls, url.rstrip("/"), policy, served_name=served_name, weights_dir=weights_dir,
            request_timeout_s=request_timeout_s, max_concurrency=max_concurrency,
            check_timeout_s=check_timeout_s,
        )  # fmt: skip

    def _exit_code(self) -> int | None:
        """The server process's exit code; None while it runs or when it was started elsewhere."""
        return self._proc.poll() if self._proc is not None else None

    def _where_log(self) -> str:
        if self.log_path is None:
            return f"it was started elsewhere (attached at {self.url}): its log is there"
        return f"its log is {self.log_path}"

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.log_path is not None, "a server started here has its log"
        deadline = time.monotonic() + timeout_s
        while True:
            code = self._exit_code()
            if code is not None:
                raise VLLMServerError(
                    f"the vLLM server exited with code {code} before GET {self.url}/health "
                    f"answered; its log is {self.log_path}, ending:\n{log_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise VLLMServerError(
                    f"the vLLM server did not answer GET {self.url}/health within {timeout_s:g} "
                    f"s; its log is {self.log_path}, ending:\n{log_tail(self.log_path)}"
                )
            time.sleep(1.0)

    @property
    def alive(self) -> bool:
        """Whether the server process is running (and the handle not closed); for an attached
        server, whether `GET /health` answers."""
        if self._closed or self._exit_code() is not None:
            return False
        if self._proc is not None:
            return True
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return False

    def close(self) -> None:
        """Stop the server: its whole process group, SIGTERM then SIGKILL after 10 s; an attached
        server keeps running (only the handle and its weight files go). Idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self.alive else "dead")
        state += ", attached" if self.attached else ""
        return (
            f"VLLMServer({state}, url={self.url}, family={self.spec.family}, "
            f"weight_version={self.weight_version}, log={self.log_path})"
        )

    def _repr_html_(self) -> str:
        rows = {
            "state": "closed" if self._closed else ("running" if self.alive else "dead"),
            "url": self.url,
            "model": (
                f"{self.spec.family}, {self.spec.num_layers} layers, {VLLM_DTYPES[self.dtype]}"
            ),
            "weight version": str(self.weight_version) + (" (sync failed)" if self._stale else ""),
            "log": str(self.log_path),
        }
        body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows.items())
        return f"<table><caption>vLLM server</caption>{body}</table>"

    # ------------------------------------------------------------------------------- requests
    def _post(self, path: str, body: Mapping[str, Any] | None) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as answer:
                text = answer.read().decode()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            raise VLLMRequestError(
                f"POST {self.url}{path} -> HTTP {err.code}: {detail}", status=err.code
            ) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            code = self._exit_code()
            state = "running" if code is None else f"exited {code}"
            raise VLLMRequestError(
                f"POST {self.url}{path} failed ({err}); the server is {state}, {self._where_log()}",
                status=None,
            ) from None
        return json.loads(text) if text.strip() else None

    def _check_usable(self) -> None:
        if self._closed:
            raise VLLMServerError("this VLLMServer is closed; start a new one")
        if self._exit_code() is not None and self.log_path is not None:
            raise VLLMServerError(
                f"the vLLM server exited with code {self._exit_code()}; its log is "
                f"{self.log_path}, ending:\n{log_tail(self.log_path)}"
            )
        if self._stale:
            raise VLLMServerError(
                f"the last sync_weights failed, so the server may hold stale or partial weights "
                f"(last good version {self.weight_version}); call sync_weights again"
            )

    # ------------------------------------------------------------------------------- sampling
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        seed: int | None = None,
        **sampling: Any,
    ) -> list[ServedCompletion]:
        """Sample completions from the server, as `Policy.generate` does from the policy.

        Args:
            prompts: str prompts (encoded with BOS by the policy's tokenizer) or token-id lists.
            seed: the call's seed (sample j of prompt i uses `seed + i * n + j`); None draws one
                from the global torch RNG, as `Policy.generate` does.
            sampling: n, max_new_tokens, temperature, top_p, top_k, stop (see
                `posttrain.policy.vllm_sampling` for how each maps and what is refused).

        Returns:
            `len(prompts) * n` `ServedCompletion`s, prompt-major, each with the sampled tokens,
            their log-probabilities under the distribution sampled from (float32 values as
            Python floats), and the weight version that drew them.

        Raises:
            ValueError: a bad or unsupported setting, named; an unknown keyword.
            VLLMServerError: the server is closed or dead, the last sync failed, or a request
                failed.
        """
        prompt_ids, bodies = call_requests(
            prompts,
            tokenizer=self.tokenizer,
            spec=self.spec,
            model=self.served_name,
            seed=seed,
            sampling=sampling,
        )
        with self._lock:
            self._check_usable()
            version = self.weight_version
            workers = max(1, min(len(bodies), self.max_concurrency))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                answers = list(pool.map(lambda b: self._post("/v1/completions", b), bodies))
        return call_completions(
            answers, prompt_ids, tokenizer=self.tokenizer, weight_version=version
        )

    def complete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """One `/v1/completions` request (a body from `vllm_sampling.call_requests`) -> the
        answer, for a client of several servers (`posttrain.policy.vllm_pool.VLLMPool`).

        Raises: VLLMServerError (closed, dead, or the last sync failed); VLLMRequestError (the
        request failed; its `status` is the HTTP status, None when no answer came).
        """
        self._check_usable()
        return self._post("/v1/completions", body)

    # ---------------------------------------------------------------------------- weight sync
    def sync_weights(self, policy: Policy) -> WeightSync:
        """Load `policy`'s current weights into the server and reset its prefix cache.

        Saves the weights as safetensors in /dev/shm, runs `reload_weights(weights_path=...)` in
        the server's workers, then resets the prefix cache, and only then bumps `weight_version`.
        If any step fails, the handle refuses to sample until a later sync succeeds. A LoRA or
        QLoRA policy is saved merged (`vllm_servable.served_policy`: new tensors, the policy
        itself untouched; the merge counts in `save_s`).

        Raises:
            ValueError: `policy` has another architecture or dtype than the served one, or a
                converter applied other than LoRA / QLoRA (named).
            VLLMServerError: the server refused the reload or the reset (its answer quoted).
        """
        if policy.spec != self.spec:
            raise ValueError(
                f"policy.spec={policy.spec} differs from the served spec {self.spec}; start a "
                "new server for another architecture"
            )
        if policy.dtype != self.dtype:
            raise ValueError(
                f"policy dtype {policy.dtype} differs from the served dtype {self.dtype}; "
                "cast the policy or start a new server"
            )
        merge_start = time.perf_counter()
        served = served_policy(policy)  # refused by name before any change; adapters merged
        merge_s = time.perf_counter() - merge_start
        with self._lock:
            if self._closed or self._exit_code() is not None:
                self._check_usable()
            self._stale = True
            t0 = time.perf_counter() - merge_s  # the merge counts as saving
            folder = Path(self._shm_dir) / "weights"
            nbytes = write_reload_files(served.model, policy.spec, folder)
            t1 = time.perf_counter()
            self._post(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}},
            )
            t2 = time.perf_counter()
            self.reset_prefix_cache()
            t3 = time.perf_counter()
            self.weight_version += 1
            self._stale = False
        return WeightSync(self.weight_version, nbytes, t1 - t0, t2 - t1, t3 - t2)

    def reset_prefix_cache(self) -> None:
        """`POST /reset_prefix_cache`, retried while the server answers success=false (blocks
        still held by running requests): after new weights, cached prompts' KV is stale.

        Raises:
            VLLMServerError: the reset kept failing (~10 s), or the request failed.
        """
        for _ in range(50):
            if (self._post("/reset_prefix_cache", None) or {}).get("success"):
                return
            time.sleep(0.2)
        raise VLLMServerError(
            "POST /reset_prefix_cache kept answering success=false (blocks still held "
            "by running requests); the server may serve cached prompts with old weights"
        )

    def post(self, path: str, body: Mapping[str, Any] | None) -> Any:
        """POST `body` as JSON to `path` (e.g. vLLM's weight-transfer routes); the answer's JSON.
        Raises VLLMRequestError (`status`: the HTTP status, None when no answer came)."""
        return self._post(path, body)
