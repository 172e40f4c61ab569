"""The quantised AR on CUDA: EasyNLA's AR-LoRA on a 4-bit / 8-bit backbone, through sft and RL.

Skipped without CUDA; the quantised runs also skip without bitsandbytes (the lead carries
bitsandbytes 0.50.2). The float32 CPU analogue of every step is tests/shell/test_ar_lora.py.

Run (not yet run; estimated under a minute on one H200):
  python -m pytest tests/gpu/test_quant_ar_gpu.py -q -s -p no:cacheprovider
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

import fixtures  # noqa: E402
from nla_shell import cli  # noqa: E402
from nla_shell.models import AR_META_FILE, ARModel  # noqa: E402

needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
MSE_SCALE = 8.0


def _sft_argv(tiny_av_dir, toy_datasets, save_dir, **overrides) -> list[str]:
    settings = dict(mode="ar", model=tiny_av_dir, parquet=toy_datasets / "ar_sft.parquet", save_dir=save_dir,
                    num_steps=2, batch_size=4, micro_batch=2, lr=1e-3, lr_schedule="constant", save_every=2,
                    lora_r=4, lora_alpha=8, logger="jsonl", device="cuda", dtype="bfloat16")
    settings.update(overrides)
    return ["sft", *(f"{k}={v}" for k, v in settings.items())]


def test_a_quantised_full_backbone_ar_is_refused_in_one_line(tiny_av_dir, toy_datasets, tmp_path, capsys):
    capsys.readouterr()
    assert cli.main(_sft_argv(tiny_av_dir, toy_datasets, tmp_path / "sft", quant="4bit")) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "'quant' = '4bit' freezes the AR's quantised backbone" in error and "ar_lora=true" in error
    assert not (tmp_path / "sft").exists()


@needs_bnb
@pytest.mark.parametrize("quant", ["4bit", "8bit"])
def test_quantised_ar_lora_trains_in_sft_and_rl(quant, tiny_av_dir, toy_datasets, nla_run_inputs, tmp_path):
    # --- sft --mode ar: a LoRA + value head on the quantised truncated backbone
    assert cli.main(_sft_argv(tiny_av_dir, toy_datasets, tmp_path / "sft", quant=quant, ar_lora="true")) == 0
    final = tmp_path / "sft" / "step_000002"
    assert json.loads((final / AR_META_FILE).read_text())["quant"] == quant
    losses = [json.loads(line)["loss"] for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert losses and all(math.isfinite(x) for x in losses)

    ar = ARModel.from_pretrained(final, mse_scale=MSE_SCALE, dtype=torch.bfloat16, device="cuda")
    quantised = [m for m in ar.lm.modules() if type(m).__module__.startswith("bitsandbytes")]
    assert quantised, "the backbone was not loaded quantised"
    trainable = {name for name, p in ar.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or name == "value_head.weight" for name in trainable)
    # The quantised AR predicts about what the same LoRA on the bf16 base does (the quantisation error).
    tokenizer = fixtures.tiny_tokenizer()
    full = ARModel.from_pretrained(final, mse_scale=MSE_SCALE, dtype=torch.bfloat16, device="cuda", full_precision=True)
    cosine = torch.nn.functional.cosine_similarity(fixtures.ar_predictions(ar, tokenizer, "cuda"),
                                                   fixtures.ar_predictions(full, tokenizer, "cuda"), dim=-1)
    print(f"{quant}: cosine(quantised AR, bf16 AR) per text {[round(float(c), 4) for c in cosine]}")
    assert float(cosine.min()) > 0.9

    # --- RL: quant for the AV's frozen base and the AR-LoRA's backbone, the critic co-trained
    save_dir = tmp_path / "rl"
    assert cli.main(fixtures.train_argv(nla_run_inputs, save_dir, ar_ckpt=final, quant=quant, device="cuda",
                                        engine="hf", num_steps=2, eval_every=0, save_every=2, train_critic="true",
                                        critic_lr=1e-2)) == 0
    metrics = fixtures.read_metrics(save_dir)
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert any(m["critic_loss"] is not None and math.isfinite(m["critic_loss"]) for m in metrics)
    critic = save_dir / "step_000002" / "critic"
    assert json.loads((critic / AR_META_FILE).read_text())["quant"] == quant
