"""`nla serve`: a trained NLA behind an HTTP JSON API (FastAPI + uvicorn, the optional extra `nla[serve]`).

The endpoints (nla_shell.serving.app): POST /v1/explain (a text's positions), POST
/v1/explain_vectors (activations captured elsewhere), GET /v1/health, GET /v1/info, and the
OpenAPI schema at /openapi.json (browsable at /docs). Concurrent requests are batched into
the engine by one worker thread (nla_shell.serving.batcher). The server binds 127.0.0.1 by
default: reachable from this machine only.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from nla_shell.io.config import normalize_fields, require
from nla_shell.serving.reader import ReaderSettings

INSTALL_HINT = "nla serve needs FastAPI and uvicorn, which are not installed: pip install 'nla[serve]'"
API_KEY_ENV = "NLA_API_KEY"
"""Environment variable read for the bearer token when api_key is not given."""


@dataclass(frozen=True, kw_only=True)
class ServeConfig(ReaderSettings):
    """Settings of `nla serve`."""

    model: str
    """Target LM whose activations /v1/explain reads (HF checkpoint dir with tokenizer)."""
    host: str = "127.0.0.1"
    """Address to bind: 127.0.0.1 serves this machine only; anything wider exposes the models (set api_key)."""
    port: int = 8000
    """TCP port; 0 picks a free one (printed at start-up)."""
    api_key: str | None = None
    """Bearer token every request but GET /v1/health must send (Authorization: Bearer KEY); None reads
    $NLA_API_KEY; unset there too: no token asked."""
    max_batch: int = 64
    """Most sites (positions or vectors, before samples) explained in one engine call."""
    batch_wait_ms: float = 5.0
    """How long the worker waits for more requests to join a batch once one is waiting."""
    max_sites: int = 256
    """Most sites one request may ask for (positions of a text, or vectors)."""
    max_text_chars: int = 20000
    """Longest text /v1/explain accepts, in characters."""
    max_text_tokens: int = 2048
    """Longest text /v1/explain accepts, in target-LM tokens."""
    max_new_tokens: int = 64
    """Explanation length when a request gives none, in tokens."""
    max_new_tokens_limit: int = 256
    """Largest max_new_tokens a request may ask for."""
    max_samples: int = 8
    """Largest samples (explanations per site, best-of-k) a request may ask for."""

    def __post_init__(self) -> None:
        normalize_fields(self)
        for key in ("max_batch", "max_sites", "max_text_chars", "max_text_tokens", "max_new_tokens",
                    "max_new_tokens_limit", "max_samples"):
            require(getattr(self, key) >= 1, key, getattr(self, key), "use an integer >= 1")
        require(0 <= self.port <= 65535, "port", self.port, "use a TCP port 0..65535 (0: a free one)")
        require(self.batch_wait_ms >= 0, "batch_wait_ms", self.batch_wait_ms, "use milliseconds >= 0")
        require(self.max_new_tokens <= self.max_new_tokens_limit, "max_new_tokens", self.max_new_tokens,
                f"use at most max_new_tokens_limit = {self.max_new_tokens_limit}")
        require(self.api_key is None or self.api_key.strip() != "", "api_key", self.api_key,
                "give a non-empty token, or leave it unset")

    def resolved_api_key(self) -> str | None:
        """The bearer token: api_key, else $NLA_API_KEY, else None (no token asked)."""
        return self.api_key if self.api_key is not None else (os.environ.get(API_KEY_ENV) or None)


def require_serve_extra() -> None:
    """An ImportError with the one-line install hint when FastAPI or uvicorn is missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL_HINT) from None


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 takes a free one (read it with getsockname)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(f"config key 'port' = {port}: cannot listen on {host}:{port} ({err.strerror}); choose another "
                      "port, or port=0 for a free one") from None
    sock.listen(128)
    return sock


def uvicorn_server(app, *, log_level: str = "warning"):
    """A uvicorn Server for `app` (run it with .run(sockets=[bind(...)]); stop it with should_exit = True)."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5))


def serve(cfg: ServeConfig) -> None:
    """Load the NLA, bind cfg.host:cfg.port, and serve until interrupted."""
    require_serve_extra()
    from nla_shell.serving.app import build_app
    from nla_shell.serving.reader import load_reader

    reader = load_reader(cfg, model=cfg.model, max_batch=cfg.max_batch * cfg.max_samples)
    app = build_app(reader, cfg)
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    token = "bearer token required" if cfg.resolved_api_key() else "no token"
    print(f"[nla serve] listening on http://{host}:{port} (engine {cfg.engine}, {token}); POST /v1/explain, "
          f"/v1/explain_vectors; GET /v1/health, /v1/info; OpenAPI at /docs", flush=True)
    try:
        uvicorn_server(app).run(sockets=[sock])
    finally:
        app.state.batcher.close()
        sock.close()
