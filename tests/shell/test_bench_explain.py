"""bench/bench_explain.py's CPU smoke mode (tiny random run, hf and native, server leg with hf): every engine
explains every site at a positive rate, with --close-explanations the AR scores every site (its time reported
apart from generation), and the server answers every site exactly once at each client count, beside the corpus
rate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]


def test_explain_bench_times_every_engine_and_the_server_answers_each_site_once(tmp_path):
    out = tmp_path / "explain.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_explain.py"), "--tiny", "--make-8b",
                    str(tmp_path / "run"), "--sites", "10", "--close-explanations", "--clients", "2,3",
                    "--out", str(out)], check=True, capture_output=True, text=True, timeout=300)
    record = json.loads(out.read_text())
    assert record["errors"] == []
    offline = {c["engine"]: c for c in record["cases"] if c["mode"] == "offline"}
    assert set(offline) == {"hf", "native"}
    for case in offline.values():
        assert case["sites"] == 10 and case["sites_per_s"] > 0 and case["tokens_per_s"] > 0
        assert 0 < case["mean_generated_tokens"] <= 8
        assert case["closed_explanations"] and case["scored"] == case["explained"] == 10  # the AR read every site
        assert case["closed_by_bench"] > 0 and case["mean_explanation_tokens"] >= 0.5 * case["mean_generated_tokens"]
        assert 0 < case["generate_s"] < case["seconds"] and case["score_s"] > 0
    (corpus,) = [c for c in record["cases"] if c["mode"] == "corpus"]
    assert corpus["sites"] == 10 and corpus["sites_per_s"] > 0
    servers = [c for c in record["cases"] if c["mode"] == "server"]
    assert [s["clients"] for s in servers] == [2, 3]
    for server in servers:
        assert server["engine"] == "hf" and server["failed_requests"] == []
        assert server["sites_answered"] == 10 and server["failed_requests"] == []
        assert server["batcher"]["sites"] == 10 and server["requests"] == 5  # 10 sites, 2 vectors a request
        assert server["sites_per_s"] > 0 and server["p99_ms"] >= server["p50_ms"] > 0
        assert server["server_over_corpus"] == pytest.approx(server["sites_per_s"] / corpus["sites_per_s"])
    assert "x hf" in record["table"] and "server/3" in record["table"]


def test_explain_bench_server_leg_with_base64_vectors(tmp_path):
    out = tmp_path / "explain.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_explain.py"), "--tiny", "--make-8b",
                    str(tmp_path / "run"), "--engines", "hf", "--sites", "6", "--server-encoding", "base64",
                    "--out", str(out)], check=True, capture_output=True, text=True, timeout=300)
    record = json.loads(out.read_text())
    assert record["errors"] == []
    (offline,) = [c for c in record["cases"] if c["mode"] == "offline"]
    assert not offline["closed_explanations"] and offline["scored"] == offline["explained"]
    (server,) = [c for c in record["cases"] if c["mode"] == "server"]
    assert server["encoding"] == "base64" and server["failed_requests"] == []
    assert server["sites_answered"] == 6 and server["batcher"]["sites"] == 6


def test_explain_bench_server_leg_with_continuous_batching(tmp_path):
    """--continuous: the native server leg with continuous_batching; every site answered once, and with
    --close-explanations the texts closed before the AR scores them (not through generate)."""
    out = tmp_path / "explain.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_explain.py"), "--tiny", "--make-8b",
                    str(tmp_path / "run"), "--engines", "native", "--server-engine", "native", "--continuous",
                    "--close-explanations", "--sites", "6", "--clients", "2", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    record = json.loads(out.read_text())
    assert record["errors"] == []
    (server,) = [c for c in record["cases"] if c["mode"] == "server"]
    assert server["continuous"] and server["engine"] == "native" and server["failed_requests"] == []
    assert server["sites_answered"] == 6 and server["batcher"]["sites"] == 6
    assert server["batcher"]["decode_steps"] > 0 and server["closed_by_bench"] >= 6


def test_repeated_rounds_set_each_server_case_against_its_own_round_s_corpus_rate(tmp_path):
    """--repeats 2: corpus, server, corpus, server; each server case's ratio is to the corpus case of its round."""
    out = tmp_path / "explain.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_explain.py"), "--tiny", "--make-8b",
                    str(tmp_path / "run"), "--engines", "hf", "--sites", "4", "--clients", "2", "--repeats", "2",
                    "--out", str(out)], check=True, capture_output=True, text=True, timeout=300)
    record = json.loads(out.read_text())
    assert record["errors"] == []
    legs = [(c["mode"], c.get("round")) for c in record["cases"]]
    assert legs == [("offline", None), ("corpus", 1), ("server", 1), ("corpus", 2), ("server", 2)]
    corpus = {c["round"]: c["sites_per_s"] for c in record["cases"] if c["mode"] == "corpus"}
    for server in (c for c in record["cases"] if c["mode"] == "server"):
        assert server["sites_answered"] == 4
        assert server["server_over_corpus"] == pytest.approx(server["sites_per_s"] / corpus[server["round"]])
