"""`nla serve` with continuous_batching (engine=native) on the two-concept toy NLA, on CPU: a real uvicorn server on a
free loopback port. Under concurrent clients its greedy answers are those of the batched path (the key off); an
engine that raises fails the requests in flight and the server goes on; a job cancelled while it waits for slots
never reaches the engine; a worker that dies fails only what it held; the key is refused on engine=hf
(engine=vllm: test_serve_continuous_vllm.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from nla_shell import cli  # noqa: E402
from nla_shell.serving.app import build_app  # noqa: E402
from nla_shell.serving.batcher import Batcher, WorkerDied  # noqa: E402
from nla_shell.serving.jobs import Decoding, Job  # noqa: E402
from nla_shell.serving.reader import load_reader  # noqa: E402
from serve_harness import Crash, running  # noqa: E402
from test_serve import TEXT, eval_vectors, serve_config  # noqa: E402, F401 - eval_vectors: a fixture

CLIENTS, REQUESTS_PER_CLIENT, TIME_CAP_S = 6, 5, 240


@pytest.fixture(scope="module")
def native_reader(two_concept_nla, nla_run_inputs):
    cfg = serve_config(two_concept_nla, nla_run_inputs, engine="native")
    return load_reader(cfg, model=cfg.model)


def request(index: int, vectors: torch.Tensor) -> tuple[str, dict]:
    """Request `index` of the load: 1-3 vectors, or the text; max_new_tokens 8 or 5 (rows of different lengths)."""
    new = 8 if index % 3 else 5
    if index % 7 == 3:
        return "/v1/explain", {"text": TEXT, "positions": [index % 5, -1], "greedy": True, "max_new_tokens": new}
    rows = [vectors[(index + k) % len(vectors)].tolist() for k in range(1 + index % 3)]
    return "/v1/explain_vectors", {"vectors": rows, "greedy": True, "max_new_tokens": new}


def answers_under_load(app, vectors: torch.Tensor) -> tuple[dict[int, list], dict]:
    """CLIENTS concurrent clients, REQUESTS_PER_CLIENT requests each: {request index: [(explanation, mse)]}, and
    the batching counters after."""
    answers: dict[int, list] = {}

    async def client(index: int, http) -> None:
        for j in range(REQUESTS_PER_CLIENT):
            which = index * REQUESTS_PER_CLIENT + j
            path, body = request(which, vectors)
            answer = await http.post(path, json=body)
            assert answer.status_code == 200, answer.text
            answers[which] = [(r["explanation"], r["mse"]) for r in answer.json()["results"]]

    async def load(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=TIME_CAP_S) as http:
            await asyncio.wait_for(asyncio.gather(*(client(i, http) for i in range(CLIENTS))), TIME_CAP_S)

    with running(app) as url:
        asyncio.run(load(url))
        batching = httpx.get(f"{url}/v1/info").json()["batching"]
    return answers, batching


def test_concurrent_greedy_answers_equal_the_batched_path_s(native_reader, eval_vectors, two_concept_nla,
                                                            nla_run_inputs):
    noise = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    vectors = torch.cat([eval_vectors, noise])
    batched, _ = answers_under_load(build_app(native_reader, serve_config(two_concept_nla, nla_run_inputs,
                                                                          engine="native")), vectors)
    start = time.perf_counter()
    continuous, batching = answers_under_load(build_app(native_reader, serve_config(
        two_concept_nla, nla_run_inputs, engine="native", max_batch=4, continuous_batching=True)), vectors)
    elapsed = time.perf_counter() - start
    print(f"\n[continuous] {len(continuous)} requests in {elapsed:.1f} s; {batching}")
    # The worker's phases are disjoint stretches of its time: each ran, and together they fit in the wall time.
    phases = [batching[key] for key in ("idle_s", "admit_s", "step_s", "answer_s")]
    assert min(phases) > 0 and sum(phases) <= elapsed, batching
    assert len(continuous) == CLIENTS * REQUESTS_PER_CLIENT == len(batched)
    for index, sites in batched.items():
        assert [text for text, _ in continuous[index]] == [text for text, _ in sites], index
        assert [mse for _, mse in continuous[index]] == pytest.approx([mse for _, mse in sites], rel=1e-4)
    assert batching["continuous"] and batching["jobs"] == len(continuous) and batching["waiting"] == 0
    assert batching["sites"] == sum(len(sites) for sites in continuous.values())
    # all 4 slots held at once, and the sites shared decode steps (one after another they take up to 7 each)
    assert batching["largest_batch_sites"] == 4 and batching["decode_steps"] < batching["sites"] * 7


def test_an_engine_that_raises_fails_the_requests_in_flight_and_the_server_goes_on(
        native_reader, eval_vectors, two_concept_nla, nla_run_inputs, monkeypatch):
    app = build_app(native_reader, serve_config(two_concept_nla, nla_run_inputs, engine="native",
                                                continuous_batching=True))
    decoder = app.state.batcher._scheduler.decoder
    original = decoder.step

    def broken(*args, **kwargs):
        monkeypatch.setattr(decoder, "step", original)  # once
        raise RuntimeError("the engine fell over")

    monkeypatch.setattr(decoder, "step", broken)
    body = {"vectors": eval_vectors[:2].tolist(), "greedy": True}
    with running(app) as url:
        failed = httpx.post(f"{url}/v1/explain_vectors", json=body, timeout=60)
        assert failed.status_code == 500
        assert failed.json()["error"]["message"] == "explaining failed: RuntimeError: the engine fell over"
        served = httpx.post(f"{url}/v1/explain_vectors", json=body, timeout=60)
        assert served.status_code == 200 and [r["explanation"] for r in served.json()["results"]] == [
            s.explanation for s in native_reader.explain(eval_vectors[:2], samples=1, greedy=True, max_new_tokens=8)]
    assert decoder.free == decoder.n_slots


def test_continuous_batching_off_the_native_engine_is_refused_in_one_line(capsys):
    assert cli.main(["serve", "--av", "a", "--ar", "b", "--model", "m", "--continuous-batching"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config key 'continuous_batching'" in err and "engine=native" in err
    assert cli.main(["serve", "--av", "a", "--ar", "b", "--model", "m", "--continuous-batching", "engine=native",
                     "max_batch=2", "max_samples=3"]) == 2
    assert "config key 'max_samples'" in capsys.readouterr().err


@pytest.fixture
def gated(native_reader, monkeypatch):
    """A continuous batcher (2 slots) on the toy NLA whose decode steps wait for `gate` (opened after the test at the
    latest); `entered` is set at the first step, `admitted` lists the sites of every admission."""
    batcher = Batcher(native_reader, max_sites=2, wait_s=0.0, continuous=True, max_new_tokens=8)
    decoder = batcher._scheduler.decoder
    gate, entered, admitted = threading.Event(), threading.Event(), []
    step, admit = decoder.step, decoder.admit

    def gated_step(*args, **kwargs):
        entered.set()
        assert gate.wait(timeout=30), "the test never opened the gate"
        return step(*args, **kwargs)

    def recorded_admit(requests, **kwargs):
        admitted.append(len(requests))
        return admit(requests, **kwargs)

    monkeypatch.setattr(decoder, "step", gated_step)
    monkeypatch.setattr(decoder, "admit", recorded_admit)
    yield batcher, gate, entered, admitted
    gate.set()
    batcher.close()


def vectors_job(vectors: torch.Tensor) -> Job:
    return Job(Decoding(samples=1, greedy=True, max_new_tokens=8), vectors=vectors)


def test_a_job_cancelled_while_it_waits_for_slots_never_reaches_the_engine(gated, native_reader, eval_vectors):
    batcher, gate, entered, admitted = gated
    running = vectors_job(eval_vectors[:2])  # both slots
    batcher.submit(running)
    assert entered.wait(timeout=30)
    waiting, later = vectors_job(eval_vectors[2:3]), vectors_job(eval_vectors[3:4])
    batcher.submit(waiting)
    assert waiting.future.cancel() and batcher.waiting == 0  # no slot was free: it had not started
    batcher.submit(later)
    gate.set()
    answered = running.future.result(timeout=30), later.future.result(timeout=30)
    # The reference decode runs once the worker is done: the engine is not shared across threads mid-decode.
    alone = native_reader.explain(eval_vectors[:4], samples=1, greedy=True, max_new_tokens=8)
    assert [s.explanation for s in answered[0]] == [s.explanation for s in alone[:2]]
    assert [s.explanation for s in answered[1]] == [alone[3].explanation]
    assert admitted == [2, 1] and batcher.stats["dropped_jobs"] == 1 and batcher.stats["jobs"] == 2


def test_a_worker_that_dies_mid_decode_fails_the_jobs_it_held_and_a_new_worker_serves_the_next(
        gated, native_reader, eval_vectors, monkeypatch):
    batcher, gate, entered, _ = gated
    decoder = batcher._scheduler.decoder
    step = decoder.step

    def crash(*args, **kwargs):
        monkeypatch.setattr(decoder, "step", step)  # once
        raise Crash("the engine's thread state is gone")

    monkeypatch.setattr(decoder, "step", crash)
    gate.set()
    held = batcher.submit(vectors_job(eval_vectors[:2]))
    with pytest.raises(WorkerDied, match="the worker stopped on Crash: the engine's thread state is gone"):
        held.result(timeout=30)
    served = batcher.submit(vectors_job(eval_vectors[:1])).result(timeout=30)
    alone = native_reader.explain(eval_vectors[:1], samples=1, greedy=True, max_new_tokens=8)
    assert [s.explanation for s in served] == [alone[0].explanation] and batcher.stats["worker_restarts"] == 1
    assert decoder.free == decoder.n_slots
