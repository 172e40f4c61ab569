"""`nla serve` on the two-concept toy NLA: a real uvicorn server on a free 127.0.0.1 port, a real HTTP client."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import nla_core  # noqa: E402
from nla_shell import cli  # noqa: E402
from nla_shell.serving.explain import ExplainConfig, explain  # noqa: E402
from nla_shell.serving.app import build_app  # noqa: E402
from nla_shell.serving.reader import load_reader  # noqa: E402
from nla_shell.serving.server import ServeConfig  # noqa: E402
from serve_harness import LOOPBACK, running  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TEXT = "the red cat sees a dog ."


def serve_config(two_concept_nla, nla_run_inputs, **overrides) -> ServeConfig:
    av, ar, _ = two_concept_nla
    settings = dict(av=str(av), ar=str(ar), model=str(nla_run_inputs[0]), max_sites=16, max_text_chars=200,
                    max_new_tokens=8, max_new_tokens_limit=16, max_samples=3, batch_wait_ms=20, device="cpu")
    settings.update(overrides)
    return ServeConfig(**settings)


@pytest.fixture(scope="module")
def reader(two_concept_nla, nla_run_inputs):
    cfg = serve_config(two_concept_nla, nla_run_inputs)
    return load_reader(cfg, model=cfg.model)


@pytest.fixture(scope="module")
def eval_vectors(two_concept_nla) -> torch.Tensor:
    rows = pq.read_table(two_concept_nla[2], columns=["activation_vector"]).to_pylist()
    return torch.tensor([r["activation_vector"] for r in rows], dtype=torch.float32)


@pytest.fixture(scope="module")
def server(reader, two_concept_nla, nla_run_inputs):
    app = build_app(reader, serve_config(two_concept_nla, nla_run_inputs))
    with running(app) as url:
        yield url, app


def test_health_and_info(server):
    url, _ = server
    assert httpx.get(f"{url}/v1/health").json() == {"status": "ok"}
    info = httpx.get(f"{url}/v1/info").json()
    assert (info["d_model"], info["layer"], info["engine"]) == (64, 1, "hf")
    assert info["marker"] == "§" and info["limits"]["max_sites"] == 16 and info["fve_baseline"] > 0
    schema = httpx.get(f"{url}/openapi.json").json()
    assert {"/v1/explain", "/v1/explain_vectors", "/v1/health", "/v1/info"} <= set(schema["paths"])


def test_explain_a_text_as_the_command_line_does(server, two_concept_nla, nla_run_inputs):
    url, _ = server
    answer = httpx.post(f"{url}/v1/explain", json={"text": TEXT, "all": True, "greedy": True}, timeout=60)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    av, ar, _ = two_concept_nla
    offline = explain(ExplainConfig(av=str(av), ar=str(ar), model=str(nla_run_inputs[0]), text=TEXT, all=True,
                                    greedy=True, max_new_tokens=8, device="cpu"))
    assert body["text_tokens"] == len(offline)
    assert [(r["position"], r["token"], r["explanation"], r["short_context"]) for r in body["results"]] == [
        (r["position"], r["token"], r["explanation"], r["short_context"]) for r in offline]
    assert [r["mse"] for r in body["results"]] == pytest.approx([r["mse"] for r in offline], rel=1e-5)
    last = httpx.post(f"{url}/v1/explain", json={"text": TEXT, "positions": [-1, 0], "samples": 3}, timeout=60).json()
    assert [r["position"] for r in last["results"]] == [len(offline) - 1, 0]
    assert all(len(r["explanations"]) == 3 for r in last["results"])


def test_explain_vectors_returns_the_concept_and_its_reconstruction(server, reader, eval_vectors):
    url, _ = server
    vectors = eval_vectors[:4]
    body = httpx.post(f"{url}/v1/explain_vectors", json={"vectors": vectors.tolist(), "greedy": True}, timeout=60)
    assert body.status_code == 200, body.text
    results = body.json()["results"]
    assert [r["explanation"] for r in results] == ["cat", "river", "cat", "river"]
    for vector, result in zip(vectors, results):
        reconstruction = torch.tensor(result["reconstruction"])
        assert reconstruction.shape == (64,)
        mse = nla_core.reconstruction_mse(reconstruction[None], vector[None], scale=reader.mse_scale)
        assert float(mse) == pytest.approx(result["mse"], rel=1e-4)
        assert result["fve"] == pytest.approx(1 - result["mse"] / reader.rawvar)


def b64(vector) -> str:
    """A vector as the base64 form: little-endian float32 bytes."""
    return base64.b64encode(torch.as_tensor(vector, dtype=torch.float32).numpy().astype("<f4").tobytes()).decode()


def from_b64(text: str) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype="<f4").copy())


def test_the_reconstruction_is_the_scoring_pass_s_one_ar_forward_per_batch(server, reader, eval_vectors, monkeypatch):
    """The AR runs once per batch (scoring); the returned reconstruction equals a separate reconstruct pass."""
    import nla_shell.training.scoring as scoring  # the reader's AR passes run through scoring.ar_predictions

    url, _ = server
    calls = []
    original = scoring.ar_predict

    def counted(*args, **kwargs):
        calls.append(len(args[1]))
        return original(*args, **kwargs)

    monkeypatch.setattr(scoring, "ar_predict", counted)
    vectors = eval_vectors[:4]
    body = httpx.post(f"{url}/v1/explain_vectors", json={"vectors": vectors.tolist(), "samples": 2}, timeout=60)
    assert body.status_code == 200, body.text
    assert len(calls) == 1 and calls[0] <= 8  # one AR forward over the 4 x 2 explanations, none after it
    monkeypatch.undo()
    results = body.json()["results"]
    offline = reader.explain(vectors, samples=1, greedy=True, max_new_tokens=8)
    from nla_shell.serving.reader import SiteExplanation

    kept = [SiteExplanation(explanations=[r["explanation"]], raw=[""], mses=[r["mse"]], best=0, fve=None,
                            reconstruction=None, generated_tokens=0) for r in results]
    for result, again in zip(results, reader.reconstruct(kept)):
        assert torch.allclose(torch.tensor(result["reconstruction"]), again.reconstruction, atol=1e-5)
    for site, again in zip(offline, reader.reconstruct(offline)):  # explain's own reconstruction, offline
        assert torch.allclose(site.reconstruction, again.reconstruction, atol=1e-5)


def test_a_padded_engine_call_explains_the_sites_as_an_unpadded_one(reader, eval_vectors):
    """reader.explain(pad_to=...) (the server's batches on a CUDA-graph engine): the extra prompts are generated and
    dropped; the sites' explanations and scores are those of the unpadded call."""
    vectors = eval_vectors[:3]
    alone = reader.explain(vectors, samples=1, greedy=True, max_new_tokens=8)
    padded = reader.explain(vectors, samples=1, greedy=True, max_new_tokens=8, pad_to=8)
    assert len(padded) == 3
    assert [s.explanations for s in padded] == [s.explanations for s in alone]
    assert [s.mse for s in padded] == pytest.approx([s.mse for s in alone], rel=1e-5)


def test_base64_vectors_and_reconstructions_match_the_float_lists(server, eval_vectors):
    url, _ = server
    vectors = torch.cat([eval_vectors[:3], torch.randn(2, 64, generator=torch.Generator().manual_seed(1))])
    floats = httpx.post(f"{url}/v1/explain_vectors", json={"vectors": vectors.tolist(), "greedy": True}, timeout=60)
    packed = httpx.post(f"{url}/v1/explain_vectors", timeout=60, json={
        "vectors": [b64(v) for v in vectors], "greedy": True, "encoding_format": "base64"})
    assert floats.status_code == 200 and packed.status_code == 200, packed.text
    for f, p in zip(floats.json()["results"], packed.json()["results"], strict=True):
        assert (p["explanation"], p["explanations"]) == (f["explanation"], f["explanations"])
        assert p["mse"] == pytest.approx(f["mse"], rel=1e-5)
        assert isinstance(p["reconstruction"], str)
        assert torch.allclose(from_b64(p["reconstruction"]), torch.tensor(f["reconstruction"]), atol=1e-5)
    explicit = httpx.post(f"{url}/v1/explain_vectors", timeout=60, json={
        "vectors": vectors[:1].tolist(), "greedy": True, "encoding_format": "float"})
    assert explicit.json()["results"][0]["reconstruction"] == pytest.approx(  # a batch of 1: padding differs
        floats.json()["results"][0]["reconstruction"], abs=1e-5)


B64_NAN = b64([0.0] * 5 + [float("nan")] + [0.0] * 58)
B64_INF = b64([float("-inf")] + [0.0] * 63)
NAN_BODY = '{"vectors": [[NaN' + ", 0.0" * 63 + "]]}"
INF_BODY = '{"vectors": [[0.0, Infinity' + ", 0.0" * 62 + "]]}"
BAD_INPUTS = [
    ("/v1/explain_vectors", {"vectors": [[0.0] * 64, [0.0] * 63]}, 422, "vectors[1]", "has 63 numbers; d_model is 64"),
    ("/v1/explain_vectors", NAN_BODY, 422, "vectors[0][0]", "finite number"),
    ("/v1/explain_vectors", INF_BODY, 422, "vectors[0][1]", "finite number"),
    ("/v1/explain_vectors", '{"vectors": [[0.0,', 400, "body", "malformed JSON"),
    ("/v1/explain_vectors", {"vectors": [[0.0] * 64, [1e39] + [0.0] * 63]}, 422, "vectors[1]", "overflows float32"),
    ("/v1/explain_vectors", {"vectors": [["0.5"] + [0.0] * 63]}, 422, "vectors[0][0]", "valid number"),
    ("/v1/explain_vectors", {"vectors": []}, 422, "vectors", "no vectors"),
    ("/v1/explain_vectors", {"vectors": [[0.0] * 64] * 17}, 422, "vectors", "the limit is 16"),
    ("/v1/explain_vectors", {"vectors": [[0.0] * 64], "temperature": 0}, 422, "temperature", "unknown field"),
    ("/v1/explain_vectors", [[0.0] * 64], 422, "body", "valid dictionary"),
    ("/v1/explain_vectors", {"vectors": [b64([0.0] * 64), b64([0.0] * 63)], "encoding_format": "base64"}, 422,
     "vectors[1]", "decodes to 252 bytes"),
    ("/v1/explain_vectors", {"vectors": ["not base64!"], "encoding_format": "base64"}, 422, "vectors[0]",
     "is not base64"),
    ("/v1/explain_vectors", {"vectors": [b64([0.0] * 64)[:-1]], "encoding_format": "base64"}, 422, "vectors[0]",
     "is not base64"),
    ("/v1/explain_vectors", {"vectors": [b64([0.0] * 64), B64_NAN], "encoding_format": "base64"}, 422,
     "vectors[1][5]", "finite number"),
    ("/v1/explain_vectors", {"vectors": [B64_INF], "encoding_format": "base64"}, 422, "vectors[0][0]", "finite number"),
    ("/v1/explain_vectors", {"vectors": [[0.0] * 64], "encoding_format": "base64"}, 422, "vectors[0]", "valid string"),
    ("/v1/explain_vectors", {"vectors": [b64([0.0] * 64)]}, 422, "vectors[0]", "valid list"),
    ("/v1/explain_vectors", {"vectors": [[0.0] * 64], "encoding_format": "hex"}, 422, "encoding_format", "'base64'"),
    ("/v1/explain_vectors", {"vectors": [b64([0.0] * 64)] * 17, "encoding_format": "base64"}, 422, "vectors",
     "the limit is 16"),
    ("/v1/explain", {}, 422, "text", "Field required"),
    ("/v1/explain", {"text": "a" * 201}, 422, "text", "the limit is 200"),
    ("/v1/explain", {"text": TEXT, "max_new_tokens": 999}, 422, "max_new_tokens", "outside 1..16"),
    ("/v1/explain", {"text": TEXT, "samples": 9}, 422, "samples", "outside 1..3"),
    ("/v1/explain", {"text": TEXT, "samples": 2, "greedy": True}, 422, "samples", "greedy"),
    ("/v1/explain", {"text": TEXT, "positions": [0, 99]}, 422, "positions[1]", "outside the text's"),
    ("/v1/explain", {"text": TEXT, "positions": [0], "all": True}, 422, "all", "exclude each other"),
    ("/v1/explain", {"text": TEXT, "greedy": "yes"}, 422, "greedy", "valid boolean"),
    ("/v1/explain", {"text": "", "all": True}, 422, "text", "no tokens"),
    ("/v1/explain", "", 400, "body", "malformed JSON"),  # an empty body is malformed JSON, not a missing field
    ("/v1/explain", "[" * 100_000 + "]" * 100_000, 400, "body", "malformed JSON"),
    ("/v1/explain_vectors", '{"vectors": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, "body", "malformed JSON"),
]


@pytest.mark.parametrize(("path", "body", "status", "field", "message"), BAD_INPUTS,
                         ids=[f"{p}-{f}-{s}" for p, _, s, f, _ in BAD_INPUTS])
def test_bad_input_is_a_4xx_naming_the_field_and_the_server_keeps_serving(server, path, body, status, field, message):
    url, _ = server
    if isinstance(body, str):
        answer = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
    else:
        answer = httpx.post(f"{url}{path}", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["field"] == field and message in error["message"], error
    assert httpx.post(f"{url}/v1/explain", json={"text": TEXT, "greedy": True}, timeout=60).status_code == 200


def test_a_failure_while_explaining_is_a_500_and_the_next_request_is_served(server, reader, monkeypatch):
    url, _ = server

    def broken(*args, **kwargs):
        raise RuntimeError("the engine fell over")

    monkeypatch.setattr(reader, "explain", broken)
    answer = httpx.post(f"{url}/v1/explain", json={"text": TEXT, "greedy": True}, timeout=60)
    assert answer.status_code == 500
    assert answer.json()["error"]["message"] == "explaining failed: RuntimeError: the engine fell over"
    monkeypatch.undo()
    assert httpx.post(f"{url}/v1/explain", json={"text": TEXT, "greedy": True}, timeout=60).status_code == 200


def test_the_docs_commands_parse_and_their_client_example_runs(reader, two_concept_nla, nla_run_inputs, tmp_path,
                                                              capsys):
    import re
    import runpy
    import shlex

    docs = (REPO / "docs" / "serving.md").read_text()
    commands = [shlex.split(line)[1:] for block in re.findall(r"```bash\n(.*?)```", docs, re.DOTALL)
                for line in block.splitlines() if line.startswith("nla ")]
    assert [c[0] for c in commands] == ["explain", "explain", "explain", "serve"]
    for argv in commands:
        parser, _ = cli.build_parser(argv)
        parser.parse_args(argv)  # exits (SystemExit) on an unknown flag
    (client,) = re.findall(r"```python\n(.*?)```", docs, re.DOTALL)
    script = tmp_path / "client.py"
    with running(build_app(reader, serve_config(two_concept_nla, nla_run_inputs, max_sites=256))) as url:
        script.write_text(client.replace('URL = "http://127.0.0.1:8000"', f'URL = "{url}"'))
        runpy.run_path(str(script))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 2 and lines[0].startswith("0 ")


def test_a_bearer_token_refuses_other_callers(reader, two_concept_nla, nla_run_inputs, monkeypatch):
    monkeypatch.setenv("NLA_API_KEY", "from-the-env")
    assert serve_config(two_concept_nla, nla_run_inputs).resolved_api_key() == "from-the-env"
    app = build_app(reader, serve_config(two_concept_nla, nla_run_inputs, api_key="s3cret"))
    with running(app) as url:
        assert httpx.get(f"{url}/v1/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer from-the-env"}, {"Authorization": "s3cret"}):
            answer = httpx.get(f"{url}/v1/info", headers=headers)
            assert answer.status_code == 401 and answer.json()["error"]["field"] == "Authorization"
            assert answer.headers["www-authenticate"] == "Bearer"
            refused = httpx.post(f"{url}/v1/explain_vectors", headers=headers, json={"vectors": [[0.0] * 63]})
            assert refused.status_code == 401  # the token is checked before the body
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{url}/v1/info", headers=good).status_code == 200
        assert httpx.post(f"{url}/v1/explain", headers=good, json={"text": TEXT}, timeout=60).status_code == 200


CLIENTS, REQUESTS_PER_CLIENT, TIME_CAP_S = 16, 20, 240


def test_concurrent_clients_are_batched_and_each_answered_once_as_an_unbatched_greedy_call(
        reader, eval_vectors, two_concept_nla, nla_run_inputs):
    """16 clients x 20 greedy requests of one vector each, under a fixed time cap: every request is
    answered once, with the explanation the reader gives that vector alone; p50/p99 latency printed."""
    noise = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 3
    vectors = torch.cat([eval_vectors, noise])
    alone = [reader.explain(v[None], samples=1, greedy=True, max_new_tokens=8)[0].explanation for v in vectors]
    app = build_app(reader, serve_config(two_concept_nla, nla_run_inputs))
    latencies: list[float] = []
    answers: dict[tuple[int, int], str | None] = {}

    async def client(index: int, http) -> None:
        for j in range(REQUESTS_PER_CLIENT):
            which = (index * REQUESTS_PER_CLIENT + j) % len(vectors)
            start = time.perf_counter()
            answer = await http.post("/v1/explain_vectors", json={"vectors": [vectors[which].tolist()],
                                                                  "greedy": True})
            latencies.append(time.perf_counter() - start)
            assert answer.status_code == 200, answer.text
            assert (index, j) not in answers
            answers[(index, j)] = answer.json()["results"][0]["explanation"]

    async def load(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=TIME_CAP_S) as http:
            await asyncio.wait_for(asyncio.gather(*(client(i, http) for i in range(CLIENTS))), TIME_CAP_S)

    with running(app) as url:
        wall = time.perf_counter()
        asyncio.run(load(url))
        wall = time.perf_counter() - wall
        stats = dict(app.state.batcher.stats)
    total = CLIENTS * REQUESTS_PER_CLIENT
    assert len(answers) == total and stats["jobs"] == total and stats["sites"] == total
    for (index, j), explanation in answers.items():
        assert explanation == alone[(index * REQUESTS_PER_CLIENT + j) % len(vectors)]
    assert stats["largest_batch_sites"] > 1 and stats["batches"] < total  # requests were batched together
    p50, p99 = statistics.quantiles(latencies, n=100)[49] * 1000, statistics.quantiles(latencies, n=100)[98] * 1000
    print(f"\n[load] {total} requests from {CLIENTS} clients in {wall:.1f} s ({total / wall:.1f} req/s): "
          f"p50 {p50:.0f} ms, p99 {p99:.0f} ms; {stats['batches']} engine batches, largest "
          f"{stats['largest_batch_sites']} sites")


FLOOD_CLIENTS, FLOOD_REQUESTS, FLOOD_CAP_S = 32, 3, 120


def test_a_flood_is_answered_with_503s_nothing_hangs_and_served_answers_are_unchanged(
        reader, eval_vectors, two_concept_nla, nla_run_inputs):
    """32 clients x 3 greedy requests at once against a queue of 4: every request answered within the cap, each a 200
    with the explanation an unbatched call gives or a 503 with Retry-After; the server healthy and serving after."""
    alone = [reader.explain(v[None], samples=1, greedy=True, max_new_tokens=8)[0].explanation for v in eval_vectors]
    app = build_app(reader, serve_config(two_concept_nla, nla_run_inputs, max_batch=4, max_queue=4,
                                         request_timeout_s=FLOOD_CAP_S))
    answers: dict[tuple[int, int], tuple[int, str | None]] = {}

    async def client(index: int, http) -> None:
        for j in range(FLOOD_REQUESTS):
            which = (index * FLOOD_REQUESTS + j) % len(eval_vectors)
            answer = await http.post("/v1/explain_vectors", json={"vectors": [eval_vectors[which].tolist()],
                                                                  "greedy": True})
            if answer.status_code == 503:
                assert answer.headers["retry-after"] == "1" and answer.json()["error"]["field"] is None
                answers[(index, j)] = (503, None)
            else:
                assert answer.status_code == 200, answer.text
                answers[(index, j)] = (200, answer.json()["results"][0]["explanation"])

    async def flood(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=FLOOD_CAP_S) as http:
            await asyncio.wait_for(asyncio.gather(*(client(i, http) for i in range(FLOOD_CLIENTS))), FLOOD_CAP_S)

    with running(app) as url:
        asyncio.run(flood(url))
        assert httpx.get(f"{url}/v1/health").json() == {"status": "ok"}
        after = httpx.post(f"{url}/v1/explain_vectors", json={"vectors": [eval_vectors[0].tolist()], "greedy": True},
                           timeout=60)
        assert after.status_code == 200 and after.json()["results"][0]["explanation"] == alone[0]
        batching = httpx.get(f"{url}/v1/info").json()["batching"]
    served = {key: text for key, (status, text) in answers.items() if status == 200}
    assert len(answers) == FLOOD_CLIENTS * FLOOD_REQUESTS  # every request answered, none left hanging
    assert 0 < len(served) < len(answers) and batching["refused_jobs"] == len(answers) - len(served)
    for (index, j), text in served.items():
        assert text == alone[(index * FLOOD_REQUESTS + j) % len(eval_vectors)]
    assert batching["jobs"] == len(served) + 1 and batching["waiting"] == 0 and batching["dropped_jobs"] == 0


def test_nla_serve_runs_on_a_free_loopback_port_and_stops_on_ctrl_c(two_concept_nla, nla_run_inputs):
    av, ar, _ = two_concept_nla
    argv = [sys.executable, "-m", "nla_shell.cli", "serve", "--av", str(av), "--ar", str(ar), "--model",
            str(nla_run_inputs[0]), "--port", "0", "--api-key", "k", "device=cpu"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline()
        if not line.startswith(f"[nla serve] listening on http://{LOOPBACK}:"):
            proc.kill()  # before reading stderr: a live server never closes it
            pytest.fail(f"first line {line!r}; stderr: {proc.communicate(timeout=30)[1]}")
        url = line.split()[4]
        assert "bearer token required" in line
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/v1/health").status_code == 200:
                    break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(f"{url}/v1/info", headers={"Authorization": "Bearer k"}).json()["d_model"] == 64
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert proc.returncode in (0, 130)


def test_serve_without_the_extra_says_how_to_install_it(two_concept_nla, nla_run_inputs, monkeypatch, capsys):
    av, ar, _ = two_concept_nla
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if FastAPI were not installed
    assert cli.main(["serve", "--av", str(av), "--ar", str(ar), "--model", str(nla_run_inputs[0]), "device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'nla[serve]'" in err


def test_serve_settings_are_checked(capsys):
    for argv, key in ((["--port", "70000"], "port"), (["--max-new-tokens", "300"], "max_new_tokens"),
                      (["--max-sites", "0"], "max_sites")):
        assert cli.main(["serve", "--av", "a", "--ar", "b", "--model", "m", *argv]) == 2
        assert f"config key '{key}'" in capsys.readouterr().err
    assert ServeConfig(av="a", ar="b", model="m").host == LOOPBACK  # this machine only, unless asked
