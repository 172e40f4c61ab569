"""nla_shell.io.data: sidecar lookup, tokenizer checks, prompt ids, streaming, eval split, bad input."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import fixtures
from nla_core import marker_well_formed
from nla_shell.toy import builders as toy
from nla_shell.io.data import (
    DataError,
    build_prompt_ids,
    chat_prompt_ids,
    check_tokenizer,
    RowWindows,
    load_eval_rows,
    load_rows,
    row_windows,
    stream_rows,
    validate_parquet_schema,
)
from nla_shell.io.sidecars import find_sidecar, load_sidecar

DRIFT_FIX = "regenerate the sidecar with this tokenizer or point av_ckpt at the tokenizer the data was made with"


@pytest.fixture
def rl(toy_rl_dir: Path) -> Path:
    return toy_rl_dir / "rl.parquet"


@pytest.fixture
def cfg(rl: Path):
    return load_sidecar(find_sidecar(rl))


def rewrite(path: Path, edit) -> Path:
    """Apply `edit(rows)` to the rows of an RL parquet and write them back (fixed-size layout)."""
    rows = fixtures.read_rows(path)
    edit(rows)
    return toy.write_rl_parquet(path, rows, row_group_size=8)


# ---------------------------------------------------------------- sidecar


def test_find_sidecar_prefers_the_file_sidecar_then_the_directory(rl):
    assert find_sidecar(rl) == rl.with_name("rl.parquet.nla_meta.yaml")
    rl.with_name("rl.parquet.nla_meta.yaml").rename(rl.with_name("nla_meta.yaml"))
    assert find_sidecar(rl) == rl.with_name("nla_meta.yaml")
    rl.with_name("nla_meta.yaml").unlink()
    with pytest.raises(DataError, match="sidecar") as err:
        find_sidecar(rl)
    assert "rl.parquet.nla_meta.yaml" in str(err.value) and str(rl.with_name("nla_meta.yaml")) in str(err.value)


def test_load_sidecar_errors_name_the_file_and_key(tmp_path, rl):
    mapping = yaml.safe_load(find_sidecar(rl).read_text(encoding="utf-8"))
    del mapping["tokens"]["injection_token_id"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(mapping), encoding="utf-8")
    with pytest.raises(DataError, match=r"tokens\.injection_token_id") as err:
        load_sidecar(bad)
    assert str(bad) in str(err.value)
    (tmp_path / "broken.yaml").write_text("kind: [unclosed", encoding="utf-8")
    with pytest.raises(DataError, match="cannot read"):
        load_sidecar(tmp_path / "broken.yaml")


# ---------------------------------------------------------------- tokenizer checks


def test_check_tokenizer_accepts_the_matching_tokenizer_saved_and_reloaded(cfg, tiny_av_dir):
    from transformers import AutoTokenizer

    check_tokenizer(cfg, AutoTokenizer.from_pretrained(tiny_av_dir))


def test_tokenizer_drift_names_the_field_both_values_and_the_fix(cfg):
    other = toy.train_tokenizer(["A completely different corpus, with other merges entirely."] * 3, vocab_size=300)
    live = other.encode("§", add_special_tokens=False)[0]
    assert live != cfg.injection_token_id
    with pytest.raises(DataError) as err:
        check_tokenizer(cfg, other)
    msg = str(err.value)
    assert "tokens.injection_token_id" in msg and str(cfg.injection_token_id) in msg and str(live) in msg
    assert DRIFT_FIX in msg


@pytest.mark.parametrize("side", ["left", "right"])
def test_neighbour_drift_names_the_field(cfg, tiny_tokenizer, side):
    field = f"injection_{side}_neighbor_id"
    drifted = dataclasses.replace(cfg, **{field: getattr(cfg, field) + 1})
    with pytest.raises(DataError, match=f"tokens.{field}: sidecar says {getattr(cfg, field) + 1}, the tokenizer gives"):
        check_tokenizer(drifted, tiny_tokenizer)


def test_multi_token_injection_char_is_drift(cfg, tiny_tokenizer):
    with pytest.raises(DataError, match=r"tokens\.injection_char: '¤' encodes to 2 tokens"):
        check_tokenizer(dataclasses.replace(cfg, injection_char="¤"), tiny_tokenizer)


def test_marker_in_other_context_fails_the_check(cfg, tiny_tokenizer):
    with pytest.raises(DataError, match="tokens.injection_left_neighbor_id"):
        check_tokenizer(cfg, tiny_tokenizer, [{"role": "user", "content": "Look:<INJECT>."}])


# ---------------------------------------------------------------- prompt ids


def test_build_prompt_ids_matches_the_reference_recipe(cfg, tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": cfg.actor_prompt_template}]
    ids = build_prompt_ids(messages, cfg, tiny_tokenizer)
    text = tiny_tokenizer.apply_chat_template(
        [messages[0], {"role": "user", "content": cfg.actor_prompt_template.replace("<INJECT>", "§")}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ids == tiny_tokenizer.encode(text, add_special_tokens=False) == chat_prompt_ids(messages, "§", tiny_tokenizer)
    assert ids[0] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")  # no BOS in front
    assert marker_well_formed(
        ids,
        marker_id=cfg.injection_token_id,
        left_id=cfg.injection_left_neighbor_id,
        right_id=cfg.injection_right_neighbor_id,
    )


@pytest.mark.parametrize("content,count", [("Explain the activation.", 0), ("At <INJECT>. And <INJECT>.", 2)])
def test_build_prompt_ids_wants_exactly_one_placeholder(cfg, tiny_tokenizer, content, count):
    with pytest.raises(DataError, match=f"prompt: row 7 holds {count} <INJECT> placeholders"):
        build_prompt_ids([{"role": "user", "content": content}], cfg, tiny_tokenizer, row=7)


def test_build_prompt_ids_rejects_the_injection_char_in_the_text(cfg, tiny_tokenizer):
    messages = [{"role": "user", "content": "See § 4. " + cfg.actor_prompt_template}]
    with pytest.raises(DataError, match="occurs 2 times after templating"):
        build_prompt_ids(messages, cfg, tiny_tokenizer)


def test_build_prompt_ids_rejects_other_neighbours(cfg, tiny_tokenizer):
    with pytest.raises(DataError, match="neighbours are"):
        build_prompt_ids([{"role": "user", "content": "Look:<INJECT>!"}], cfg, tiny_tokenizer, row=3)


# ---------------------------------------------------------------- streaming


def _expected(rows, i):
    return rows[i]["prompt"], torch.tensor(rows[i]["activation_vector"], dtype=torch.float32), rows[i]["doc_id"]


def test_stream_equals_a_full_read(rl, cfg):
    full = fixtures.read_rows(rl)
    streamed = list(stream_rows(rl, cfg, extra_columns=("position", "context")))
    assert [r.index for r in streamed] == list(range(len(full)))
    for row in streamed:
        prompt, act, doc = _expected(full, row.index)
        assert (row.prompt, row.doc_id) == (prompt, doc)
        assert row.activation.dtype == torch.float32 and row.activation.shape == (cfg.d_model,)
        assert torch.equal(row.activation, act)
        assert row.extras == {"position": full[row.index]["position"], "context": full[row.index]["context"]}


@settings(max_examples=25, deadline=None)
@given(
    group=st.integers(1, 12),
    start=st.integers(0, 30),
    length=st.one_of(st.none(), st.integers(0, 30)),
    variable=st.booleans(),
)
def test_stream_window_equals_the_slice(tmp_path_factory, group, start, length, variable):
    directory = tmp_path_factory.mktemp("window")
    path = fixtures.build_toy_rl(directory, n_rows=25, n_docs=5, seed=group, row_group_size=group)
    full = fixtures.read_rows(path)
    if variable:
        fixtures.write_list_parquet(path, full, row_group_size=group)
    cfg = load_sidecar(find_sidecar(path))
    stop = None if length is None else start + length
    got = list(stream_rows(path, cfg, start=start, stop=stop))
    assert [r.index for r in got] == list(range(25))[start:stop]
    for row in got:
        assert torch.equal(row.activation, _expected(full, row.index)[1])


def test_load_rows_max_rows_and_validation_only_of_what_is_read(rl, cfg):
    rewrite(rl, lambda rows: rows[40]["activation_vector"].__setitem__(0, math.nan))
    assert [r.index for r in load_rows(rl, cfg, max_rows=16)] == list(range(16))
    with pytest.raises(DataError, match="row 40"):
        load_rows(rl, cfg)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("column", ["prompt", "activation_vector", "doc_id"])
def test_missing_column(rl, cfg, column):
    table = pq.read_table(rl)
    pq.write_table(table.drop_columns([column]), rl)
    with pytest.raises(DataError, match=f"^rl_parquet: .* has no column '{column}'.*written by nla datagen") as err:
        load_rows(rl, cfg)
    assert str([n for n in table.column_names if n != column]) in str(err.value)
    with pytest.raises(DataError, match=f"^parquet: .* has no column '{column}'"):
        list(stream_rows(rl, cfg, key="parquet"))  # nla sft and nla eval name their own key


def test_activation_width_differs_from_sidecar(tmp_path, tiny_tokenizer, cfg):
    narrow = fixtures.build_toy_rl(tmp_path / "narrow", tiny_tokenizer)
    rows = fixtures.read_rows(narrow)
    for r in rows:
        r["activation_vector"] = r["activation_vector"][:32]
    toy.write_rl_parquet(narrow, rows)
    with pytest.raises(DataError, match=r"activation_vector: length \[32\] .* d_model is 64"):
        validate_parquet_schema(narrow, d_model=cfg.d_model)
    fixtures.write_list_parquet(narrow, rows)  # variable-length lists: caught from the first row group
    with pytest.raises(DataError, match=r"activation_vector: length \[32\] .* d_model is 64"):
        stream_rows(narrow, cfg)


def test_one_row_of_wrong_length_in_a_later_row_group(rl, cfg):
    rows = fixtures.read_rows(rl)
    rows[19]["activation_vector"] = rows[19]["activation_vector"][:-1]
    fixtures.write_list_parquet(rl, rows)
    validate_parquet_schema(rl, d_model=cfg.d_model)  # the first row group is fine
    with pytest.raises(DataError, match=f"activation_vector: row 19 \\(doc_id '{rows[19]['doc_id']}'\\) has length 63"):
        load_rows(rl, cfg)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_activation(rl, cfg, value):
    rows = fixtures.read_rows(rl)
    rewrite(rl, lambda rs: rs[13]["activation_vector"].__setitem__(5, value))
    with pytest.raises(DataError, match=f"activation_vector: row 13 \\(doc_id '{rows[13]['doc_id']}'\\) holds NaN or inf"):
        load_rows(rl, cfg)


def test_all_zero_activation(rl, cfg):
    rewrite(rl, lambda rs: rs[2].__setitem__("activation_vector", [0.0] * cfg.d_model))
    with pytest.raises(DataError, match="activation_vector: row 2 .* is all zeros, which cannot be norm-matched"):
        load_rows(rl, cfg)


@pytest.mark.parametrize("content,count", [("no placeholder", 0), ("<INJECT> and <INJECT>", 2)])
def test_stored_prompt_with_wrong_placeholder_count(rl, cfg, content, count):
    rewrite(rl, lambda rs: rs[9].__setitem__("prompt", [{"role": "user", "content": content}]))
    with pytest.raises(DataError, match=f"prompt: row 9 \\(doc_id '.*'\\) holds {count} <INJECT>"):
        load_rows(rl, cfg)


def test_wrong_column_types(rl, cfg):
    table = pq.read_table(rl)
    as_text = table.set_column(0, "prompt", pa.array(["x"] * table.num_rows))
    pq.write_table(as_text, rl)
    with pytest.raises(DataError, match="prompt: column type is string"):
        validate_parquet_schema(rl, d_model=cfg.d_model)
    ints = pa.array([[1] * cfg.d_model] * table.num_rows, type=pa.list_(pa.int64()))
    pq.write_table(table.set_column(1, "activation_vector", ints), rl)
    with pytest.raises(DataError, match="activation_vector: column type is list<.*int64>, expected a list of floats"):
        validate_parquet_schema(rl, d_model=cfg.d_model)


def test_null_doc_id(rl, cfg):
    rewrite(rl, lambda rs: rs[4].__setitem__("doc_id", None))
    with pytest.raises(DataError, match="doc_id: row 4 is null"):
        load_rows(rl, cfg)


def test_empty_dataset_and_too_few_rows(rl, cfg):
    pq.write_table(pq.read_table(rl).slice(0, 0), rl)
    with pytest.raises(DataError, match="rl_parquet: .* yields 0 rows"):
        load_rows(rl, cfg)
    fixtures.build_toy_rl(rl.parent, n_rows=5)
    with pytest.raises(DataError, match="yields 5 rows .* fewer than the 8 needed \\(batch_prompts\\)"):
        load_rows(rl, cfg, min_rows=8)


# ---------------------------------------------------------------- eval split


def test_eval_rows_are_doc_disjoint_and_past_the_skip(rl, cfg):
    docs = [r["doc_id"] for r in fixtures.read_rows(rl)]
    rows = load_eval_rows(rl, cfg, skip_rows=24, n=10, train_doc_ids=docs[:20])
    expected = [i for i in range(24, len(docs)) if docs[i] not in set(docs[:20])][:10]
    assert len(expected) >= 5  # the fixture leaves enough unseen documents to mean something
    assert [r.index for r in rows] == expected
    assert all(r.doc_id == docs[r.index] for r in rows)
    full = fixtures.read_rows(rl)
    assert all(torch.equal(r.activation, _expected(full, r.index)[1]) for r in rows)
    assert load_eval_rows(rl, cfg, skip_rows=24, n=0, train_doc_ids=docs[:20]) == []


def test_eval_window_overlapping_training_is_refused():
    with pytest.raises(DataError, match=r"eval rows overlap the training window.*set max_rows <= eval_skip_rows"):
        row_windows(100, max_rows=11, eval_skip_rows=10, n_eval=5)


@pytest.mark.parametrize("n_rows", [8, 12, 40, 344, 30001])
def test_default_row_windows_work_on_any_size(n_rows):
    """No eval_skip_rows: the last tenth (at least n_eval rows, at most half) is held out, the rest trains."""
    w = row_windows(n_rows, max_rows=None, eval_skip_rows=None, n_eval=5)
    assert w.train_stop == w.eval_start
    assert n_rows - w.eval_start == min(max(5, -(-n_rows // 10)), n_rows // 2)
    assert 0 < w.eval_start < n_rows
    assert row_windows(n_rows, max_rows=None, eval_skip_rows=None, n_eval=0) == RowWindows(None, None)
    assert row_windows(n_rows, max_rows=3, eval_skip_rows=None, n_eval=5) == RowWindows(3, w.eval_start)


def test_reference_row_window_still_available():
    assert row_windows(40000, max_rows=None, eval_skip_rows=30000, n_eval=20) == RowWindows(30000, 30000)
    assert row_windows(40000, max_rows=100, eval_skip_rows=30000, n_eval=20) == RowWindows(100, 30000)
    with pytest.raises(DataError, match=r"eval_skip_rows: 30000 is past the parquet's last row \(344 rows\)"):
        row_windows(344, max_rows=None, eval_skip_rows=30000, n_eval=20)
    with pytest.raises(DataError, match=r"max_rows: 340 overlaps the held-out last rows \[309, 344\)"):
        row_windows(344, max_rows=340, eval_skip_rows=None, n_eval=20)


def test_eval_with_no_unseen_document(tmp_path, tiny_tokenizer):
    path = fixtures.build_toy_rl(tmp_path, tiny_tokenizer, n_rows=30, n_docs=1)
    cfg = load_sidecar(find_sidecar(path))
    docs = [r["doc_id"] for r in fixtures.read_rows(path)]
    with pytest.raises(DataError, match="eval_skip_rows: no row past row 20"):
        load_eval_rows(path, cfg, skip_rows=20, n=5, train_doc_ids=docs[:20])


def test_eval_skips_bad_rows_it_does_not_take(rl, cfg):
    docs = [r["doc_id"] for r in fixtures.read_rows(rl)]
    seen = [i for i in range(24, len(docs)) if docs[i] in set(docs[:20])]
    assert seen, "the fixture should put some training documents past the skip"
    rewrite(rl, lambda rs: rs[seen[0]].__setitem__("activation_vector", [0.0] * 64))
    assert seen[0] not in [r.index for r in load_eval_rows(rl, cfg, skip_rows=24, n=10, train_doc_ids=docs[:20])]


def test_activation_values_survive_float32_exactly(rl, cfg):
    table = pq.read_table(rl, columns=["activation_vector"])
    direct = np.asarray(table.column(0).combine_chunks().flatten()).reshape(-1, cfg.d_model)
    streamed = torch.stack([r.activation for r in stream_rows(rl, cfg)]).numpy()
    assert np.array_equal(direct, streamed)
