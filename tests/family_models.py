"""Tiny random models of every supported family, sized to a given tokenizer.

Small enough that a whole datagen -> sft -> train -> eval chain runs in seconds, yet with the
quirks that matter switched on: sliding windows shorter than a prompt (Mistral, Gemma 2/3,
so the window masks decide what is attended), Gemma 2's attention and final-logit
soft-capping at caps the random logits exceed (lm_head scaled up to trained-scale logits),
GPT-2's fused c_attn / Conv1D layout.
"""

from __future__ import annotations

from pathlib import Path

import torch

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 3, 4, 2, 8
HIDDEN = HEADS * HEAD_DIM
WINDOW = 4
"""Sliding window of the windowed families: far shorter than the AV prompt (~15 tokens)."""
FAMILY_NAMES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gpt2")


def tiny_config(model_type: str, tokenizer, *, head_dim: int = HEAD_DIM, layers: int = LAYERS,
                tie_word_embeddings: bool = False):
    """A tiny config of `model_type` (an HF model_type) for `tokenizer`'s vocabulary.

    HEADS query heads of `head_dim` (hidden = HEADS * head_dim, FFN = 2 * hidden); the GPU
    tests ask for head_dim 64, a size vLLM's attention kernels serve. Untied embeddings by
    default, so lm_head can be scaled on its own; vLLM serves Gemma 2 only tied.
    """
    import transformers as tf

    hidden = HEADS * head_dim
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    shape = dict(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=HEADS,
                 num_key_value_heads=KV_HEADS, head_dim=head_dim, intermediate_size=2 * hidden,
                 max_position_embeddings=256, tie_word_embeddings=tie_word_embeddings, **ids)
    if model_type == "llama":
        return tf.LlamaConfig(**shape)
    if model_type == "mistral":
        return tf.MistralConfig(**shape, sliding_window=WINDOW)
    if model_type == "qwen2":
        return tf.Qwen2Config(**shape)
    if model_type == "qwen3":
        return tf.Qwen3Config(**shape)
    if model_type == "gemma2":
        return tf.Gemma2Config(**shape, sliding_window=WINDOW, final_logit_softcapping=2.0, attn_logit_softcapping=1.0,
                               query_pre_attn_scalar=head_dim)
    if model_type == "gemma3_text":
        return tf.Gemma3TextConfig(**shape, sliding_window=WINDOW, query_pre_attn_scalar=head_dim,
                                   layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)])
    if model_type == "gpt2":
        return tf.GPT2Config(vocab_size=len(tokenizer), n_embd=hidden, n_layer=layers, n_head=HEADS, n_positions=256,
                             tie_word_embeddings=tie_word_embeddings, **ids)
    raise ValueError(f"no tiny config for {model_type!r}")


def build_tiny_model(model_type: str, tokenizer, *, seed: int = 0, **shape):
    """A random float32 causal LM of the family (`shape`: tiny_config's), with full-distribution
    sampling defaults.

    Gemma 2's lm_head is scaled so its logits reach the soft-cap's non-linear range, as a
    trained model's do (random init gives logits near 0, where the cap is the identity).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, tokenizer, **shape), dtype=torch.float32)
    if model_type == "gemma2" and not model.config.tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.mul_(40.0)
    model.generation_config = GenerationConfig(
        do_sample=True, top_k=0, top_p=1.0, temperature=1.0, repetition_penalty=1.0, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return model


def save_tiny_model(directory: Path, model_type: str, tokenizer) -> Path:
    """Save the tiny model and tokenizer side by side (once; reused when present)."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        build_tiny_model(model_type, tokenizer).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directory


def without_pad_token(tokenizer):
    """A copy of `tokenizer` with no pad token, as Llama-3's tokenizers ship."""
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.pad_token = None
    assert bare.pad_token_id is None
    return bare
