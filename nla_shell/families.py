"""Model families: every architecture quirk the shell depends on, in one adapter table.

An NLA touches a causal LM in a few places: the decoder blocks (injection hook, activation
capture, AR truncation), the backbone that returns the last hidden state and its final
norm (the AR bypasses it; the fused log-prob path reads the hidden state after it), the
modules a LoRA adapts, the final-logit transform (Gemma 2/3 soft-capping) that the fused
log-prob path must apply, the per-layer sliding windows the native engine must mask, and
the pad token (Llama-3 tokenizers have none: pad with EOS, as the reference does). Nothing
outside this module spells `model.model.layers` or a family name.

A family is looked up by the HF config's `model_type`; an unknown one is refused with the
list of supported families. Per family, `engines` names the rollout engines that claim it;
`require_engine` refuses the others at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

__all__ = [
    "FAMILIES",
    "Family",
    "UnsupportedModelError",
    "backbone",
    "causal_lm",
    "decoder_blocks",
    "embedding_scale",
    "family_of",
    "final_logit_softcap",
    "final_norm",
    "layer_windows",
    "load_causal_lm",
    "load_tokenizer",
    "lora_targets",
    "require_engine",
    "set_final_norm",
    "truncate_blocks",
    "use_eos_as_pad",
]


class UnsupportedModelError(ValueError):
    """An architecture no family adapter covers, or an engine that does not claim the family."""


@dataclass(frozen=True)
class Family:
    """How one architecture family is laid out and what it needs."""

    name: str
    """Human name, used in messages."""
    model_types: tuple[str, ...]
    """HF `config.model_type` values of this family."""
    backbone: str
    """Attribute of the *ForCausalLM holding the decoder (returns `last_hidden_state`)."""
    blocks: str
    """Attribute of the backbone holding the decoder blocks (an nn.ModuleList)."""
    norm: str
    """Attribute of the backbone holding the final norm, applied after the last block."""
    lora_targets: tuple[str, ...]
    """Module names a LoRA adapts: the attention projections."""
    scaled_embeddings: bool
    """The backbone multiplies token embeddings by sqrt(hidden_size) (Gemma)."""
    engines: tuple[str, ...]
    """Rollout engines that support this family."""
    vllm_needs_tied_embeddings: bool = False
    """vLLM's model class asserts tied input and output embeddings (vLLM 0.24's Gemma2ForCausalLM:
    `assert config.tie_word_embeddings`); every released checkpoint of the family has them."""


_ALL_ENGINES = ("hf", "native", "vllm")
_LLAMA_LIKE = dict(backbone="model", blocks="layers", norm="norm", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))

FAMILIES: tuple[Family, ...] = (
    Family(name="Llama", model_types=("llama",), scaled_embeddings=False, engines=_ALL_ENGINES, **_LLAMA_LIKE),
    Family(name="Mistral", model_types=("mistral",), scaled_embeddings=False, engines=_ALL_ENGINES, **_LLAMA_LIKE),
    Family(name="Qwen2", model_types=("qwen2",), scaled_embeddings=False, engines=_ALL_ENGINES, **_LLAMA_LIKE),
    Family(name="Qwen3", model_types=("qwen3",), scaled_embeddings=False, engines=_ALL_ENGINES, **_LLAMA_LIKE),
    Family(name="Gemma2", model_types=("gemma2",), scaled_embeddings=True, engines=_ALL_ENGINES,
           vllm_needs_tied_embeddings=True, **_LLAMA_LIKE),
    Family(name="Gemma3 (text)", model_types=("gemma3_text",), scaled_embeddings=True, engines=_ALL_ENGINES,
           **_LLAMA_LIKE),
    # GPT-2: fused qkv projection `c_attn` and output `c_proj` (Conv1D), as EasyNLA's adapter targets.
    # Its learned position embeddings and un-grouped heads are outside the native engine's static KV
    # layout, and the vLLM steering plugin reads `model.layers`: only the HF engine claims it.
    Family(name="GPT-2", model_types=("gpt2",), backbone="transformer", blocks="h", norm="ln_f",
           lora_targets=("c_attn", "c_proj"), scaled_embeddings=False, engines=("hf",)),
)
"""The supported families; docs/families.md lists the ones the tests cover."""


def _supported() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)


def _config(model_or_config: Any) -> Any:
    """The HF config of a config, a *ForCausalLM, or a PEFT-wrapped one."""
    return causal_lm(model_or_config).config if isinstance(model_or_config, nn.Module) else model_or_config


def family_of(model_or_config: Any) -> Family:
    """The family of an HF config or model; UnsupportedModelError listing the supported ones."""
    config = _config(model_or_config)
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not a supported architecture; nla supports {_supported()}"
    )


def require_engine(model_or_config: Any, engine: str) -> Family:
    """The family, when `engine` claims it and this model; else UnsupportedModelError naming the
    engines that do."""
    family = family_of(model_or_config)
    if engine not in family.engines:
        raise UnsupportedModelError(
            f"engine={engine} does not support {family.name} models; use engine={' or engine='.join(family.engines)}"
        )
    if engine == "vllm" and family.vllm_needs_tied_embeddings and not _config(model_or_config).tie_word_embeddings:
        others = " or engine=".join(e for e in family.engines if e != engine)
        raise UnsupportedModelError(
            f"engine=vllm needs a {family.name} model with tied input and output embeddings (vLLM's {family.name} "
            f"asserts tie_word_embeddings) and this one sets tie_word_embeddings=false; use engine={others}"
        )
    return family


# --------------------------------------------------------------------------- modules


def causal_lm(model: nn.Module) -> nn.Module:
    """The HF *ForCausalLM under any PEFT wrapping."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone(model: nn.Module) -> nn.Module:
    """The decoder of a *ForCausalLM (PEFT-wrapped or not): token ids -> last_hidden_state."""
    lm = causal_lm(model)
    return getattr(lm, family_of(lm).backbone)


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks, in order: block k's output is the residual stream after block k."""
    lm = causal_lm(model)
    return getattr(backbone(lm), family_of(lm).blocks)


def final_norm(model: nn.Module) -> nn.Module:
    """The norm the backbone applies after its last block."""
    lm = causal_lm(model)
    return getattr(backbone(lm), family_of(lm).norm)


def set_final_norm(model: nn.Module, norm: nn.Module) -> None:
    """Replace the backbone's final norm (the AR swaps in nn.Identity to read the raw residual)."""
    lm = causal_lm(model)
    setattr(backbone(lm), family_of(lm).norm, norm)


def truncate_blocks(model: nn.Module, keep: int) -> None:
    """Keep the first `keep` blocks, and the config's per-layer fields in step with them."""
    lm = causal_lm(model)
    setattr(backbone(lm), family_of(lm).blocks, decoder_blocks(lm)[:keep])
    lm.config.num_hidden_layers = keep
    if getattr(lm.config, "layer_types", None) is not None:
        lm.config.layer_types = lm.config.layer_types[:keep]


def lora_targets(model_or_config: Any, requested: Sequence[str] = ()) -> list[str]:
    """Module names a LoRA adapts: `requested` (PEFT's target_modules, e.g. the MLP's as well as attention's),
    each checked to name a linear layer of `model_or_config` (then a model); none: this family's attention
    projections.

    Raises ValueError naming the config key `lora_targets` and the model's linear-layer names for a name that
    matches none.
    """
    if not requested:
        return list(family_of(model_or_config).lora_targets)
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model_or_config.named_modules()
                     if isinstance(module, nn.Linear) and "." in name})
    missing = [name for name in requested if name not in linear]
    if missing:
        raise ValueError(f"config key 'lora_targets' names {', '.join(missing)}, not a linear layer of this model; "
                         f"use some of {','.join(linear)}")
    return list(requested)


def require_lora_targets(model_dir: str | Path, requested: Sequence[str]) -> None:
    """lora_targets checked against the model's skeleton (meta tensors: nothing loaded), before a run writes."""
    if requested:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        lora_targets(skeleton, requested)


def block_count(model_dir: str | Path) -> int:
    """The decoder blocks of the model in `model_dir`, from its config (nothing loaded)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return int(getattr(config, "text_config", config).num_hidden_layers)


# --------------------------------------------------------------------------- numerics


def embedding_scale(config: Any) -> float:
    """Factor the backbone multiplies token embeddings by: sqrt(hidden_size) for Gemma, else 1.0.

    An embedding-space injection (kitft style) must scale its target norm by this, since the
    residual stream starts at embedding * scale.
    """
    return math.sqrt(config.hidden_size) if family_of(config).scaled_embeddings else 1.0


def final_logit_softcap(model_or_config: Any) -> float | None:
    """c of the final-logit soft-capping logits = c * tanh(logits / c) (Gemma 2/3), or None."""
    config = _config(model_or_config)
    family_of(config)
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def layer_windows(model_or_config: Any) -> list[int | None]:
    """Per decoder block, its sliding attention window W (a query at position q sees keys at
    q - W < k <= q), or None for full causal attention.

    Follows transformers' reading of the config: `layer_types` when present (Gemma 2/3,
    Qwen2/3 with use_sliding_window), else `sliding_window` for every block (Mistral v0.1).
    """
    config = _config(model_or_config)
    family_of(config)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def load_causal_lm(model_dir: str | Path, **kwargs: Any) -> Any:
    """AutoModelForCausalLM.from_pretrained(model_dir, **kwargs), with what the model's family needs.

    Attention-logit soft-capping (Gemma 2: s = c * tanh(s / c)) is honoured by the eager
    attention only: SDPA has none (transformers 5.2x refuses it; the 5.17 on the H200 dropped
    it silently, and the native engine's decode, which is the eager arithmetic, then sampled
    0.41 nats per token away from the trainer on a tiny Gemma 2), so such a model loads eager.
    The config is read once and handed to the model load.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, "attn_logit_softcapping", None):
        kwargs["attn_implementation"] = "eager"
    return AutoModelForCausalLM.from_pretrained(model_dir, config=config, **kwargs)


# --------------------------------------------------------------------------- tokenizers


def use_eos_as_pad(tokenizer: Any, *, source: str | Path = "the tokenizer") -> Any:
    """Give a tokenizer without a pad token its EOS as pad (as the reference does); returns it.

    Padding is always masked out by length, so pad == eos changes no computation. A
    tokenizer with neither is refused, naming `source`.
    """
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer: {source} has neither a pad nor an eos token; set eos_token (or pad_token) in its "
                "tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer(path: str | Path) -> Any:
    """AutoTokenizer.from_pretrained(path), padding with EOS when it has no pad token."""
    from transformers import AutoTokenizer

    return use_eos_as_pad(AutoTokenizer.from_pretrained(path), source=path)
