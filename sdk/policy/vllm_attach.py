"""What `VLLMServer.attach` checks before it takes a vLLM server started elsewhere (by another
process, `scripts/`, a pytest session, or by hand) as a handle: that it serves the policy's
model and that posttrain can load new weights into it.

A server is attachable when:
- `GET /v1/models` lists the served name (`--served-model-name`, posttrain's own servers use
  "posttrain-policy") with `max_model_len` equal to the policy's `spec.max_seq_len` (start it
  with `--max-model-len` that value);
- its weights can be reloaded: the dev-mode routes answer (`VLLM_SERVER_DEV_MODE=1` in the
  server's environment: `POST /reset_prefix_cache` is probed, `POST /collective_rpc` comes with
  it), and the weight files posttrain writes are readable by the server: the default folder is
  /dev/shm, so the server must run on this machine (its URL's host is one of this machine's
  addresses), unless a `weights_dir` both machines read is given.

The first sync (`VLLMServer.attach` makes one at once) proves the reload end to end.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Any

from posttrain.policy.vllm_process import VLLMServerError

if TYPE_CHECKING:
    from posttrain.policy.policy import Policy

__all__ = ["AttachRefused", "attach_handle", "check_attachable", "is_this_machine"]


class AttachRefused(VLLMServerError):
    """A server that `VLLMServer.attach` cannot use: it serves another model, or its weights
    cannot be reloaded from here (the message names which and how to start it)."""


def is_this_machine(host: str) -> bool:
    """Whether `host` (a name or an address) is one of this machine's addresses: a socket binds
    to an address only on the machine that has it (a name may resolve to several, e.g. ::1 and
    127.0.0.1 where IPv6 is off: one that binds is enough)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        if address[0] in ("0.0.0.0", "::"):
            return True
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address[0], 0, *address[2:]))
            except OSError:
                continue
            return True
    return False


def _request(url: str, method: str, timeout_s: float) -> tuple[int | None, Any]:
    """(HTTP status, JSON answer or None) of one request without a body; status None when no
    answer came."""
    request = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            text = answer.read().decode(errors="replace")
            status = answer.status
    except urllib.error.HTTPError as err:
        return err.code, None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        raise AttachRefused(
            f"{method} {url} failed ({err}): is a vLLM server running there?"
        ) from None
    try:
        return status, json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return status, None


def check_attachable(
    url: str,
    *,
    served_name: str,
    max_model_len: int,
    weights_dir: str | None,
    timeout_s: float,
) -> None:
    """Check that the server at `url` serves `served_name` with `max_model_len` and that its
    weights can be reloaded from this process (module docstring).

    Raises:
        ValueError: `url` is not http://host:port.
        AttachRefused: no answer; another served model or max_model_len (the models listed);
            a server on another machine without `weights_dir`; the dev-mode routes missing.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"url={url!r} must be http://host:port (a vLLM server's address)")
    if weights_dir is None and not is_this_machine(parts.hostname):
        raise AttachRefused(
            f"the vLLM server at {url} runs on another machine ({parts.hostname} is none of this "
            "machine's addresses), and its weights reload from files written to /dev/shm here: "
            "attach from its machine, or pass weights_dir= a folder both machines read"
        )
    status, models = _request(f"{url}/v1/models", "GET", timeout_s)
    cards = (models or {}).get("data") if isinstance(models, dict) else None
    if status != 200 or not isinstance(cards, list):
        raise AttachRefused(f"GET {url}/v1/models answered HTTP {status}: is it a vLLM server?")
    listed = {c.get("id"): c.get("max_model_len") for c in cards if isinstance(c, dict)}
    if served_name not in listed:
        raise AttachRefused(
            f"the vLLM server at {url} serves {sorted(map(str, listed))}, not {served_name!r}: "
            f"start it with --served-model-name {served_name}, or pass served_name= its name"
        )
    if listed[served_name] != max_model_len:
        raise AttachRefused(
            f"the vLLM server at {url} serves {served_name!r} with max_model_len="
            f"{listed[served_name]}, the policy's spec.max_seq_len is {max_model_len}: start it "
            f"with --max-model-len {max_model_len}"
        )
    status, _ = _request(f"{url}/reset_prefix_cache", "POST", timeout_s)
    if status == 404:
        raise AttachRefused(
            f"the vLLM server at {url} has no weight-reload routes (POST /reset_prefix_cache "
            "answered 404), so posttrain cannot load new weights into it: start it with "
            "VLLM_SERVER_DEV_MODE=1 in its environment (docs/runbooks/vllm.md)"
        )
    if status != 200:
        raise AttachRefused(f"POST {url}/reset_prefix_cache answered HTTP {status}")


def attach_handle(
    server_cls: Any,
    url: str,
    policy: Policy,
    *,
    served_name: str,
    weights_dir: str | None,
    request_timeout_s: float,
    max_concurrency: int,
    check_timeout_s: float,
) -> Any:
    """`VLLMServer.attach` (`server_cls` is `VLLMServer`): the checks, a handle without a
    process, and the policy's weights loaded (a sync; the handle closed again when it fails),
    at weight version 0."""
    from posttrain.policy.vllm_servable import served_policy

    served_policy(policy)  # checked before any request: the same refusals as start's
    check_attachable(
        url,
        served_name=served_name,
        max_model_len=policy.spec.max_seq_len,
        weights_dir=weights_dir,
        timeout_s=check_timeout_s,
    )
    server = server_cls(
        proc=None, url=url, log_path=None, model_dir=None, spec=policy.spec,
        tokenizer=policy.tokenizer, dtype=policy.dtype, request_timeout_s=request_timeout_s,
        max_concurrency=max_concurrency, served_name=served_name, weights_dir=weights_dir,
    )  # fmt: skip
    try:
        server.sync_weights(policy)
    except BaseException:
        server.close()
        raise
    server.weight_version = 0  # the policy's weights, as a started server's
    return server
