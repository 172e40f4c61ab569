"""What `nla serve` checks before an endpoint reads a byte of the body: the token, the body's size, room to queue.

`Guard` is plain ASGI middleware around the FastAPI app (OWASP's API rules: authenticate
before parsing, cap body sizes). On every path but the open ones (`/v1/health`) it checks
`Authorization: Bearer KEY` from the headers alone (401, the body unread); a POST is refused
503 with Retry-After when the server has no room to queue it (`busy`); then it reads the body
into memory up to `max_body_bytes`, answering 413 at once for a larger `Content-Length` or as
soon as a streamed (chunked) body grows past the cap, the rest unread. The endpoint gets the
body as read. Every refusal has the server's one JSON shape (`error_response`).
"""

from __future__ import annotations

import hmac
from typing import Any, Awaitable, Callable, Mapping

from starlette.responses import JSONResponse

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/v1/health"})
"""Paths answered without the bearer token."""
RETRY_AFTER_S = 1
"""Retry-After of a 503 (no room to queue): a batch takes about this long on a GPU."""


def error_response(status: int, field: str | None, message: str,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """`{"error": {"field": ..., "message": ...}}` with the status (401 adds WWW-Authenticate: Bearer)."""
    headers = {**({"WWW-Authenticate": "Bearer"} if status == 401 else {}), **(headers or {})}
    return JSONResponse({"error": {"field": field, "message": message}}, status_code=status, headers=headers or None)


def busy_response(reason: str) -> JSONResponse:
    """503 with Retry-After: the server has no room for the request now."""
    return error_response(503, None, f"the server is busy: {reason}; retry after {RETRY_AFTER_S} s",
                          {"Retry-After": str(RETRY_AFTER_S)})


class BodyTooLarge(Exception):
    """The body is past the cap: answered 413."""


class Guard:
    """ASGI middleware: the bearer token, room to queue a POST (`busy`: why there is none, or None), then the body
    read up to `max_body_bytes`, before the app runs."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 busy: Callable[[], str | None] = lambda: None) -> None:
        self.app, self.api_key, self.max_body_bytes, self.busy = app, api_key, max_body_bytes, busy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = (self._unauthorized(scope["path"], headers) or self._declared_too_large(headers)
                   or self._no_room(scope["method"]))
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        try:
            body = await self._read_body(receive)
        except BodyTooLarge as err:
            await error_response(413, "body", str(err))(scope, receive, send)
            return
        if body is not None:  # None: the client left while sending it
            await self.app(scope, replay(body, receive), send)

    def _unauthorized(self, path: str, headers: Mapping[str, str]) -> JSONResponse | None:
        if self.api_key is None or path in OPEN_PATHS:
            return None
        sent = headers.get("authorization", "")
        if hmac.compare_digest(sent.encode(), f"Bearer {self.api_key}".encode()):
            return None
        return error_response(401, "Authorization", "send the header 'Authorization: Bearer <api key>'")

    def _no_room(self, method: str) -> JSONResponse | None:
        reason = self.busy() if method == "POST" else None
        return None if reason is None else busy_response(reason)

    def _declared_too_large(self, headers: Mapping[str, str]) -> JSONResponse | None:
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return error_response(413, "body", self._too_large(f"Content-Length is {int(declared)} bytes"))
        return None

    def _too_large(self, what: str) -> str:
        return (f"{what}; the limit is {self.max_body_bytes} bytes (max_body_mb): send fewer vectors per request, "
                "or encoding_format=\"base64\"")

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body (None if the client left), or BodyTooLarge as soon as it grows past the cap (the rest
        unread)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge(self._too_large(f"the body passed {self.max_body_bytes} bytes"))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body already read, then the server's own messages (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
