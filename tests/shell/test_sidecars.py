"""nla_shell.io.sidecars: finding, reading and writing sidecars, against upstream's files and readers."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

import fixtures
import upstream
from nla_core import parse_sidecar
from nla_shell import cli
from nla_shell.io.data import DataError, check_tokenizer
from nla_shell.io.sidecars import (
    DEFAULT_AR_TEMPLATE,
    DEFAULT_AV_TEMPLATE,
    Injection,
    dataset_sidecar,
    find_sidecar,
    injection_settings,
    load_sidecar,
    model_sidecar,
    read_sidecar,
    write_sidecar,
)

CHAR = "§"  # the toy tokenizer's single-token marker


@pytest.fixture
def kitft_rl(tmp_path, tiny_tokenizer) -> Path:
    return upstream.write_dataset(tmp_path / "data", tiny_tokenizer, stage="rl", n_rows=12, d_model=fixtures.D_MODEL,
                                  layer_index=fixtures.LAYER_INDEX, injection_char=CHAR)


# ---------------------------------------------------------------- find and read


def test_a_sidecar_a_parquet_a_sliced_parquet_and_a_dir_resolve(kitft_rl, tmp_path):
    yaml_path = kitft_rl.with_name("rl.parquet.nla_meta.yaml")
    assert find_sidecar(yaml_path) == yaml_path
    assert find_sidecar(kitft_rl) == yaml_path
    assert find_sidecar(f"{kitft_rl}@[0:8]") == yaml_path  # miles' slice syntax, upstream sidecar_path_for
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(yaml_path, ckpt / "nla_meta.yaml")
    assert find_sidecar(ckpt) == ckpt / "nla_meta.yaml"
    # the parquet path as `sidecar` (the reference README's --sidecar usage) reads the YAML, not the parquet's bytes
    assert load_sidecar(kitft_rl) == load_sidecar(yaml_path) == load_sidecar(ckpt)
    for source in (yaml_path, kitft_rl, ckpt):
        assert upstream.sidecar_path_for(source if source != yaml_path else kitft_rl).read_text() == yaml_path.read_text()


def test_missing_and_unreadable_sidecars_name_the_paths(tmp_path):
    with pytest.raises(DataError, match=r"sidecar: no sidecar for .*x\.parquet; tried .*x\.parquet\.nla_meta\.yaml and .*nla_meta\.yaml"):
        find_sidecar(tmp_path / "x.parquet")
    with pytest.raises(DataError, match=r"no sidecar for .*tried .*empty.nla_meta\.yaml"):
        (tmp_path / "empty").mkdir()
        find_sidecar(tmp_path / "empty")
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xa4\x00kind: [")
    with pytest.raises(DataError, match=r"cannot read .*bad\.yaml as UTF-8 YAML"):
        read_sidecar(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    with pytest.raises(DataError, match=r"list\.yaml: expected a YAML mapping"):
        load_sidecar(listed)


def test_kitft_dataset_sidecar_passes_the_tokenizer_check_and_drift_is_caught(kitft_rl, tmp_path, tiny_tokenizer):
    cfg = load_sidecar(kitft_rl)
    check_tokenizer(cfg, tiny_tokenizer)
    ours = upstream.load_config(kitft_rl, tiny_tokenizer)  # upstream's own reader agrees on every shared fact
    assert (cfg.d_model, cfg.injection_token_id, cfg.injection_left_neighbor_id, cfg.injection_right_neighbor_id) == (
        ours.d_model, ours.injection_token_id, ours.injection_left_neighbor_id, ours.injection_right_neighbor_id)
    assert cfg.actor_prompt_template.replace("<INJECT>", CHAR) == ours.actor_prompt_template.format(injection_char=CHAR)
    mapping = yaml.safe_load(kitft_rl.with_name("rl.parquet.nla_meta.yaml").read_text())
    mapping["tokens"]["injection_right_neighbor_id"] += 1
    with pytest.raises(DataError, match="tokens.injection_right_neighbor_id: sidecar says"):
        check_tokenizer(parse_sidecar(mapping), tiny_tokenizer)


# ---------------------------------------------------------------- what nla writes, read by upstream


def _nla_dataset_mapping(tokenizer, **overrides):
    settings = dict(stage="ar_sft", row_count=10, base_model="/models/tiny", d_model=fixtures.D_MODEL,
                    layer_index=fixtures.LAYER_INDEX, corpus="/data/corpus.jsonl", positions_per_doc=3,
                    av_content=DEFAULT_AV_TEMPLATE, ar_template=upstream.CRITIC_TEMPLATE, injection_char=CHAR)
    settings.update(overrides)
    return dataset_sidecar(tokenizer, **settings)


@pytest.mark.parametrize("mse_scale", ["sqrt_d_model", None, 4.0])
def test_nla_dataset_sidecar_is_read_by_upstream(tmp_path, tiny_tokenizer, mse_scale):
    mapping = _nla_dataset_mapping(tiny_tokenizer, mse_scale=mse_scale)
    parquet = tmp_path / "ar_sft.parquet"
    path = write_sidecar(mapping, tmp_path / "ar_sft.parquet.nla_meta.yaml")
    assert find_sidecar(parquet) == path
    text = path.read_text(encoding="utf-8")
    if mse_scale == "sqrt_d_model":  # upstream's datagen reader builds NLAExtractionMeta from exactly its fields
        assert upstream.deserialize_dataset_sidecar(text)["tokens"]["injection_char"] == CHAR
    theirs = upstream.load_config(parquet, tiny_tokenizer)
    ours = load_sidecar(parquet)
    assert theirs.mse_scale == (math.sqrt(fixtures.D_MODEL) if mse_scale == "sqrt_d_model" else mse_scale)
    assert theirs.actor_prompt_template == "Explain the activation at {injection_char}."
    assert theirs.actor_prompt_template.format(injection_char="<INJECT>") == ours.actor_prompt_template
    assert theirs.critic_prompt_template == ours.critic_prompt_template == upstream.CRITIC_TEMPLATE
    assert (theirs.d_model, theirs.injection_token_id) == (ours.d_model, ours.injection_token_id)
    # upstream's suffix rule, computed independently
    assert mapping["tokens"]["critic_suffix_ids"] == upstream.token_meta(
        tiny_tokenizer, CHAR, actor_template="Explain the activation at {injection_char}.",
        critic_template=upstream.CRITIC_TEMPLATE)["critic_suffix_ids"]
    assert ours.critic_suffix_ids == tuple(mapping["tokens"]["critic_suffix_ids"])


def test_template_braces_survive_the_upstream_form(tmp_path, tiny_tokenizer):
    content = "Explain {the} activation at <INJECT>."
    mapping = _nla_dataset_mapping(tiny_tokenizer, av_content=content, ar_template=DEFAULT_AR_TEMPLATE)
    assert mapping["prompt_templates"]["actor"] == "Explain {{the}} activation at {injection_char}."
    assert mapping["tokens"]["critic_suffix_ids"] is None  # "Text: {explanation}" has no suffix to check
    write_sidecar(mapping, tmp_path / "x.parquet.nla_meta.yaml")
    assert upstream.load_config(tmp_path / "x.parquet", tiny_tokenizer).injection_right_neighbor_id == \
        mapping["tokens"]["injection_right_neighbor_id"]
    assert load_sidecar(tmp_path / "x.parquet").actor_prompt_template == content


@pytest.mark.parametrize("style, norm", [("residual_add", None), ("embedding_replace", 12.5)])
def test_nla_model_sidecar_is_read_by_upstream(tmp_path, tiny_tokenizer, style, norm):
    nla = parse_sidecar(_nla_dataset_mapping(tiny_tokenizer))
    mapping = model_sidecar(nla, role="av", stage="sft", base_checkpoint="/models/tiny", injection=Injection(style, norm, 1),
                            trained_on=["/data/av_sft.parquet"])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_sidecar(mapping, ckpt / "nla_meta.yaml")
    theirs = upstream.load_config(ckpt, tiny_tokenizer)
    assert (theirs.d_model, theirs.injection_scale, theirs.critic_num_layers) == (fixtures.D_MODEL, norm, fixtures.LAYER_INDEX)
    assert theirs.mse_scale == pytest.approx(math.sqrt(fixtures.D_MODEL))
    again = load_sidecar(ckpt)
    assert (again.injection_style, again.extraction_layer_index, again.critic_suffix_ids) == (
        style, fixtures.LAYER_INDEX, nla.critic_suffix_ids)
    assert injection_settings(again) == (style, norm, 1)


# ---------------------------------------------------------------- injection settings


def test_injection_settings_sources_and_errors(tmp_path, tiny_tokenizer, kitft_rl):
    data = load_sidecar(kitft_rl)
    assert injection_settings(data) == ("residual_add", None, 1)
    with pytest.raises(DataError, match=r"injection_scale: the embedding_replace style needs .*injection_scale="):
        injection_settings(data, style="embedding_replace")
    assert injection_settings(data, style="embedding_replace", scale="sqrt_d_model") == ("embedding_replace", 8.0, 1)
    assert injection_settings(data, style="embedding_replace", scale="raw") == ("embedding_replace", None, 1)
    with pytest.raises(DataError, match=r"injection_scale: scale='big'"):
        injection_settings(data, style="embedding_replace", scale="big")
    # an AV checkpoint's own sidecar (a kitft actor) decides over the dataset's
    av = tmp_path / "kitft_av"
    av.mkdir()
    tokens = upstream.token_meta(tiny_tokenizer, CHAR)
    upstream.write_sidecar(upstream.model_sidecar(tokens, role="actor", d_model=fixtures.D_MODEL, injection_scale=30.0,
                                                  mse_scale=None, critic_layer=None), av / "nla_meta.yaml")
    assert injection_settings(data, av_dir=av) == ("embedding_replace", 30.0, 1)
    assert injection_settings(data, av_dir=av, style="residual_add") == ("residual_add", None, 1)


@pytest.mark.parametrize("layer", [0, 1, 5])
def test_the_injection_layer_round_trips_and_an_upstream_sidecar_means_block_1(tmp_path, tiny_tokenizer, kitft_rl,
                                                                              layer):
    """nla's `injection_layer` (an addition): written under residual_add, read back, the config's over the
    checkpoint's over the data's; a sidecar without it (upstream's, EasyNLA's) adds at block 1, the reference's."""
    data = load_sidecar(kitft_rl)
    assert data.injection_layer == 1 and injection_settings(data).layer == 1
    written = model_sidecar(data, role="av", stage="sft", base_checkpoint="/m", injection=Injection("residual_add", None,
                                                                                                     layer),
                            trained_on=[])
    assert written["injection_layer"] == layer
    av = tmp_path / "av"
    av.mkdir()
    write_sidecar(written, av / "nla_meta.yaml")
    assert injection_settings(data, av_dir=av) == ("residual_add", None, layer)
    assert injection_settings(data, av_dir=av, layer=layer + 2).layer == layer + 2
    # kitft's reader ignores the key it does not know
    assert upstream.load_config(av, tiny_tokenizer).d_model == fixtures.D_MODEL
    replaced = model_sidecar(data, role="av", stage="sft", base_checkpoint="/m",
                             injection=Injection("embedding_replace", 8.0, layer), trained_on=[])
    assert "injection_layer" not in replaced  # embedding_replace injects at the embedding: no block to name


@pytest.mark.parametrize("bad", [-1, True, "2"])
def test_a_bad_injection_layer_is_refused_naming_the_key(kitft_rl, tmp_path, bad):
    data = load_sidecar(kitft_rl)
    with pytest.raises(DataError, match=r"^injection_layer: .* is not a decoder block index"):
        injection_settings(data, layer=bad)
    mapping = yaml.safe_load((find_sidecar(kitft_rl)).read_text())
    mapping["injection_layer"] = bad
    (tmp_path / "x.nla_meta.yaml").write_text(yaml.safe_dump(mapping))
    with pytest.raises(DataError, match=r"sidecar key `injection_layer` must be"):
        load_sidecar(tmp_path / "x.nla_meta.yaml")


def test_train_refuses_embedding_replace_without_a_norm_in_one_line(tmp_path, kitft_rl, tiny_av_dir, capsys):
    save_dir = tmp_path / "run"
    code = cli.main(["train", f"av_ckpt={tiny_av_dir}", f"ar_ckpt={tiny_av_dir}", f"rl_parquet={kitft_rl}",
                     f"save_dir={save_dir}", "injection_style=embedding_replace", "device=cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and not save_dir.exists()
    assert len(err) == 1 and "injection_scale" in err[0] and "embedding_replace" in err[0], err


@pytest.mark.parametrize("command", ["train", "sft"])
def test_an_injection_layer_past_the_models_blocks_is_refused_in_one_line_before_anything_is_written(
        tmp_path, kitft_rl, tiny_av_dir, capsys, command):
    """injection_layer = the tiny AV's block count names none of its blocks."""
    blocks = json.loads((tiny_av_dir / "config.json").read_text())["num_hidden_layers"]
    save_dir = tmp_path / "run"
    args = ([f"av_ckpt={tiny_av_dir}", f"ar_ckpt={tiny_av_dir}", f"rl_parquet={kitft_rl}", "batch_prompts=2"]
            if command == "train"
            else ["mode=av", f"model={tiny_av_dir}", f"parquet={kitft_rl}"])
    code = cli.main([command, *args, f"save_dir={save_dir}", f"injection_layer={blocks}", "device=cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and not save_dir.exists()
    assert len(err) == 1 and f"injection_layer={blocks}: " in err[0] and f"{blocks} decoder blocks" in err[0], err
    assert f"0..{blocks - 1}" in err[0], err
