"""Qwen3's real vocabulary: the tokenizer fixture against the package's encoder, the injection
character it gets, and the whole pipeline on a tiny random Qwen3 with vocab 151,936."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import fixtures
import qwen_vocab
from nla_shell import cli
from nla_shell.io.data import DataError
from nla_shell.io.sidecars import load_sidecar
from nla_shell.pipeline.markers import (
    INJECTION_CHAR_CANDIDATES,
    choose_injection_char,
    injection_char_candidates,
    injection_char_problem,
)
from nla_shell.io.sidecars import DEFAULT_AV_TEMPLATE

SAMPLES = (
    "The cat sat on the mat.  Twice!\n\nIt's 2024, isn't it?",
    "Explain the activation at ㈎. Then § and ¶ and ※ at the end§",
    "中文测试：模型在读取上下文。 ünïcödé e\u0301 café\r\n\ttabs   and    spaces",
    "def add(a, b):\n    return a + b  # 42\n",
)


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    return qwen_vocab.qwen3_tokenizer()


def test_fixture_encodes_exactly_as_the_package_and_holds_qwen3s_added_tokens(qwen3_tokenizer):
    reference = qwen_vocab.package_encoder()
    for text in SAMPLES:
        ids = qwen3_tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text)
        assert qwen3_tokenizer.decode(ids) == reference.decode(ids)
    assert len(qwen3_tokenizer) == 151669
    for token_id, content, _ in qwen_vocab.QWEN3_ADDED_TOKENS:
        assert qwen3_tokenizer.convert_tokens_to_ids(content) == token_id
    assert (qwen3_tokenizer.pad_token_id, qwen3_tokenizer.eos_token_id) == (151643, 151645)
    assert qwen3_tokenizer.encode("㈎", add_special_tokens=False) == [qwen_vocab.QWEN_INJECTION_TOKEN_ID]


def test_qwen_gets_its_injection_char_and_symbols_are_refused_for_merging_with_a_space(qwen3_tokenizer):
    from transformers import Qwen3Config

    candidates = list(injection_char_candidates(Qwen3Config(), qwen3_tokenizer))
    assert candidates[0] == "㈎"
    assert choose_injection_char(qwen3_tokenizer, set(), av_content=DEFAULT_AV_TEMPLATE, candidates=candidates) == "㈎"
    # "at §." tokenizes as "at", " §", ".": the bare "§" token never appears in the prompt.
    assert "merges with its neighbours" in injection_char_problem(qwen3_tokenizer, "§", DEFAULT_AV_TEMPLATE)
    with pytest.raises(DataError) as err:
        choose_injection_char(qwen3_tokenizer, {"㈎"}, av_content=DEFAULT_AV_TEMPLATE,
                              candidates="㈎" + INJECTION_CHAR_CANDIDATES[:6])
    message = str(err.value)
    assert "('㈎') occurs in the corpus" in message and "merges with its neighbours in the chat-templated AV prompt" in message


def _tiny_qwen3(directory: Path, tokenizer) -> Path:
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=qwen_vocab.QWEN3_VOCAB_SIZE, hidden_size=16, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
                         max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_whole_pipeline_on_a_tiny_qwen3_with_the_real_vocabulary(tmp_path, qwen3_tokenizer, capsys):
    model = _tiny_qwen3(tmp_path / "qwen3", qwen3_tokenizer)
    corpus = fixtures.write_toy_corpus(tmp_path / "corpus.jsonl", n_docs=20)
    data = tmp_path / "data"
    assert cli.main(["datagen", f"model={model}", f"corpus={corpus}", "layer=1", f"out_dir={data}", "explainer=rule",
                     "positions_per_doc=3", "batch_size=10", "device=cpu", "progress=false"]) == 0
    nla = load_sidecar(data / "rl.parquet.nla_meta.yaml")
    assert (nla.injection_char, nla.injection_token_id) == ("㈎", qwen_vocab.QWEN_INJECTION_TOKEN_ID)
    sft = dict(num_steps=1, batch_size=2, micro_batch=2, lora_r=4, lora_alpha=4, save_every=1, logger="jsonl",
               device="cpu", dtype="float32")
    for mode in ("av", "ar"):
        assert cli.main(["sft", f"mode={mode}", f"model={model}", f"parquet={data / f'{mode}_sft.parquet'}",
                         f"save_dir={tmp_path / mode}", *(f"{k}={v}" for k, v in sft.items())]) == 0
    av, ar = tmp_path / "av" / "step_000001", tmp_path / "ar" / "step_000001"
    assert cli.main(["train", f"av_ckpt={av}", f"ar_ckpt={ar}", f"rl_parquet={data / 'rl.parquet'}",
                     f"save_dir={tmp_path / 'run'}", "num_steps=1", "batch_prompts=2", "group_size=2",
                     "max_new_tokens=6", "lora_r=4", "lora_alpha=8", "eval_every=0", "max_rows=8", "save_every=1",
                     "device=cpu", "logger=jsonl"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and math.isfinite(lines[0]["loss"])
    assert cli.main(["eval", "--av", str(av), "--ar", str(ar), "--parquet", str(data / "eval.parquet"), "--n-rows", "3",
                     "--max-new-tokens", "6", "--out-dir", str(tmp_path / "eval"), "device=cpu"]) == 0
    assert math.isfinite(json.loads((tmp_path / "eval" / "eval_summary.json").read_text())["gold/fve"])
    capsys.readouterr()
    assert cli.main(["explain", "--av", str(av), "--ar", str(ar), "--model", str(model), "--text",
                     "The cat sat on the mat.", "--position", "-1", "--max-new-tokens", "6", "device=cpu"]) == 0
    assert "token" in capsys.readouterr().out


def test_the_vocabulary_search_finds_a_marker_when_no_listed_character_serves(qwen3_tokenizer):
    from transformers import Qwen3Config

    from nla_shell.pipeline.markers import QWEN_INJECTION_CHAR, UPSTREAM_RANGE

    listed = set(INJECTION_CHAR_CANDIDATES + QWEN_INJECTION_CHAR)  # as if the corpus held every listed one
    char = choose_injection_char(qwen3_tokenizer, listed, av_content=DEFAULT_AV_TEMPLATE,
                                 candidates=injection_char_candidates(Qwen3Config(), qwen3_tokenizer))
    assert char not in listed and injection_char_problem(qwen3_tokenizer, char, DEFAULT_AV_TEMPLATE) is None
    assert UPSTREAM_RANGE[0] <= ord(char) <= UPSTREAM_RANGE[1]  # upstream's range is searched first
    (marker,) = qwen3_tokenizer.encode(char, add_special_tokens=False)
    assert qwen3_tokenizer.decode([marker]) == char
