"""nla_shell.explainers: the API wire formats against a local mock server, retries, refusals,
malformed replies, the failure threshold, the reply cache (kill -9 and resume), the local HF
explainer, and datagen's explainer choice and sites-to-label mode."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

import fixtures
import upstream
from llm_server import API_KEY, API_SETTINGS, Answer, LLMServer, mock_reply, sample_sites, usage
from nla_core import extract_explanation
from nla_shell import cli
from nla_shell.explainers import ExplainerError, Site
from nla_shell.explainers.api import ApiCompleter, retry_after_seconds
from nla_shell.explainers.cache import Reply, ReplyCache
from nla_shell.explainers.llm import LLMExplainer
from nla_shell.explainers.prompt import INSTRUCTION, instruction_prompt
from nla_shell.io.config import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _explainer(server: LLMServer, provider: str, cache: Path, **overrides) -> LLMExplainer:
    base = server.url + ("/v1" if provider == "openai" else "")
    settings = dict(provider=provider, base_url=base, concurrency=3, **API_SETTINGS)
    threshold = overrides.pop("failure_threshold", 0.2)
    settings.update(overrides)
    return LLMExplainer(ApiCompleter(**settings), ReplyCache(cache), failure_threshold=threshold, progress=False)


def _expected(site: Site) -> str:
    return extract_explanation(mock_reply(instruction_prompt(site.context, site.token)))


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_both_wire_formats_label_every_site_and_a_rerun_is_free(tmp_path, provider):
    sites = sample_sites(7, repeat_first=True)
    with LLMServer() as server:
        explainer = _explainer(server, provider, tmp_path / "cache.jsonl")
        assert explainer.explain(sites) == [_expected(s) for s in sites]
        assert len(server.requests) == 7  # the repeated prompt is asked once
        request = server.requests[0]
        assert request.path == ("/v1/chat/completions" if provider == "openai" else "/v1/messages")
        assert {k: request.body[k] for k in ("model", "max_tokens", "temperature")} == {
            "model": "mock-model", "max_tokens": 77, "temperature": 0.5}
        assert request.body["messages"] == [{"role": "user", "content": request.prompt}]
        if provider == "anthropic":
            assert request.headers["anthropic-version"] == "2023-06-01"
        tally = explainer.tally
        assert (tally.sites, tally.labelled, tally.answered, tally.cached) == (8, 8, 7, 0)
        assert tally.input_tokens == sum(usage(r.prompt, mock_reply(r.prompt))[0] for r in server.requests)
        assert tally.output_tokens == 7 * usage("", mock_reply("x"))[1]
        explainer.finish()

        again = _explainer(server, provider, tmp_path / "cache.jsonl")
        assert again.explain(sites) == [_expected(s) for s in sites]
        assert len(server.requests) == 7 and again.tally.cached == 8
    summary = again.sidecar_summary()
    assert summary == {"model": "mock-model", "max_tokens": 77, "temperature": 0.5, "instruction_prompt": INSTRUCTION}


def test_a_null_temperature_is_left_out_of_the_request_and_is_its_own_cache_key(tmp_path):
    sites = sample_sites(2)
    with LLMServer() as server:
        _explainer(server, "anthropic", tmp_path / "cache.jsonl").explain(sites)
        explainer = _explainer(server, "anthropic", tmp_path / "cache.jsonl", temperature=None)
        assert explainer.explain(sites) == [_expected(s) for s in sites]
        assert len(server.requests) == 4 and "temperature" not in server.requests[-1].body


def test_rate_limits_and_server_errors_are_retried_honouring_retry_after(tmp_path):
    def script(prompt, attempt):
        return [Answer("status", status=429, retry_after="0.3"), Answer("status", status=503), Answer()][min(attempt, 2)]

    sites = sample_sites(4)
    with LLMServer(script) as server:
        explainer = _explainer(server, "openai", tmp_path / "cache.jsonl")
        assert explainer.explain(sites) == [_expected(s) for s in sites]
        for site in sites:
            times = [r.time for r in server.requests if r.prompt == instruction_prompt(site.context, site.token)]
            assert len(times) == 3
            assert times[1] - times[0] >= 0.3  # waited as told
    assert explainer.tally.failed == 0


def test_requests_that_keep_failing_are_counted_and_not_cached(tmp_path):
    sites = sample_sites(10)
    doomed = instruction_prompt(sites[3].context, sites[3].token)
    outage = [True]
    with LLMServer(lambda p, a: Answer("status", status=500, retry_after="0") if p == doomed and outage[0]
                   else Answer()) as server:
        explainer = _explainer(server, "anthropic", tmp_path / "cache.jsonl", max_retries=2)
        out = explainer.explain(sites)
        assert out[3] is None and None not in out[:3] + out[4:]
        assert server.count(doomed) == 3  # first try + 2 retries
        assert explainer.tally.failed == 1
        outage[0] = False
        rerun = _explainer(server, "anthropic", tmp_path / "cache.jsonl")
        assert rerun.explain(sites) == [_expected(s) for s in sites]
        assert server.count(doomed) == 4 and len(server.requests) == 9 + 4  # only the failed one is asked again


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_refusals_are_missing_rows_and_cached_as_answers(tmp_path, provider):
    sites = sample_sites(5)
    refused = instruction_prompt(sites[1].context, sites[1].token)
    with LLMServer(lambda p, a: Answer("refuse") if p == refused else Answer()) as server:
        explainer = _explainer(server, provider, tmp_path / "cache.jsonl")
        out = explainer.explain(sites)
        assert out[1] is None and all(out[i] == _expected(sites[i]) for i in (0, 2, 3, 4))
        assert (explainer.tally.refused, explainer.tally.failed, explainer.tally.labelled) == (1, 0, 4)
        _explainer(server, provider, tmp_path / "cache.jsonl").explain(sites)
        assert server.count(refused) == 1


def test_malformed_bodies_fail_and_replies_without_tags_are_unextractable(tmp_path, capsys):
    sites = sample_sites(10)
    prompts = [instruction_prompt(s.context, s.token) for s in sites]
    scripted = {prompts[0]: Answer("malformed"), prompts[1]: Answer(text="no tags at all"),
                prompts[2]: Answer(text="<explanation>cut off by max_tokens"),
                prompts[3]: Answer(text="<explanation>  </explanation>")}
    with LLMServer(lambda p, a: scripted.get(p, Answer())) as server:
        explainer = _explainer(server, "openai", tmp_path / "cache.jsonl")
        out = explainer.explain(sites)
        assert out[:4] == [None] * 4 and out[4:] == [_expected(s) for s in sites[4:]]
        assert server.count(prompts[0]) == 1  # a malformed body is not retried
    tally = explainer.tally
    assert (tally.failed, tally.unextractable, tally.labelled) == (1, 3, 6)
    explainer.finish()
    line = capsys.readouterr().out
    assert "1 failed, 3 unextractable" in line and "explainer_max_tokens" in line


def test_a_systemic_failure_rate_stops_the_run_and_keeps_what_was_answered(tmp_path):
    sites = sample_sites(10)
    down = {instruction_prompt(sites[i].context, sites[i].token) for i in (1, 3)}
    with LLMServer(lambda p, a: Answer("status", status=503, retry_after="0") if p in down else Answer()) as server:
        explainer = _explainer(server, "openai", tmp_path / "cache.jsonl", max_retries=1)
        with pytest.raises(ExplainerError, match=r"2 of 10 requests failed") as err:
            _explainer(server, "openai", tmp_path / "other.jsonl", max_retries=1, failure_threshold=0.1).explain(sites)
        assert "explainer_failure_threshold = 0.1" in str(err.value) and "resume" in str(err.value)
        assert len(ReplyCache(tmp_path / "other.jsonl")) == 8
        assert explainer.explain(sites).count(None) == 2  # 20 % is not over the default 0.2


def test_a_bad_key_stops_at_once_naming_the_setting(tmp_path):
    with LLMServer() as server:
        explainer = _explainer(server, "openai", tmp_path / "cache.jsonl", api_key="wrong")
        with pytest.raises(ExplainerError, match="HTTP 401.*OPENAI_API_KEY"):
            explainer.explain(sample_sites(6))
        assert len(server.requests) <= 3  # the in-flight ones; nothing retried, the rest cancelled


def test_a_missing_key_is_refused_before_any_request(monkeypatch):
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="'explainer_api_key'.*ANTHROPIC_API_KEY"):
        ApiCompleter(provider="anthropic", model="m")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "from-env")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9/")
    completer = ApiCompleter(provider="anthropic", model="m")
    assert (completer.api_key, completer.url) == ("from-env", "http://127.0.0.1:9/v1/messages")


def test_datagen_without_a_key_is_refused_before_writing(tmp_path, tiny_av_dir, capsys, monkeypatch):
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl", n_docs=4)
    assert cli.main(_datagen_argv(tiny_av_dir, corpus, tmp_path / "out", "explainer=api", "explainer_model=m")) == 2
    assert "'explainer_api_key' is not set and OPENAI_API_KEY is empty" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert cli.main(_datagen_argv(tiny_av_dir, corpus, tmp_path / "out", "explainer=api")) == 2
    assert "'explainer_model'" in capsys.readouterr().err


def test_retry_after_reads_seconds_and_http_dates():
    assert retry_after_seconds("2.5") == 2.5 and retry_after_seconds(None) is None
    assert retry_after_seconds("soon") is None
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 <= retry_after_seconds(date) <= 31


def test_the_cache_drops_a_line_torn_by_a_kill(tmp_path):
    path = tmp_path / "cache.jsonl"
    cache = ReplyCache(path)
    cache.put("a", Reply("<explanation>x</explanation>", input_tokens=3, output_tokens=2))
    cache.put("b", Reply(None, refused=True))
    with path.open("a") as f:
        f.write('{"key": "c", "text": "half a li')
    cache = ReplyCache(path)
    assert set(cache.replies) == {"a", "b"} and cache.get("b").refused
    cache.put("d", Reply("y"))
    assert set(ReplyCache(path).replies) == {"a", "b", "d"}
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="explainer_cache.*line 1"):
        ReplyCache(path)


KILL_SCRIPT = """
from llm_server import API_SETTINGS, sample_sites
from nla_shell.explainers.api import ApiCompleter
from nla_shell.explainers.cache import ReplyCache
from nla_shell.explainers.llm import LLMExplainer
completer = ApiCompleter(provider="openai", base_url={url!r}, concurrency=2, **API_SETTINGS)
LLMExplainer(completer, ReplyCache({cache!r}), progress=False).explain(sample_sites(12))
"""


def test_kill_9_mid_run_then_resume_asks_only_for_what_is_not_cached(tmp_path):
    cache = tmp_path / "cache.jsonl"
    answered = 5
    killed = [False]
    with LLMServer(lambda p, a: Answer("hang") if not killed[0] and len(server.requests) > answered else Answer()) as server:
        script = KILL_SCRIPT.format(url=server.url + "/v1", cache=str(cache))
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path,
                                env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"})
        try:
            deadline = time.monotonic() + 60
            while not (cache.exists() and cache.read_text().count("\n") >= answered):
                assert proc.poll() is None and time.monotonic() < deadline, "the labelling run ended or stalled"
                time.sleep(0.05)
            time.sleep(0.2)  # the two hung requests are in flight
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            killed[0] = True
        first_run = list(server.requests)
        assert len(first_run) == answered + 2
        cached = ReplyCache(cache)
        assert len(cached) == answered

        sites = sample_sites(12)
        explainer = _explainer(server, "openai", cache)
        assert explainer.explain(sites) == [_expected(s) for s in sites]
        resumed = server.requests[len(first_run):]
        answered_prompts = {r.prompt for r in first_run[:answered]}
        assert len(resumed) == 12 - answered  # every uncached prompt once, no cached one again
        assert not answered_prompts & {r.prompt for r in resumed}
        assert explainer.tally.cached == answered


def test_local_explainer_on_a_tiny_hf_model(tmp_path, tiny_av_dir):
    from nla_shell.explainers.local import LocalCompleter

    sites = sample_sites(3, repeat_first=True)

    def make():
        completer = LocalCompleter(model=str(tiny_av_dir), max_tokens=12, temperature=1.0, device="cpu", seed=3)
        return LLMExplainer(completer, ReplyCache(tmp_path / "cache.jsonl"), progress=False)

    explainer = make()
    out = explainer.explain(sites)
    tally = explainer.tally
    assert tally.labelled + tally.unextractable == 4 and tally.failed == tally.refused == 0
    assert sum(o is not None for o in out) == tally.labelled
    assert out[0] == out[3]  # one prompt, one reply
    replies = ReplyCache(tmp_path / "cache.jsonl").replies
    assert len(replies) == 3 and all(0 < r.output_tokens <= 12 and r.input_tokens > 0 for r in replies.values())
    for reply, explanation in zip(replies.values(), out):
        assert explanation == (extract_explanation(reply.text) or None)

    rerun = make()
    assert rerun.explain(sites) == out and rerun.tally.cached == 4
    assert rerun.completer._lm is None  # answered from the cache without loading the model
    with pytest.raises(ConfigError, match="'explainer_model'"):
        LocalCompleter(model=str(tmp_path / "no_such_model"))


# --------------------------------------------------------------------------- datagen


def _datagen_argv(model: Path, corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["datagen", "--model", str(model), "--corpus", str(corpus), "--layer", str(fixtures.LAYER_INDEX),
            "--out-dir", str(out), "device=cpu", "progress=false", "positions_per_doc=2", "batch_size=4", *extra]


def test_datagen_labels_with_an_api_and_records_api_summaries(tmp_path, tiny_av_dir):
    from transformers import AutoTokenizer

    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl", n_docs=12)
    tokenizer = AutoTokenizer.from_pretrained(tiny_av_dir)
    token_ids = {d["id"]: tokenizer.encode(d["text"], add_special_tokens=False)
                 for d in map(json.loads, corpus.read_text().splitlines())}
    with LLMServer() as server:
        api = ["explainer=api", "explainer_provider=anthropic", "explainer_model=mock-model",
               f"explainer_base_url={server.url}", f"explainer_api_key={API_KEY}", "explainer_batch_size=5"]
        assert cli.main(_datagen_argv(tiny_av_dir, corpus, tmp_path / "out", *api)) == 0
        requests = len(server.requests)
        for split in ("av_sft", "ar_sft", "eval"):
            for row in pq.read_table(tmp_path / "out" / f"{split}.parquet").to_pylist():
                token = tokenizer.decode([token_ids[row["doc_id"]][row["position"]]])
                assert row["explanation"] == extract_explanation(mock_reply(instruction_prompt(row["context"], token)))
                if split != "ar_sft":
                    assert row["response"] == upstream.wrap_explanation(row["explanation"])
            text = (tmp_path / "out" / f"{split}.parquet.nla_meta.yaml").read_text()
            upstream.deserialize_dataset_sidecar(text)  # upstream's reader builds NLAApiSummaryMeta from it
            assert yaml.safe_load(text)["api_summaries"] == {
                "model": "mock-model", "max_tokens": 300, "temperature": 1.0, "instruction_prompt": INSTRUCTION}
            assert API_KEY not in text
        assert "api_summaries" not in yaml.safe_load((tmp_path / "out" / "rl.parquet.nla_meta.yaml").read_text())
        assert requests == sum(pq.ParquetFile(tmp_path / "out" / f"{s}.parquet").metadata.num_rows
                               for s in ("av_sft", "ar_sft", "eval"))
        # The same settings again (overwrite): every reply comes from the cache.
        assert cli.main(_datagen_argv(tiny_av_dir, corpus, tmp_path / "out", *api, "overwrite=true")) == 0
        assert len(server.requests) == requests


def test_datagen_stops_on_a_systemic_api_failure_with_one_line_and_no_datasets(tmp_path, tiny_av_dir, capsys):
    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl", n_docs=8)
    with LLMServer(lambda p, a: Answer("status", status=500, retry_after="0")) as server:
        argv = _datagen_argv(tiny_av_dir, corpus, tmp_path / "out", "explainer=api", "explainer_model=m",
                             f"explainer_base_url={server.url}/v1", f"explainer_api_key={API_KEY}",
                             "explainer_max_retries=1")
        assert cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(err) == 1 and err[0].startswith("nla datagen: error: explainer: ")
    assert "requests failed after retries" in err[0] and "explainer_failure_threshold" in err[0]
    assert not list((tmp_path / "out").glob("*.parquet"))


def test_the_explainer_must_be_chosen_and_the_rule_refuses_real_text(tmp_path, tiny_av_dir, capsys):
    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl", n_docs=8)
    assert cli.main(_datagen_argv(tiny_av_dir, corpus, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "'explainer'" in err and "api" in err and "write_sites" in err
    assert not (tmp_path / "out").exists()

    english = tmp_path / "english.jsonl"
    english.write_text("".join(json.dumps({"id": f"e{i}", "text": f"Researchers measured {i} samples of river "
                                           "water, reporting their findings in a journal."}) + "\n" for i in range(8)))
    assert cli.main(_datagen_argv(tiny_av_dir, english, tmp_path / "out", "explainer=rule")) == 2
    assert "labels the toy language only" in capsys.readouterr().err
    assert not list((tmp_path / "out").glob("*.parquet"))


def test_sites_to_label_round_trip_through_the_jsonl_explainer(tmp_path, tiny_av_dir, capsys):
    from transformers import AutoTokenizer

    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl", n_docs=12)
    sites_file = tmp_path / "to_label.jsonl"
    assert cli.main(_datagen_argv(tiny_av_dir, corpus, tmp_path / "out", f"write_sites={sites_file}")) == 0
    assert str(sites_file) in capsys.readouterr().out
    assert not (tmp_path / "out").exists()  # only the sites file is written
    sites = [json.loads(line) for line in sites_file.read_text().splitlines()]
    assert sites and {s["split"] for s in sites} == {"av_sft", "ar_sft", "eval"}
    tokenizer = AutoTokenizer.from_pretrained(tiny_av_dir)
    texts = {json.loads(line)["id"]: json.loads(line)["text"] for line in corpus.read_text().splitlines()}
    for site in sites:  # `position` indexes the document's token ids; context and token are that prefix and token
        ids = tokenizer.encode(texts[site["doc_id"]], add_special_tokens=False)
        assert site["context"] == tokenizer.decode(ids[: site["position"] + 1])
        assert site["token"] == tokenizer.decode([ids[site["position"]]])

    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text("".join(json.dumps({**s, "explanation": f"label {s['doc_id']}@{s['position']}"}) + "\n"
                                for s in sites))
    argv = _datagen_argv(tiny_av_dir, corpus, tmp_path / "out", "explainer=jsonl", f"explanations={labelled}")
    assert cli.main(argv) == 0
    rows = [r for split in ("av_sft", "ar_sft", "eval")
            for r in pq.read_table(tmp_path / "out" / f"{split}.parquet").to_pylist()]
    assert sorted((r["doc_id"], r["position"]) for r in rows) == sorted((s["doc_id"], s["position"]) for s in sites)
    assert all(r["explanation"] == f"label {r['doc_id']}@{r['position']}" for r in rows)
    # Writing the sites again would lose labels added in place: refused unless overwrite.
    assert cli.main(_datagen_argv(tiny_av_dir, corpus, tmp_path / "o2", f"write_sites={labelled}")) == 2
    assert "'write_sites'" in capsys.readouterr().err and "explanation" in labelled.read_text()


def test_the_sites_pass_refuses_the_injection_char_the_labelled_run_would_refuse(tmp_path, tiny_av_dir, capsys):
    """Both passes choose the marker with one function on the same documents: no sites for a doomed run."""
    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl", n_docs=12, extra=["the cat § sat"])
    sites_file = tmp_path / "to_label.jsonl"
    argv = _datagen_argv(tiny_av_dir, corpus, tmp_path / "out", f"write_sites={sites_file}", "injection_char=§")
    assert cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "injection_char: '§' occurs in the corpus" in err[0]
    assert not sites_file.exists() and not (tmp_path / "out").exists()
    # Unset, both passes name the same automatic choice.
    assert cli.main(_datagen_argv(tiny_av_dir, corpus, tmp_path / "out", f"write_sites={sites_file}")) == 0
    chosen = capsys.readouterr().out.split("(injection char ")[1][1]
    assert chosen != "§"
