"""nla_shell.toy.builders: the hub-free tokenizer, tiny Qwen3 and RL parquet (with its sidecar) builders."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import fixtures
from nla_shell.toy import builders as toy
from nla_shell.io.sidecars import load_sidecar

AV_PROMPT = [{"role": "user", "content": "Explain the activation at <INJECT>."}]


@pytest.mark.parametrize("char", ["§", "※", "#"])  # 2-byte (collides with a byte symbol), 3-byte, ASCII
def test_injection_char_is_one_token_everywhere(char):
    tok = toy.train_tokenizer(fixtures.TINY_CORPUS + ("a # b",), injection_char=char)
    (marker,) = tok.encode(char, add_special_tokens=False)
    for text in (f"at {char}.", f"x{char}y", f"{char}{char}", f"café {char} ç", f"\n{char}\n"):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids.count(marker) == text.count(char), (text, tok.convert_ids_to_tokens(ids))
        assert tok.decode(ids) == text
    assert tok.decode([marker], skip_special_tokens=True) == char


def test_special_tokens_and_explanation_tags(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.convert_ids_to_tokens([0, 1, 2]) == list(toy.SPECIAL_TOKENS)
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<|endoftext|>", "<|im_end|>", None)
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2
    open_ids = tok.encode("<explanation>", add_special_tokens=False)
    close_ids = tok.encode("</explanation>", add_special_tokens=False)
    assert len(open_ids) == 1 and len(close_ids) == 1
    text = "<|im_start|>assistant\n<explanation>a cat</explanation><|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<explanation>a cat</explanation>"
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)  # no BOS


def test_chat_template_is_chatml(tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi §."}]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi §.<|im_end|>\n<|im_start|>assistant\n"
    no_gen = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_gen == text.removesuffix("<|im_start|>assistant\n")


def test_tokenizer_training_is_deterministic(tiny_tokenizer):
    again = toy.train_tokenizer(fixtures.TINY_CORPUS, vocab_size=512)
    assert again.backend_tokenizer.to_str() == tiny_tokenizer.backend_tokenizer.to_str()


def test_non_single_char_rejected():
    with pytest.raises(ValueError, match="injection_char"):
        toy.train_tokenizer(["abc"], injection_char="ab")


def test_tiny_qwen3_config_and_generation_defaults(tiny_tokenizer):
    model = toy.build_tiny_qwen3(tiny_tokenizer, seed=3)
    cfg = model.config
    assert cfg.vocab_size == len(tiny_tokenizer)
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.tie_word_embeddings) == (2, 0, False)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (64, 2, 2, 16)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    gen = model.generation_config
    assert (gen.do_sample, gen.top_k, gen.top_p, gen.temperature, gen.repetition_penalty) == (True, 0, 1.0, 1.0, 1.0)
    same = toy.build_tiny_qwen3(tiny_tokenizer, seed=3)
    other = toy.build_tiny_qwen3(tiny_tokenizer, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values()))
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
    ids = torch.tensor([tiny_tokenizer.encode("The cat sat.", add_special_tokens=False)])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tiny_tokenizer))
    assert toy.build_tiny_qwen3(tiny_tokenizer, dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16


def test_saved_av_checkpoint_reloads_identically(tiny_av_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_av_dir)
    built = toy.build_tiny_qwen3(tiny_tokenizer, hidden_size=fixtures.D_MODEL, num_layers=fixtures.NUM_LAYERS, seed=0)
    saved, fresh = model.state_dict(), built.state_dict()
    assert saved.keys() == fresh.keys()
    assert all(torch.equal(saved[k], fresh[k]) for k in saved)
    assert model.generation_config.top_k == 0 and model.generation_config.do_sample is True
    tok = AutoTokenizer.from_pretrained(tiny_av_dir)
    text = tok.apply_chat_template(AV_PROMPT, tokenize=False, add_generation_prompt=True)
    assert text == tiny_tokenizer.apply_chat_template(AV_PROMPT, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text.replace("<INJECT>", "§"), add_special_tokens=False) == tiny_tokenizer.encode(
        text.replace("<INJECT>", "§"), add_special_tokens=False
    )
    assert (tok.eos_token, tok.pad_token, len(tok)) == ("<|im_end|>", "<|endoftext|>", len(tiny_tokenizer))


def test_write_rl_parquet_schema(tmp_path):
    rows = [
        {"prompt": AV_PROMPT, "activation_vector": [1.0, 2.0, 3.0], "doc_id": "d0", "position": 5, "context": "ab"},
        {"prompt": AV_PROMPT, "activation_vector": [4.0, 5.0, 6.0], "doc_id": "d1", "position": 6, "context": "cd"},
    ]
    path = toy.write_rl_parquet(tmp_path / "x.parquet", rows, row_group_size=1)
    pf = pq.ParquetFile(path)
    assert pf.num_row_groups == 2
    schema = pf.schema_arrow
    assert schema.field("activation_vector").type == pa.list_(pa.float32(), 3)
    assert schema.field("prompt").type == pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert (schema.field("doc_id").type, schema.field("position").type) == (pa.string(), pa.int64())
    assert pq.read_table(path).to_pylist() == rows
    bare = toy.write_rl_parquet(tmp_path / "y.parquet", [{k: rows[0][k] for k in ("prompt", "activation_vector", "doc_id")}])
    assert pq.ParquetFile(bare).schema_arrow.names == ["prompt", "activation_vector", "doc_id"]


def test_toy_rl_dataset_is_seeded_and_consistent(tmp_path, tiny_tokenizer):
    a = fixtures.build_toy_rl(tmp_path / "a", tiny_tokenizer, n_rows=20, n_docs=5, seed=1)
    b = fixtures.build_toy_rl(tmp_path / "b", tiny_tokenizer, n_rows=20, n_docs=5, seed=1)
    c = fixtures.build_toy_rl(tmp_path / "c", tiny_tokenizer, n_rows=20, n_docs=5, seed=2)
    assert fixtures.read_rows(a) == fixtures.read_rows(b) != fixtures.read_rows(c)
    assert pq.ParquetFile(a).num_row_groups == 3
    rows = fixtures.read_rows(a)
    assert {r["doc_id"] for r in rows} <= {f"doc{i:04d}" for i in range(5)}
    assert all(r["prompt"] == [{"role": "user", "content": toy.DEFAULT_AV_TEMPLATE}] for r in rows)
    cfg = load_sidecar(a.with_name("rl.parquet.nla_meta.yaml"))
    assert cfg.d_model == fixtures.D_MODEL and cfg.actor_prompt_template == toy.DEFAULT_AV_TEMPLATE
