"""A marker that carries its leading space: when the AV template puts a space before <INJECT>,
a byte-level BPE fuses it with every bare character, and the marker becomes the vocabulary's
" X" token (GPT-2's 'Ġ' + X). The tokenizer here is the toy byte-level BPE with both "一" and
" 一" forced to single tokens; its ASCII symbols (~ ^ | @) would serve bare, as this small
vocabulary learned no 'Ġ~' merge, so the corpora below hold them."""

from __future__ import annotations

import json

import fixtures
import pytest
import upstream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, Qwen3Config

from nla_core import INJECT_PLACEHOLDER, marker_char, marker_content, parse_sidecar
from nla_shell import cli
from nla_shell.toy import builders as toy
from nla_shell.io.data import DataError, av_prompt_messages, build_prompt_ids, chat_prompt_ids, chat_prompt_text, check_tokenizer
from nla_shell.io.sidecars import Injection, dataset_sidecar, load_sidecar, model_sidecar, write_sidecar
from nla_shell.pipeline.markers import choose_injection_char, injection_char_candidates, injection_char_problem

SPACED = " 一"
TEMPLATE = "Explain: <INJECT>"
BARE_ASCII = set("~^|@")


@pytest.fixture(scope="module")
def spaced_tokenizer():
    return toy.train_tokenizer(fixtures.TINY_CORPUS, vocab_size=512, injection_char=SPACED)


def _choose(tokenizer, av_content: str, forbidden=BARE_ASCII) -> str:
    return choose_injection_char(tokenizer, set(forbidden), av_content=av_content,
                                 candidates=injection_char_candidates(Qwen3Config(), tokenizer, av_content=av_content))


def test_a_spaced_placeholder_gets_the_token_that_carries_the_space(spaced_tokenizer):
    tok = spaced_tokenizer
    assert "merges with its neighbours" in injection_char_problem(tok, "一", TEMPLATE)  # fused with the space
    char = _choose(tok, TEMPLATE)
    assert char == SPACED and marker_char(char) == "一"
    stored = marker_content(TEMPLATE, char)
    assert stored == "Explain:<INJECT>"
    # The stored template filled with the marker is the template as written, and holds one marker token.
    assert chat_prompt_text(av_prompt_messages(stored), char, tok) == chat_prompt_text(av_prompt_messages(TEMPLATE), "一", tok)
    (marker,) = tok.encode(char, add_special_tokens=False)
    assert chat_prompt_ids(av_prompt_messages(stored), char, tok).count(marker) == 1
    # A tight template keeps the bare character; a spaced marker there is refused, naming why.
    assert _choose(tok, "Explain:<INJECT>") == "一"
    assert "carries a leading space" in injection_char_problem(tok, SPACED, "Explain:<INJECT>")
    with pytest.raises(DataError, match="injection_char: ' 一' carries a leading space"):
        choose_injection_char(tok, set(), av_content="Explain:<INJECT>", candidates="", requested=SPACED)
    # The corpus rules the marker out by its character.
    with pytest.raises(DataError, match="occurs in the corpus"):
        choose_injection_char(tok, {"一"}, av_content=TEMPLATE, candidates="", requested=SPACED)


def test_the_spaced_marker_round_trips_through_the_sidecar_to_the_same_prompt_ids(tmp_path, spaced_tokenizer):
    tok = spaced_tokenizer
    char = _choose(tok, TEMPLATE)
    stored = marker_content(TEMPLATE, char)
    datagen_ids = chat_prompt_ids(av_prompt_messages(stored), char, tok)  # the prompt column datagen writes
    mapping = dataset_sidecar(tok, stage="rl", row_count=1, base_model="m", d_model=8, layer_index=0, corpus="c.jsonl",
                              positions_per_doc=1, av_content=stored, ar_template="Text: {explanation}", injection_char=char)
    path = tmp_path / "rl.parquet.nla_meta.yaml"
    write_sidecar(mapping, path)
    assert mapping["tokens"]["injection_char"] == SPACED and mapping["prompt_templates"]["actor"] == "Explain:{injection_char}"
    cfg = load_sidecar(path)
    assert cfg.injection_char == SPACED
    check_tokenizer(cfg, tok)
    # Train time (build_prompt_ids on the sidecar's template) and upstream's reader build the same ids.
    assert build_prompt_ids(av_prompt_messages(cfg.actor_prompt_template), cfg, tok) == datagen_ids
    # An exported model sidecar (nla export, nla_shell.io.sidecars.model_sidecar) names the same prompt.
    exported = parse_sidecar(model_sidecar(cfg, role="av", stage="rl", base_checkpoint="m",
                                           injection=Injection("residual_add", None, 1), trained_on=[]))
    assert (exported.injection_char, exported.actor_prompt_template) == (cfg.injection_char, cfg.actor_prompt_template)
    ours = upstream.load_config(tmp_path / "rl.parquet", tok)  # kitft nla/config.py's asserts, one marker included
    assert upstream.canonical_ids(tok, ours.actor_prompt_template, ours.injection_char) == datagen_ids


def test_parse_sidecar_takes_one_character_or_a_space_and_one():
    base = {"kind": "nla_dataset", "extraction": {"d_model": 8},
            "tokens": {"injection_token_id": 5, "injection_left_neighbor_id": 4, "injection_right_neighbor_id": 6},
            "prompt_templates": {"actor": "a:{injection_char}", "critic": "{explanation}"}}
    for good in ("一", " 一"):
        assert parse_sidecar({**base, "tokens": {**base["tokens"], "injection_char": good}}).injection_char == good
    for bad in ("ab", "  一", " ", "一 "):
        with pytest.raises(ValueError, match="tokens.injection_char"):
            parse_sidecar({**base, "tokens": {**base["tokens"], "injection_char": bad}})


_TEXT = st.text(alphabet="abc .:\n()<>", max_size=12).filter(lambda t: INJECT_PLACEHOLDER not in t)


@given(prefix=_TEXT, suffix=_TEXT, marker=st.sampled_from(["一", " 一", "§", " §"]))
def test_marker_content_rebuilds_the_text_as_written(prefix, suffix, marker):
    content = f"{prefix} {INJECT_PLACEHOLDER}{suffix}"
    stored = marker_content(content, marker)
    assert stored.count(INJECT_PLACEHOLDER) == 1
    assert stored.replace(INJECT_PLACEHOLDER, marker) == content.replace(INJECT_PLACEHOLDER, marker.lstrip(" "))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefix=st.text(alphabet="abcxyz .:\n", min_size=1, max_size=10), spaced=st.booleans(),
       suffix=st.text(alphabet="abcxyz .:\n", max_size=10))
def test_whatever_marker_is_chosen_the_prompt_holds_it_once_at_a_clean_boundary(spaced_tokenizer, prefix, spaced, suffix):
    tok = spaced_tokenizer
    template = prefix.rstrip(" ") + (" " if spaced else "") + INJECT_PLACEHOLDER + suffix
    try:
        char = _choose(tok, template)
    except DataError:
        return  # no marker fits this template: the error says so
    stored = marker_content(template, char)
    text = chat_prompt_text(av_prompt_messages(stored), char, tok)
    assert text == chat_prompt_text(av_prompt_messages(template), char.lstrip(" "), tok)  # the text as written
    ids = tok.encode(text, add_special_tokens=False)
    (marker,) = tok.encode(char, add_special_tokens=False)
    before, after = text.split(char)
    assert ids.count(marker) == 1
    assert tok.encode(before, add_special_tokens=False) + [marker] + tok.encode(after, add_special_tokens=False) == ids


def test_write_sites_and_the_labelled_run_agree_on_the_spaced_marker(tmp_path, spaced_tokenizer, capsys):
    av = fixtures.build_av_dir(tmp_path / "av", spaced_tokenizer)
    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl", n_docs=12, extra=["the cat ~ sat ^ on | the @ mat ."])
    common = ["datagen", "--model", str(av), "--corpus", str(corpus), "--layer", str(fixtures.LAYER_INDEX),
              "--out-dir", str(tmp_path / "out"), "device=cpu", "progress=false", "positions_per_doc=2",
              "batch_size=4", f"av_template={TEMPLATE}"]
    sites_file = tmp_path / "to_label.jsonl"
    assert cli.main([*common, f"write_sites={sites_file}"]) == 0
    assert f"(injection char {SPACED!r})" in capsys.readouterr().out
    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text("".join(json.dumps({**json.loads(line), "explanation": "a label"}) + "\n"
                                for line in sites_file.read_text().splitlines()))
    assert cli.main([*common, "explainer=jsonl", f"explanations={labelled}"]) == 0
    tok = AutoTokenizer.from_pretrained(av)
    for split in ("rl", "av_sft", "eval"):
        cfg = load_sidecar(tmp_path / "out" / f"{split}.parquet")
        assert cfg.injection_char == SPACED and cfg.actor_prompt_template == "Explain:<INJECT>"
        check_tokenizer(cfg, tok)
        prompt = upstream.read_rows(tmp_path / "out" / f"{split}.parquet")[0]["prompt"]  # the prompt column
        assert build_prompt_ids(prompt, cfg, tok) == upstream.canonical_ids(tok, "Explain: {injection_char}", "一")
