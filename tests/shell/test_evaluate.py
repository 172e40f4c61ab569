"""`nla eval`, `nla explain`, `nla plot` on the toy SFT checkpoints."""

from __future__ import annotations

import json
import shutil
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from nla_core import resolve_target_scale
from nla_shell import cli
from nla_shell.io.sidecars import load_sidecar
from nla_shell.pipeline.explain import ExplainConfig, explain
from nla_shell.models import ARModel, ar_predict
from nla_shell.pipeline.plot import plot_run
from nla_shell.training.scoring import ar_token_ids

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_an_exact_ar_scores_fve_one(tmp_path, toy_sft, toy_datasets):
    """Activations made to be the AR's own reconstructions of the gold text: FVE exactly 1."""
    _, ar = toy_sft
    nla = load_sidecar(toy_datasets / "eval.parquet.nla_meta.yaml")
    tokenizer = AutoTokenizer.from_pretrained(ar)
    table = pq.read_table(toy_datasets / "eval.parquet").slice(0, 6)
    ids = [ar_token_ids(e, nla.critic_prompt_template, tokenizer, max_tokens=1024) for e in table["explanation"].to_pylist()]
    critic = ARModel.from_pretrained(ar, mse_scale=resolve_target_scale(nla.mse_scale, nla.d_model))
    preds = ar_predict(critic, ids, pad_id=tokenizer.pad_token_id, micro_batch=4, device=torch.device("cpu")).numpy()
    column = pa.FixedSizeListArray.from_arrays(pa.array(preds.reshape(-1)), nla.d_model)
    table = table.set_column(table.schema.get_field_index("activation_vector"), "activation_vector", column)
    parquet = tmp_path / "exact.parquet"
    pq.write_table(table, parquet)
    shutil.copy(toy_datasets / "eval.parquet.nla_meta.yaml", tmp_path / "exact.parquet.nla_meta.yaml")

    assert cli.main(["eval", "--ar", str(ar), "--parquet", str(parquet), "--out-dir", str(tmp_path / "out"),
                     "device=cpu"]) == 0
    summary = json.loads((tmp_path / "out" / "eval_summary.json").read_text())
    assert summary["n_rows"] == 6 and summary["baseline_rawvar"] > 0
    assert summary["gold/fve"] == pytest.approx(1.0, abs=1e-6)
    assert summary["gold/mse_mean"] == pytest.approx(0.0, abs=1e-6)
    assert "av/fve" not in summary


def test_eval_of_an_av_writes_samples_table_and_summary(tmp_path, toy_sft, toy_datasets):
    av, ar = toy_sft
    argv = ["eval", "--av", str(av), "--ar", str(ar), "--parquet", str(toy_datasets / "eval.parquet"),
            "--n-rows", "5", "--max-new-tokens", "8", "--table-rows", "3", "device=cpu"]
    assert cli.main([*argv, "--out-dir", str(tmp_path / "a")]) == 0
    summary = json.loads((tmp_path / "a" / "eval_summary.json").read_text())
    assert {"av/fve", "av/fve_meannorm", "av/reward_mean", "av/extraction_rate", "gold/fve"} <= set(summary)
    assert 0.0 <= summary["av/extraction_rate"] <= 1.0
    samples = [json.loads(line) for line in (tmp_path / "a" / "eval_samples.jsonl").read_text().splitlines()]
    eval_rows = pq.read_table(toy_datasets / "eval.parquet").slice(0, 5).to_pylist()
    assert [(s["doc_id"], s["position"], s["gold_explanation"]) for s in samples] == [
        (r["doc_id"], r["position"], r["explanation"]) for r in eval_rows
    ]
    assert all({"explanation", "reward", "mse", "fve", "gold_fve"} <= set(s) for s in samples)
    table = (tmp_path / "a" / "eval_table.md").read_text().splitlines()
    assert table[0].startswith("| context (tail) | gold |") and len(table) == 2 + 3
    # Same seed, same samples: two checkpoints evaluated alike see the same random stream.
    assert cli.main([*argv, "--out-dir", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "eval_samples.jsonl").read_text() == (tmp_path / "b" / "eval_samples.jsonl").read_text()


def test_explain_reads_positions_of_a_text(toy_sft, tiny_av_dir, capsys):
    av, ar = toy_sft
    text = "the red cat sees a dog ."
    n_tokens = len(AutoTokenizer.from_pretrained(tiny_av_dir).encode(text, add_special_tokens=False))
    results = explain(ExplainConfig(av=str(av), ar=str(ar), model=str(tiny_av_dir), text=text, all=True,
                                    max_new_tokens=6, device="cpu"))
    assert [r["position"] for r in results] == list(range(n_tokens))
    assert results[-1]["context"] == text
    out = capsys.readouterr().out
    assert all(f"[{p}] token" in out for p in range(n_tokens))
    argv = ["explain", "--av", str(av), "--ar", str(ar), "--model", str(tiny_av_dir), "--text", text, "device=cpu"]
    assert cli.main([*argv, "--position", "-2", "--max-new-tokens", "6"]) == 0
    assert f"[{n_tokens - 2}] token" in capsys.readouterr().out
    assert cli.main([*argv, "--position", "99"]) == 2
    assert "outside the text's" in capsys.readouterr().err


def _write_metrics(run_dir, n=5):
    run_dir.mkdir()
    lines = [{"step": s, "reward_mean": 1.0 + s, "fve": 0.1 * s, "kl_mean": 0.01 * s, "clip_frac": None} for s in range(n)]
    lines[2]["eval/fve"] = 0.3
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "rew')


def test_plot_draws_a_png(tmp_path):
    _write_metrics(tmp_path / "run")
    assert cli.main(["plot", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "curves.png").read_bytes().startswith(PNG_MAGIC)
    out = plot_run(tmp_path / "run", tmp_path / "elsewhere.png")
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_plot_says_what_is_missing(tmp_path, monkeypatch, capsys):
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
    _write_metrics(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    assert cli.main(["plot", str(tmp_path / "run")]) == 2
    assert "pip install 'nla[plot]'" in capsys.readouterr().err
