"""The AR-LoRA: a LoRA (plus the float32 value head) trained on the AR's frozen backbone.

EasyNLA trains its AR this way on a 4-bit base (nla/train_sft.py, `--mode ar --use-lora
--quant 4bit`; RL co-trains the same LoRA and head, nla/train_rl_self_contained.py). Here
the same code path runs unquantised in float32 on the CPU (bitsandbytes needs CUDA; its
quantised run is tests/gpu/test_quant_ar_gpu.py): sft --mode ar ar_lora=true, a train
step with train_critic, resume, eval and export all read and write it.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import fixtures
from nla_shell import cli
from nla_shell.models import AR_LORA_FILE, AR_META_FILE, ARModel
from nla_shell.pipeline.sft import sft

MSE_SCALE = 8.0
# EasyNLA nla/train_sft.py writes these ar_meta.json keys for an AR-LoRA.
EASYNLA_META_KEYS = {"ar_num_layers", "lora_r", "lora_alpha", "quant", "target_modules", "final_norm_stripped"}


def _lora_ar(tiny_av_dir) -> ARModel:
    ar = ARModel.from_pretrained(tiny_av_dir, mse_scale=MSE_SCALE, extraction_layer_index=fixtures.LAYER_INDEX,
                                 create_head=True)
    return ar.add_lora(r=4, alpha=8, use_rslora=True, base_model=tiny_av_dir)


def test_an_ar_lora_trains_only_its_lora_and_head_and_round_trips_in_easynlas_layout(tiny_av_dir, tiny_tokenizer,
                                                                                      tmp_path):
    ar = _lora_ar(tiny_av_dir)
    before = fixtures.ar_predictions(ar, tiny_tokenizer)
    trainable = {name for name, p in ar.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or name == "value_head.weight" for name in trainable)
    assert "value_head.weight" in trainable and any("lora_B" in name for name in trainable)
    # B = 0 at the start: the fresh LoRA leaves the warm-start AR's predictions unchanged.
    plain = ARModel.from_pretrained(tiny_av_dir, mse_scale=MSE_SCALE, extraction_layer_index=fixtures.LAYER_INDEX,
                                    create_head=True)
    torch.testing.assert_close(before, fixtures.ar_predictions(plain, tiny_tokenizer), rtol=0, atol=0)

    with torch.no_grad():
        for name, p in ar.named_parameters():
            if "lora_B" in name or name == "value_head.weight":
                p.add_(torch.randn_like(p), alpha=0.05)
    trained = fixtures.ar_predictions(ar, tiny_tokenizer)
    assert (trained - before).abs().max() > 1e-3
    ar.save_pretrained(tmp_path / "ar")

    # --- the layout: only the trained tensors, named as EasyNLA's NLACriticModel names them
    assert {p.name for p in (tmp_path / "ar").iterdir()} == {AR_LORA_FILE, AR_META_FILE}
    tensors = load_file(str(tmp_path / "ar" / AR_LORA_FILE))
    assert "value_head.weight" in tensors and tensors["value_head.weight"].dtype == torch.float32
    lora_keys = [k for k in tensors if k != "value_head.weight"]
    assert lora_keys and all(k.startswith("backbone.model.layers.") and ".lora_" in k and k.endswith(".default.weight")
                             for k in lora_keys)
    meta = json.loads((tmp_path / "ar" / AR_META_FILE).read_text())
    assert EASYNLA_META_KEYS <= meta.keys()
    assert (meta["ar_num_layers"], meta["lora_r"], meta["lora_alpha"], meta["quant"], meta["final_norm_stripped"]) == (
        fixtures.LAYER_INDEX + 1, 4, 8, "none", True)
    assert meta["base_model_name_or_path"] == str(tiny_av_dir.resolve())

    # --- reloaded from the dir alone: the same predictions, bit for bit; merged: the same up to rounding
    again = ARModel.from_pretrained(tmp_path / "ar", mse_scale=MSE_SCALE)
    assert again.lora is not None and again.num_layers == fixtures.LAYER_INDEX + 1
    torch.testing.assert_close(fixtures.ar_predictions(again, tiny_tokenizer), trained, rtol=0, atol=0)
    merged = again.merge_lora()
    assert merged.lora is None and not any("lora_" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(fixtures.ar_predictions(merged, tiny_tokenizer), trained, rtol=1e-5, atol=1e-5)


def test_an_ar_lora_dir_that_cannot_be_rebuilt_is_refused_in_one_line(tiny_av_dir, tmp_path):
    _lora_ar(tiny_av_dir).save_pretrained(tmp_path / "ar")
    meta_file = tmp_path / "ar" / AR_META_FILE
    meta = json.loads(meta_file.read_text())

    def refusal(**changes) -> str:
        meta_file.write_text(json.dumps({k: v for k, v in {**meta, **changes}.items() if v is not None}))
        with pytest.raises(ValueError) as err:
            ARModel.from_pretrained(tmp_path / "ar", mse_scale=MSE_SCALE)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert "names no base_model_name_or_path" in refusal(base_model_name_or_path=None)  # EasyNLA records none
    assert "'quant' = '4bit' needs a CUDA device" in refusal(quant="4bit")
    assert "final_norm_stripped is false" in refusal(final_norm_stripped=False)
    assert "lora_A" in refusal(lora_r=8) and "expected" in refusal(lora_r=8)  # the file holds rank-4 tensors


def _sft_ar(tiny_av_dir, toy_datasets, save_dir, **overrides):
    return fixtures.sft_config("ar", tiny_av_dir, toy_datasets, save_dir, ar_lora=True, **overrides)


def test_sft_ar_lora_resumes_and_feeds_a_co_trained_critic_eval_and_export(tiny_av_dir, toy_datasets, nla_run_inputs,
                                                                           tmp_path, capsys):
    # --- sft --mode ar ar_lora=true; killed after its step-1 checkpoint, rerun: the same run
    cfg = _sft_ar(tiny_av_dir, toy_datasets, tmp_path / "sft", num_steps=2, save_every=1, batch_size=3, micro_batch=2)
    final = sft(cfg)
    assert {AR_LORA_FILE, AR_META_FILE} <= {p.name for p in final.iterdir()} and not (final / "model.safetensors").exists()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(str(final / AR_LORA_FILE))
    shutil.rmtree(final)
    assert sft(cfg) == final and "at step 1" in capsys.readouterr().out
    assert [json.loads(line)["loss"] for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()] == losses
    again = load_file(str(final / AR_LORA_FILE))
    assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)
    assert any(torch.count_nonzero(v) for k, v in weights.items() if "lora_B" in k)

    # --- RL co-trains that LoRA and head (the base stays frozen: nothing else is saved), and resumes
    # (nla_run_inputs' AV writes the explanation format, so the critic gets pairs to train on)
    argv = lambda save_dir, steps: fixtures.train_argv(  # noqa: E731
        nla_run_inputs, save_dir, ar_ckpt=final, num_steps=steps, eval_every=0, save_every=1, train_critic="true",
        critic_lr=1e-2)
    assert cli.main(argv(tmp_path / "rl", 2)) == 0
    critic = tmp_path / "rl" / "step_000002" / "critic"
    assert {AR_LORA_FILE, AR_META_FILE} <= {p.name for p in critic.iterdir()}
    co_trained = load_file(str(critic / AR_LORA_FILE))
    assert co_trained.keys() == weights.keys()
    assert any(not torch.equal(co_trained[k], weights[k]) for k in weights), "the critic step changed nothing"
    assert cli.main(argv(tmp_path / "split", 1)) == 0 and cli.main(argv(tmp_path / "split", 2)) == 0
    read = lambda d: [(m["step"], m["critic_loss"]) for m in fixtures.read_metrics(d)]  # noqa: E731
    assert all(loss is not None for _, loss in read(tmp_path / "rl"))  # the SFT'd AV's explanations were scored
    assert read(tmp_path / "split") == read(tmp_path / "rl")
    resumed = load_file(str(tmp_path / "split" / "step_000002" / "critic" / AR_LORA_FILE))
    assert all(torch.equal(resumed[k], co_trained[k]) for k in co_trained)

    # --- eval reads it; export merges it into upstream's plain critic with the same predictions
    assert cli.main(["eval", "--ar", str(critic), "--parquet", str(toy_datasets / "eval.parquet"), "--n-rows", "4",
                     "--out-dir", str(tmp_path / "eval"), "device=cpu"]) == 0  # its tokenizer: the base's
    assert json.loads((tmp_path / "eval" / "eval_summary.json").read_text())["n_rows"] == 4
    assert cli.main(["export", f"--ar={critic}", f"--sidecar={final}", f"--out_dir={tmp_path / 'export'}",
                     "--dtype=float32"]) == 0
    exported = ARModel.from_pretrained(tmp_path / "export" / "ar", mse_scale=MSE_SCALE)
    assert exported.lora is None and not (tmp_path / "export" / "ar" / AR_META_FILE).exists()
    tokenizer = fixtures.tiny_tokenizer()
    torch.testing.assert_close(fixtures.ar_predictions(exported, tokenizer),
                               fixtures.ar_predictions(ARModel.from_pretrained(critic, mse_scale=MSE_SCALE), tokenizer),
                               rtol=1e-5, atol=1e-5)


def test_a_quantised_ar_is_refused_on_cpu_before_anything_is_written(tiny_av_dir, toy_datasets, tmp_path, capsys):
    capsys.readouterr()
    assert cli.main(["sft", *(f"{k}={v}" for k, v in dict(
        mode="ar", model=tiny_av_dir, parquet=toy_datasets / "ar_sft.parquet", save_dir=tmp_path / "sft",
        ar_lora="true", quant="4bit", device="cpu").items())]) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "'quant' = '4bit' needs a CUDA device" in error and "quant=none" in error
    assert not (tmp_path / "sft").exists()


def test_ar_lora_is_for_the_ar_only(tiny_av_dir, toy_datasets, tmp_path):
    from nla_shell.io.config import ConfigError

    with pytest.raises(ConfigError, match="'ar_lora' = true applies to mode=ar only"):
        fixtures.sft_config("av", tiny_av_dir, toy_datasets, tmp_path / "sft", ar_lora=True)
