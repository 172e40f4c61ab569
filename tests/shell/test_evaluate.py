"""`nla eval`, `nla explain`, `nla plot` on the toy SFT checkpoints."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from nla_core import resolve_target_scale, spread_rows
from nla_shell import cli
from nla_shell.io.sidecars import load_sidecar
from nla_shell.serving.explain import ExplainConfig, explain
from nla_shell.models import ARModel, ar_predict
from nla_shell.pipeline.plot import heldout_series, panels, plot_run, read_metrics
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
                     "heldout_docs=all", "device=cpu"]) == 0
    summary = json.loads((tmp_path / "out" / "eval_summary.json").read_text())
    assert summary["n_rows"] == 6 and summary["baseline_rawvar"] > 0
    assert summary["gold/fve"] == pytest.approx(1.0, abs=1e-6)
    assert summary["gold/mse_mean"] == pytest.approx(0.0, abs=1e-6)
    assert "av/fve" not in summary


def test_splice_kl_of_gold_reconstructions_and_a_model_that_is_not_the_datas(tmp_path, toy_sft, toy_datasets,
                                                                            tiny_av_dir, capsys):
    _, ar = toy_sft
    argv = ["eval", "--ar", str(ar), "--parquet", str(toy_datasets / "eval.parquet"), "--model", str(tiny_av_dir),
            "--n-rows", "6", "device=cpu"]
    assert cli.main([*argv, "--out-dir", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "eval_summary.json").read_text())
    # The toy data are the tiny LM's own residuals: every context re-encodes to its site and matches.
    assert summary["splice/n_rows"] == 6 and summary["splice/resid_cosine_min"] > 0.999
    for key in ("splice/kl_gold", "splice/kl_random", "splice/kl_mean"):
        assert summary[key] > 0, key
    samples = [json.loads(line) for line in (tmp_path / "out" / "eval_samples.jsonl").read_text().splitlines()]
    assert sum(s["splice_kl_gold"] for s in samples) / 6 == pytest.approx(summary["splice/kl_gold"], rel=1e-5)
    controls = (tmp_path / "out" / "eval_controls.md").read_text()
    assert "| random vector at the AV+AR's error (splice reference) |" in controls
    assert f"{summary['splice/kl_mean']:.4f} |" in controls.splitlines()[-1]  # the floor's row
    # Activations that are not the model's residuals (random vectors here) are refused, in one line.
    table = pq.read_table(toy_datasets / "eval.parquet").slice(0, 6)
    column = pa.FixedSizeListArray.from_arrays(pa.array(torch.randn(6 * 64).numpy()), 64)
    pq.write_table(table.set_column(table.schema.get_field_index("activation_vector"), "activation_vector", column),
                   tmp_path / "other.parquet")
    shutil.copy(toy_datasets / "eval.parquet.nla_meta.yaml", tmp_path / "other.parquet.nla_meta.yaml")
    argv[argv.index("--parquet") + 1] = str(tmp_path / "other.parquet")
    assert cli.main([*argv, "--out-dir", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "does not reproduce the activations" in err and "pass the model datagen read" in err
    assert "Traceback" not in err and sum(line.startswith("nla eval: error:") for line in err.splitlines()) == 1
    assert not (tmp_path / "other").exists()


def test_eval_refuses_an_out_dir_that_holds_files(tmp_path, toy_sft, toy_datasets, capsys):
    _, ar = toy_sft
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["eval", "--ar", str(ar), "--parquet", str(toy_datasets / "eval.parquet"), "--out-dir", str(out),
            "--n-rows", "3", "device=cpu"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("nla eval: error: config key 'out_dir'") and "--overwrite" in err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert cli.main([*argv, "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "eval_summary.json").is_file()
    # What was scored, and which sidecar said how.
    provenance = json.loads((out / "eval_summary.json").read_text())["provenance"]
    sidecar = toy_datasets / "eval.parquet.nla_meta.yaml"
    assert provenance["ar"]["path"] == str(ar.resolve()) and provenance["av"] is None
    assert provenance["ar"]["sidecar_sha256"] == hashlib.sha256((ar / "nla_meta.yaml").read_bytes()).hexdigest()
    assert provenance["parquet"]["path"] == str((toy_datasets / "eval.parquet").resolve())
    assert provenance["sidecar"]["sha256"] == hashlib.sha256(sidecar.read_bytes()).hexdigest()
    assert provenance["sidecar"]["d_model"] == 64 and provenance["config"]["n_rows"] == 3


def test_the_shuffled_control_collapses_and_the_length_curve_ends_at_the_fve(tmp_path, two_concept_nla):
    """On a toy NLA after SFT (two concepts, named "cat" / "river"), the AV reading another row's
    vector explains the true row far worse; cutting explanations past their length changes nothing."""
    av, ar, parquet = two_concept_nla
    assert cli.main(["eval", "--av", str(av), "--ar", str(ar), "--parquet", str(parquet), "--out-dir", str(tmp_path / "e"),
                     "--n-rows", "16", "--max-new-tokens", "8", "--greedy", "--length-ks", "1,64", "device=cpu"]) == 0
    summary = json.loads((tmp_path / "e" / "eval_summary.json").read_text())
    assert summary["av/extraction_rate"] == 1.0 and summary["av/fve"] > 0.3
    assert summary["shuffled/fve"] < summary["av/fve"] - 0.5
    assert summary["length/fve_k64"] == summary["av/fve"] and summary["length/truncated_frac_k64"] == 0.0
    assert summary["length/truncated_frac_k1"] > 0 and summary["length/tokens_max"] > 1
    samples = [json.loads(line) for line in (tmp_path / "e" / "eval_samples.jsonl").read_text().splitlines()]
    assert all(s["shuffled_from"] != s["idx"] for s in samples)
    assert sorted(s["shuffled_from"] for s in samples) == list(range(16))
    controls = (tmp_path / "e" / "eval_controls.md").read_text().splitlines()
    rows = [line.split(" | ")[0].lstrip("| ") for line in controls if line.startswith("| ") and "---" not in line]
    assert rows == ["", "AV+AR", "AV on a shuffled vector, scored against the true row (control)",
                    "AR on the gold explanation (ceiling)", "dataset mean (floor)"]


def test_the_length_line_ends_without_a_dangling_separator():
    from nla_shell.pipeline.evaluate import length_line

    metrics = {"length/tokens_mean": 7.25, "length/tokens_p10": 3, "length/tokens_p50": 7, "length/tokens_p90": 11,
               "length/tokens_max": 12, "length/fve_k4": 0.25}
    assert length_line(metrics, ()) == "[eval] explanation tokens: mean 7.2, p10 3, p50 7, p90 11, max 12"
    assert length_line(metrics, (4,)).endswith("max 12; FVE(k=4) 0.2500")


def test_eval_of_an_av_writes_samples_table_and_summary(tmp_path, toy_sft, toy_datasets, capsys):
    av, ar = toy_sft
    argv = ["eval", "--av", str(av), "--ar", str(ar), "--parquet", str(toy_datasets / "eval.parquet"),
            "--n-rows", "5", "--max-new-tokens", "8", "--table-rows", "3", "device=cpu", "length_ks="]
    assert cli.main([*argv, "--out-dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out.splitlines()
    # The controls table says whose it is (the demo prints three in a row); no line ends in a dangling "; ".
    assert f"[eval] AV {av}, AR {ar}:" in out and out[out.index(f"[eval] AV {av}, AR {ar}:") + 1].startswith("Held-out")
    assert not [line for line in out if line.rstrip().endswith(";")]
    summary = json.loads((tmp_path / "a" / "eval_summary.json").read_text())
    assert {"av/fve", "av/fve_meannorm", "av/reward_mean", "av/extraction_rate", "gold/fve"} <= set(summary)
    assert 0.0 <= summary["av/extraction_rate"] <= 1.0
    samples = [json.loads(line) for line in (tmp_path / "a" / "eval_samples.jsonl").read_text().splitlines()]
    # The rows: 5 spread over the report half's documents (a row of each before a second), in file order.
    all_rows = pq.read_table(toy_datasets / "eval.parquet").to_pylist()
    eval_rows = [all_rows[i] for i in spread_rows([r["doc_id"] for r in all_rows], 5, docs="report")]
    assert [(s["doc_id"], s["position"], s["gold_explanation"]) for s in samples] == [
        (r["doc_id"], r["position"], r["explanation"]) for r in eval_rows
    ]
    half = {all_rows[i]["doc_id"] for i in spread_rows([r["doc_id"] for r in all_rows], 10**6, docs="report")}
    assert summary["n_docs"] == len({r["doc_id"] for r in eval_rows}) == min(5, len(half)) > 2  # the file's first 5: 2
    assert all({"explanation", "reward", "mse", "fve", "gold_fve"} <= set(s) for s in samples)
    table = (tmp_path / "a" / "eval_table.md").read_text().splitlines()
    assert table[0].startswith("| context (tail) | gold |") and len(table) == 2 + 3
    # Same seed, same samples: two checkpoints evaluated alike see the same random stream.
    assert cli.main([*argv, "--out-dir", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "eval_samples.jsonl").read_text() == (tmp_path / "b" / "eval_samples.jsonl").read_text()


def test_explain_greedy_is_seed_free_and_short_contexts_are_flagged(toy_sft, tiny_av_dir, capsys):
    av, ar = toy_sft
    text = "the red cat sees a dog ."
    common = dict(av=str(av), ar=str(ar), model=str(tiny_av_dir), text=text, max_new_tokens=6, device="cpu")
    greedy = [explain(ExplainConfig(**common, all=True, greedy=True, seed=seed)) for seed in (0, 1)]
    assert [r["raw"] for r in greedy[0]] == [r["raw"] for r in greedy[1]]
    # toy_datasets were made with min_context=4 (recorded in the sidecar's provenance, copied by nla sft).
    assert [r["short_context"] for r in greedy[0]] == [p < 4 for p in range(len(greedy[0]))]
    out = capsys.readouterr().out
    assert out.count("note: only") == 2 * 4 and "datagen sampled positions with >= 4, so" in out


def test_explain_refuses_another_lm_of_the_same_width(toy_sft, tiny_av_dir, tiny_tokenizer, tmp_path, capsys):
    """As `nla eval --model` does: another LM of the AV's width would be explained without a word (MSE ~2)."""
    import fixtures
    from nla_shell.toy import builders as toy

    av, ar = toy_sft
    other = tmp_path / "other_lm"
    toy.save_av_checkpoint(toy.build_tiny_qwen3(tiny_tokenizer, hidden_size=fixtures.D_MODEL,
                                                num_layers=fixtures.NUM_LAYERS, seed=1), tiny_tokenizer, other)
    capsys.readouterr()
    argv = ["explain", "--av", str(av), "--ar", str(ar), "--text", "the red cat sees a dog .", "--max-new-tokens", "4",
            "device=cpu"]
    assert cli.main([*argv, "--model", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"nla explain: error: model: {other} does not reproduce"), err
    assert "pass the model datagen read" in err
    assert cli.main([*argv, "--model", str(tiny_av_dir)]) == 0  # the LM the data came from passes
    assert "note: no training parquet" not in capsys.readouterr().out


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


def test_on_policy_runs_plot_the_extraction_rate_and_a_final_held_out_point(tmp_path):
    run = tmp_path / "run"
    _write_metrics(run)  # clip_frac is None at every step: never clipped
    records = read_metrics(run / "metrics.jsonl")
    assert [title for _, _, title in panels(records)][3].startswith("extraction rate")
    assert panels([{**r, "clip_frac": 0.0} for r in records])[3][0] == "extraction_rate"
    assert panels([*records, {"step": 9, "clip_frac": 0.02}])[3][0] == "clip_frac"
    assert heldout_series(run, records, "eval/fve") == ([2], [0.3])
    (run / "summary.json").write_text(json.dumps({"final": {"step": 4}, "final_eval": {"step": 4, "eval/fve": 0.5}}))
    assert heldout_series(run, records, "eval/fve") == ([2, 4], [0.3, 0.5])
    assert plot_run(run).read_bytes().startswith(PNG_MAGIC)


def test_plot_says_what_is_missing(tmp_path, monkeypatch, capsys):
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
    _write_metrics(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    assert cli.main(["plot", str(tmp_path / "run")]) == 2
    assert "pip install 'nla[plot]'" in capsys.readouterr().err


def test_fve_nrm_is_upstreams_formula_over_the_ars_training_baseline(tmp_path, toy_sft, toy_datasets):
    """fve_nrm = 1 - mean_i mse_nrm_i / rawvar of the AR's training activations (kitft 047eb8e, nla/loss.py),
    recomputed here in float64 from the gold rows' MSEs and the AR's training parquet."""
    import nla_core
    from nla_shell.io.sidecars import load_sidecar

    _, ar = toy_sft
    argv = ["eval", "--ar", str(ar), "--parquet", str(toy_datasets / "eval.parquet"), "--n-rows", "6",
            "device=cpu", "length_ks=", "--out-dir", str(tmp_path / "e")]
    assert cli.main(argv) == 0
    summary = json.loads((tmp_path / "e" / "eval_summary.json").read_text())
    samples = [json.loads(line) for line in (tmp_path / "e" / "eval_samples.jsonl").read_text().splitlines()]
    nla = load_sidecar(toy_datasets / "ar_sft.parquet")
    train = torch.tensor(pq.read_table(toy_datasets / "ar_sft.parquet").column("activation_vector").to_pylist(),
                         dtype=torch.float64)
    u = train * (nla.d_model ** 0.5 / train.norm(dim=-1, keepdim=True))
    rawvar_train = float((u - u.mean(0)).square().mean())
    mse = sum(s["gold_mse"] for s in samples) / len(samples)
    assert summary["baseline_rawvar_train"] == pytest.approx(rawvar_train, rel=1e-5)
    assert summary["gold/fve_nrm"] == pytest.approx(1 - mse / rawvar_train, rel=1e-5, abs=1e-6)
    # nla's fve differs only in its baseline: the held-out rows' own.
    assert summary["gold/fve"] == pytest.approx(nla_core.fve(mse, summary["baseline_rawvar"]), rel=1e-5, abs=1e-6)
