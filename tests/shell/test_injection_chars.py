"""The per-model cache of proven injection characters (upstream's injection_token_cache.yaml).

conftest gives every test its own empty user cache ($NLA_INJECTION_CACHE).
"""

from __future__ import annotations

import pytest
import yaml

import fixtures
import qwen_vocab
from nla_shell import cli
from nla_shell.io.data import DataError
from nla_shell.io.injection_chars import SHIPPED_CACHE, cached_injection_char
from nla_shell.pipeline.datagen import datagen
from nla_shell.pipeline.markers import INJECTION_CHAR_CANDIDATES


class _Named:
    """A tokenizer under another name_or_path (the read-only session tokenizer is left alone)."""

    def __init__(self, tokenizer, name: str) -> None:
        self.name_or_path, self._tokenizer = name, tokenizer

    def encode(self, *args, **kwargs):
        return self._tokenizer.encode(*args, **kwargs)


def test_upstreams_entry_for_qwen3_holds_with_the_real_vocabulary():
    shipped = yaml.safe_load(SHIPPED_CACHE.read_text(encoding="utf-8"))
    assert shipped["Qwen/Qwen3-8B"] == {"char": "㈎", "token_id": 149705}  # EasyNLA's entry
    assert cached_injection_char(_Named(qwen_vocab.qwen3_tokenizer(), "Qwen/Qwen3-8B")) == "㈎"
    # Llama-3.3's entry (kitft's and EasyNLA's) is checked against the tokenizer it names: Qwen's vocabulary
    # encodes ㎡ otherwise, which is the drift the cache exists to catch.
    with pytest.raises(DataError, match=r"maps '㎡' to token 105565, but this tokenizer encodes it as \[\d+\]"):
        cached_injection_char(_Named(qwen_vocab.qwen3_tokenizer(), "meta-llama/Llama-3.3-70B-Instruct"))
    assert cached_injection_char(_Named(qwen_vocab.qwen3_tokenizer(), "")) is None  # an unnamed tokenizer


def test_datagen_records_its_choice_and_the_next_run_prefers_it(tiny_av_dir, tmp_path, fresh_injection_cache,
                                                                 monkeypatch):
    first = INJECTION_CHAR_CANDIDATES[0]
    marked = fixtures.write_toy_corpus(tmp_path / "marked.jsonl", n_docs=12, extra=[f"the cat {first} sat"])
    clean = fixtures.write_toy_corpus(tmp_path / "clean.jsonl", n_docs=12)
    # The marked corpus holds the first candidate, so this run takes another and records it.
    chosen = datagen(fixtures.datagen_config(tiny_av_dir, marked, tmp_path / "a")).injection_char
    assert chosen != first
    cache = yaml.safe_load(fresh_injection_cache.read_text(encoding="utf-8"))
    token_id = fixtures.tiny_tokenizer().encode(chosen, add_special_tokens=False)
    assert cache == {str(tiny_av_dir.resolve()): {"char": chosen, "token_id": token_id[0]}}
    # A clean corpus would allow the first candidate, but the model's proven character comes first.
    assert datagen(fixtures.datagen_config(tiny_av_dir, clean, tmp_path / "b")).injection_char == chosen
    monkeypatch.setenv("NLA_INJECTION_CACHE", str(tmp_path / "empty.yaml"))
    assert datagen(fixtures.datagen_config(tiny_av_dir, clean, tmp_path / "c")).injection_char == first


def test_a_drifted_entry_stops_datagen_in_one_line_before_anything_is_written(tiny_av_dir, tmp_path,
                                                                               fresh_injection_cache, capsys):
    fresh_injection_cache.write_text(yaml.safe_dump({str(tiny_av_dir.resolve()): {"char": "¶", "token_id": 3}},
                                                    allow_unicode=True), encoding="utf-8")
    corpus = fixtures.write_toy_corpus(tmp_path / "corpus.jsonl", n_docs=12)
    cfg = fixtures.datagen_config(tiny_av_dir, corpus, tmp_path / "out")
    capsys.readouterr()
    items = (f"{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in vars(cfg).items()
             if v is not None and k not in ("av_template", "ar_template"))
    assert cli.main(["datagen", *items]) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert str(fresh_injection_cache) in error and "maps '¶' to token 3" in error and "delete that entry" in error
    assert not (tmp_path / "out").exists()
