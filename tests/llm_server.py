"""A stand-in for LLM APIs on 127.0.0.1: OpenAI chat completions and Anthropic messages.

Speaks both wire formats the way the real endpoints do (the shapes nla_shell/explainers/api.py
documents): POST {url}/v1/chat/completions answers {"choices": [{"message": {"content",
"refusal"}, "finish_reason"}], "usage": {"prompt_tokens", "completion_tokens"}}; POST
{url}/v1/messages answers {"content": [{"type": "text", "text"}], "stop_reason", "usage":
{"input_tokens", "output_tokens"}}. Both check their key header (401 otherwise).

What each request gets is decided by `script(prompt, attempt)` (attempt counts the
requests for that prompt, from 0): an `Answer`. The server counts every request, runs on
daemon threads, and shuts itself down after `lifetime_s` even if a test forgets to; a
"hang" answer waits until the server stops.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from nla_shell.explainers import Site

API_KEY = "test-key"
API_SETTINGS = dict(model="mock-model", api_key=API_KEY, max_retries=3, backoff_s=0.01, max_tokens=77, temperature=0.5)
"""ApiCompleter settings for talking to this server (besides provider, base_url and concurrency)."""


def sample_sites(n: int, *, repeat_first: bool = False) -> list[Site]:
    """n sites with distinct contexts; repeat_first appends one more with the first site's text (same prompt)."""
    sites = [Site(f"d{i}", 5 + i, (1, 2, 3), f"The text number {i} ends with", " with") for i in range(n)]
    return sites + [Site("dup", 9, (1, 2, 3), sites[0].context, sites[0].token)] if repeat_first else sites


@dataclass(frozen=True)
class Answer:
    kind: str = "ok"
    """ok | refuse | status (HTTP `status`) | malformed (200, not JSON) | hang (until the server stops)."""
    text: str | None = None
    """The reply text for "ok"; None -> mock_reply(prompt)."""
    status: int = 200
    retry_after: str | None = None
    """Retry-After header sent with a "status" answer."""


def mock_reply(prompt: str) -> str:
    """The default reply: an explanation that names the prompt's hash, so a test can tell replies apart."""
    return f"Sure.\n<explanation>\nfeature {mock_tag(prompt)}\n</explanation>"


def mock_tag(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()[:10]


def usage(prompt: str, text: str | None) -> tuple[int, int]:
    """(input, output) token counts the server bills: whitespace words."""
    return len(prompt.split()), len((text or "").split())


@dataclass(frozen=True)
class Request:
    path: str
    prompt: str
    body: dict
    headers: dict
    time: float


class LLMServer:
    def __init__(self, script: Callable[[str, int], Answer] = lambda prompt, attempt: Answer(), *,
                 lifetime_s: float = 60.0) -> None:
        self.script = script
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                prompt = body["messages"][0]["content"]
                with server._lock:
                    attempt = sum(r.prompt == prompt for r in server.requests)
                    server.requests.append(Request(self.path, prompt, body, {k.lower(): v for k, v in self.headers.items()},
                                                       time.monotonic()))
                server._answer(self, prompt, attempt)

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._watchdog = threading.Timer(lifetime_s, self.stop)
        self._watchdog.daemon = True

    def __enter__(self) -> "LLMServer":
        self._thread.start()
        self._watchdog.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            self._watchdog.cancel()
            self._http.shutdown()
            self._http.server_close()

    def count(self, prompt: str) -> int:
        with self._lock:
            return sum(r.prompt == prompt for r in self.requests)

    # --- answers --------------------------------------------------------------------------

    def _answer(self, handler: BaseHTTPRequestHandler, prompt: str, attempt: int) -> None:
        anthropic = handler.path == "/v1/messages"
        key = handler.headers.get("x-api-key") if anthropic else handler.headers.get("authorization", "")[7:]
        if handler.path not in ("/v1/messages", "/v1/chat/completions"):
            return self._send(handler, 404, b'{"error": "no such endpoint"}')
        if key != API_KEY:
            return self._send(handler, 401, b'{"error": {"message": "invalid api key"}}')
        answer = self.script(prompt, attempt)
        if answer.kind == "hang":
            self._stopped.wait()
            return None
        if answer.kind == "status":
            return self._send(handler, answer.status, b'{"error": "scripted"}', answer.retry_after)
        if answer.kind == "malformed":
            return self._send(handler, 200, b"<html>gateway says hi</html>")
        text = None if answer.kind == "refuse" else (answer.text if answer.text is not None else mock_reply(prompt))
        n_in, n_out = usage(prompt, text)
        if anthropic:
            body = {"type": "message", "role": "assistant", "model": "mock",
                    "content": [] if text is None else [{"type": "text", "text": text}],
                    "stop_reason": "refusal" if text is None else "end_turn",
                    "usage": {"input_tokens": n_in, "output_tokens": n_out}}
        else:
            message = {"role": "assistant", "content": text, "refusal": "I can't help with that." if text is None else None}
            body = {"object": "chat.completion", "model": "mock",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}}
        return self._send(handler, 200, json.dumps(body).encode())

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, payload: bytes, retry_after: str | None = None) -> None:
        handler.send_response(status)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-length", str(len(payload)))
        if retry_after is not None:
            handler.send_header("retry-after", retry_after)
        handler.end_headers()
        handler.wfile.write(payload)
