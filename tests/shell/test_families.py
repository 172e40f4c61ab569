"""Every supported model family through the pipeline, and every engine's log-probs against the trainer's.

Tiny random models (tests/family_models.py) share the toy tokenizer; Llama's copy has no
pad token, as Llama-3's tokenizers ship. Built once per session.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import family_models
import fixtures
from nla_core import token_logprobs_from_hidden
from nla_shell import cli, families
from nla_shell.engines.base import RolloutRequest
from nla_shell.engines.hf import HFRolloutEngine
from nla_shell.engines.native import NativeRolloutEngine
from nla_shell.io.data import build_prompt_ids, load_rows
from nla_shell.io.sidecars import load_sidecar
from nla_shell.models import Injector, inner_lm, load_actor, response_logprobs
from nla_shell.training.update import response_batch

FAMILIES = family_models.FAMILY_NAMES
ENGINES = {"hf": HFRolloutEngine, "native": NativeRolloutEngine}


def _tokenizer(model_type: str):
    tokenizer = fixtures.tiny_tokenizer()
    return family_models.without_pad_token(tokenizer) if model_type == "llama" else tokenizer


@pytest.fixture(scope="session")
def family_dir(nla_cache_dir: Path):
    """model_type -> its saved tiny model dir (built on first use)."""
    return lambda model_type: family_models.save_tiny_model(
        nla_cache_dir / "families" / model_type, model_type, _tokenizer(model_type)
    )


@pytest.fixture(scope="session")
def family_data(nla_cache_dir: Path, family_dir):
    """model_type -> `nla datagen` output dir of its tiny model over 20 toy documents."""
    def build(model_type: str) -> Path:
        out = nla_cache_dir / "families" / f"{model_type}_data"
        if not (out / "eval.parquet").exists():
            corpus = fixtures.write_toy_corpus(nla_cache_dir / "families" / "corpus.jsonl", n_docs=20)
            assert cli.main(["datagen", *_overrides(fixtures.datagen_config(family_dir(model_type), corpus, out))]) == 0
        return out
    return build


def _overrides(cfg) -> list[str]:
    """A config dataclass as the CLI's key=value overrides (its set fields; templates left at default)."""
    import dataclasses

    spell = lambda v: ",".join(v) if isinstance(v, tuple) else v  # noqa: E731
    return [f"{f.name}={spell(getattr(cfg, f.name))}" for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) is not None and f.name not in ("av_template", "ar_template")]


# --------------------------------------------------------------------------- the adapter table


def test_unknown_architecture_is_refused_with_the_supported_list():
    from transformers import BertConfig

    with pytest.raises(families.UnsupportedModelError) as err:
        families.family_of(BertConfig())
    message = str(err.value)
    assert "'bert'" in message and all(name in message for name in ("Llama", "Mistral", "Gemma2", "GPT-2", "Qwen3"))


def test_train_refuses_what_vllm_cannot_serve_before_anything_is_written(family_dir, family_data, tmp_path, capsys):
    """GPT-2 (no engine=vllm) and a Gemma 2 with untied embeddings: vLLM 0.24's Gemma2ForCausalLM
    asserts tie_word_embeddings (seen on the H200: a bare AssertionError from inside vLLM)."""
    for model_type, cause in (("gpt2", "does not support GPT-2 models; use engine=hf"),
                              ("gemma2", "tied input and output embeddings")):
        av, data = family_dir(model_type), family_data(model_type)
        capsys.readouterr()
        assert cli.main(["train", f"av_ckpt={av}", f"ar_ckpt={av}", f"rl_parquet={data / 'rl.parquet'}",
                         f"save_dir={tmp_path / model_type}", "engine=vllm", "device=cpu"]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and "engine=vllm" in errors[0] and cause in errors[0], errors
        assert not (tmp_path / model_type).exists()
    tied = family_models.tiny_config("gemma2", _tokenizer("gemma2"), tie_word_embeddings=True)
    assert families.require_engine(tied, "vllm").name == "Gemma2"
    untied = family_models.tiny_config("gemma2", _tokenizer("gemma2"))
    assert families.require_engine(untied, "native").name == "Gemma2"
    with pytest.raises(families.UnsupportedModelError, match="use engine=hf or engine=native$"):
        families.require_engine(untied, "vllm")


def test_embedding_scale_and_soft_cap_follow_the_config(family_dir):
    for model_type in FAMILIES:
        config = family_models.tiny_config(model_type, _tokenizer(model_type))
        gemma = model_type.startswith("gemma")
        assert families.embedding_scale(config) == pytest.approx(math.sqrt(32) if gemma else 1.0)
        assert families.final_logit_softcap(config) == (2.0 if model_type == "gemma2" else None)
    # The scale is the one the backbone applies: embed(ids) = table[ids] * scale.
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(family_dir("gemma2"))
    ids = torch.tensor([[5, 9]])
    torch.testing.assert_close(lm.get_input_embeddings()(ids),
                               lm.get_input_embeddings().weight[ids] * families.embedding_scale(lm.config))


def test_attention_soft_capping_loads_the_eager_attention(family_dir):
    """SDPA has no attention soft-capping (transformers 5.17 dropped it silently: on the H200 the
    native engine then sampled 0.41 nats per token away from the trainer on the tiny Gemma 2)."""
    from transformers import AutoModelForCausalLM

    for model_type in FAMILIES:
        loaded = families.load_causal_lm(family_dir(model_type)).config._attn_implementation
        plain = AutoModelForCausalLM.from_pretrained(family_dir(model_type)).config._attn_implementation
        assert loaded == ("eager" if model_type == "gemma2" else plain), model_type
    # Forced even where the caller (or a transformers default) asks for SDPA.
    forced = families.load_causal_lm(family_dir("gemma2"), attn_implementation="sdpa")
    assert forced.config._attn_implementation == "eager"
    actor = load_actor(family_dir("gemma2"), lora_r=4, lora_alpha=8, use_rslora=True, resume_adapter=None,
                       dtype=torch.float32, device=torch.device("cpu"))
    assert inner_lm(actor).config._attn_implementation == "eager"


def test_a_tokenizer_without_pad_pads_with_eos_and_one_without_either_is_refused(tmp_path):
    bare = family_models.without_pad_token(fixtures.tiny_tokenizer())
    bare.save_pretrained(tmp_path / "tok")
    loaded = families.load_tokenizer(tmp_path / "tok")
    assert loaded.pad_token_id == loaded.eos_token_id == bare.eos_token_id
    bare.eos_token = None
    with pytest.raises(ValueError, match="has neither a pad nor an eos token"):
        families.use_eos_as_pad(bare, source=tmp_path / "tok")


# --------------------------------------------------------------------------- engines vs trainer


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("model_type", FAMILIES)
def test_engine_behaviour_logprobs_equal_the_trainer(model_type, engine, family_dir, family_data):
    """Sampled tokens' log-probs under the engine equal the trainer's fused path (float32, <= 1e-4)."""
    av, data = family_dir(model_type), family_data(model_type)
    tokenizer = families.load_tokenizer(av)
    nla = load_sidecar(data / "rl.parquet.nla_meta.yaml")
    torch.manual_seed(0)
    actor = load_actor(av, lora_r=4, lora_alpha=8, use_rslora=True, resume_adapter=None, dtype=torch.float32,
                       device=torch.device("cpu"))
    for name, p in actor.named_parameters():  # a non-zero adapter: the policy is not the base model
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    injector = Injector(actor, marker_id=nla.injection_token_id, left_id=nla.injection_left_neighbor_id,
                        right_id=nla.injection_right_neighbor_id)
    if engine not in families.family_of(actor).engines:
        with pytest.raises(families.UnsupportedModelError, match=f"engine={engine} does not support"):
            ENGINES[engine](actor, injector, tokenizer)
        return
    rows = load_rows(data / "rl.parquet", nla, max_rows=3)
    requests = [RolloutRequest(tuple(build_prompt_ids(r.prompt, nla, tokenizer)), r.activation) for r in rows]
    rollouts = ENGINES[engine](actor, injector, tokenizer).generate(
        requests, group_size=2, max_new_tokens=8, generator=torch.Generator().manual_seed(0)
    )
    batch = response_batch(rollouts, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    acts = torch.stack([requests[r.prompt_index].activation for r in rollouts])
    with torch.no_grad(), injector.inject(batch.input_ids, acts):
        logp = response_logprobs(actor, batch.input_ids, batch.attention_mask, batch.positions, batch.targets)
    diff = (logp - batch.behavior_logp)[batch.mask].abs()
    assert diff.numel() > 0 and float(diff.max()) <= 1e-4
    if model_type == "gemma2":  # the soft-cap is doing work here: without it the trainer would disagree
        lm = inner_lm(actor)
        with torch.no_grad(), injector.inject(batch.input_ids, acts):
            hidden = families.backbone(lm)(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
            picked = hidden.gather(1, batch.positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            uncapped = token_logprobs_from_hidden(picked, lm.lm_head.weight, batch.targets)
        assert float((uncapped - batch.behavior_logp)[batch.mask].abs().max()) > 0.1


# --------------------------------------------------------------------------- the pipeline


def _train(av: Path, ar: Path, data: Path, save_dir: Path, engine: str) -> list[dict]:
    settings = dict(av_ckpt=av, ar_ckpt=ar, rl_parquet=data / "rl.parquet", save_dir=save_dir, num_steps=1,
                    batch_prompts=2, group_size=2, max_new_tokens=6, lora_r=4, lora_alpha=8, lr=1e-3,
                    logp_micro_batch=4, eval_every=0, max_rows=8, save_every=1, device="cpu", logger="jsonl",
                    engine=engine, train_critic="true", critic_lr=1e-3)
    assert cli.main(["train", *(f"{k}={v}" for k, v in settings.items())]) == 0
    return [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_pipeline_runs_on_every_family(model_type, family_dir, family_data, tmp_path, capsys):
    """datagen -> sft av / ar -> train (each engine the family claims) -> eval, all exit 0 with finite losses."""
    av, data = family_dir(model_type), family_data(model_type)
    sidecar = load_sidecar(data / "rl.parquet.nla_meta.yaml")
    assert sidecar.d_model == family_models.HIDDEN
    for mode in ("av", "ar"):
        cfg = fixtures.sft_config(mode, av, data, tmp_path / f"sft_{mode}", num_steps=1, save_every=1, batch_size=2)
        assert cli.main(["sft", *_overrides(cfg)]) == 0
        losses = [json.loads(line)["loss"] for line in (tmp_path / f"sft_{mode}" / "metrics.jsonl").read_text().splitlines()]
        assert losses and all(math.isfinite(x) for x in losses)
    av_sft, ar_sft = tmp_path / "sft_av" / "step_000001", tmp_path / "sft_ar" / "step_000001"
    for engine in ("hf", "native", "vllm"):
        if engine not in families.family_of(family_models.tiny_config(model_type, _tokenizer(model_type))).engines:
            capsys.readouterr()
            assert cli.main(["train", f"av_ckpt={av_sft}", f"ar_ckpt={ar_sft}", f"rl_parquet={data / 'rl.parquet'}",
                             f"save_dir={tmp_path / engine}", f"engine={engine}", "device=cpu"]) == 2
            assert f"engine={engine} does not support" in capsys.readouterr().err
            assert not (tmp_path / engine).exists()
        elif engine != "vllm":  # vLLM needs a GPU: its claim is checked on the device only
            lines = _train(av_sft, ar_sft, data, tmp_path / engine, engine)
            assert lines and all(math.isfinite(line["loss"]) for line in lines)
    assert cli.main(["eval", "--av", str(av_sft), "--ar", str(ar_sft), "--parquet", str(data / "eval.parquet"),
                     "--n-rows", "3", "--max-new-tokens", "6", "--out-dir", str(tmp_path / "eval"), "device=cpu"]) == 0
    summary = json.loads((tmp_path / "eval" / "eval_summary.json").read_text())
    assert math.isfinite(summary["gold/fve"])


# --------------------------------------------------------------------------- quantisation


def test_quant_is_refused_on_cpu_before_anything_is_written(family_dir, family_data, tmp_path, capsys):
    av, data = family_dir("qwen3"), family_data("qwen3")
    capsys.readouterr()
    assert cli.main(["train", f"av_ckpt={av}", f"ar_ckpt={av}", f"rl_parquet={data / 'rl.parquet'}",
                     f"save_dir={tmp_path / 'run'}", "quant=4bit", "device=cpu"]) == 2
    cfg = fixtures.sft_config("av", av, data, tmp_path / "sft", quant="8bit")
    assert cli.main(["sft", *_overrides(cfg)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 2 and all("'quant'" in e and "needs a CUDA device" in e and "quant=none" in e for e in errors)
    assert not (tmp_path / "run").exists() and not (tmp_path / "sft").exists()


def test_quant_names_each_other_cause():
    from nla_shell.quant import require_quant

    cuda = torch.device("cuda")
    require_quant("none", torch.device("cpu"))  # nothing to check
    with pytest.raises(ValueError, match="works with engine=hf only"):
        require_quant("4bit", cuda, engine="native")
    with pytest.raises(ValueError, match="only a LoRA on it can train: use sft --mode ar ar_lora=true"):
        require_quant("8bit", cuda, trains_ar_backbone=True)
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"needs bitsandbytes: pip install 'nla\[bnb\]'"):
            require_quant("4bit", cuda)
