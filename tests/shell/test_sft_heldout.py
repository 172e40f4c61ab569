"""`nla sft` with held-out rows: the held-out figures, the best checkpoint as the result, the plateau stop, epochs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fixtures
from nla_shell import cli
from nla_shell.pipeline.sft import HELDOUT_SCORE, sft
from nla_shell.pipeline.sft_eval import EarlyStopping
from nla_shell.training import checkpoint as ckpt


def _records(save_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]


def _manifest_score(path: Path) -> float | None:
    return json.loads((path / ckpt.MANIFEST_NAME).read_text())["metrics"].get(HELDOUT_SCORE)


# --------------------------------------------------------------------------- the stopping rule alone


@settings(max_examples=60, deadline=None)
@given(scores=st.lists(st.one_of(st.floats(-10, 10), st.just(math.nan)), min_size=1, max_size=30),
       patience=st.integers(0, 4), min_delta=st.sampled_from([0.0, 0.1, 1.0]))
def test_early_stopping_counts_evaluations_since_the_best(scores, patience, min_delta):
    rule = EarlyStopping(patience=patience, min_delta=min_delta)
    best, best_step, since = -math.inf, None, 0
    for step, score in enumerate(scores, start=1):
        rule = rule.update(score, step)
        if math.isfinite(score) and score > best + min_delta:  # the rule, written out
            best, best_step, since = score, step, 0
        elif best_step is not None:  # before a first finite figure, nothing counts towards the plateau
            since += 1
        assert (rule.best_score, rule.best_step, rule.evals_since_best) == (best, best_step, since)
        assert rule.improved == (since == 0 and best_step is not None)
        assert rule.should_stop == (patience > 0 and since >= patience)
    # A checkpoint's counters come back under the resumed run's own patience.
    again = EarlyStopping(patience=patience + 1, min_delta=min_delta).restored(rule.state())
    assert (again.best_score, again.best_step, again.evals_since_best, again.patience) == (
        rule.best_score, rule.best_step, rule.evals_since_best, patience + 1)


# --------------------------------------------------------------------------- runs


def test_ar_sft_scores_the_held_out_rows_and_returns_its_best(tmp_path, tiny_av_dir, toy_datasets, capsys):
    cfg = fixtures.sft_config("ar", tiny_av_dir, toy_datasets, tmp_path / "ar", num_steps=6, save_every=100,
                              eval_parquet=str(toy_datasets / "eval.parquet"), eval_every=2, eval_rows=16)
    result = sft(cfg)
    records = _records(tmp_path / "ar")
    evaluated = [r for r in records if "heldout/fve" in r]
    assert [r["step"] for r in evaluated] == [1, 3, 5]  # steps done 2, 4, 6 (records count from 0)
    assert all(math.isfinite(r["heldout/fve"]) and r["heldout/extraction_rate"] == 1.0 for r in evaluated)
    best = max(evaluated, key=lambda r: r["heldout/fve"])
    assert result == ckpt.checkpoint_dir(tmp_path / "ar", best["step"] + 1)
    assert _manifest_score(result) == pytest.approx(best["heldout/fve"])
    out = capsys.readouterr().out
    assert "held-out FVE" in out and f"best held-out checkpoint {result}" in out


def test_av_sft_reports_the_vector_gap_and_the_round_trip(tmp_path, tiny_av_dir, toy_datasets, toy_sft):
    _, ar = toy_sft
    cfg = fixtures.sft_config("av", tiny_av_dir, toy_datasets, tmp_path / "av", num_steps=4, save_every=100,
                              eval_parquet=str(toy_datasets / "eval.parquet"), eval_every=2, eval_rows=8,
                              eval_ar=str(ar), eval_max_new_tokens=8)
    result = sft(cfg)
    evaluated = [r for r in _records(tmp_path / "av") if "heldout/nll" in r]
    assert len(evaluated) == 2
    for r in evaluated:
        assert r["heldout/nll_gap"] == pytest.approx(r["heldout/nll_shuffled"] - r["heldout/nll"])
        assert r["heldout/nll"] > 0 and "heldout/fve" in r and 0 <= r["heldout/extraction_rate"] <= 1
    # The round trip selects (higher is better); NaN (nothing extracted, written as null) never counts as best,
    # and a run with no best at all returns its newest checkpoint.
    finite = [r for r in evaluated if r["heldout/fve"] is not None and math.isfinite(r["heldout/fve"])]
    best_step = max(finite, key=lambda r: r["heldout/fve"])["step"] + 1 if finite else 4
    assert result == ckpt.checkpoint_dir(tmp_path / "av", best_step)
    # The training RNG is untouched by the evaluation's sampling: the losses are those of a run without it.
    plain = fixtures.sft_config("av", tiny_av_dir, toy_datasets, tmp_path / "plain", num_steps=4, save_every=100)
    sft(plain)
    assert [r["loss"] for r in _records(tmp_path / "av")] == [r["loss"] for r in _records(tmp_path / "plain")]


def _plateau_argv(tiny_av_dir: Path, data: Path, save_dir: Path, *extra: str) -> list[str]:
    return ["sft", "--mode", "ar", "--model", str(tiny_av_dir), "--parquet", str(data / "ar_sft.parquet"),
            "--save-dir", str(save_dir), "--eval-parquet", str(data / "eval.parquet"), "--eval-every", "1",
            "--eval-rows", "8", "--num-steps", "20", "--batch-size", "4", "--micro-batch", "4", "--device", "cpu",
            "--dtype", "float32", "--logger", "jsonl", *extra]


def test_cli_stops_on_a_held_out_plateau_and_a_rerun_trains_nothing(tmp_path, tiny_av_dir, toy_datasets, capsys):
    # min_delta so large that only the first evaluation is a new best: two more without one stop the run.
    argv = _plateau_argv(tiny_av_dir, toy_datasets, tmp_path / "ar", "--patience", "2", "--min-delta", "1e9")
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "held-out plateau: no new best in 2 evaluations; stopped at step 3 of 20" in out
    assert f"best held-out checkpoint {tmp_path / 'ar' / 'step_000001'}" in out
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path / "ar")] == ["step_000003", "step_000001"]
    assert len(_records(tmp_path / "ar")) == 3
    # The same command again: the stop is part of the run's state, nothing more is trained.
    assert cli.main(argv) == 0
    assert "nothing to train" in capsys.readouterr().out
    assert len(_records(tmp_path / "ar")) == 3


def test_a_killed_run_resumes_with_its_best_and_its_count(tmp_path, tiny_av_dir, toy_datasets):
    # patience 3 after a first best at step 1: the run lasts at least 4 steps, so step 2's checkpoint exists.
    argv = _plateau_argv(tiny_av_dir, toy_datasets, tmp_path / "ar", "--patience", "3", "--save-every", "2")
    assert cli.main(argv) == 0
    uninterrupted = [r["heldout/fve"] for r in _records(tmp_path / "ar")]
    last = ckpt.latest_checkpoint(tmp_path / "ar").name
    # Killed after step 2's checkpoint: the same command continues, with the best and the count it had.
    for path in ckpt.complete_checkpoints(tmp_path / "ar"):
        if path.name != "step_000002":
            shutil.rmtree(path)
    assert cli.main(argv) == 0
    assert [r["heldout/fve"] for r in _records(tmp_path / "ar")] == uninterrupted
    assert ckpt.latest_checkpoint(tmp_path / "ar").name == last


def test_keep_last_keeps_the_newest_and_the_best(tmp_path, tiny_av_dir, toy_datasets):
    argv = _plateau_argv(tiny_av_dir, toy_datasets, tmp_path / "ar", "--num-steps", "6", "--keep-last", "1")
    assert cli.main(argv) == 0
    best = max(_records(tmp_path / "ar"), key=lambda r: r["heldout/fve"])["step"] + 1
    kept = [p.name for p in ckpt.complete_checkpoints(tmp_path / "ar")]
    assert kept == sorted({"step_000006", f"step_{best:06d}"}, reverse=True)


def test_epochs_set_the_step_count(tmp_path, tiny_av_dir, toy_datasets):
    import pyarrow.parquet as pq

    rows = pq.ParquetFile(toy_datasets / "ar_sft.parquet").metadata.num_rows
    cfg = fixtures.sft_config("ar", tiny_av_dir, toy_datasets, tmp_path / "ar", epochs=1.5, num_steps=1000,
                              save_every=1000)
    sft(cfg)
    assert len(_records(tmp_path / "ar")) == math.ceil(1.5 * rows / cfg.batch_size)


@pytest.mark.parametrize("extra, key", [
    (["--eval-ar", "somewhere"], "eval_ar"),  # mode=ar: the AR needs no other model
    (["--patience", "2", "--eval-parquet", "null"], "patience"),
    (["--epochs", "0"], "epochs"),
])
def test_cli_refuses_a_held_out_setting_it_cannot_serve(tmp_path, tiny_av_dir, toy_datasets, capsys, extra, key):
    argv = [*_plateau_argv(tiny_av_dir, toy_datasets, tmp_path / "ar"), *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{key}'" in err
    assert not (tmp_path / "ar").exists()


# --------------------------------------------------------------------------- which held-out rows


def test_selection_and_the_reported_result_share_no_document_by_default(toy_datasets, tiny_av_dir):
    """nla sft selects its checkpoint, and nla train draws its curve, on held-out documents that nla eval never
    reports on; each spreads its rows over its documents, a row of each before a second."""
    from transformers import AutoTokenizer

    from nla_core import spread_rows
    from nla_shell.io.data import load_heldout_rows
    from nla_shell.io.sidecars import load_sidecar
    from nla_shell.pipeline.evaluate import EvalConfig
    from nla_shell.pipeline.sft_config import SFTConfig
    from nla_shell.pipeline.sft_eval import load_heldout
    from nla_shell.training.config import TrainConfig
    from nla_shell.training.setup import load_train_and_eval_rows

    path = toy_datasets / "eval.parquet"
    nla = load_sidecar(toy_datasets / "eval.parquet.nla_meta.yaml")
    doc_ids = [r.doc_id for r in load_heldout_rows(path, nla, n=10**6, docs="all", key="eval_parquet")]
    sft_docs = SFTConfig(mode="av", model="m", parquet="p", save_dir="s").heldout_docs
    train_cfg = TrainConfig(av_ckpt="a", ar_ckpt="b", rl_parquet=str(toy_datasets / "rl.parquet"), save_dir="s",
                            eval_parquet=str(path), eval_n_prompts=6)
    eval_docs = EvalConfig(ar="a", parquet=str(path), out_dir="o").heldout_docs

    # nla sft: its held-out vectors are those of the rows spread over its half
    held = load_heldout(str(path), nla, AutoTokenizer.from_pretrained(tiny_av_dir), n_rows=6, docs=sft_docs, seed=0,
                        mse_scale=None, need_response=True)
    sft_rows = load_heldout_rows(path, nla, n=6, docs=sft_docs, key="eval_parquet")
    assert [r.index for r in sft_rows] == spread_rows(doc_ids, 6, docs=sft_docs)
    assert torch.equal(held.golds, torch.stack([r.activation for r in sft_rows]))
    # nla train: its eval rows, minus documents seen in training (none here: the splits are document-disjoint)
    _, train_rows = load_train_and_eval_rows(train_cfg, nla)
    assert [r.index for r in train_rows] == spread_rows(doc_ids, 6, docs=train_cfg.heldout_docs)
    # nla eval: the other half
    report = {doc_ids[i] for i in spread_rows(doc_ids, len(doc_ids), docs=eval_docs)}
    selecting = {r.doc_id for r in sft_rows} | {r.doc_id for r in train_rows}
    assert report and selecting and not report & selecting
    # spread: six rows from as many documents as the half holds, where the file's first six rows are two documents
    half = {doc_ids[i] for i in spread_rows(doc_ids, len(doc_ids), docs=sft_docs)}
    assert len({r.doc_id for r in sft_rows}) == min(6, len(half)) > len(set(doc_ids[:6])) == 2
