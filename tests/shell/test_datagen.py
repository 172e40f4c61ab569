"""`nla datagen`: document-disjoint splits, sidecars, captured activations, explainers, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import fixtures
from nla_core import parse_sidecar
from nla_shell import cli
from nla_shell.toy import builders as toy
from nla_shell.io.config import ConfigError
from nla_shell.io.data import DataError, check_tokenizer
from nla_shell.io.sidecars import load_sidecar
from nla_shell.pipeline.datagen import capture_activations, datagen
from nla_shell.pipeline.dataset_writer import EXTRA_COLUMNS
from nla_shell.pipeline.documents import assign_split, read_documents
from nla_shell.pipeline.markers import choose_injection_char, injection_char_problem
from nla_shell.explainers import Site
from nla_shell.explainers.rule import RuleExplainer
from nla_shell.io.sidecars import DEFAULT_AV_TEMPLATE
from nla_shell.toy.corpus import generate_documents

SPLITS = ("rl", "av_sft", "ar_sft", "eval")


def _rows(data_dir: Path, split: str) -> list[dict]:
    return pq.read_table(data_dir / f"{split}.parquet").to_pylist()


def test_splits_are_document_disjoint_with_the_promised_columns(toy_datasets):
    docs = {split: {r["doc_id"] for r in _rows(toy_datasets, split)} for split in SPLITS}
    assert all(docs.values()), "every split should get documents"
    for i, a in enumerate(SPLITS):
        for b in SPLITS[i + 1 :]:
            assert not docs[a] & docs[b], f"{a} and {b} share documents {docs[a] & docs[b]}"
    corpus = [json.loads(line)["id"] for line in (toy_datasets / "corpus.jsonl").read_text().splitlines()]
    assert set().union(*docs.values()) == set(corpus)  # no document lost (none is too short)
    template = yaml.safe_load((toy_datasets / "ar_sft.parquet.nla_meta.yaml").read_text())["prompt_templates"]["critic"]
    for split in SPLITS:
        rows = _rows(toy_datasets, split)
        assert list(rows[0]) == ["prompt", "activation_vector", "doc_id", "n_raw_tokens", "activation_layer",
                                 "position", "context", *EXTRA_COLUMNS[split]]
        assert all(r["position"] >= 4 for r in rows)  # min_context
        assert all(r["n_raw_tokens"] == r["position"] + 1 and r["activation_layer"] == 1 for r in rows)
        per_doc = {}
        for r in rows:
            per_doc.setdefault(r["doc_id"], []).append(r["position"])
        assert all(len(p) == len(set(p)) <= 3 for p in per_doc.values())  # distinct, positions_per_doc
        for r in rows:
            if "response" in r:  # upstream nla/schema.py wrap_explanation
                assert r["response"] == f"<explanation>\n{r['explanation']}\n</explanation>"
            if split == "ar_sft":  # upstream nla/datagen/stage3_build.py: the filled critic template
                assert r["prompt"] == template.format(explanation=r["explanation"])
    assert pq.ParquetFile(toy_datasets / "rl.parquet").schema_arrow.field("activation_vector").type.list_size == 64


def test_sidecars_round_trip_through_parse_and_the_tokenizer_check(toy_datasets, tiny_av_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_av_dir)
    for split in SPLITS:
        path = toy_datasets / f"{split}.parquet.nla_meta.yaml"
        mapping = yaml.safe_load(path.read_text(encoding="utf-8"))
        cfg = load_sidecar(path)
        assert cfg == parse_sidecar(mapping)
        check_tokenizer(cfg, tokenizer)
        stage = "av_sft" if split == "eval" else split
        assert (mapping["kind"], mapping["stage"], cfg.d_model, cfg.extraction_layer_index) == ("nla_dataset", stage, 64, 1)
        assert mapping["provenance"]["split"] == split and mapping["row_count"] == mapping["provenance"]["rows"]
        assert mapping["provenance"]["rows"] == pq.ParquetFile(toy_datasets / f"{split}.parquet").metadata.num_rows
        assert mapping["provenance"]["seed"] == 0 and mapping["provenance"]["model"] == str(tiny_av_dir.resolve())
        corpus_text = (toy_datasets / "corpus.jsonl").read_text(encoding="utf-8")
        assert cfg.injection_char not in corpus_text


def test_activation_equals_hidden_states_of_a_plain_forward(toy_datasets, tiny_av_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_av_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_av_dir)
    texts = {d["id"]: d["text"] for d in map(json.loads, (toy_datasets / "corpus.jsonl").read_text().splitlines())}
    layer = fixtures.LAYER_INDEX
    for row in _rows(toy_datasets, "rl")[:6]:
        ids = tokenizer.encode(texts[row["doc_id"]], add_special_tokens=False)
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[layer + 1]
        expected = hidden[0, row["position"]]
        torch.testing.assert_close(torch.tensor(row["activation_vector"]), expected, atol=1e-5, rtol=1e-5)
        assert row["context"] == tokenizer.decode(ids[: row["position"] + 1])


def test_capture_of_the_last_block_is_the_raw_residual(tiny_av_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_av_dir).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    last = model.config.num_hidden_layers - 1
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    raw = capture_activations(model, ids, torch.ones_like(ids), last)
    # HF applies the final norm to its last hidden state; the capture keeps the residual stream.
    torch.testing.assert_close(model.model.norm(raw), out.hidden_states[-1])
    assert not torch.allclose(raw, out.hidden_states[-1])


def test_rule_explainer_names_class_word_and_previous_word():
    docs = generate_documents(30, seed=1)
    tokenizer = toy.train_tokenizer(docs + ["the red cat sees a bread ."], vocab_size=400)
    ids = tokenizer.encode("the red cat sees a bread .", add_special_tokens=False)
    assert len(ids) == 7  # every toy word is one token
    sites = [Site("d", p, tuple(ids[: p + 1]), "", "") for p in (2, 3, 6)]
    assert RuleExplainer(tokenizer).explain(sites) == [
        "animal: cat, after red", "verb: sees, after cat", "punctuation: ., after bread",
    ]


def test_split_assignment_is_stable_and_follows_the_fractions():
    fractions = {"rl": 0.5, "av_sft": 0.3, "ar_sft": 0.0, "eval": 0.2}
    picks = [assign_split(f"doc{i}", 7, fractions) for i in range(4000)]
    assert picks == [assign_split(f"doc{i}", 7, fractions) for i in range(4000)]
    assert "ar_sft" not in picks
    for name in ("rl", "av_sft", "eval"):
        assert abs(picks.count(name) / len(picks) - fractions[name]) < 0.03
    assert picks != [assign_split(f"doc{i}", 8, fractions) for i in range(4000)]  # the seed matters


def test_read_documents_from_text_and_parquet(tmp_path):
    txt = tmp_path / "c.txt"
    txt.write_text("first doc\nstill first\n\n\nsecond doc\n")
    assert [(d.doc_id, d.text) for d in read_documents(txt)] == [
        ("doc000000", "first doc\nstill first"), ("doc000001", "second doc"),
    ]
    import pyarrow as pa

    pq.write_table(pa.table({"body": ["a b c", "d e"], "key": [10, 11]}), tmp_path / "c.parquet")
    docs = list(read_documents(tmp_path / "c.parquet", text_column="body", id_column="key"))
    assert [(d.doc_id, d.text) for d in docs] == [("10", "a b c"), ("11", "d e")]
    with pytest.raises(DataError, match="no column 'text'"):
        list(read_documents(tmp_path / "c.parquet"))


def test_short_documents_are_skipped_and_counted(tmp_path, tiny_av_dir, capsys):
    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl", n_docs=12, extra=["a", "the cat", ""])
    result = datagen(fixtures.datagen_config(tiny_av_dir, corpus, tmp_path / "out", av_sft_fraction=0,
                                             ar_sft_fraction=0, eval_fraction=0))
    assert (result.documents, result.skipped_short) == (15, 3)
    assert "skipped 3 of 15 documents" in capsys.readouterr().out
    provenance = yaml.safe_load((tmp_path / "out" / "rl.parquet.nla_meta.yaml").read_text())["provenance"]
    assert provenance["documents_skipped_short"] == 3
    assert not (tmp_path / "out" / "av_sft.parquet").exists()


def test_layer_beyond_the_model_is_refused_before_writing(tmp_path, tiny_av_dir, capsys):
    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl", n_docs=4)
    argv = ["datagen", "--model", str(tiny_av_dir), "--corpus", str(corpus), "--layer", "3",
            "--out-dir", str(tmp_path / "out"), "device=cpu", "explainer=rule"]
    assert cli.main(argv) == 2
    assert "'layer' = 3" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_requested_injection_char_is_used_or_refused_with_its_cause(tiny_tokenizer):
    template = DEFAULT_AV_TEMPLATE
    assert injection_char_problem(tiny_tokenizer, "§", template) is None
    assert "not one non-space character" in injection_char_problem(tiny_tokenizer, "ab", template)
    assert "2 tokens on its own" in injection_char_problem(tiny_tokenizer, "é", template)  # two byte tokens here
    assert choose_injection_char(tiny_tokenizer, set(), av_content=template, candidates="¶", requested="§") == "§"
    for requested, forbidden, why in (("é", set(), "is 2 tokens on its own"), ("§", {"§"}, "occurs in the corpus")):
        with pytest.raises(DataError, match=f"injection_char: {requested!r} {why}"):
            choose_injection_char(tiny_tokenizer, forbidden, av_content=template, candidates="§", requested=requested)


def test_no_usable_candidate_names_each_cause(tiny_tokenizer):
    with pytest.raises(DataError) as err:
        choose_injection_char(tiny_tokenizer, {"§"}, av_content=DEFAULT_AV_TEMPLATE, candidates="§é")
    assert "('§') occurs in the corpus" in str(err.value) and "('é') is 2 tokens on its own" in str(err.value)


def test_corpus_holding_the_injection_char_gets_another(tmp_path, tiny_av_dir):
    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl", n_docs=10, extra=["the cat § sees the dog ."])
    result = datagen(fixtures.datagen_config(tiny_av_dir, corpus, tmp_path / "out"))
    assert result.injection_char != "§"
    cfg = load_sidecar(tmp_path / "out" / "rl.parquet.nla_meta.yaml")
    assert cfg.injection_char == result.injection_char
    check_tokenizer(cfg, AutoTokenizer.from_pretrained(tiny_av_dir))


def test_explanations_file_missing_keys_names_them(tmp_path, tiny_av_dir, toy_datasets):
    corpus = toy_datasets / "corpus.jsonl"
    keyed = [(r["doc_id"], r["position"], r["explanation"]) for s in ("av_sft", "ar_sft", "eval")
             for r in _rows(toy_datasets, s)]
    lines = [json.dumps({"doc_id": d, "position": p, "explanation": f"custom {e}"}) for d, p, e in keyed]
    explanations = tmp_path / "explanations.jsonl"
    explanations.write_text("\n".join(lines[2:]) + "\n")
    cfg = fixtures.datagen_config(tiny_av_dir, corpus, tmp_path / "out", explainer="jsonl", explanations=str(explanations))
    with pytest.raises(DataError, match="no explanation for 2") as err:
        datagen(cfg)
    for doc_id, position, _ in keyed[:2]:
        assert f"({doc_id!r}, {position})" in str(err.value)
    assert not list((tmp_path / "out").glob("*.parquet"))

    explanations.write_text("\n".join(lines) + "\n")
    datagen(cfg)
    assert [r["explanation"] for r in _rows(tmp_path / "out", "eval")] == [
        f"custom {r['explanation']}" for r in _rows(toy_datasets, "eval")
    ]


def test_existing_datasets_are_refused_unless_overwrite(tmp_path, tiny_av_dir):
    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl", n_docs=12)
    cfg = fixtures.datagen_config(tiny_av_dir, corpus, tmp_path / "out")
    datagen(cfg)
    before = (tmp_path / "out" / "rl.parquet").read_bytes()
    with pytest.raises(ConfigError, match="already holds datasets"):
        datagen(cfg)
    datagen(fixtures.datagen_config(tiny_av_dir, corpus, tmp_path / "out", overwrite=True, positions_per_doc=2))
    assert (tmp_path / "out" / "rl.parquet").read_bytes() != before
    assert not (tmp_path / "out" / ".datagen_tmp").exists()
