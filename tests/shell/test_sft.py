"""`nla sft`: the AV loss sees only response tokens, the AR learns, checkpoints load in `nla train`, resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import fixtures
from nla_shell import cli
from nla_shell.io.config import ConfigError
from nla_shell.io.data import build_prompt_ids, stream_rows
from nla_shell.io.sidecars import load_sidecar
from nla_shell.models import REFERENCE_ADAPTER, ARModel, Injector, load_actor
from nla_shell.pipeline.sft import lr_factor, sft
from nla_shell.pipeline.sft_loss import AVExample, av_response_nll


def _losses(save_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (save_dir / "metrics.jsonl").read_text().splitlines()]


def _av_examples(data_dir: Path, tokenizer, n: int) -> tuple[list[AVExample], object]:
    nla = load_sidecar(data_dir / "av_sft.parquet.nla_meta.yaml")
    rows = list(stream_rows(data_dir / "av_sft.parquet", nla, stop=n, extra_columns=("response",)))
    return [
        AVExample(tuple(build_prompt_ids(r.prompt, nla, tokenizer)),
                  tuple(tokenizer.encode(r.extras["response"], add_special_tokens=False)) + (tokenizer.eos_token_id,),
                  r.activation)
        for r in rows
    ], nla


def test_av_loss_counts_only_the_response_tokens(tiny_av_dir, toy_datasets):
    tokenizer = AutoTokenizer.from_pretrained(tiny_av_dir)
    examples, nla = _av_examples(toy_datasets, tokenizer, 3)
    torch.manual_seed(0)
    actor = load_actor(tiny_av_dir, lora_r=4, lora_alpha=4, use_rslora=True, resume_adapter=None,
                       dtype=torch.float32, device=torch.device("cpu"))
    injector = Injector(actor, marker_id=nla.injection_token_id, left_id=nla.injection_left_neighbor_id,
                        right_id=nla.injection_right_neighbor_id)
    nll, n_tokens = av_response_nll(actor, injector, examples, pad_id=tokenizer.pad_token_id)
    assert n_tokens == sum(len(e.response_ids) for e in examples)

    # Reference: HF cross-entropy of each unpadded sequence with the prompt labels ignored.
    masked = everything = 0.0
    for e in examples:
        ids = torch.tensor([e.prompt_ids + e.response_ids])
        with torch.no_grad(), injector.inject(ids, e.activation[None]):
            logits = actor(input_ids=ids).logits[0, :-1]
        labels = ids[0, 1:].clone()
        everything += float(F.cross_entropy(logits, labels, reduction="sum"))
        labels[: len(e.prompt_ids) - 1] = -100
        masked += float(F.cross_entropy(logits, labels, reduction="sum", ignore_index=-100))
    assert float(nll.detach()) == pytest.approx(masked, rel=1e-4)
    assert everything > masked + 1.0  # the prompt tokens would have counted for a lot


def test_av_loss_sees_the_injected_activation(tiny_av_dir, toy_datasets):
    tokenizer = AutoTokenizer.from_pretrained(tiny_av_dir)
    examples, nla = _av_examples(toy_datasets, tokenizer, 2)
    actor = load_actor(tiny_av_dir, lora_r=4, lora_alpha=4, use_rslora=True, resume_adapter=None,
                       dtype=torch.float32, device=torch.device("cpu"))
    injector = Injector(actor, marker_id=nla.injection_token_id, left_id=nla.injection_left_neighbor_id,
                        right_id=nla.injection_right_neighbor_id)
    flipped = [AVExample(e.prompt_ids, e.response_ids, -e.activation) for e in examples]
    with torch.no_grad():
        a, _ = av_response_nll(actor, injector, examples, pad_id=tokenizer.pad_token_id)
        b, _ = av_response_nll(actor, injector, flipped, pad_id=tokenizer.pad_token_id)
    assert abs(float(a) - float(b)) > 1e-3


def test_ar_sft_reduces_its_loss_on_a_fixed_batch(tmp_path, tiny_av_dir, toy_datasets):
    save_dir = tmp_path / "ar"
    # max_rows == batch_size: every step sees the same eight rows.
    sft(fixtures.sft_config("ar", tiny_av_dir, toy_datasets, save_dir, max_rows=8, batch_size=8, micro_batch=3,
                            num_steps=6, save_every=6, lr=1e-3))
    losses = _losses(save_dir)
    assert len(losses) == 6
    assert losses[-1] < 0.7 * losses[0], losses
    fves = [json.loads(line)["fve"] for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    assert fves[-1] > fves[0]


def test_checkpoints_are_what_nla_train_loads(toy_sft, toy_datasets, tmp_path):
    av, ar = toy_sft
    for directory in (av, ar):
        meta = yaml.safe_load((directory / "nla_meta.yaml").read_text())
        assert meta["kind"] == "nla_model" and meta["baselines"]["rawvar"] > 0
        assert load_sidecar(directory / "nla_meta.yaml").d_model == fixtures.D_MODEL
        assert (directory / "tokenizer_config.json").is_file() and (directory / "training_state.pt").is_file()

    # The AV is an adapter that RL continues, with the SFT'd weights (not a zero LoRA) as reference.
    saved = load_file(str(av / "adapter_model.safetensors"))
    lora_b = [v for k, v in saved.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)
    actor = load_actor(av, lora_r=8, lora_alpha=8, use_rslora=True, resume_adapter=None, dtype=torch.float32,
                       device=torch.device("cpu"))
    params = dict(actor.named_parameters())
    for key, value in saved.items():
        stem = key.removesuffix(".weight")
        torch.testing.assert_close(params[f"{stem}.default.weight"], value)
        torch.testing.assert_close(params[f"{stem}.{REFERENCE_ADAPTER}.weight"], value)

    critic = ARModel.from_pretrained(ar, mse_scale=8.0)
    assert critic.num_layers == fixtures.LAYER_INDEX + 1

    argv = ["train", f"av_ckpt={av}", f"ar_ckpt={ar}", f"rl_parquet={toy_datasets / 'rl.parquet'}",
            f"save_dir={tmp_path / 'rl'}", "num_steps=1", "batch_prompts=2", "group_size=2", "max_new_tokens=6",
            "eval_every=0", "device=cpu", "logger=jsonl"]
    assert cli.main(argv) == 0
    assert (tmp_path / "rl" / "step_000001" / "adapter" / "adapter_config.json").is_file()


@pytest.mark.parametrize("mode, av_lora, weights", [
    ("av", True, "adapter_model.safetensors"),
    ("av", False, "model.safetensors"),  # the fully fine-tuned AV: its whole LM, and AdamW's state for all of it
    ("ar", True, "value_head.safetensors"),
])
def test_resume_matches_an_uninterrupted_run(tmp_path, tiny_av_dir, toy_datasets, mode, av_lora, weights, capsys):
    cfg = fixtures.sft_config(mode, tiny_av_dir, toy_datasets, tmp_path / "run", num_steps=4, save_every=2,
                              batch_size=3, micro_batch=2, lr_schedule="cosine", av_lora=av_lora)
    sft(cfg)
    losses, final = _losses(tmp_path / "run"), load_file(str(tmp_path / "run" / "step_000004" / weights))
    # A run killed after its step-2 checkpoint: rerunning the same command continues from there.
    shutil.rmtree(tmp_path / "run" / "step_000004")
    if av_lora:  # a run saved before the av_lora key existed ran as its default does: no conflict
        saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
        (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({k: v for k, v in saved.items() if k != "av_lora"}))
    assert sft(cfg) == tmp_path / "run" / "step_000004"
    assert "at step 2" in capsys.readouterr().out
    assert _losses(tmp_path / "run") == losses
    again = load_file(str(tmp_path / "run" / "step_000004" / weights))
    assert again.keys() == final.keys() and all(torch.equal(again[k], final[k]) for k in final)


def test_av_sft_needs_the_response_column(tmp_path, tiny_av_dir, toy_datasets, capsys):
    """One line naming the missing column and the parquet that has it (not a column that exists nowhere)."""
    argv = ["sft", "--mode", "av", "--model", str(tiny_av_dir), "--parquet", str(toy_datasets / "rl.parquet"),
            "--save-dir", str(tmp_path / "av"), "--num-steps", "2", "--device", "cpu"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("nla sft: error: response: column missing"), err
    assert "point parquet at av_sft.parquet" in err and "ar_prompt" not in err, err
    assert not (tmp_path / "av").exists()


def test_lr_schedule():
    assert lr_factor(0, num_steps=100, warmup_steps=10, schedule="cosine") == pytest.approx(0.1)
    assert lr_factor(9, num_steps=100, warmup_steps=10, schedule="cosine") == pytest.approx(1.0)
    assert lr_factor(10, num_steps=100, warmup_steps=10, schedule="cosine") == pytest.approx(1.0)
    assert lr_factor(55, num_steps=100, warmup_steps=10, schedule="cosine") == pytest.approx(0.5)
    assert lr_factor(100, num_steps=100, warmup_steps=10, schedule="cosine") == pytest.approx(0.0)
    assert lr_factor(99, num_steps=100, warmup_steps=0, schedule="constant") == 1.0


def test_micro_batching_does_not_change_the_run(tmp_path, tiny_av_dir, toy_datasets):
    runs = {}
    for micro in (1, 4):
        save_dir = tmp_path / f"micro{micro}"
        sft(fixtures.sft_config("av", tiny_av_dir, toy_datasets, save_dir, num_steps=3, save_every=3, batch_size=4,
                                micro_batch=micro))
        runs[micro] = (_losses(save_dir), load_file(str(save_dir / "step_000003" / "adapter_model.safetensors")))
    assert runs[1][0] == pytest.approx(runs[4][0], rel=1e-5)
    for key, value in runs[4][1].items():
        torch.testing.assert_close(runs[1][1][key], value, atol=1e-6, rtol=1e-4)


def test_sft_refuses_an_adapter_as_the_base_model(tmp_path, toy_sft, toy_datasets):
    av, _ = toy_sft
    with pytest.raises(ConfigError, match="is a LoRA adapter dir"):
        sft(fixtures.sft_config("av", av, toy_datasets, tmp_path / "again"))


MLP_AND_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_lora_targets_reach_the_adapter_and_rl_samples_with_every_one(tmp_path, tiny_av_dir, toy_datasets, toy_sft):
    """lora_targets (PEFT's target_modules) put the AV's LoRA on the MLP too; RL continues that adapter, and the
    native engine samples with all of it: its log-probs match the trainer's, so no adapted module is left out."""
    cfg = fixtures.sft_config("av", tiny_av_dir, toy_datasets, tmp_path / "av", lora_targets=MLP_AND_ATTENTION)
    av = sft(cfg)
    adapter = json.loads((av / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == sorted(MLP_AND_ATTENTION)
    saved = load_file(str(av / "adapter_model.safetensors"))
    assert any("mlp.down_proj.lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())
    _, ar = toy_sft
    argv = ["train", f"av_ckpt={av}", f"ar_ckpt={ar}", f"rl_parquet={toy_datasets / 'rl.parquet'}",
            f"save_dir={tmp_path / 'rl'}", "num_steps=1", "batch_prompts=2", "group_size=2", "max_new_tokens=6",
            "eval_every=0", "device=cpu", "logger=jsonl", "engine=native"]
    assert cli.main(argv) == 0
    (line,) = fixtures.read_metrics(tmp_path / "rl")
    assert line["logp_diff_max"] < 1e-3
    # The same check catches an engine that leaves the MLP's LoRA out: half the adapter dropped moves the log-probs.
    saved_rl = load_file(str(tmp_path / "rl" / "step_000001" / "adapter" / "adapter_model.safetensors"))
    assert {k for k in saved_rl if "mlp" in k} == {k for k in saved if "mlp" in k}


def test_a_lora_target_that_names_no_linear_layer_is_refused_in_one_line(tmp_path, tiny_av_dir, toy_datasets,
                                                                        capsys):
    argv = ["sft", "--mode", "av", "--model", str(tiny_av_dir), "--parquet", str(toy_datasets / "av_sft.parquet"),
            "--save-dir", str(tmp_path / "av"), "--num-steps", "2", "--batch-size", "4", "--device", "cpu",
            "lora_targets=q_proj,mlp"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("nla sft: error: config key 'lora_targets' names mlp, not a linear layer"), err
    assert "gate_proj" in err and "use some of" in err
    assert not (tmp_path / "av").exists()


# --------------------------------------------------------------------------- av_lora=false: the whole AV trains


@pytest.fixture(scope="module")
def full_av(tmp_path_factory, tiny_av_dir, toy_datasets, toy_sft) -> Path:
    """`nla sft --mode av av_lora=false` with a held-out split and the round trip through the toy AR: its result."""
    save_dir = tmp_path_factory.mktemp("full_av") / "av"
    _, ar = toy_sft
    argv = ["sft", "--mode", "av", "--model", str(tiny_av_dir), "--parquet", str(toy_datasets / "av_sft.parquet"),
            "--save-dir", str(save_dir), "--num-steps", "2", "--batch-size", "4", "--device", "cpu",
            "--dtype", "float32", "--logger", "jsonl", "--lr", "1e-3", "--no-av-lora",
            f"eval_parquet={toy_datasets / 'eval.parquet'}", "eval_every=1", "eval_rows=4", f"eval_ar={ar}",
            "eval_max_new_tokens=6", "keep_best=false"]
    assert cli.main(argv) == 0
    return save_dir / "step_000002"


def test_a_fully_fine_tuned_av_saves_its_whole_lm_and_scores_the_held_out_rows(full_av, tiny_av_dir):
    assert (full_av / "config.json").is_file() and (full_av / "model.safetensors").is_file()
    assert not (full_av / "adapter_config.json").exists()
    assert {"tokenizer_config.json", "nla_meta.yaml", "training_state.pt"} <= {p.name for p in full_av.iterdir()}
    meta = yaml.safe_load((full_av / "nla_meta.yaml").read_text())
    assert meta["kind"] == "nla_model" and meta["injection_style"] == "residual_add"
    base, tuned = load_file(str(tiny_av_dir / "model.safetensors")), load_file(str(full_av / "model.safetensors"))
    blocks = [k for k in base if ".layers." in k]
    assert blocks and any(not torch.equal(base[k], tuned[k]) for k in blocks)  # the blocks trained, not only a LoRA
    assert not torch.equal(base["model.embed_tokens.weight"], tuned["model.embed_tokens.weight"])
    held = [r for r in fixtures.read_metrics(full_av.parent) if "heldout/nll" in r]
    assert [r["step"] for r in held] == [0, 1]
    for r in held:
        assert r["heldout/nll"] > 0 and "heldout/fve" in r
        assert r["heldout/nll_gap"] == pytest.approx(r["heldout/nll_shuffled"] - r["heldout/nll"])


def test_rl_trains_a_fresh_lora_on_a_fully_fine_tuned_av_against_its_sft_weights(full_av, toy_sft, toy_datasets,
                                                                                 tmp_path):
    from nla_shell.models import reference_policy
    from nla_shell.models.actor import load_actor as load

    # The KL reference is the SFT'd LM (the LoRA off), whatever the LoRA has learnt.
    actor = load(full_av, lora_r=4, lora_alpha=4, use_rslora=True, resume_adapter=None, dtype=torch.float32,
                 device=torch.device("cpu"))
    sft_lm = AutoModelForCausalLM.from_pretrained(full_av, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.fill_(0.05)
        with reference_policy(actor):
            reference = actor(ids).logits
        moved = actor(ids).logits
        expected = sft_lm(ids).logits
    torch.testing.assert_close(reference, expected)
    assert not torch.allclose(moved, expected, atol=1e-4)

    _, ar = toy_sft
    argv = ["train", f"av_ckpt={full_av}", f"ar_ckpt={ar}", f"rl_parquet={toy_datasets / 'rl.parquet'}",
            f"save_dir={tmp_path / 'rl'}", "num_steps=2", "batch_prompts=2", "group_size=2", "max_new_tokens=6",
            "eval_every=0", "device=cpu", "logger=jsonl", "lora_r=4", "lora_alpha=4"]
    assert cli.main(argv) == 0
    first, _ = fixtures.read_metrics(tmp_path / "rl")
    assert first["kl_mean"] == pytest.approx(0.0, abs=1e-6)  # a fresh LoRA starts at its reference: the SFT'd AV
    adapter = json.loads((tmp_path / "rl" / "step_000002" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and Path(adapter["base_model_name_or_path"]).resolve() == full_av.resolve()


@pytest.mark.parametrize("extra", [["--mode", "av", "quant=4bit"], ["--mode", "ar"]])
def test_a_full_av_that_cannot_be_trained_is_refused_in_one_line(tmp_path, tiny_av_dir, toy_datasets, capsys, extra):
    mode = extra[1]
    argv = ["sft", *extra, "--model", str(tiny_av_dir), "--parquet", str(toy_datasets / f"{mode}_sft.parquet"),
            "--save-dir", str(tmp_path / "run"), "--device", "cpu", "av_lora=false"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("nla sft: error: config key 'av_lora' = false"), err
    assert not (tmp_path / "run").exists()
