"""`nla serve`: a trained NLA behind an HTTP JSON API (FastAPI + uvicorn, the optional extra `nla[serve]`).

The endpoints (nla_shell.serving.app): POST /v1/explain (a text's positions), POST
/v1/explain_vectors (activations captured elsewhere), GET /v1/health, GET /v1/info, and the
OpenAPI schema at /openapi.json (browsable at /docs). Concurrent requests are batched into
the engine by one worker thread (nla_shell.serving.batcher). The server binds 127.0.0.1 by
default: reachable from this machine only.
"""

from __future__ import annotations

import socket

from nla_shell.serving.config import ServeConfig

__all__ = ["ServeConfig", "bind", "require_serve_extra", "serve", "uvicorn_server"]

INSTALL_HINT = "nla serve needs FastAPI and uvicorn, which are not installed: pip install 'nla[serve]'"


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
