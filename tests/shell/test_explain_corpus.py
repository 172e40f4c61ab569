"""`nla explain` over a corpus or a parquet (nla_shell.serving.corpus), and the FVE baseline of `nla explain`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from nla_shell import cli
from nla_shell.serving.explain import ExplainConfig, explain

REPO = Path(__file__).resolve().parents[2]

SIGNALLED_AT_THIRD_BATCH = """
import os, signal, sys
from nla_shell import cli
from nla_shell.serving import reader

calls = 0
original = reader.NLAReader.explain

def explain(self, *args, **kwargs):
    global calls
    calls += 1
    if calls == 3:  # mid-run: two batches written, the third being explained
        os.kill(os.getpid(), getattr(signal, os.environ["NLA_TEST_SIGNAL"]))
    return original(self, *args, **kwargs)

reader.NLAReader.explain = explain
sys.exit(cli.main(sys.argv[1:]))
"""


def corpus_argv(toy_sft, tiny_av_dir, toy_datasets, out: Path, *extra: str) -> list[str]:
    av, ar = toy_sft
    return ["explain", "--av", str(av), "--ar", str(ar), "--model", str(tiny_av_dir),
            "--corpus", str(toy_datasets / "corpus.jsonl"), "--out", str(out), "--sites", "sample",
            "--positions-per-doc", "3", "--min-context", "4", "--samples", "2", "--batch-size", "8",
            "--max-new-tokens", "5", "device=cpu", *extra]


def datagen_sites(toy_datasets: Path) -> list[tuple[str, int]]:
    """Every (doc_id, position) datagen wrote into toy_datasets' four splits."""
    return sorted((r["doc_id"], r["position"]) for split in ("rl", "av_sft", "ar_sft", "eval")
                  for r in pq.read_table(toy_datasets / f"{split}.parquet", columns=["doc_id", "position"]).to_pylist())


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, toy_sft, tiny_av_dir, toy_datasets):
    """(rows, stdout) of one uninterrupted corpus run with a JSONL beside the parquet."""
    out = tmp_path_factory.mktemp("full") / "explained.parquet"
    assert cli.main([*corpus_argv(toy_sft, tiny_av_dir, toy_datasets, out), "--jsonl", str(out.with_suffix(".jsonl")),
                     "--progress-every-s", "0"]) == 0
    return out, pq.read_table(out).to_pylist()


def test_sampled_corpus_sites_are_datagens_and_best_of_k_is_kept(full_run, toy_datasets):
    out, rows = full_run
    assert sorted((r["doc_id"], r["position"]) for r in rows) == datagen_sites(toy_datasets)
    assert [r["site"] for r in rows] == list(range(len(rows)))
    for row in rows:
        assert len(row["explanations"]) == len(row["mses"]) == 2
        scored = [m for m in row["mses"] if m is not None]
        assert row["mse"] == (min(scored) if scored else None)
        assert row["explanation"] == row["explanations"][row["mses"].index(row["mse"]) if scored else 0]
        assert row["short_context"] is False and row["generated_tokens"] >= 2
    jsonl = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert jsonl == rows
    assert not out.with_name(out.name + ".parts").exists()


def test_a_killed_corpus_run_resumes_with_no_site_twice_and_none_missing(tmp_path, full_run, toy_sft, tiny_av_dir,
                                                                         toy_datasets, capsys):
    out = tmp_path / "explained.parquet"
    argv = [*corpus_argv(toy_sft, tiny_av_dir, toy_datasets, out), "--jsonl", str(tmp_path / "explained.jsonl")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "NLA_TEST_SIGNAL": "SIGKILL"}
    killed = subprocess.run([sys.executable, "-c", SIGNALLED_AT_THIRD_BATCH, *argv], env=env, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    parts = out.with_name(out.name + ".parts")
    assert sorted(p.name for p in parts.glob("part-*.parquet")) == ["part-00000000.parquet", "part-00000001.parquet"]
    assert not out.exists()

    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "resuming" in printed and "2 batches of 8 already written" in printed
    resumed = pq.read_table(out).to_pylist()
    assert [r["site"] for r in resumed] == list(range(len(full_run[1])))
    # Each batch is seeded by its index: the resumed run wrote what the uninterrupted one did.
    assert resumed == full_run[1]
    assert [json.loads(line) for line in (tmp_path / "explained.jsonl").read_text().splitlines()] == resumed


@pytest.mark.parametrize(("signal_name", "code", "verb"), [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "stopped")])
def test_ctrl_c_or_sigterm_says_how_to_resume_in_one_line_and_the_rerun_resumes(
        tmp_path, full_run, toy_sft, tiny_av_dir, toy_datasets, signal_name, code, verb, capsys):
    out = tmp_path / "explained.parquet"
    argv = corpus_argv(toy_sft, tiny_av_dir, toy_datasets, out)
    env = {**os.environ, "PYTHONPATH": str(REPO), "NLA_TEST_SIGNAL": signal_name}
    stopped = subprocess.run([sys.executable, "-c", SIGNALLED_AT_THIRD_BATCH, *argv], env=env, capture_output=True,
                             text=True, timeout=300)
    parts = out.with_name(out.name + ".parts")
    assert stopped.returncode == code, stopped.stderr[-2000:]
    assert stopped.stderr.splitlines()[-1] == (f"nla explain: {verb} with 2 batches written; rerun the same command "
                                               f"to resume from {parts}")
    assert "Traceback" not in stopped.stderr and not out.exists()
    assert sorted(p.name for p in parts.glob("part-*.parquet")) == ["part-00000000.parquet", "part-00000001.parquet"]
    assert cli.main(argv) == 0
    assert "2 batches of 8 already written" in capsys.readouterr().out
    assert pq.read_table(out).to_pylist() == full_run[1]


def test_resuming_with_other_settings_or_over_a_finished_run_is_refused(tmp_path, full_run, toy_sft, tiny_av_dir,
                                                                        toy_datasets, capsys):
    out = tmp_path / "explained.parquet"
    parts = out.with_name(out.name + ".parts")
    parts.mkdir()
    settings = {"samples": 2, "batch_size": 8}
    (parts / "settings.json").write_text(json.dumps(settings))
    assert cli.main(corpus_argv(toy_sft, tiny_av_dir, toy_datasets, out)) == 2
    err = capsys.readouterr().err
    assert "config key 'av' =" in err and "differs from the killed run's None" in err and "overwrite=true" in err
    finished = full_run[0]
    assert cli.main(corpus_argv(toy_sft, tiny_av_dir, toy_datasets, finished)) == 2
    assert "already holds a finished run" in capsys.readouterr().err
    assert cli.main(["explain", "--av", "a", "--ar", "b", "--corpus", "c.jsonl", "device=cpu"]) == 2
    assert "config key 'out' = None is invalid: give the output parquet path (corpus mode)" in capsys.readouterr().err
    assert cli.main(["explain", "--av", "a", "--ar", "b", "--text", "t", "--corpus", "c.jsonl"]) == 2
    assert "give exactly one (got ['text', 'corpus'])" in capsys.readouterr().err


def test_progress_eta_and_the_throughput_line(tmp_path, toy_sft, tiny_av_dir, toy_datasets, capsys):
    out = tmp_path / "e.parquet"
    assert cli.main([*corpus_argv(toy_sft, tiny_av_dir, toy_datasets, out), "--max-docs", "6",
                     "--progress-every-s", "0", "--samples", "1", "--greedy"]) == 0
    lines = capsys.readouterr().out.splitlines()
    progress = [line for line in lines if "ETA" in line]
    assert progress and progress[-1].split("; ")[1].startswith("6/6 documents (100%)")
    (summary,) = [line for line in lines if line.startswith("[explain] explained")]
    n = pq.read_metadata(out).num_rows
    assert summary.startswith(f"[explain] explained {n} sites in ") and "sites/s" in summary and "tokens/s" in summary


def test_every_position_of_a_corpus_flagging_short_contexts(tmp_path, toy_sft, tiny_av_dir, toy_datasets):
    av, ar = toy_sft
    common = dict(av=str(av), ar=str(ar), max_new_tokens=4, greedy=True, batch_size=16, device="cpu")
    corpus = tmp_path / "two.jsonl"
    corpus.write_text('{"id": "a", "text": "the red cat sees a dog ."}\n{"id": "b", "text": "a dog ."}\n')
    explain(ExplainConfig(**common, model=str(tiny_av_dir), corpus=str(corpus), out=str(tmp_path / "all.parquet"),
                          min_context=4))
    rows = pq.read_table(tmp_path / "all.parquet").to_pylist()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_av_dir)
    lengths = {d: len(tokenizer.encode(t, add_special_tokens=False)) for d, t in
               (("a", "the red cat sees a dog ."), ("b", "a dog ."))}
    assert [(r["doc_id"], r["position"]) for r in rows] == [(d, p) for d in "ab" for p in range(lengths[d])]
    assert [r["short_context"] for r in rows] == [r["position"] < 4 for r in rows]
    assert rows[lengths["a"] - 1]["context"] == "the red cat sees a dog ."



def test_a_parquet_of_vectors_is_explained_row_by_row_with_its_fve(tmp_path, two_concept_nla):
    """The two-concept toy NLA reads its eval split: each row's doc_id, position and context carried over,
    greedy decoding names every row's concept, and each FVE is against the AR's baseline."""
    av, ar, parquet = two_concept_nla
    common = dict(av=str(av), ar=str(ar), parquet=str(parquet), max_new_tokens=8, batch_size=10, device="cpu")
    explain(ExplainConfig(**common, out=str(tmp_path / "greedy.parquet"), greedy=True))
    explain(ExplainConfig(**common, out=str(tmp_path / "best_of_3.parquet"), samples=3))
    source = pq.read_table(parquet, columns=["doc_id", "position", "context", "explanation"]).to_pylist()
    greedy, best = (pq.read_table(tmp_path / f"{name}.parquet").to_pylist() for name in ("greedy", "best_of_3"))
    for rows in (greedy, best):
        assert [(r["doc_id"], r["position"], r["context"]) for r in rows] == [
            (s["doc_id"], s["position"], s["context"]) for s in source]
    assert [r["explanation"] for r in greedy] == [s["explanation"] for s in source]
    assert sum(r["fve"] for r in greedy) / len(greedy) > 0.3
    rawvar = yaml.safe_load((ar / "nla_meta.yaml").read_text())["baselines"]["rawvar"]
    for row in best:
        scored = [m for m in row["mses"] if m is not None]
        assert len(row["explanations"]) == 3 and row["mse"] == (min(scored) if scored else None)
        assert row["fve"] is None or row["fve"] == pytest.approx(1 - row["mse"] / rawvar)


def test_a_parquet_of_the_wrong_width_or_with_nan_is_refused_naming_the_row(tmp_path, two_concept_nla, capsys):
    av, ar, parquet = two_concept_nla
    table = pq.read_table(parquet, columns=["activation_vector", "doc_id"]).slice(0, 3).to_pylist()
    for name, vector, message in (("narrow", [0.0] * 63, "row 2: activation_vector has 63 numbers, the sidecar's "
                                   "d_model is 64"), ("nan", [float("nan")] * 64, "row 2: activation_vector is not finite")):
        rows = [*table[:2], {"activation_vector": vector, "doc_id": "bad"}]
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        assert cli.main(["explain", "--av", str(av), "--ar", str(ar), "--parquet", str(path), "--out",
                         str(tmp_path / f"{name}_out.parquet"), "--batch-size", "2", "device=cpu"]) == 2
        assert message in capsys.readouterr().err


def test_the_native_engine_explains_a_parquet_as_hf_generate_does_under_greedy_decoding(tmp_path, two_concept_nla):
    av, ar, parquet = two_concept_nla
    rows = {}
    for engine in ("hf", "native"):
        explain(ExplainConfig(av=str(av), ar=str(ar), parquet=str(parquet), out=str(tmp_path / f"{engine}.parquet"),
                              engine=engine, greedy=True, max_new_tokens=8, batch_size=16, device="cpu"))
        rows[engine] = pq.read_table(tmp_path / f"{engine}.parquet").to_pylist()
    assert [r["explanations"] for r in rows["native"]] == [r["explanations"] for r in rows["hf"]]
    assert [r["mse"] for r in rows["native"]] == pytest.approx([r["mse"] for r in rows["hf"]], rel=1e-5)


def test_explain_reports_fve_against_the_ars_baseline_when_the_av_sidecar_has_none(tmp_path, two_concept_nla,
                                                                                  nla_run_inputs, capsys):
    """Issue 28 item 5: an RL adapter's sidecar records no baselines; the AR's does, and is the one FVE uses."""
    av, ar, _ = two_concept_nla
    model = nla_run_inputs[0]  # the AV's base: the LM whose residuals are read
    rl_like = tmp_path / "adapter"
    shutil.copytree(av, rl_like)
    meta = yaml.safe_load((rl_like / "nla_meta.yaml").read_text())
    meta.pop("baselines")
    (rl_like / "nla_meta.yaml").write_text(yaml.safe_dump(meta))
    ar_rawvar = yaml.safe_load((ar / "nla_meta.yaml").read_text())["baselines"]["rawvar"]
    assert ar_rawvar != yaml.safe_load((av / "nla_meta.yaml").read_text())["baselines"]["rawvar"]
    for adapter in (rl_like, av):
        results = explain(ExplainConfig(av=str(adapter), ar=str(ar), model=str(model), text="the red cat sees a dog .",
                                        all=True, greedy=True, max_new_tokens=8, device="cpu"))
        scored = [r for r in results if r["mse"] is not None]
        assert len(scored) == len(results) and all(r["fve"] == pytest.approx(1 - r["mse"] / ar_rawvar) for r in scored)
    out = capsys.readouterr().out
    assert "FVE n/a" not in out and out.count("| FVE ") == 2 * len(results)
