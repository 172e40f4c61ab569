"""Upstream's files through nla: kitft AVs give kitft's logits; SFT and train run on kitft-layout
data; what `nla datagen` writes passes upstream's readers (tests/upstream.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

import fixtures
import upstream
from nla_shell import cli
from nla_shell.io.data import av_prompt_messages, build_prompt_ids, check_tokenizer
from nla_shell.io.sidecars import injection_settings, load_sidecar
from nla_shell.models import Injector
from nla_shell.pipeline.evaluate import load_av

CHAR = "§"


def _tiny_gemma3(tokenizer):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=fixtures.D_MODEL, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256, sliding_window=16,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    return Gemma3ForCausalLM(config).eval()


def _kitft_av_dir(directory: Path, model, tokenizer, *, injection_scale: float) -> Path:
    """A full AV dir as kitft releases one: HF weights + tokenizer + a schema-v2 actor sidecar
    renamed by release/hf_stage_and_scrub.py (av keys, top-level extraction_layer_index)."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    tokens = upstream.token_meta(tokenizer, CHAR)
    meta = upstream.model_sidecar(tokens, role="actor", d_model=fixtures.D_MODEL, injection_scale=injection_scale,
                                  mse_scale=None, critic_layer=None)
    upstream.write_sidecar(upstream.released_sidecar(meta, layer_index=fixtures.LAYER_INDEX), directory / "nla_meta.yaml")
    return directory


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])  # embedding scale 1 and sqrt(D) (kitft arch_adapters.py)
def test_a_kitft_av_gives_kitfts_logits(tmp_path, tiny_tokenizer, family):
    from nla_shell.toy.builders import build_tiny_qwen3

    model = (build_tiny_qwen3(tiny_tokenizer, hidden_size=fixtures.D_MODEL, num_layers=2, seed=0).eval()
             if family == "qwen3" else _tiny_gemma3(tiny_tokenizer))
    av = _kitft_av_dir(tmp_path / "av", model, tiny_tokenizer, injection_scale=40.0)
    activation = torch.randn(fixtures.D_MODEL, generator=torch.Generator().manual_seed(1)) * 7
    ids, expected = upstream.kitft_logits(model, av, tiny_tokenizer, activation)

    # --- nla's way: the sidecar, the prompt, the AV and its injection, as `nla explain` / `nla eval` run them
    nla = load_sidecar(av)
    check_tokenizer(nla, tiny_tokenizer)
    injection = injection_settings(nla, av_dir=av)
    assert (injection.style, injection.norm, nla.extraction_layer_index) == ("embedding_replace", 40.0,
                                                                            fixtures.LAYER_INDEX)
    prompt = build_prompt_ids(av_prompt_messages(nla.actor_prompt_template), nla, tiny_tokenizer)
    assert prompt == ids
    actor = load_av(av, dtype=torch.float32, device=torch.device("cpu"))
    injector = Injector.for_sidecar(actor, nla, injection)
    input_ids = torch.tensor([prompt])
    with torch.no_grad(), injector.inject(input_ids, activation[None]):
        got = actor(input_ids=input_ids).logits[0].float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # and the injection matters: without it the logits differ
        plain = actor(input_ids=input_ids).logits[0].float()
    assert (plain - expected).abs().max() > 1e-3


def test_nla_explain_runs_a_kitft_av(tmp_path, tiny_tokenizer, tiny_av_dir, toy_sft, capsys):
    from nla_shell.toy.builders import build_tiny_qwen3

    model = build_tiny_qwen3(tiny_tokenizer, hidden_size=fixtures.D_MODEL, num_layers=2, seed=0)
    av = _kitft_av_dir(tmp_path / "av", model, tiny_tokenizer, injection_scale=40.0)
    _, ar = toy_sft
    code = cli.main(["explain", "--model", str(tiny_av_dir), "--av", str(av), "--ar", str(ar), "--text",
                     "the cat sat on the mat", "--max_new_tokens", "4", "--device", "cpu"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "token" in out.out


# ---------------------------------------------------------------- SFT and train on kitft-layout data


def _sft_args(mode: str, model: Path, parquet: Path, save_dir: Path) -> list[str]:
    return ["sft", f"--mode={mode}", f"--model={model}", f"--parquet={parquet}", f"--save_dir={save_dir}",
            "--num_steps=2", "--batch_size=4", "--micro_batch=2", "--lora_r=4", "--lora_alpha=4",
            "--save_every=2", "--logger=jsonl", "--device=cpu", "--dtype=float32"]


@pytest.mark.parametrize("mode", ["av", "ar"])
def test_sft_two_steps_on_kitft_data(tmp_path, tiny_tokenizer, tiny_av_dir, mode):
    parquet = upstream.write_dataset(tmp_path / "data", tiny_tokenizer, stage=f"{mode}_sft", n_rows=12,
                                     d_model=fixtures.D_MODEL, layer_index=fixtures.LAYER_INDEX, injection_char=CHAR)
    if mode == "ar":
        assert pq.ParquetFile(parquet).schema_arrow.field("prompt").type == pa.string()
    save_dir = tmp_path / mode
    assert cli.main(_sft_args(mode, tiny_av_dir, parquet, save_dir)) == 0
    lines = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1] and all(math.isfinite(line["loss"]) for line in lines)
    ckpt = save_dir / "step_000002"
    theirs = upstream.load_config(ckpt, tiny_tokenizer)  # the checkpoint's sidecar passes upstream's reader
    assert (theirs.d_model, theirs.critic_num_layers, theirs.injection_scale) == (fixtures.D_MODEL, fixtures.LAYER_INDEX, None)
    meta = yaml.safe_load((ckpt / "nla_meta.yaml").read_text())
    assert (meta["kind"], meta["role"], meta["injection_style"]) == ("nla_model", mode, "residual_add")
    assert meta["prompt_templates"]["actor"] == upstream.ACTOR_TEMPLATE


def test_sft_ar_refuses_a_messages_prompt_in_one_line(tmp_path, tiny_tokenizer, tiny_av_dir, capsys):
    parquet = upstream.write_dataset(tmp_path / "data", tiny_tokenizer, stage="rl", n_rows=4,
                                     d_model=fixtures.D_MODEL, layer_index=fixtures.LAYER_INDEX, injection_char=CHAR)
    assert cli.main(_sft_args("ar", tiny_av_dir, parquet, tmp_path / "ar")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prompt: column type is" in err[0] and "expected string" in err[0], err
    assert not (tmp_path / "ar").exists()


def test_train_two_steps_on_kitft_data_with_the_parquet_as_sidecar(tmp_path, tiny_tokenizer, nla_cache_dir):
    av, ar, _ = fixtures.build_trainer_inputs(nla_cache_dir / "trainer_inputs", tiny_tokenizer)
    parquet = upstream.write_dataset(tmp_path / "data", tiny_tokenizer, stage="rl", n_rows=12,
                                     d_model=fixtures.D_MODEL, layer_index=fixtures.LAYER_INDEX, injection_char=CHAR)
    save_dir = tmp_path / "run"
    args = ["train", f"av_ckpt={av}", f"ar_ckpt={ar}", f"rl_parquet={parquet}", f"sidecar={parquet}",
            f"save_dir={save_dir}", "num_steps=2", "batch_prompts=2", "group_size=2", "max_new_tokens=6",
            "lora_r=4", "lora_alpha=4", "eval_every=0", "save_every=2", "device=cpu", "logger=jsonl"]
    assert cli.main(args) == 0
    lines = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    adapter = save_dir / "step_000002" / "adapter"  # its sidecar says how it was trained, in upstream's layout
    theirs = upstream.load_config(adapter, tiny_tokenizer)
    assert (theirs.d_model, theirs.critic_num_layers, theirs.injection_scale) == (fixtures.D_MODEL, fixtures.LAYER_INDEX, None)
    assert injection_settings(load_sidecar(adapter), av_dir=adapter) == ("residual_add", None, 1)


def test_an_easynla_rl_save_dir_is_a_sidecar_source(tmp_path, tiny_tokenizer):
    parquet = upstream.write_dataset(tmp_path / "data", tiny_tokenizer, stage="rl", n_rows=4,
                                     d_model=fixtures.D_MODEL, layer_index=fixtures.LAYER_INDEX, injection_char=CHAR)
    ckpt = upstream.easynla_checkpoint_sidecar(tmp_path / "easynla_run", parquet)
    assert load_sidecar(ckpt) == load_sidecar(parquet)
    assert injection_settings(load_sidecar(ckpt), av_dir=ckpt) == ("residual_add", None, 1)  # EasyNLA adds at block 1


# ---------------------------------------------------------------- nla datagen's output, read by upstream


def test_datagen_output_passes_upstreams_readers(toy_datasets, tiny_av_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_av_dir)
    # upstream nla/datagen/stage3_build.py _schema_for: the columns it writes, with their types
    message = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    for split, prompt_type in (("rl", message), ("av_sft", message), ("ar_sft", pa.string()), ("eval", message)):
        parquet = toy_datasets / f"{split}.parquet"
        schema = pq.ParquetFile(parquet).schema_arrow
        assert schema.field("prompt").type == prompt_type
        assert schema.field("activation_vector").type == pa.list_(pa.float32(), fixtures.D_MODEL)
        for name, kind in (("n_raw_tokens", pa.int64()), ("activation_layer", pa.int64()), ("doc_id", pa.string())):
            assert schema.field(name).type == kind
        if split in ("av_sft", "eval"):
            assert schema.field("response").type == pa.string()
        sidecar_text = parquet.with_name(parquet.name + ".nla_meta.yaml").read_text(encoding="utf-8")
        meta = upstream.deserialize_dataset_sidecar(sidecar_text)
        theirs = upstream.load_config(parquet, tokenizer)
        assert (theirs.d_model, meta["extraction"]["layer_index"]) == (fixtures.D_MODEL, fixtures.LAYER_INDEX)
        assert meta["row_count"] == pq.ParquetFile(parquet).metadata.num_rows
        for row in upstream.read_rows(parquet):
            if split == "ar_sft":
                assert row["prompt"] == theirs.critic_prompt_template.format(explanation=row["explanation"])
            if "response" in row:
                assert upstream.extract_explanation(row["response"]) == row["explanation"]
                assert row["response"] == upstream.wrap_explanation(row["explanation"])


# ---------------------------------------------------------------- nla export


def test_export_loads_in_transformers_and_upstreams_readers(tmp_path, toy_sft, tiny_av_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nla_shell.models import ARModel

    av, ar = toy_sft
    out = tmp_path / "export"
    assert cli.main(["export", f"--av={av}", f"--ar={ar}", f"--out_dir={out}", "--dtype=float32"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(out / "av")

    # --- AV: a plain HF model whose logits are the adapter-on actor's
    merged = AutoModelForCausalLM.from_pretrained(out / "av").eval()
    actor = load_av(av, dtype=torch.float32, device=torch.device("cpu"))
    ids = torch.tensor([tokenizer.encode("the cat sat on the mat", add_special_tokens=False)])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, actor(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    theirs = upstream.load_config(out / "av", tokenizer)
    assert (theirs.d_model, theirs.critic_num_layers, theirs.injection_scale) == (fixtures.D_MODEL, fixtures.LAYER_INDEX, None)
    assert yaml.safe_load((out / "av" / "nla_meta.yaml").read_text())["injection_style"] == "residual_add"

    # --- AR: kitft's NLACriticModel reading by hand (nla/models.py): the truncated causal LM,
    # final norm and lm_head bypassed, value_head on the last hidden state; equal to nla's after normalising
    backbone = AutoModelForCausalLM.from_pretrained(out / "ar").eval()
    assert backbone.config.num_hidden_layers == fixtures.LAYER_INDEX + 1
    head = load_file(str(out / "ar" / upstream.VALUE_HEAD_FILE))["weight"]
    assert head.shape == (fixtures.D_MODEL, fixtures.D_MODEL) and head.dtype == torch.float32
    assert AutoTokenizer.from_pretrained(out / "ar").padding_side == "right"
    cfg = upstream.load_config(out / "ar", tokenizer)
    with torch.no_grad():
        backbone.model.norm = torch.nn.Identity()
        h = backbone.model(input_ids=ids).last_hidden_state[0, -1]
        kitft_pred = upstream.normalize_activation(h @ head.T, cfg.mse_scale)
        ours = ARModel.from_pretrained(ar, mse_scale=cfg.mse_scale)(ids, torch.ones_like(ids))[0]
    torch.testing.assert_close(upstream.normalize_activation(ours, cfg.mse_scale), kitft_pred, rtol=1e-4, atol=1e-4)


def test_export_refuses_an_occupied_out_dir_in_one_line(tmp_path, toy_sft, capsys):
    av, _ = toy_sft
    (tmp_path / "out" / "av").mkdir(parents=True)
    assert cli.main(["export", f"--av={av}", f"--out_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out_dir" in err[0] and "overwrite=true" in err[0], err
