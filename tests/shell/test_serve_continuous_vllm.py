"""`nla serve` continuous batching with engine=vllm, on CPU: the toy NLA's reader with its VLLMRolloutEngine over the
fake `vllm` of test_vllm_sleep.py, whose LLM's `llm_engine` is swapped for `FakeLLMEngine` below. Each job gets the rows
its own vLLM requests produced, whenever it joined; vLLM never holds more rows than the slots; a job cancelled while it
waits never reaches vLLM; a step that raises fails the jobs in flight, aborts them in vLLM, and the server goes on;
what reaches `add_request` is what `run_specs` hands `LLM.generate`. None of it runs vLLM itself."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import fixtures  # noqa: E402
from nla_shell import cli  # noqa: E402
from nla_shell.engines import vllm_steering as steer  # noqa: E402
from nla_shell.engines.base import RolloutRequest  # noqa: E402
from nla_shell.engines.vllm_stream import VLLMStream  # noqa: E402
from nla_shell.serving.app import build_app  # noqa: E402
from nla_shell.serving.batcher import Batcher  # noqa: E402
from nla_shell.serving.config import ServeConfig  # noqa: E402
from nla_shell.serving.continuous import stream_decoder  # noqa: E402
from nla_shell.serving.jobs import Decoding, Job  # noqa: E402
from nla_shell.serving.reader import load_reader  # noqa: E402
from serve_harness import running  # noqa: E402
from test_serve import serve_config  # noqa: E402
from test_vllm_sleep import install_fake_vllm  # noqa: E402

SLOTS = 4


def fake_tokens(code: int, sample: int, *, greedy: bool, max_tokens: int, eos: int,
                encode: Callable[[str], list[int]]) -> list[int]:
    """What the fake samples for a site whose vector starts with `code`: an explanation naming the site (greedy rows
    all alike, sampled rows by their sample index), padded by 0-3 words so that requests end after different steps,
    then EOS, cut at max_tokens."""
    name = f"g{code}" if greedy else f"s{code}.{sample}"
    pad = " x" * ((code + (0 if greedy else sample)) % 4)
    return (encode(f"<explanation>{name}{pad}</explanation>") + [eos])[:max_tokens]


@dataclass
class _Held:
    """A request the fake holds: what add_request got, each sample's tokens, the steps it has taken."""

    request_id: str
    prompt: dict
    params: SimpleNamespace
    tokens: list[list[int]]
    steps: int = 0


@dataclass
class FakeLLMEngine:
    """vLLM 0.24.0's LLMEngine as VLLMStream uses it, read in the 0.24.0 wheel (commit ee0da84ab):
    vllm/v1/engine/llm_engine.py `add_request(request_id: str, prompt, params, arrival_time=None, lora_request=None,
    tokenization_kwargs=None, trace_headers=None, priority=0, prompt_text=None) -> str` (the internal id: the given one
    plus 8 random characters, input_processor.py `assign_request_id`), `step() -> list[RequestOutput]`,
    `abort_request(request_ids: list[str], internal=False)`, `has_unfinished_requests()`.

    Each step generates one token of every sample held. RequestOutputs carry request_id (the id given to add_request:
    output_processor.py), prompt_token_ids, outputs (CompletionOutputs: index, token_ids, logprobs as one
    {token: Logprob} per step, finish_reason) and finished. With output_kind FINAL_ONLY a request returns once, with
    all n outputs, in the step its last sample ends; with the default (CUMULATIVE) each step returns one output per
    sample with that sample's completion only (parallel_sampling.py `get_outputs`). A step's outputs come newest
    request first, so that matching them by position would swap them. `on_step` runs at the start of each step;
    `fault` is raised by the next step."""

    eos: int
    encode: Callable[[str], list[int]]
    on_step: Callable[[], None] = lambda: None
    fault: BaseException | None = None
    held: dict[str, _Held] = field(default_factory=dict)
    added: list[_Held] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    most_rows: int = 0
    mid_decode_joins: int = 0
    """Requests added while another had already taken steps."""

    def add_request(self, request_id, prompt, params, arrival_time=None, lora_request=None, tokenization_kwargs=None,
                    trace_headers=None, priority=0, prompt_text=None) -> str:
        assert isinstance(request_id, str) and request_id not in self.held
        code = int(np.frombuffer(params.extra_args[steer.EXTRA_ARGS_KEY]["vector"], dtype="<f4")[0])
        tokens = [fake_tokens(code, i, greedy=params.temperature == 0.0, max_tokens=params.max_tokens, eos=self.eos,
                              encode=self.encode) for i in range(params.n)]
        self.mid_decode_joins += any(h.steps for h in self.held.values())
        self.held[request_id] = held = _Held(request_id, prompt, params, tokens)
        self.added.append(held)
        self.most_rows = max(self.most_rows, self.rows)
        return f"{request_id}-0a1b2c3d"

    @property
    def rows(self) -> int:
        return sum(h.params.n for h in self.held.values())

    def has_unfinished_requests(self) -> bool:
        return bool(self.held)

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        self.aborted += request_ids
        for request_id in request_ids:
            self.held.pop(request_id, None)

    def step(self) -> list[SimpleNamespace]:
        self.on_step()
        if self.fault is not None:
            fault, self.fault = self.fault, None
            raise fault
        outputs = []
        for held in reversed(list(self.held.values())):
            held.steps += 1
            done = [i for i, t in enumerate(held.tokens) if len(t) <= held.steps]
            finished = len(done) == len(held.tokens)
            if finished:
                del self.held[held.request_id]
            completions = [_completion(i, tokens[: held.steps], i in done) for i, tokens in enumerate(held.tokens)]
            if getattr(getattr(held.params, "output_kind", None), "name", "CUMULATIVE") == "FINAL_ONLY":
                groups = [completions] if finished else []
            else:
                groups = [[completion] for completion in completions]
            outputs += [SimpleNamespace(request_id=held.request_id, prompt_token_ids=held.prompt["prompt_token_ids"],
                                        finished=finished, outputs=group) for group in groups]
        return outputs


def _completion(index: int, tokens: list[int], done: bool) -> SimpleNamespace:
    return SimpleNamespace(index=index, token_ids=tokens, finish_reason="stop" if done else None,
                           logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in tokens])


@pytest.fixture(scope="module")
def vllm_reader(two_concept_nla, nla_run_inputs):
    """The toy NLA's reader with engine=vllm over the fake `vllm` (installed for this module's tests)."""
    with pytest.MonkeyPatch.context() as patch:
        install_fake_vllm(patch, [], None, fixtures.D_MODEL)
        cfg = serve_config(two_concept_nla, nla_run_inputs, engine="vllm")
        yield load_reader(cfg, model=cfg.model)


@pytest.fixture
def fake(vllm_reader, monkeypatch) -> FakeLLMEngine:
    """A fresh FakeLLMEngine as the reader's vLLM engine."""
    engine = FakeLLMEngine(eos=vllm_reader.engine.stop_token_ids[0],
                           encode=lambda text: vllm_reader.tokenizer.encode(text, add_special_tokens=False))
    monkeypatch.setattr(vllm_reader.engine.llm, "llm_engine", engine)
    return engine


def site_vectors(*codes: int) -> torch.Tensor:
    """[len(codes), D] vectors whose first number is the code the fake reads (the rest random)."""
    vectors = torch.randn(len(codes), fixtures.D_MODEL, generator=torch.Generator().manual_seed(sum(codes)))
    vectors[:, 0] = torch.tensor(codes, dtype=torch.float32)
    return vectors


def expected_raw(reader, codes, decoding: Decoding) -> list[list[str]]:
    """Per site, the texts of the rows the fake samples for it under `decoding`."""
    eos = reader.engine.stop_token_ids[0]
    return [[reader.engine.decode(fake_tokens(code, i, greedy=decoding.greedy, max_tokens=decoding.max_new_tokens,
                                              eos=eos, encode=lambda text: reader.tokenizer.encode(
                                                  text, add_special_tokens=False)))
             for i in range(decoding.samples)] for code in codes]


def test_jobs_joining_at_different_steps_get_their_own_rows_and_vllm_never_holds_more_than_the_slots(vllm_reader, fake):
    batcher = Batcher(vllm_reader, max_sites=SLOTS, wait_s=0.0, continuous=True, max_new_tokens=8)
    stream = batcher._scheduler.decoder
    assert isinstance(stream, VLLMStream)
    jobs = {  # codes: (decoding, submitted at this step)
        (1, 2): (Decoding(samples=1, greedy=True, max_new_tokens=8), 0),
        (3,): (Decoding(samples=2, greedy=False, max_new_tokens=3), 1),
        (4, 5, 6): (Decoding(samples=1, greedy=False, max_new_tokens=6), 1),
        (7,): (Decoding(samples=3, greedy=False, max_new_tokens=8), 3),
        (2, 8): (Decoding(samples=1, greedy=True, max_new_tokens=2), 4),
    }
    submitted: dict[tuple, Job] = {}
    steps, all_submitted, counts = [0], threading.Event(), []

    def submit_due() -> None:
        for codes, (decoding, at) in jobs.items():
            if at == steps[0]:
                submitted[codes] = Job(decoding, vectors=site_vectors(*codes))
                batcher.submit(submitted[codes])
        if len(submitted) == len(jobs):
            all_submitted.set()

    def on_step() -> None:  # in the worker, between vLLM's steps
        counts.append((stream.free, fake.rows))
        steps[0] += 1
        submit_due()

    fake.on_step = on_step
    try:
        submit_due()
        if not all_submitted.wait(timeout=30):
            pytest.fail(f"only {len(submitted)} jobs by step {steps[0]}; their failures: "
                        f"{[job.future.exception() for job in submitted.values() if job.future.done()]}")
        answers = {codes: job.future.result(timeout=60) for codes, job in submitted.items()}
    finally:
        batcher.close()
    for codes, sites in answers.items():
        assert [site.raw for site in sites] == expected_raw(vllm_reader, codes, jobs[codes][0]), codes
    # one vLLM request per site, in arrival order, n = its job's samples, with its job's max_new_tokens
    assert [(h.params.n, h.params.max_tokens) for h in fake.added] == [
        (decoding.samples, decoding.max_new_tokens) for codes, (decoding, _) in jobs.items() for _ in codes]
    # the stream's free slots are the rows vLLM does not hold, and vLLM held all the slots at times, never more
    assert all(0 <= free <= SLOTS and rows == SLOTS - free for free, rows in counts), counts
    assert fake.most_rows == SLOTS and fake.mid_decode_joins > 0
    assert fake.held == {} and stream.free == SLOTS and not stream.busy
    assert batcher.stats["jobs"] == len(jobs) and batcher.stats["sites"] == len(fake.added)


def test_run_specs_and_the_stream_hand_vllm_the_same_prompt_and_sampling_params(vllm_reader, fake, monkeypatch):
    engine = vllm_reader.engine
    request = RolloutRequest(vllm_reader.prompt, site_vectors(9)[0])
    for greedy, samples in ((True, 1), (False, 3)):
        generated = []

        def generate(prompts, params, **_):
            generated.append((prompts, params))
            return []

        monkeypatch.setattr(engine.llm, "generate", generate)
        monkeypatch.setattr(engine, "greedy", greedy)
        specs = engine.build_specs([request], group_size=samples, max_new_tokens=5)
        engine.run_specs(specs)
        stream = VLLMStream(engine, slots=SLOTS, max_new_tokens=8)
        stream.admit([request], keys=["k"], rows=samples, max_new_tokens=5, greedy=greedy)
        (([prompt], [params]),), added = generated, fake.added[-1]
        assert added.prompt == prompt and vars(added.params) == vars(params)
        assert params.output_kind.name == "FINAL_ONLY" and params.temperature == (0.0 if greedy else 1.0)
        assert (params.n, params.max_tokens, prompt["cache_salt"]) == (samples, 5, specs[0].cache_salt)
        stream.drop_all()


def test_a_job_cancelled_while_it_waits_for_slots_never_reaches_vllm(vllm_reader, fake):
    batcher = Batcher(vllm_reader, max_sites=2, wait_s=0.0, continuous=True, max_new_tokens=8)
    greedy = Decoding(samples=1, greedy=True, max_new_tokens=8)
    first, waiting, later = (Job(greedy, vectors=site_vectors(*codes)) for codes in ((1, 2), (3,), (4,)))
    cancelled = []

    def on_step() -> None:  # first holds both slots: waiting stays queued
        if not cancelled:
            batcher.submit(waiting)
            cancelled.append(waiting.future.cancel())
            batcher.submit(later)

    fake.on_step = on_step
    try:
        batcher.submit(first)
        assert [s.raw for s in first.future.result(timeout=60)] == expected_raw(vllm_reader, (1, 2), greedy)
        assert [s.raw for s in later.future.result(timeout=60)] == expected_raw(vllm_reader, (4,), greedy)
    finally:
        batcher.close()
    assert cancelled == [True] and batcher.stats["dropped_jobs"] == 1 and fake.most_rows == 2  # later waited too
    codes = [int(np.frombuffer(h.params.extra_args[steer.EXTRA_ARGS_KEY]["vector"], dtype="<f4")[0])
             for h in fake.added]
    assert codes == [1, 2, 4]


def test_a_step_that_raises_fails_the_requests_in_flight_aborts_them_and_the_server_goes_on(
        vllm_reader, fake, two_concept_nla, nla_run_inputs):
    app = build_app(vllm_reader, serve_config(two_concept_nla, nla_run_inputs, engine="vllm", max_batch=SLOTS,
                                              continuous_batching=True))
    stream = app.state.batcher._scheduler.decoder
    fake.fault = RuntimeError("the engine fell over")
    body = {"vectors": site_vectors(1, 2).tolist(), "greedy": True, "max_new_tokens": 16}
    with running(app) as url:
        failed = httpx.post(f"{url}/v1/explain_vectors", json=body, timeout=60)
        assert failed.status_code == 500
        assert failed.json()["error"]["message"] == "explaining failed: RuntimeError: the engine fell over"
        in_flight = [h.request_id for h in fake.added]
        assert len(in_flight) == 2 and fake.aborted == in_flight and not fake.has_unfinished_requests()
        served = httpx.post(f"{url}/v1/explain_vectors", json=body, timeout=60)
        assert served.status_code == 200, served.text
        assert [r["explanations"] for r in served.json()["results"]] == [["g1 x"], ["g2 x x"]]
    assert stream.free == stream.n_slots and len(fake.added) == 4


def test_continuous_batching_is_refused_on_engine_hf_in_one_line_and_taken_on_vllm(capsys):
    assert cli.main(["serve", "--av", "a", "--ar", "b", "--model", "m", "--continuous-batching", "engine=hf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config key 'continuous_batching'" in err and "engine=vllm" in err
    assert ServeConfig(av="a", ar="b", model="m", engine="vllm", continuous_batching=True).continuous_batching
    with pytest.raises(ValueError, match="^continuous_batching needs engine=native or engine=vllm, this reader's "
                                         "is hf$"):
        stream_decoder(SimpleNamespace(), slots=2, max_prompt_len=8, max_new_tokens=4, engine_name="hf")
