"""LLM APIs over plain HTTP (stdlib urllib): OpenAI-compatible chat completions and Anthropic messages.

No SDK: each provider is a request builder and a reply parser, following the wire format
of the endpoint the SDKs call (and the environment variables they read):

    openai     POST {OPENAI_BASE_URL or https://api.openai.com/v1}/chat/completions
               Authorization: Bearer {OPENAI_API_KEY}
               reply: choices[0].message.content; refusal: message.refusal or finish_reason
               "content_filter"; usage: prompt_tokens / completion_tokens
    anthropic  POST {ANTHROPIC_BASE_URL or https://api.anthropic.com}/v1/messages
               x-api-key: {ANTHROPIC_API_KEY}, anthropic-version: 2023-06-01
               reply: the text blocks of content; refusal: stop_reason "refusal";
               usage: input_tokens / output_tokens

Requests run on `concurrency` threads. 408/409/429/5xx answers and network errors are
retried up to `max_retries` times, waiting the server's Retry-After when it sends one and
an exponential backoff with jitter otherwise; a request that still fails is reported as
failed. Any other HTTP error (bad key, unknown model, bad request) cannot be fixed by
waiting: it stops the run at once with a message naming the setting to check.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from nla_shell.explainers.base import ExplainerError
from nla_shell.explainers.cache import Reply
from nla_shell.io.config import ConfigError

RETRY_STATUSES = frozenset({408, 409, 429}) | frozenset(range(500, 600))
"""HTTP statuses worth retrying: timeouts, conflicts, rate limits, server errors (529 overloaded included)."""
ANTHROPIC_VERSION = "2023-06-01"
"""The anthropic-version header the messages API requires."""


@dataclass(frozen=True)
class Provider:
    """Where a provider lives and how to reach it."""

    default_base_url: str
    base_url_env: str
    api_key_env: str
    path: str
    """Appended to the base URL."""


PROVIDERS: Mapping[str, Provider] = {
    "openai": Provider("https://api.openai.com/v1", "OPENAI_BASE_URL", "OPENAI_API_KEY", "/chat/completions"),
    "anthropic": Provider("https://api.anthropic.com", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "/v1/messages"),
}


def request_body(*, model: str, prompt: str, max_tokens: int, temperature: float | None) -> dict[str, Any]:
    """The JSON body asking `model` for one reply to the user message `prompt` (the same keys in both formats).

    temperature None leaves the key out: some newer models reject it (as EasyNLA's providers.py notes).
    """
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}]}
    if temperature is not None:
        body["temperature"] = temperature
    return body


def request_headers(provider: str, api_key: str | None) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if provider == "anthropic":
        headers["anthropic-version"] = ANTHROPIC_VERSION
        if api_key:
            headers["x-api-key"] = api_key
    elif api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


def parse_response(provider: str, body: Mapping[str, Any]) -> Reply:
    """A Reply from a decoded 200 body; KeyError/TypeError/IndexError when the body is not of that format."""
    usage = body.get("usage") or {}
    if provider == "anthropic":
        tokens = dict(input_tokens=int(usage.get("input_tokens", 0)), output_tokens=int(usage.get("output_tokens", 0)))
        if body["stop_reason"] == "refusal":
            return Reply(None, refused=True, **tokens)
        return Reply("".join(block["text"] for block in body["content"] if block["type"] == "text"), **tokens)
    tokens = dict(input_tokens=int(usage.get("prompt_tokens", 0)), output_tokens=int(usage.get("completion_tokens", 0)))
    choice = body["choices"][0]
    message = choice["message"]
    if message.get("refusal") or choice.get("finish_reason") == "content_filter":
        return Reply(None, refused=True, **tokens)
    content = message["content"]
    if not isinstance(content, str):
        raise TypeError(f"message.content is {type(content).__name__}, not a string")
    return Reply(content, **tokens)


def retry_after_seconds(value: str | None) -> float | None:
    """The Retry-After header as seconds (a number, or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class _Transient(Exception):
    """A failure worth retrying; `wait` is the server's Retry-After, if it sent one."""

    def __init__(self, message: str, wait: float | None = None) -> None:
        super().__init__(message)
        self.wait = wait


class ApiCompleter:
    """A Completer over an LLM API (see the module docstring for the wire formats)."""

    def __init__(self, *, provider: str, model: str, base_url: str | None = None, api_key: str | None = None,
                 max_tokens: int = 300, temperature: float | None = 1.0, concurrency: int = 16, max_retries: int = 6,
                 timeout_s: float = 120.0, backoff_s: float = 1.0, max_backoff_s: float = 60.0) -> None:
        if provider not in PROVIDERS:
            raise ConfigError(f"config key 'explainer_provider' = {provider!r} is invalid: use one of {sorted(PROVIDERS)}")
        spec = PROVIDERS[provider]
        given_url = base_url or os.environ.get(spec.base_url_env)
        self.api_key = api_key or os.environ.get(spec.api_key_env) or None
        if self.api_key is None and not given_url:
            raise ConfigError(
                f"config key 'explainer_api_key' is not set and {spec.api_key_env} is empty: {spec.default_base_url} "
                f"needs a key; export {spec.api_key_env}=... (or set explainer_base_url for a server without keys)"
            )
        self.provider, self.model = provider, model
        self.url = (given_url or spec.default_base_url).rstrip("/") + spec.path
        self.max_tokens, self.temperature = max_tokens, temperature
        self.concurrency, self.max_retries, self.timeout_s = concurrency, max_retries, timeout_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._stop = threading.Event()

    def settings(self) -> dict[str, Any]:
        return {"provider": self.provider, "model": self.model, "max_tokens": self.max_tokens,
                "temperature": self.temperature}

    def complete(self, prompts: Sequence[str], on_reply: Callable[[int, Reply], None]) -> dict[int, str]:
        failures: dict[int, str] = {}
        self._stop.clear()
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="nla-explainer")
        futures: dict[Future, int] = {pool.submit(self._ask, prompt): i for i, prompt in enumerate(prompts)}
        try:
            for future in as_completed(futures):
                outcome = future.result()  # an ExplainerError (not retryable) propagates from here
                if isinstance(outcome, Reply):
                    on_reply(futures[future], outcome)
                else:
                    failures[futures[future]] = outcome
        except BaseException:
            self._stop.set()  # wakes threads sleeping in a backoff; queued requests are cancelled
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        return failures

    # --- one request, with retries -----------------------------------------------------------

    def _ask(self, prompt: str) -> Reply | str:
        """The reply, or a one-line reason why there is none after all retries."""
        body = json.dumps(request_body(model=self.model, prompt=prompt, max_tokens=self.max_tokens,
                                       temperature=self.temperature)).encode("utf-8")
        headers = request_headers(self.provider, self.api_key)
        for attempt in range(self.max_retries + 1):
            if self._stop.is_set():
                return "cancelled"
            try:
                return self._post(body, headers)
            except ExplainerError:
                self._stop.set()  # no other thread starts a request that cannot succeed either
                raise
            except _Transient as err:
                reason = f"{err} (after {attempt + 1} attempts)"
                if attempt == self.max_retries:
                    return reason
                backoff = self.backoff_s * 2**attempt * random.uniform(0.5, 1.0)
                wait = min(self.max_backoff_s, err.wait if err.wait is not None else backoff)
                if self._stop.wait(wait):
                    return reason
        raise AssertionError("unreachable: the loop returns on its last attempt")

    def _post(self, body: bytes, headers: Mapping[str, str]) -> Reply | str:
        request = urllib.request.Request(self.url, data=body, headers=dict(headers), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode("utf-8", "replace").replace("\n", " ")
            if err.code in RETRY_STATUSES:
                raise _Transient(f"HTTP {err.code} from {self.url}: {detail}",
                                 retry_after_seconds(err.headers.get("retry-after"))) from None
            raise ExplainerError(f"explainer: {self.provider} answered HTTP {err.code} to POST {self.url}: {detail}; "
                                 f"{self._fix_for(err.code)}") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
            reason = getattr(err, "reason", err)
            raise _Transient(f"no answer from {self.url}: {reason}") from None
        try:
            return parse_response(self.provider, json.loads(raw))
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            return f"malformed {self.provider} reply from {self.url} ({type(err).__name__}: {err}): {raw[:200]!r}"

    def _fix_for(self, status: int) -> str:
        spec = PROVIDERS[self.provider]
        if status in (401, 403):
            return f"check explainer_api_key / {spec.api_key_env}"
        if status == 404:
            return f"check explainer_base_url / {spec.base_url_env} and explainer_model = {self.model!r}"
        return f"check explainer_model = {self.model!r} and the explainer_* settings"
