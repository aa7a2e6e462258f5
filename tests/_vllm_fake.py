"""A stand-in for vLLM's OpenAI server, for tests of the clients' logic that need no vLLM venv (the
pool's routing, retries and syncs). `fake_venv(folder)` makes a folder that
`VLLMServer.start(..., venv=...)` takes for a vLLM venv: its `bin/python` runs this file for `-m
vllm.entrypoints.openai.api_server` and the real python for anything else (the watchdog).

The fake answers like the real server, in the parts the clients read: `GET /health`, `GET
/v1/models` (the served name and max_model_len), `POST /v1/completions` (one choice with token
ids, their log-probs and a finish reason; HTTP 400 when `max_tokens` < 1, as vLLM), `POST
/collective_rpc` (a reload: the weights' digest changes) and `POST /reset_prefix_cache`. Its
samples are a function of the request and the weights it holds (`expected_ids`), so a test knows
each answer without the fake.

Controls, as files in the server's folder (`run_dir/vllm/`, the model folder's parent), read at
each request: `delay_s` (seconds to wait before answering a completion), `fail_reload` (the
reload answers HTTP 500), `fail_500` (completions answer HTTP 500), `garbage` (completions
answer 200 with a body that is not JSON), `no_dev_mode` (the dev-mode routes, reload and prefix-
cache reset, answer 404: a server started without VLLM_SERVER_DEV_MODE=1). It writes `received`
when a completion request arrives.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from pathlib import Path

VOCAB = 256  # byte ids: decodable by the tiny models' byte tokenizer, never a stop id


def expected_ids(prompt: list[int], seed: int, temperature: float, max_tokens: int, digest: int):
    """The fake's sample for one request: the weights' digest first, then ids from the prompt
    (and the seed when sampling)."""
    base = sum(prompt) * 13 + (seed * 7919 if temperature > 0 else 0)
    return [digest % VOCAB] + [(base + 31 * j) % VOCAB for j in range(max_tokens - 1)]


def weights_digest(folder: Path) -> int:
    """crc32 of the folder's safetensors files, in name order."""
    crc = 0
    for path in sorted(folder.glob("*.safetensors")):
        crc = zlib.crc32(path.read_bytes(), crc)
    return crc


def fake_venv(folder: Path) -> Path:
    """A folder `VLLMServer.start(venv=...)` takes, whose server is this file."""
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    python = folder / "bin" / "python"
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "vllm.entrypoints.openai.api_server" ]; then\n'
        f'  shift 2; exec {sys.executable} {Path(__file__).resolve()} "$@"\n'
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    (folder / "posttrain-vllm.stamp").write_text("fake vLLM server for tests\n")
    return folder


def _serve(argv: list[str]) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    args = {
        flag: argv[k + 1]
        for k, flag in enumerate(argv[:-1])
        if flag in ("--model", "--host", "--port", "--served-model-name", "--max-model-len")
    }
    model = Path(args["--model"])
    controls = model.parent
    state = {"digest": weights_digest(model)}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _answer(self, code: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                card = {"id": args["--served-model-name"], "object": "model"}
                card["max_model_len"] = int(args["--max-model-len"])
                return self._answer(200, {"object": "list", "data": [card]})
            self._answer(200 if self.path == "/health" else 404, {})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"null")
            dev = self.path in ("/collective_rpc", "/reset_prefix_cache")
            if dev and (controls / "no_dev_mode").exists():
                return self._answer(404, {"detail": "Not Found"})
            if self.path == "/collective_rpc":
                if (controls / "fail_reload").exists():
                    return self._answer(500, {"error": "reload failed (fail_reload)"})
                state["digest"] = weights_digest(Path(body["kwargs"]["weights_path"]))
                return self._answer(200, {"results": [None]})
            if self.path == "/reset_prefix_cache":
                return self._answer(200, {"success": True})
            if self.path != "/v1/completions":
                return self._answer(404, {"error": self.path})
            (controls / "received").touch()
            delay = controls / "delay_s"
            if delay.exists():
                time.sleep(float(delay.read_text()))
            if (controls / "fail_500").exists():
                return self._answer(500, {"error": "internal error (fail_500)"})
            if (controls / "garbage").exists():
                self.send_response(200)
                self.send_header("Content-Length", "9")
                self.end_headers()
                return self.wfile.write(b"not json!")
            if body["max_tokens"] < 1:
                return self._answer(400, {"error": "max_tokens must be at least 1"})
            ids = expected_ids(
                body["prompt"], body["seed"], body["temperature"], body["max_tokens"],
                state["digest"],
            )  # fmt: skip
            choice = {"token_ids": ids, "logprobs": {"token_logprobs": [-1.0] * len(ids)}}
            self._answer(200, {"choices": [{**choice, "finish_reason": "length"}]})

    # the listen backlog of the real server (uvicorn: 2048), not http.server's 5: several
    # clients' concurrent requests on a loaded machine overflow 5, and connections are reset
    ThreadingHTTPServer.request_queue_size = 2048
    ThreadingHTTPServer((args["--host"], int(args["--port"])), Handler).serve_forever()


if __name__ == "__main__":
    _serve(sys.argv[1:])
