"""`nla serve` under hostile and heavy traffic, as a client meets it (status, headers, time to answer, the server
healthy after): the app of `nla serve` on a stand-in reader, a real uvicorn server on a free 127.0.0.1 port."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from nla_shell.serving.app import build_app  # noqa: E402
from nla_shell.serving.config import ServeConfig  # noqa: E402
from serve_harness import Crash, StandInReader, running, vector  # noqa: E402


def config(**overrides) -> ServeConfig:
    settings = dict(av="av", ar="ar", model="lm", max_sites=16, batch_wait_ms=0, batch_max_wait_ms=0)
    return ServeConfig(**{**settings, **overrides})


def raw_request(url: str, head: str, body: bytes = b"", *, chunks: int = 0, chunk: bytes = b"") -> tuple[bytes, float]:
    """Send a request's head (and some of its body) on a raw socket; the server's answer and the seconds it took,
    read without ever finishing the body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(head.encode() + body)
        for _ in range(chunks):
            try:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            except OSError:  # the server answered and closed: the rest is not read
                break
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        return answer, time.monotonic() - start


@contextlib.contextmanager
def gated(**overrides):
    """(reader, app, client, pool): the app on a stand-in whose engine waits for its gate (opened at the end at the
    latest), an HTTP client, and threads to send requests that wait."""
    reader = StandInReader()
    reader.gate.clear()
    app = build_app(reader, config(**overrides))
    try:
        with running(app) as url, httpx.Client(base_url=url, timeout=30) as http, \
                concurrent.futures.ThreadPoolExecutor(4) as pool:
            try:
                yield reader, app, http, pool
            finally:
                reader.gate.set()  # before the pool's threads are joined
    finally:
        reader.gate.set()


def until_waiting(app, n: int) -> None:
    """Returns once n requests (not cancelled) wait in the batcher's queue (10 s at most)."""
    deadline = time.monotonic() + 10
    while app.state.batcher.waiting < n:
        assert time.monotonic() < deadline, f"{app.state.batcher.waiting} requests waiting, not {n}"
        time.sleep(0.01)


def post(http, first: float):
    return http.post("/v1/explain_vectors", json={"vectors": [vector(first)]})


def status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_body_past_the_cap_is_413_before_the_rest_is_read():
    app = build_app(StandInReader(), config(max_body_mb=0.1))
    with running(app) as url:
        head = ("POST /v1/explain_vectors HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 200000000\r\n\r\n")
        answer, seconds = raw_request(url, head, b'{"vectors": [[')  # 200 MB declared, 14 bytes sent
        status, error = status_and_error(answer)
        assert (status, error["field"]) == (413, "body") and seconds < 5
        assert "Content-Length is 200000000 bytes; the limit is 100000 bytes (max_body_mb)" in error["message"]
        chunked = ("POST /v1/explain_vectors HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   "Transfer-Encoding: chunked\r\n\r\n")
        answer, seconds = raw_request(url, chunked, chunks=40, chunk=b" " * 10_000)  # never the last chunk
        status, error = status_and_error(answer)
        assert status == 413 and "the body passed 100000 bytes" in error["message"] and seconds < 5
        small = httpx.post(f"{url}/v1/explain_vectors", json={"vectors": [vector(1.0)], "greedy": True})
        assert small.status_code == 200 and small.json()["results"][0]["explanation"] == "site 1"


def test_the_token_is_checked_before_the_body_on_every_endpoint_but_health():
    app = build_app(StandInReader(), config(api_key="s3cret"))
    with running(app) as url:
        assert httpx.get(f"{url}/v1/health").status_code == 200
        for method, path in (("GET", "/v1/info"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such"),
                             ("POST", "/v1/explain"), ("POST", "/v1/explain_vectors")):
            answer = httpx.request(method, f"{url}{path}", content=b"{not json")
            assert answer.status_code == 401, (path, answer.text)  # not 400: the body was not parsed
            assert answer.json()["error"]["field"] == "Authorization" and answer.headers["www-authenticate"] == "Bearer"
        head = ("POST /v1/explain_vectors HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 50000000\r\n\r\n")
        answer, seconds = raw_request(url, head, b"{")  # 50 MB declared: refused on the headers alone
        assert status_and_error(answer)[0] == 401 and seconds < 5
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{url}/openapi.json", headers=good).status_code == 200
        assert httpx.get(f"{url}/docs", headers=good).status_code == 200


def test_unknown_paths_and_methods_answer_in_the_error_shape():
    with running(build_app(StandInReader(), config())) as url:
        missing = httpx.get(f"{url}/v1/explane")
        assert missing.status_code == 404
        assert missing.json() == {"error": {"field": None, "message": "no endpoint /v1/explane; see GET /openapi.json "
                                                                       "for the endpoints"}}
        wrong = httpx.get(f"{url}/v1/explain")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert wrong.json()["error"]["message"] == "GET is not allowed on /v1/explain"


def test_a_text_without_positions_or_all_explains_its_last_token_only():
    with running(build_app(StandInReader(), config())) as url:
        answer = httpx.post(f"{url}/v1/explain", json={"text": "one two three"})
        assert answer.status_code == 200
        assert [(r["position"], r["token"]) for r in answer.json()["results"]] == [(2, "three")]


def test_a_full_queue_is_503_with_retry_after_at_once_and_the_queued_are_served():
    with gated(max_batch=1, max_queue=2) as (reader, app, http, pool):
        held = [pool.submit(post, http, 0.0)]
        assert reader.entered.wait(timeout=10)  # in the engine: no longer waiting
        held += [pool.submit(post, http, float(i)) for i in (1, 2)]
        until_waiting(app, 2)
        start = time.monotonic()
        refused = post(http, 9.0)
        assert time.monotonic() - start < 2
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "2 requests are waiting (the limit, max_queue)" in refused.json()["error"]["message"]
        head = ("POST /v1/explain_vectors HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 20000000\r\n\r\n")
        answer, seconds = raw_request(str(http.base_url).rstrip("/"), head, b"{")  # refused before its 20 MB
        assert status_and_error(answer)[0] == 503 and b"retry-after: 1" in answer.lower() and seconds < 5
        assert app.state.batcher.stats["refused_jobs"] == 2
        reader.gate.set()
        answers = [f.result(timeout=30) for f in held]
        assert [a.json()["results"][0]["explanation"] for a in answers] == ["site 0", "site 1", "site 2"]
        assert 9.0 not in reader.seen and http.get("/v1/health").status_code == 200


def test_a_request_not_answered_in_time_is_504_and_the_server_goes_on():
    """An engine that hangs: the request held gets 504 after request_timeout_s, one waiting behind it too and its
    site is dropped (never explained); health answers meanwhile; once the engine is back, requests are served."""
    with gated(max_batch=1, request_timeout_s=1.0) as (reader, app, http, pool):
        start = time.monotonic()
        hung = pool.submit(post, http, 1.0)
        assert reader.entered.wait(timeout=10)
        behind = pool.submit(post, http, 2.0)
        assert http.get("/v1/health").status_code == 200  # while the engine hangs
        for answer in (hung.result(timeout=30), behind.result(timeout=30)):
            assert answer.status_code == 504
            assert "not answered within 1 s (request_timeout_s)" in answer.json()["error"]["message"]
        assert time.monotonic() - start < 10
        reader.gate.set()
        served = post(http, 3.0)
        assert served.status_code == 200 and served.json()["results"][0]["explanation"] == "site 3"
        assert reader.seen == [1.0, 3.0]  # the timed-out request that never started was dropped
        assert http.get("/v1/info").json()["batching"]["dropped_jobs"] == 1


def test_a_client_that_disconnects_is_dropped_before_the_engine_and_fails_no_one():
    with gated(max_batch=1) as (reader, app, http, pool):
        first = pool.submit(post, http, 1.0)
        assert reader.entered.wait(timeout=10)
        body = json.dumps({"vectors": [vector(2.0)]}).encode()
        host, port = str(http.base_url).removeprefix("http://").rstrip("/").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # sends, then leaves
            sock.sendall(f"POST /v1/explain_vectors HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            until_waiting(app, 1)
        deadline = time.monotonic() + 10
        while app.state.batcher.waiting:  # the server notices the closed connection and cancels the waiting job
            assert time.monotonic() < deadline, "the left client's job was not cancelled"
            time.sleep(0.01)
        third = pool.submit(post, http, 3.0)
        reader.gate.set()
        assert first.result(timeout=30).json()["results"][0]["explanation"] == "site 1"
        assert third.result(timeout=30).json()["results"][0]["explanation"] == "site 3"
        assert reader.seen == [1.0, 3.0]
        assert http.get("/v1/info").json()["batching"]["dropped_jobs"] == 1


def test_a_worker_that_dies_is_a_500_and_the_next_request_is_served():
    reader = StandInReader(fault=Crash("gone"))
    with running(build_app(reader, config())) as url:
        answer = httpx.post(f"{url}/v1/explain_vectors", json={"vectors": [vector(1.0)]}, timeout=30)
        assert answer.status_code == 500
        assert answer.json()["error"]["message"] == "explaining failed: WorkerDied: the worker stopped on Crash: gone"
        assert httpx.post(f"{url}/v1/explain_vectors", json={"vectors": [vector(2.0)]}, timeout=30).status_code == 200
        assert httpx.get(f"{url}/v1/info").json()["batching"]["worker_restarts"] == 1
